"""Hub ids, through huggingface-hub itself, against a hub cache laid out on disk, offline."""

import shutil

import huggingface_hub.constants
import pytest

from specdec_cli.errors import ModelNotFoundError
from specdec_cli.models import load_model

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def offline_hub(tmp_path, monkeypatch, llama_folder):
    """HF_HOME at tmp_path, offline, holding `tiny-org/tiny-llama` at REVISION as refs/main."""
    hub_cache = tmp_path / "hf" / "hub"
    repo = hub_cache / "models--tiny-org--tiny-llama"
    shutil.copytree(llama_folder, repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface-hub reads these once at import; a real user sets them before starting specdec.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return repo


def test_a_cached_hub_model_loads_offline(offline_hub):
    loaded = load_model("tiny-org/tiny-llama", device="cpu", dtype="float32", progress=False)
    assert loaded.name == "tiny-org/tiny-llama"
    assert loaded.source == "tiny-org/tiny-llama@main"
    assert loaded.vocab_size == 300


def test_a_revision_is_honoured(offline_hub):
    loaded = load_model(f"tiny-org/tiny-llama@{REVISION}", device="cpu", dtype="float32", progress=False)
    assert loaded.source == f"tiny-org/tiny-llama@{REVISION}"


def test_an_uncached_model_offline_is_one_line_naming_it(offline_hub):
    with pytest.raises(ModelNotFoundError) as raised:
        load_model("tiny-org/not-downloaded", progress=False)
    line = raised.value.one_line()
    assert line.startswith("tiny-org/not-downloaded is not in the local Hugging Face cache")
    assert "HF_HUB_OFFLINE" in line
    assert "\n" not in line


def test_a_hub_repository_of_gguf_files_says_to_pass_one_of_them(offline_hub):
    """A llama.cpp user's habit, `--target Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF`: the repository has .gguf files and
    no config.json, and the load ended in "cannot read the config ... check the model files"."""
    repo = offline_hub.parent / "models--tiny-org--tiny-llama-GGUF"
    (repo / "snapshots" / REVISION).mkdir(parents=True)
    (repo / "snapshots" / REVISION / "README.md").write_text("GGUF files")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    with pytest.raises(ModelNotFoundError) as raised:
        load_model("tiny-org/tiny-llama-GGUF", progress=False)
    assert raised.value.one_line() == (
        "tiny-org/tiny-llama-GGUF has no config.json on the hub (a repository of .gguf files?) — download one of its "
        ".gguf files (hf download tiny-org/tiny-llama-GGUF FILE.gguf --local-dir .) and pass that file")
