"""Fixtures for the models layer: tiny saved models, and a specdec cache that is never the real one."""

from __future__ import annotations

import pytest

from tests.tiny import build_tiny_gguf, build_tiny_model, build_tokenizer


@pytest.fixture(scope="session")
def llama_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_model(path, arch="llama")
    return path


@pytest.fixture(scope="session")
def qwen2_padded_folder(tmp_path_factory):
    """A Qwen2-style model whose output layer is padded past the tokenizer (like 7B's 152064 vs 151936)."""
    path = tmp_path_factory.mktemp("tiny-qwen2-padded")
    build_tiny_model(path, arch="qwen2", vocab_size=320, seed=1)
    return path


@pytest.fixture(scope="session")
def other_tokenizer_folder(tmp_path_factory):
    """A model with a tokenizer trained on different text: same size, different token→id map."""
    path = tmp_path_factory.mktemp("tiny-other-tokenizer")
    corpus = ["Completely different words: zebra, quartz, jukebox, fjord, sphinx, vexing, waltz."] * 3
    build_tiny_model(path, arch="llama", tokenizer=build_tokenizer(corpus=corpus))
    return path


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """(path to a tiny F32 llama .gguf, the transformers model it was written from)."""
    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny-llama.gguf"
    model = build_tiny_gguf(path)
    return path, model
