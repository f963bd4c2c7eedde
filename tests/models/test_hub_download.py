"""Hub ids downloaded over HTTP, as a user with internet gets them: `specdec run` in a subprocess with HF_ENDPOINT at
a local stand-in for huggingface.co (tests/fake_hub.py), through huggingface_hub's own download code. The cache tests
(test_hub.py) lay the HF cache out by hand; these make huggingface_hub fill it."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.fake_hub import FakeHub

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def hub(tiny_pair, tiny_gguf, tmp_path):
    """tiny-org/target and tiny-org/draft (the tiny pair's folders), tiny-org/tiny-GGUF (two .gguf files of the
    names such repositories use), tiny-org/gated (gated), tiny-org/both (safetensors and pickle weights)."""
    hub = FakeHub()
    hub.add("tiny-org/target", Path(tiny_pair.target))
    hub.add("tiny-org/draft", Path(tiny_pair.draft))
    ggufs = tmp_path / "ggufs"
    ggufs.mkdir()
    for name in ("tiny-llama-q4_k_m.gguf", "tiny-llama-q8_0.gguf"):
        shutil.copy(tiny_gguf[0], ggufs / name)
    hub.add("tiny-org/tiny-GGUF", ggufs)
    hub.add("tiny-org/gated", Path(tiny_pair.target), gated=True)
    both = tmp_path / "both"
    shutil.copytree(tiny_pair.target, both)
    (both / "pytorch_model.bin").write_bytes(b"\0" * 4096)  # never to be fetched while safetensors are there
    hub.add("tiny-org/both", both)
    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_pair.target, pickled)
    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    hub.add("tiny-org/pickled", pickled)
    endpoint, stop = hub.serve()
    hub.endpoint = endpoint
    yield hub
    stop()


def specdec_run(tmp_path, endpoint, *args):
    """`specdec run` as a user runs it with the hub at `endpoint` (HF_HOME and SPECDEC_HOME in tmp_path)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf"),
           "SPECDEC_HOME": str(tmp_path / "home"), "NO_COLOR": "1", "OMP_NUM_THREADS": "1"}
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HF_TOKEN"):
        env.pop(name, None)
    command = [sys.executable, "-m", "specdec_cli", "run", *map(str, args), "--dtype", "float32", "-t", "0", "-n", "4",
               "-q"]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def texts(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def test_a_hub_pair_downloads_config_first_then_weights_and_runs_offline_after(hub, tiny_pair, tmp_path):
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "Hello there"}) + "\n")
    local = specdec_run(tmp_path, hub.endpoint, "in.jsonl", "-o", "local.jsonl", "--target", tiny_pair.target,
                        "--draft", tiny_pair.draft)
    assert local.returncode == 0, local.stderr
    hub.requests.clear()
    result = specdec_run(tmp_path, hub.endpoint, "in.jsonl", "-o", "hub.jsonl", "--target", "tiny-org/target",
                         "--draft", "tiny-org/draft")
    assert result.returncode == 0, result.stderr
    assert texts(tmp_path / "hub.jsonl") == texts(tmp_path / "local.jsonl")
    for repo in ("tiny-org/target", "tiny-org/draft"):  # the config is read before the weights are fetched
        fetched = [path for method, path in hub.requests if method == "GET" and path.startswith(f"/{repo}/resolve/")]
        names = [path.rsplit("/", 1)[1] for path in fetched]
        assert "config.json" in names and "model.safetensors" in names
        assert names.index("config.json") < names.index("model.safetensors")
    snapshots = list((tmp_path / "hf" / "hub" / "models--tiny-org--target" / "snapshots").iterdir())
    assert len(snapshots) == 1 and (snapshots[0] / "model.safetensors").is_file()

    # the hub out of reach: the cache serves the same run
    offline = specdec_run(tmp_path, "http://127.0.0.1:9", "in.jsonl", "-o", "offline.jsonl", "--target",
                          "tiny-org/target", "--draft", "tiny-org/draft")
    assert offline.returncode == 0, offline.stderr
    assert texts(tmp_path / "offline.jsonl") == texts(tmp_path / "local.jsonl")


def test_a_pinned_revision_and_a_gguf_tag_download_what_they_name(hub, tmp_path):
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "Hello"}) + "\n")
    commit = hub.repositories["tiny-org/target"].commit
    pinned = specdec_run(tmp_path, hub.endpoint, "in.jsonl", "-o", "pinned.jsonl", "--target",
                         f"tiny-org/target@{commit}")
    assert pinned.returncode == 0, pinned.stderr
    assert pinned.stderr == ""  # -q: no "Fetching N files" bar either
    assert not any("/revision/" in path for _, path in hub.requests)  # a commit needs no lookup of "main"
    assert hub.fetched("model.safetensors") == [f"/tiny-org/target/resolve/{commit}/model.safetensors"]
    hub.requests.clear()
    tagged = specdec_run(tmp_path, hub.endpoint, "in.jsonl", "-o", "tagged.jsonl", "--target", "tiny-org/tiny-GGUF:Q4_K_M")
    assert tagged.returncode == 0, tagged.stderr
    assert [path.rsplit("/", 1)[1] for path in hub.fetched(".gguf")] == ["tiny-llama-q4_k_m.gguf"]  # not q8_0's


def test_pickle_weights_are_not_fetched_beside_safetensors(hub, tmp_path):
    """With --allow-pickle the download took the safetensors and the .bin files both: a repository that holds the
    same weights in both formats (many do) cost twice its size in download and disk, for files never read."""
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "Hello"}) + "\n")
    result = specdec_run(tmp_path, hub.endpoint, "in.jsonl", "-o", "out.jsonl", "--target", "tiny-org/both",
                         "--allow-pickle")
    assert result.returncode == 0, result.stderr
    assert hub.fetched("model.safetensors") and not hub.fetched(".bin")
    # a repository of pickle weights alone: refused without the flag (nothing of its weights fetched), run with it
    hub.requests.clear()
    refused = specdec_run(tmp_path, hub.endpoint, "in.jsonl", "-o", "refused.jsonl", "--target", "tiny-org/pickled")
    assert refused.returncode == 2 and "tiny-org/pickled has no weights" in refused.stderr, refused.stderr
    assert not hub.fetched(".bin")
    allowed = specdec_run(tmp_path, hub.endpoint, "in.jsonl", "-o", "pickled.jsonl", "--target", "tiny-org/pickled",
                          "--allow-pickle")
    assert allowed.returncode == 0, allowed.stderr
    assert hub.fetched("pytorch_model.bin")
    assert texts(tmp_path / "pickled.jsonl") == texts(tmp_path / "out.jsonl")  # the same weights, the same answer


@pytest.mark.parametrize(("target", "says"), [
    ("tiny-org/nope", "error: tiny-org/nope was not found on the Hugging Face hub — check the name, or set HF_TOKEN "
                      "for a private model"),
    ("tiny-org/gated", "error: tiny-org/gated is gated on the Hugging Face hub — accept its licence on huggingface.co "
                       "and set HF_TOKEN"),
    ("tiny-org/target@v9", "error: tiny-org/target@v9: revision not found on the hub — check the @revision"),
    ("tiny-org/tiny-GGUF:Q5_K_M", "error: tiny-org/tiny-GGUF has no .gguf file whose name ends in Q5_K_M — check the "
                                  "tag against the repository's files (hf download tiny-org/tiny-GGUF --include "
                                  "'*.gguf' --dry-run lists them), e.g. :Q4_K_M"),
])
def test_what_the_hub_refuses_is_one_line_and_exit_2(hub, tmp_path, target, says):
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "Hello"}) + "\n")
    result = specdec_run(tmp_path, hub.endpoint, "in.jsonl", "-o", "out.jsonl", "--target", target)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [says]
    assert not (tmp_path / "out.jsonl").exists()
