"""`specdec compare --batch-size B` on tiny saved models: throughput rows, their --json, and its one-line errors."""

import json

import pytest

from specdec_cli import bench
from specdec_cli.bench.batched_peers import PeerUnavailable
from specdec_cli.bench.throughput import Pass
from specdec_cli.engine import SamplingParams
from specdec_cli.errors import InputError
from specdec_cli.models import load_model
from specdec_cli.prompts import Prompt

from tests.cli_result import assert_exited
from tests.compare.test_compare_command import invoke, spec_bench_file, table_rows

NAMES = ["target alone ×3", "model k=2 ×3", "ngram k=2 ×3", "HF generate, padded ×3", "HF generate_batch ×3"]


def batched(tiny_pair, folder, *extra):
    """4 prompts at batch size 3 (a full batch, then one row), 8 new tokens, the target's own copy as the draft."""
    return invoke(
        "--target", tiny_pair.target, "--draft", tiny_pair.same, "--draft-quant", "none", "--dtype", "float32",
        "--device", "cpu",
        "--prompts", spec_bench_file(folder / "q.jsonl"), "--drafter", "model,ngram", "--k", "2",
        "--max-new-tokens", "8", "--batch-size", "3", "--json", folder / "out.json", *extra,
        env={"SPECDEC_HOME": str(folder / "home")},
    )


@pytest.fixture(scope="module")
def compared(tiny_pair, tmp_path_factory):
    folder = tmp_path_factory.mktemp("compare-batched")
    return batched(tiny_pair, folder, "--repeats", "2"), folder


def test_one_throughput_row_per_configuration_all_greedy_outputs_identical(compared):
    result, _ = compared
    assert_exited(result, 0)
    rows = table_rows(result.stdout)
    assert [row[0] for row in rows] == NAMES
    assert all(row[1] == "64" for row in rows)  # 4 prompts × 8 tokens × 2 repeats (no EOS on these prompts)
    assert all(row[-1] == "4/4" for row in rows)
    by_name = {row[0]: row for row in rows}
    assert by_name["target alone ×3"][4] == "×1.00"
    assert by_name["model k=2 ×3"][5] == "1.00"  # the draft is the target's copy: every draft accepted
    assert by_name["HF generate, padded ×3"][5] == "–"
    assert by_name["target alone ×3"][6] == "–" and by_name["model k=2 ×3"][6].endswith("%")  # drafted steps
    assert "batch size 3" in result.stdout


def test_the_json_holds_every_pass_and_the_rows(compared):
    _, folder = compared
    report = json.loads((folder / "out.json").read_text())
    assert report["schema"] == "specdec.compare-throughput/1" and "partial" not in report
    assert report["settings"]["batch_size"] == 3 and report["settings"]["repeats"] == 2
    assert report["settings"]["hf_continuous_batching"]["max_requests_per_batch"] == 3
    assert [(p["repeat"], p["configuration"]) for p in report["passes"]] == [tuple(entry) for entry in report["order"]]
    assert [name for _, name in report["order"][:5]] == NAMES and [name for _, name in report["order"][5:]] == NAMES[1:] + NAMES[:1]
    baseline = [p["tokens"] for p in report["passes"] if p["configuration"] == NAMES[0]]
    assert all(len(tokens) == 4 and all(len(row) == 8 for row in tokens) for tokens in baseline)
    for name in NAMES:
        assert [p["tokens"] for p in report["passes"] if p["configuration"] == name] == baseline, name
    summary = {row["configuration"]: row for row in report["summary"]}
    assert list(summary) == NAMES
    assert all((row["new_tokens"], row["identical"], row["compared"], row["passes"]) == (64, 4, 4, 2) for row in summary.values())
    assert summary[NAMES[0]]["ratio"] == 1.0 and report["unavailable"] == {}


def test_progress_is_one_line_per_pass_without_a_terminal(compared):
    result, folder = compared
    lines = [line for line in result.stderr.splitlines() if line.startswith("pass ")]
    assert lines == [f"pass {i}/10 measured: {name}" for i, name in enumerate(NAMES + NAMES[1:] + NAMES[:1], start=1)]
    assert f"wrote {folder / 'out.json'}" in result.stderr


def test_a_peer_that_cannot_run_says_why_in_one_line(tiny_pair, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise PeerUnavailable("no paged attention for this model")

    monkeypatch.setattr("specdec_cli.bench.throughput.generate_batch", refuse)
    result = batched(tiny_pair, tmp_path)
    assert_exited(result, 0)
    rows = {row[0]: row for row in table_rows(result.stdout)}
    assert rows["HF generate_batch ×3"][1:] == ["–"] * 7
    assert rows["HF generate, padded ×3"][1] == "32"
    assert "HF generate_batch ×3 cannot run here: no paged attention for this model" in result.stdout
    assert "note: HF generate_batch ×3 cannot run here: no paged attention for this model" in result.stderr
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["unavailable"] == {"HF generate_batch ×3": "no paged attention for this model"}
    assert all(p["configuration"] != "HF generate_batch ×3" for p in report["passes"])


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
        (["--batch-size", "-2"], "--batch-size must be at least 1, got -2"),
        (["--batch-size", "4", "--with-hf"], "--with-hf cannot combine with --batch-size"),
        (["--batch-size", "4", "--by-category"], "--by-category cannot combine with --batch-size"),
        (["--batch-size", "4", "--plot", "{tmp}/out.png"], "--plot cannot combine with --batch-size"),
        (["--batch-size", "4", "--drafter", "model,tree"], "--batch-size cannot run the tree drafter"),
    ],
)
def test_mistakes_are_one_line_errors_before_any_model_loads(tmp_path, args, complaint):
    result = invoke("--target", tmp_path / "not-loaded", *[a.format(tmp=tmp_path) for a in args])
    assert_exited(result, 2)
    assert complaint in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_configurations_start_with_the_target_alone_and_drop_k_0():
    configs = bench.batched_configurations(["model", "ngram", "model"], [0, 2, "auto"], 8, has_draft=True)
    assert [(c.name, c.kind, c.drafter, c.k) for c in configs] == [
        ("target alone ×8", "batched", "none", 0), ("model k=2 ×8", "batched", "model", 2),
        ("model k=auto ×8", "batched", "model", "auto"), ("ngram k=2 ×8", "batched", "ngram", 2),
        ("ngram k=auto ×8", "batched", "ngram", "auto"), ("HF generate, padded ×8", "hf-padded", "none", 0),
        ("HF generate_batch ×8", "hf-generate-batch", "none", 0),
    ]


def test_a_model_drafter_without_a_draft_model_is_refused():
    with pytest.raises(InputError, match="the cascade drafter needs a draft model"):
        bench.batched_configurations(["cascade"], [2], 4, has_draft=False)


@pytest.fixture(scope="module")
def tiny_target(tiny_pair):
    return load_model(tiny_pair.target, device="cpu", dtype="float32", progress=False)


def rows_of(target, passes, greedy=True, unavailable=None):
    """Summary rows from hand-made passes (no decoding): what the table shows."""
    configs = bench.batched_configurations(["ngram"], [2], 2, has_draft=False)
    prompts = [Prompt("a", "chat", text="Hello"), Prompt("b", "chat", text="def add")]
    settings = bench.BenchSettings(SamplingParams() if greedy else SamplingParams(temperature=0.8, seed=0), 8)
    benchmark = bench.ThroughputBenchmark(target, None, configs, prompts, settings, batch_size=2)
    benchmark.passes, benchmark.unavailable = passes, unavailable or {}
    return {row["configuration"]: row for row in benchmark.summary()}


def test_a_row_is_its_tokens_over_its_seconds_against_the_target_alones(tiny_target):
    rows = rows_of(tiny_target, [
        Pass("target alone ×2", 0, [[1, 2, 3, 4], [5, 6, 7, 8]], 2.0),
        Pass("ngram k=2 ×2", 0, [[1, 2, 3, 4], [5, 6, 7, 9]], 1.0, drafted=10, accepted=4),
        Pass("HF generate, padded ×2", 0, [[1, 2, 3, 4], [5, 6]], 0.5),
    ], unavailable={"HF generate_batch ×2": "cannot"})
    assert (rows["target alone ×2"]["tokens_per_second"], rows["target alone ×2"]["ratio"]) == (4.0, 1.0)
    assert (rows["ngram k=2 ×2"]["tokens_per_second"], rows["ngram k=2 ×2"]["ratio"]) == (8.0, 2.0)
    assert rows["ngram k=2 ×2"]["acceptance_rate"] == 0.4
    assert (rows["ngram k=2 ×2"]["identical"], rows["ngram k=2 ×2"]["compared"]) == (1, 2)
    assert (rows["HF generate, padded ×2"]["new_tokens"], rows["HF generate, padded ×2"]["ratio"]) == (6, 3.0)
    assert rows["HF generate, padded ×2"]["acceptance_rate"] is None
    unavailable = rows["HF generate_batch ×2"]
    assert (unavailable["unavailable"], unavailable["tokens_per_second"], unavailable["identical"]) == ("cannot", None, None)


def test_sampled_rows_have_no_identical_count(tiny_target):
    rows = rows_of(tiny_target, [Pass("target alone ×2", 0, [[1], [2]], 1.0)], greedy=False)
    assert all(row["identical"] is None for row in rows.values())
