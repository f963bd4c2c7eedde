"""`specdec compare` end to end on tiny saved models, and its one-line errors."""

import json

import pytest
from typer.testing import CliRunner

from specdec_cli.cli import app

from tests.cli_result import assert_exited

WIDE = {"COLUMNS": "250"}


def spec_bench_file(path):
    rows = [
        {"question_id": 1, "category": "coding", "turns": ["def add(a, b):", "explain"]},
        {"question_id": 2, "category": "coding", "turns": ["for i in range(10):", "again"]},
        {"question_id": 3, "category": "writing", "turns": ["Hello, how are you today?"]},
        {"question_id": 4, "category": "math", "turns": ["The quick brown fox"]},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def invoke(*args, env=None):
    return CliRunner().invoke(app, ["compare", *map(str, args)], env={**WIDE, **(env or {})})


@pytest.fixture(scope="module")
def compared(tiny_pair, tmp_path_factory):
    folder = tmp_path_factory.mktemp("compare")
    result = invoke(
        "--target", tiny_pair.target, "--draft", tiny_pair.same, "--dtype", "float32", "--device", "cpu",
        "--prompts", spec_bench_file(folder / "q.jsonl"), "--category", "coding", "--category", "writing",
        "--n-prompts", "1", "--drafter", "model,ngram", "--k", "2", "--max-new-tokens", "8", "--with-hf",
        "--by-category", "--json", folder / "out.json", "--plot", folder / "out.png",
        env={"SPECDEC_HOME": str(folder / "home")},
    )
    return result, folder


def table_rows(text):
    return [[cell.strip() for cell in line.split("│")[1:-1]] for line in text.splitlines() if line.startswith("│")]


def test_the_table_has_a_row_per_configuration_then_a_group_per_category(compared):
    result, _ = compared
    assert result.exit_code == 0, result.output
    names = ["target alone", "model k=2", "ngram k=2", "HF assisted", "HF prompt lookup (10)"]
    rows = table_rows(result.stdout)
    assert [row[0] for row in rows[:5]] == names
    assert [row[0] for row in rows[5:17]] == ["coding", *names, "writing", *names]
    assert all(row[-1] == "2/2" for row in rows[:5])  # greedy, .same draft: every output equals the baseline's
    assert all(row[-1] == "1/1" for row in rows[6:11] + rows[12:17])
    by_name = {row[0]: row for row in rows[:5]}
    assert by_name["target alone"][3] == "×1.00" and by_name["target alone"][7] == "×1.00"  # overall, decoding
    # 1st step s (a tiny model's first step may round to 0.00) and decode tok/s: measured, not dashes
    assert float(by_name["model k=2"][5]) >= 0 and float(by_name["model k=2"][6]) > 0
    assert by_name["model k=2"][8] == "1.00"  # acceptance
    assert by_name["model k=2"][10] == "1.00/1.00/–/–"
    assert by_name["HF assisted"][5:9] == ["–"] * 4  # HF's generate does not say when its first token came


def test_the_theory_table_sits_beside_the_measurement(compared):
    result, _ = compared
    theory = {row[0]: row for row in table_rows(result.stdout) if len(row) == 8}
    assert "model k=2" in theory and set(theory) <= {"model k=2", "ngram k=2"}  # rows that drafted after the prefill
    # α, γ: 8 tokens in steps of 2 drafts + 1, 2 + 1, then 1 + 1 (the budget caps the last draft): 5 drafts / 3 steps
    assert theory["model k=2"][1:3] == ["1.00", "1.67"]


def test_the_json_holds_the_selected_prompts_and_every_run(compared):
    _, folder = compared
    report = json.loads((folder / "out.json").read_text())
    assert [(p["id"], p["category"]) for p in report["prompts"]] == [("1", "coding"), ("3", "writing")]
    assert len(report["runs"]) == 2 * 5
    assert [(r["prompt_index"], r["configuration"]) for r in report["runs"]] == [(p, name) for p, _, name in report["order"]]
    baseline = {r["prompt_index"]: r["tokens"] for r in report["runs"] if r["configuration"] == "target alone"}
    hf = {r["prompt_index"]: r["tokens"] for r in report["runs"] if r["configuration"] == "HF assisted"}
    assert hf == baseline and all(len(tokens) == 8 for tokens in baseline.values())
    assert report["environment"]["draft"].endswith("same")


def test_the_plot_is_a_png(compared):
    _, folder = compared
    assert (folder / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_and_notes_go_to_stderr(compared):
    result, folder = compared
    assert f"wrote {folder / 'out.json'}" in result.stderr
    assert "target alone" not in result.stderr.replace("target: ", "")


def test_without_a_terminal_progress_is_one_line_per_prompt(compared):
    result, _ = compared
    lines = [line for line in result.stderr.splitlines() if line.startswith("prompt ")]
    assert [line.split(" (")[0] for line in lines] == ["prompt 1/2 measured", "prompt 2/2 measured"]
    assert lines[-1].split(" (")[1].startswith("10/10 runs")


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["--prompts", "{tmp}/none.jsonl"], "no prompt file"),
        (["--category", "poetry"], "no prompts in category 'poetry' — choose from: chat, code"),
        (["--k", "2,seven"], "invalid draft length 'seven'"),
        (["--json", "{tmp}/no/such/dir/out.json"], "no folder"),
        (["--json", "{tmp}"], "is a folder — give --json a file name"),
        (["--plot", "{tmp}"], "is a folder — give --plot a file name"),
        (["--json", "/proc/specdec-out.json"], "cannot write in /proc for --json"),
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["--n-prompts", "0"], "--n-prompts must be at least 1"),
    ],
)
def test_mistakes_are_one_line_errors_before_any_model_loads(tmp_path, args, complaint):
    result = invoke("--target", tmp_path / "not-loaded", *[a.format(tmp=tmp_path) for a in args])
    assert_exited(result, 2)
    assert complaint in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    result = invoke("--target", tmp_path / "not-loaded", "--plot", tmp_path / "out.png")
    assert result.exit_code == 2
    assert "--plot needs matplotlib — pip install 'specdec[plot]'" in result.stderr


def test_with_an_int8_draft_hf_assisted_also_gets_the_draft_as_hf_loads_it(tiny_pair, tmp_path):
    result = invoke(
        "--target", tiny_pair.target, "--draft", tiny_pair.same, "--draft-int8", "--dtype", "float32",
        "--device", "cpu", "--category", "code", "--n-prompts", "1", "--drafter", "model", "--k", "2",
        "--max-new-tokens", "4", "--with-hf", env={"SPECDEC_HOME": str(tmp_path / "home")},
    )
    assert result.exit_code == 0, result.output
    names = [row[0] for row in table_rows(result.stdout) if row and row[0]]
    assert "HF assisted" in names and "HF assisted (int8 draft)" in names
    assert "draft: " in result.stderr and "int8" in result.stderr
    assert "draft for HF assisted: " in result.stderr


@pytest.mark.parametrize("fails_from", [1, 3], ids=["in_its_warm_up", "on_a_later_prompt"])
def test_a_peer_that_fails_on_the_pair_is_left_out_in_one_line_and_the_rest_measured(tiny_pair, tmp_path,
                                                                                      monkeypatch, fails_from):
    """HF's universal assisted generation raised IndexError inside transformers 5.25 on a real pair of two tokenizers
    (Qwen2.5-Coder-1.5B with SmolLM2-135M), on some prompts: compare ended in that traceback and wrote nothing. A
    peer that fails is now left out with one line saying why (its runs so far dropped), and the rest is measured."""
    from specdec_cli.bench import measure

    real, calls = measure.hf_generate, []

    def failing_assisted(target, assistant, *args, **kwargs):
        if assistant is not None:
            calls.append(1)
            if len(calls) >= fails_from:
                raise IndexError("index -1 is out of bounds for dimension 1 with size 0")
        return real(target, assistant, *args, **kwargs)

    monkeypatch.setattr(measure, "hf_generate", failing_assisted)
    result = invoke("--target", tiny_pair.target, "--draft", tiny_pair.same, "--dtype", "float32", "--device", "cpu",
                    "--prompts", spec_bench_file(tmp_path / "q.jsonl"), "--n-prompts", "2", "--drafter", "model",
                    "--k", "2", "--max-new-tokens", "4", "--with-hf", "--json", tmp_path / "out.json",
                    env={"SPECDEC_HOME": str(tmp_path / "home")})
    assert result.exit_code == 0, result.output
    assert [row[0] for row in table_rows(result.stdout)][:3] == ["target alone", "model k=2", "HF prompt lookup (10)"]
    assert ("note: HF assisted failed on this pair and is left out (IndexError: index -1 is out of "
            "bounds for dimension 1 with size 0; transformers' own code)") in result.stderr
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["left_out"] == {"HF assisted": "IndexError: index -1 is out of bounds for dimension 1 with size 0"}
    assert {run["configuration"] for run in report["runs"]} == {"target alone", "model k=2", "HF prompt lookup (10)"}
    assert len(report["runs"]) == 3 * len(report["prompts"])


def test_the_json_keeps_every_prompt_measured_before_a_failure(tiny_pair, tmp_path, monkeypatch):
    from specdec_cli import bench

    counted_run = bench.Benchmark._counted_run

    def failing_on_the_second_prompt(self, *args):
        if len(self.runs) == 2:  # target alone and k=2 on the first prompt are measured
            raise RuntimeError("the machine fell over")
        return counted_run(self, *args)

    monkeypatch.setattr(bench.Benchmark, "_counted_run", failing_on_the_second_prompt)
    result = invoke("--target", tiny_pair.target, "--draft", tiny_pair.same, "--dtype", "float32", "--device", "cpu",
                    "--prompts", spec_bench_file(tmp_path / "q.jsonl"), "--drafter", "model", "--k", "2",
                    "--max-new-tokens", "4", "--json", tmp_path / "out.json")
    assert isinstance(result.exception, RuntimeError)
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["partial"] is True
    assert [(run["prompt_index"], run["configuration"]) for run in report["runs"]] == [(0, "target alone"), (0, "model k=2")]
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".")] == []  # no temporary left


def test_k_0_alone_prints_no_empty_theory_table(tiny_pair, tmp_path):
    result = invoke("--target", tiny_pair.target, "--draft", tiny_pair.same, "--dtype", "float32", "--device", "cpu",
                    "--prompts", spec_bench_file(tmp_path / "q.jsonl"), "--n-prompts", "1", "--category", "coding",
                    "--drafter", "model", "--k", "0", "--max-new-tokens", "4")
    assert result.exit_code == 0, result.output
    assert "configuration" in result.stdout and "theory" not in result.stdout


@pytest.mark.parametrize(("drafter", "configuration"), [("tree", "tree"), ("model,tree", "model or tree")])
def test_a_drafter_left_without_a_configuration_by_k_0_is_said(tiny_pair, tmp_path, drafter, configuration):
    """--drafter tree --k 0 printed the target alone and no word that the tree configuration was dropped."""
    result = invoke("--target", tiny_pair.target, "--draft", tiny_pair.same, "--dtype", "float32", "--device", "cpu",
                    "--prompts", spec_bench_file(tmp_path / "q.jsonl"), "--n-prompts", "1", "--category", "coding",
                    "--drafter", drafter, "--k", "0,", "--max-new-tokens", "4")
    assert_exited(result, 0)
    assert [row[0] for row in table_rows(result.stdout)] == ["target alone"]
    notes = [line for line in result.stderr.splitlines() if line.startswith("note: no ")]  # not a busy machine's
    assert notes == [f"note: no {configuration} configuration: k 0 drafts nothing (it is the target alone) — give --k "
                     "1 or more, or auto"]


def test_k_0_beside_another_k_drops_no_drafter_and_says_nothing(tiny_pair, tmp_path):
    result = invoke("--target", tiny_pair.target, "--draft", tiny_pair.same, "--dtype", "float32", "--device", "cpu",
                    "--prompts", spec_bench_file(tmp_path / "q.jsonl"), "--n-prompts", "1", "--category", "coding",
                    "--drafter", "tree", "--tree-size", "4", "--k", "0,2", "--max-new-tokens", "4")
    assert_exited(result, 0)
    assert [row[0] for row in table_rows(result.stdout)][:2] == ["target alone", "tree4 k=2"]
    assert "note: no" not in result.stderr


def test_an_int8_target_is_compared_with_itself_unquantised(tiny_pair, tmp_path):
    result = invoke("--target", tiny_pair.target, "--draft", tiny_pair.same, "--target-quant", "int8", "--dtype",
                    "float32", "--device", "cpu", "--prompts", spec_bench_file(tmp_path / "q.jsonl"), "--drafter",
                    "model", "--k", "2", "--max-new-tokens", "6", "--json", tmp_path / "out.json",
                    env={"SPECDEC_HOME": str(tmp_path / "home")})
    assert result.exit_code == 0, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    quality = json.loads((tmp_path / "out.json").read_text())["quality"]
    assert quality["compared"] == 4 and 0 <= quality["identical"] <= 4
    assert quality["target"].startswith("int8") and quality["reference"] == "float32"
    ours, theirs = quality["target_tokens_per_second"], quality["reference_tokens_per_second"]
    assert ours > 0 and theirs > 0  # the float target's speed on the same prompts (issue 60), timed
    line = [line for line in result.stdout.splitlines() if line.startswith("quality:")]
    assert line == [f"quality: the {quality['target']} target's greedy output equals the float32 target's on "
                    f"{quality['identical']}/4 prompts" + ("" if quality["identical"] == 4 else
                    f"; the others first differ at token {quality['median_first_divergence']:g} (median)") +
                    f"; the float32 target alone decoded them at {theirs:.1f} tok/s here, the quantised one at "
                    f"{ours:.1f} (×{ours / theirs:.2f}; one run)"]


def test_an_unquantised_target_gets_no_quality_line(compared):
    result, folder = compared
    assert "quality:" not in result.stdout and "quality" not in json.loads((folder / "out.json").read_text())


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["--prompts", "{tmp}/q.jsonl", "--json", "{tmp}/q.jsonl"], "--json {tmp}/q.jsonl is the --prompts file"),
        (["--prompts", "{tmp}/q.jsonl", "--plot", "{tmp}/q.jsonl"], "--plot {tmp}/q.jsonl is the --prompts file"),
        (["--json", "{tmp}/notes.md"], "{tmp}/notes.md exists and is not a specdec compare result"),
        (["--json", "{tmp}/r.json", "--plot", "{tmp}/r.json"], "--plot {tmp}/r.json is the --json file too"),
        (["--plot", "{tmp}/out.jsonl"], "--plot {tmp}/out.jsonl: matplotlib cannot write .jsonl files — end the name"),
    ],
)
def test_an_output_that_would_replace_another_file_or_cannot_be_written_is_refused_before_loading(
        tmp_path, args, complaint):
    """The prompts file, a file of the user's own, an image format matplotlib lacks (it failed with a traceback
    after the whole benchmark): one line, exit 2, before any model loads; the files are as they were."""
    spec_bench_file(tmp_path / "q.jsonl")
    (tmp_path / "notes.md").write_text("# my notes\n")
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    result = invoke("--target", tmp_path / "not-loaded", *[a.format(tmp=tmp_path) for a in args])
    assert_exited(result, 2)
    assert complaint.format(tmp=tmp_path) in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == before


def test_json_replaces_an_earlier_result_of_its_own(tmp_path):
    """An earlier compare result may be replaced (the check passes and leaves it as it was until the run writes);
    a JSON file of another kind beside it is refused."""
    from specdec_cli.cli.compare import _check_outputs
    from specdec_cli.errors import InputError

    for schema in ("specdec.compare/1", "specdec.compare-throughput/1"):
        earlier = json.dumps({"schema": schema, "partial": True, "runs": []})
        (tmp_path / "old.json").write_text(earlier)
        assert _check_outputs(tmp_path / "old.json", tmp_path / "plot.svg", tmp_path / "q.jsonl") is None
        assert (tmp_path / "old.json").read_text() == earlier
    (tmp_path / "other.json").write_text(json.dumps({"schema": "specdec.calibrate/1", "runs": []}))
    with pytest.raises(InputError, match="other.json exists and is not a specdec compare result"):
        _check_outputs(tmp_path / "other.json", None, tmp_path / "q.jsonl")


def test_the_json_says_how_much_cpu_other_processes_took_and_a_busy_run_gets_a_note(tiny_pair, tmp_path, monkeypatch):
    """A benchmark beside another job measures it too: its JSON keeps the cores' worth other processes used while it
    measured, and past half a core stderr says so (the table is still printed: it is the user's machine)."""
    from specdec_cli.bench import probes

    args = ("--target", tiny_pair.target, "--draft", tiny_pair.same, "--dtype", "float32", "--device", "cpu",
            "--prompts", spec_bench_file(tmp_path / "q.jsonl"), "--n-prompts", "1", "--category", "coding",
            "--drafter", "model", "--k", "2", "--max-new-tokens", "4")
    quiet = invoke(*args, "--json", tmp_path / "quiet.json")
    assert_exited(quiet, 0)
    assert isinstance(json.loads((tmp_path / "quiet.json").read_text())["environment"]["others_cpu_cores"], float)
    from specdec_cli.models import device

    monkeypatch.setattr(probes.BackgroundLoad, "cores", lambda self: 1.2)
    monkeypatch.setattr(device, "busy_cores", lambda: 0.5)  # a 2-core machine's
    for extra in (("--json", tmp_path / "busy.json"), ("--batch-size", "2", "--json", tmp_path / "busy-b2.json")):
        busy = invoke(*args, *extra)
        assert_exited(busy, 0)
        assert ("note: other processes used 1.2 cores on average while this measured: its timings include them "
                "(measure on an idle machine)") in busy.stderr
        assert json.loads(extra[-1].read_text())["environment"]["others_cpu_cores"] == 1.2
        assert "target alone" in busy.stdout


def test_a_full_disk_leaves_no_partial_json_or_plot_and_an_earlier_plot_whole(tmp_path, monkeypatch):
    """A full disk left `.out.json.tmp` beside the JSON, and a cut-short image in place of the plot."""
    import errno

    from matplotlib.figure import Figure

    from specdec_cli.bench.measure import write_json
    from specdec_cli.bench.report import write_plot
    from specdec_cli.errors import InputError

    def cut_short(write):
        def failing(self, target, *args, **kwargs):
            write(self, target, *args, **kwargs)
            with open(target, "r+b") as file:  # the disk filled halfway through
                file.truncate(max(1, file.seek(0, 2) // 2))
            raise OSError(errno.ENOSPC, "No space left on device")
        return failing

    rows = [{"configuration": "target alone", "speedup": 1.0, "speedup_min": 1.0, "speedup_max": 1.0,
             "acceptance_rate": None, "acceptance_at": []}]
    earlier = tmp_path / "out.png"
    write_plot(earlier, rows)
    image = earlier.read_bytes()
    monkeypatch.setattr(Figure, "savefig", cut_short(Figure.savefig))
    with pytest.raises(InputError, match="No space left on device"):
        write_plot(earlier, rows)
    written = type(tmp_path).write_text

    def text_cut_short(self, text, *args, **kwargs):
        written(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(type(tmp_path), "write_text", text_cut_short)
    with pytest.raises(InputError, match="No space left on device"):
        write_json(tmp_path / "out.json", {"runs": list(range(100))})
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out.png"]
    assert earlier.read_bytes() == image


@pytest.mark.parametrize("disk", ["fills then frees", "stays full"])
def test_a_json_that_cannot_be_written_midway_does_not_stop_the_measuring(tiny_pair, tmp_path, monkeypatch, disk):
    """--json is rewritten after every prompt; a disk that filled up midway stopped the benchmark at that write, and
    every run measured was lost, tables and all. Now it says so once, measures on, prints the tables, and writes
    --json again at the end (an error line, exit 2, if that fails too)."""
    from specdec_cli import bench
    from specdec_cli.errors import InputError

    real_write = bench.write_json
    calls = []

    def write_json(path, report):
        calls.append(report.get("partial", False))
        if disk == "stays full" or len(calls) == 1:
            raise InputError(f"cannot write {path}: No space left on device", "choose a writable path for --json")
        real_write(path, report)

    monkeypatch.setattr(bench, "write_json", write_json)
    out = tmp_path / "out.json"
    result = invoke("--target", tiny_pair.target, "--draft", tiny_pair.same, "--dtype", "float32", "--device", "cpu",
                    "--prompts", spec_bench_file(tmp_path / "q.jsonl"), "--drafter", "model", "--k", "2",
                    "--max-new-tokens", "4", "--json", out, env={"SPECDEC_HOME": str(tmp_path / "home")})
    assert result.stderr.count(f"note: cannot write {out}: No space left on device: measuring goes on") == 1
    assert [row[0] for row in table_rows(result.stdout)][:2] == ["target alone", "model k=2"]  # the tables printed
    assert calls[-1] is False and calls.count(True) == 4  # a partial write per prompt, then the whole report
    if disk == "stays full":
        assert_exited(result, 2)
        assert result.stderr.splitlines()[-1] == (f"error: cannot write {out}: No space left on device — choose a "
                                                  "writable path for --json")
        assert not out.exists()
    else:
        assert_exited(result, 0)
        report = json.loads(out.read_text())
        assert "partial" not in report and len(report["runs"]) == 8  # 4 prompts x 2 configurations


def test_a_json_that_cannot_be_written_at_the_end_still_leaves_the_plot(tiny_pair, tmp_path, monkeypatch):
    """The plot was written after the JSON, so a full disk at the JSON's final write (an error, exit 2) left no plot
    either, though a plot is a few kilobytes and often fits where the JSON did not."""
    from specdec_cli import bench
    from specdec_cli.errors import InputError

    def write_json(path, report):
        raise InputError(f"cannot write {path}: No space left on device", "choose a writable path for --json")

    monkeypatch.setattr(bench, "write_json", write_json)
    out, plot = tmp_path / "out.json", tmp_path / "speed.png"
    result = invoke("--target", tiny_pair.target, "--draft", tiny_pair.same, "--dtype", "float32", "--device", "cpu",
                    "--prompts", spec_bench_file(tmp_path / "q.jsonl"), "--n-prompts", "1", "--category", "coding",
                    "--drafter", "model", "--k", "2", "--max-new-tokens", "4", "--json", out, "--plot", plot,
                    env={"SPECDEC_HOME": str(tmp_path / "home")})
    assert_exited(result, 2)
    assert plot.read_bytes().startswith(b"\x89PNG") and not out.exists()
    assert f"wrote {plot}" in result.stderr
    assert result.stderr.splitlines()[-1] == (f"error: cannot write {out}: No space left on device — choose a "
                                              "writable path for --json")
