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
    assert line.startswith("tiny-org/not-downloaded is not in the local Hugging Face cache and HF_HUB_OFFLINE is set")
    assert "unset HF_HUB_OFFLINE to download it once" in line
    assert "\n" not in line


def test_an_uncached_model_with_no_network_says_to_check_the_connection_not_hf_hub_offline(offline_hub, monkeypatch):
    """Not offline by the user's switch, the hub just out of reach (no network, a proxy): the line said "unset
    HF_HUB_OFFLINE", which the user never set."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(ModelNotFoundError) as raised:
        load_model("tiny-org/not-downloaded", progress=False)
    assert raised.value.one_line() == (
        "tiny-org/not-downloaded is not in the local Hugging Face cache and the hub cannot be reached — check the "
        "connection to huggingface.co (or HTTPS_PROXY, or HF_ENDPOINT for a mirror) to download it once, or pass a "
        "local folder or .gguf file")


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
        "tiny-org/tiny-llama-GGUF has no config.json on the hub (a repository of .gguf files?) — name one of its .gguf "
        "files by its quantisation, as llama.cpp's -hf does: tiny-org/tiny-llama-GGUF:Q4_K_M")


@pytest.fixture
def gguf_repo(offline_hub, tiny_gguf):
    """`tiny-org/tiny-llama-GGUF` in the same cache: its files named as such repositories name them (lower case)."""
    repo = offline_hub.parent / "models--tiny-org--tiny-llama-GGUF"
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    for name in ("tiny-llama-q4_k_m.gguf", "tiny-llama-q8_0.gguf"):
        shutil.copy(tiny_gguf[0], snapshot / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


def test_a_gguf_repository_file_is_named_by_its_tag_as_llama_cpp_does(gguf_repo, tiny_gguf):
    """`-hf org/name:Q4_K_M` is how a llama.cpp user names a model on the hub; it was "not a file, folder, demo model
    or hub id"."""
    loaded = load_model("tiny-org/tiny-llama-GGUF:Q4_K_M", device="cpu", dtype="float32", progress=False)
    assert loaded.name == "tiny-org/tiny-llama-GGUF:Q4_K_M"
    assert loaded.source == str(gguf_repo / "tiny-llama-q4_k_m.gguf")
    assert loaded.vocab_size == tiny_gguf[1].config.vocab_size
    pinned = load_model(f"tiny-org/tiny-llama-GGUF@{REVISION}:q8_0", device="cpu", dtype="float32", progress=False)
    assert pinned.source == str(gguf_repo / "tiny-llama-q8_0.gguf")


def test_a_gguf_tag_the_repository_lacks_is_one_line_and_one_it_holds_in_parts_is_read_in_place(gguf_repo, tiny_gguf):
    from specdec_cli.errors import ModelLoadError

    with pytest.raises(ModelNotFoundError) as raised:
        load_model("tiny-org/tiny-llama-GGUF:Q4_K", progress=False)  # not a prefix of Q4_K_M: the name must end in it
    assert raised.value.one_line() == (
        "tiny-org/tiny-llama-GGUF has no .gguf file whose name ends in Q4_K — check the tag against the repository's "
        "files (hf download tiny-org/tiny-llama-GGUF --include '*.gguf' --dry-run lists them), e.g. :Q4_K_M")
    for part in (1, 2):
        shutil.copy(tiny_gguf[0], gguf_repo / f"tiny-llama-f16-0000{part}-of-00002.gguf")
    with pytest.raises(ModelLoadError) as raised:  # a split set: read in place, in q4 only
        load_model("tiny-org/tiny-llama-GGUF:F16", dtype="float32", progress=False)
    assert raised.value.one_line().startswith("tiny-org/tiny-llama-GGUF:F16 is a split .gguf set, which specdec reads "
                                              "in place in q4 only")
    split = load_model("tiny-org/tiny-llama-GGUF:F16", dtype="float32", quantization="q4", progress=False)
    assert split.source == str(gguf_repo / "tiny-llama-f16-00001-of-00002.gguf")
    with pytest.raises(ModelNotFoundError) as raised:
        load_model("tiny-org/not-downloaded-GGUF:Q4_K_M", progress=False)
    assert raised.value.one_line().startswith("tiny-org/not-downloaded-GGUF is not in the local Hugging Face cache")
