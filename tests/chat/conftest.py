"""Chat fixtures: the tiny saved pair loaded once, and conversations on it (greedy, fp32)."""

from __future__ import annotations

import pytest

from specdec_cli.chat import Conversation
from specdec_cli.settings import DecodingSettings
from specdec_cli.models import load_model


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread; several threads thrash on a shared CPU."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def loaded(tiny_pair):
    """target, draft (low acceptance) and same (a copy of the target), loaded in float32."""
    from types import SimpleNamespace

    def load(path):
        return load_model(path, device="cpu", dtype="float32", progress=False)

    return SimpleNamespace(target=load(tiny_pair.target), draft=load(tiny_pair.draft), same=load(tiny_pair.same))


def settings(k=3, temperature=0.0, max_new_tokens=12, system=None, seed=None) -> DecodingSettings:
    return DecodingSettings(k=k, temperature=temperature, top_p=1.0, top_k=0, seed=seed,
                            max_new_tokens=max_new_tokens, system=system)


@pytest.fixture
def make_conversation(loaded):
    """make_conversation(draft="draft"|"same"|None, **settings) -> a fresh Conversation."""

    def make(draft: str | None = "draft", **overrides) -> Conversation:
        draft_model = getattr(loaded, draft) if draft else None
        return Conversation(loaded.target, draft_model, "model" if draft else "ngram", settings(**overrides))

    return make
