"""`--draft` with another tokenizer than the target's, end to end: chat, run and compare accept the pair, say the
vocabularies' overlap in one line before any weights load, and give the target alone's output (greedy).

The pair (tests/two_tokenizers.py), saved as tiny random models: a Qwen2-style target with a byte-level BPE and a
Llama-style draft with a SentencePiece-style tokenizer (byte fallback, its own BOS and special tokens)."""

import json
import re

import pytest
from typer.testing import CliRunner

from specdec_cli.cli import app

from tests.cli_result import assert_exited
from tests.tiny import CORPUS, build_tiny_model
from tests.two_tokenizers import DRAFT_CORPUS, TARGET_CORPUS, draft_tokenizer, target_tokenizer

WIDE = {"COLUMNS": "250", "NO_COLOR": None, "FORCE_COLOR": None}
COMMON = ["--dtype", "float32", "--device", "cpu", "-t", "0", "--max-new-tokens", "10"]
PROMPTS = [{"id": "a", "prompt": "The quick brown fox"}, {"id": "b", "messages": [{"role": "user", "content": "Hello, café?"}]},
           {"id": "c", "prompt": "def add(a, b):"}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("cross-vocab-pair")
    # The target's vocabulary is the larger, its ChatML tokens last (ids past the draft's rows, as Qwen's are past
    # SmolLM2's): a target id fed to the draft fails.
    target_tok = target_tokenizer(700, TARGET_CORPUS + DRAFT_CORPUS + CORPUS, specials_last=True)
    assert target_tok.convert_tokens_to_ids("<|im_start|>") >= len(draft_tokenizer())
    build_tiny_model(root / "target", arch="qwen2", seed=0, tokenizer=target_tok)
    build_tiny_model(root / "draft", arch="llama", seed=1, tokenizer=draft_tokenizer())
    return str(root / "target"), str(root / "draft")


def invoke(command: str, *args, stdin=None, home=None):
    env = {**WIDE, **({"SPECDEC_HOME": str(home)} if home else {})}
    return CliRunner().invoke(app, [command, *map(str, args)], input=stdin, env=env)


def said_overlap(stderr: str, draft: str) -> bool:
    return any(line.startswith(("note: the draft", "warning: the draft")) and draft in line
               and "another tokenizer" in line for line in stderr.splitlines())


def test_run_decodes_with_the_pair_one_request_at_a_time(pair, tmp_path):
    target, draft = pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    outputs = {}
    for k in ("3", "0"):
        out = tmp_path / f"out-{k}.jsonl"
        result = invoke("run", prompts, "-o", out, "--target", target, "--draft", draft, "--drafter", "cascade",
                        "--k", k, *COMMON, home=tmp_path / "home")
        assert_exited(result, 0)
        outputs[k] = [(r["id"], r["text"], r["completion_tokens"]) for r in map(json.loads, out.read_text().splitlines())]
    assert outputs["3"] == outputs["0"]
    assert said_overlap(result.stderr, draft)
    assert "batch: 1 request at a time (the draft has another tokenizer than the target" in result.stderr


def test_chat_replies_as_the_target_alone(pair, tmp_path):
    target, draft = pair
    replies = {}
    for k in ("3", "0"):
        result = invoke("chat", "--target", target, "--draft", draft, "--drafter", "model", "--k", k, *COMMON,
                        stdin="Hello, café?\nThe quick brown fox\n", home=tmp_path / "home")
        assert_exited(result, 0)
        replies[k] = [line for line in result.stdout.splitlines() if "tok/s" not in line]
        if k == "3":
            assert said_overlap(result.stderr, draft)
            drafted = [int(count) for count in re.findall(r"\(\d+/(\d+) drafted", result.stdout)]
            assert len(drafted) == 2 and sum(drafted) > 0, result.stdout  # the stats lines count the drafts
    assert replies["3"] == replies["0"]


def test_compare_rows_for_the_pair_are_identical_to_the_target_alone(pair, tmp_path):
    """The model and cascade drafters, the tree (which drafts the cascade's chains, said in one line) and HF's
    assisted generation as a peer."""
    target, draft = pair
    result = invoke("compare", "--target", target, "--draft", draft, "--drafter", "model,cascade,tree", "--k", "2",
                    "--n-prompts", "1", "--category", "code", "--with-hf", *COMMON, "--json", tmp_path / "out.json",
                    home=tmp_path / "home")
    assert_exited(result, 0)
    report = json.loads((tmp_path / "out.json").read_text())
    runs = report["runs"]
    baseline = {run["prompt_index"]: run["tokens"] for run in runs if run["configuration"] == "target alone"}
    drafted = [run for run in runs if run["configuration"] != "target alone"]
    assert {run["configuration"] for run in drafted} >= {"model k=2", "cascade k=2", "HF assisted"}  # HF: universal
    # assisted generation, given both tokenizers
    assert all(run["tokens"] == baseline[run["prompt_index"]] for run in drafted)
    assert "the tree drafter drafts the cascade's chains (a tree needs a draft of the target's tokenizer)" in result.stderr


def test_compare_batch_size_refuses_the_pair_in_one_line(pair, tmp_path):
    """`run` decodes the pair one request at a time; compare's throughput mode, which batches, says why it cannot."""
    target, draft = pair
    result = invoke("compare", "--target", target, "--draft", draft, "--drafter", "model", "--k", "2", "--n-prompts",
                    "1", "--category", "code", "--batch-size", "2", *COMMON, home=tmp_path / "home")
    assert_exited(result, 2)
    assert result.stderr.splitlines()[-1] == ("error: a batch drafts only with a draft of the target's tokenizer; this "
                                              "draft has another one — compare one request at a time (leave out "
                                              "--batch-size), or use --drafter ngram")
