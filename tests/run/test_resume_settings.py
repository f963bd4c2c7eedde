"""`--resume` checks the settings OUTPUT was made with (OUTPUT.settings.json) and refuses others unless --force; and
that the requests its records answer are those of the input (another file's lines take the same ids: line numbers)."""

import json

import pytest
from typer.testing import CliRunner

from specdec_cli import batch
from specdec_cli.cli import app

LINES = [{"id": f"r{i}", "prompt": f"Hello {i}"} for i in range(3)]


@pytest.fixture
def run(tiny_pair, tmp_path):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in LINES))

    def invoke(*args):
        arguments = ["run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--target", tiny_pair.target,
                     "--draft", tiny_pair.draft, "--dtype", "float32", "-t", "0", *map(str, args)]
        return CliRunner().invoke(app, arguments)
    return invoke


def _other_notes(stderr: str) -> list[str]:
    """The notes beside the one a float target gets on a CPU where a quantised format runs faster."""
    return [line for line in stderr.splitlines() if line.startswith("note:") and " faster here " not in line]


def stored(tmp_path) -> dict:
    return json.loads((tmp_path / "out.jsonl.settings.json").read_text())["settings"]


def test_a_run_stores_the_settings_that_shape_its_records(run, tmp_path, tiny_pair):
    import torch

    from specdec_cli.models import resolve_auto_quantization

    assert run("-n", "5", "--k", "3", "--system", "Be brief.").exit_code == 0
    drafted_in = resolve_auto_quantization("draft", torch.device("cpu"), tiny_pair.draft, torch.float32)  # this CPU's
    assert stored(tmp_path) == {
        "target": tiny_pair.target, "draft": tiny_pair.draft, "drafter": "model", "device": "auto", "dtype": "float32",
        "target_quantization": None, "draft_quantization": drafted_in, "k": 3, "temperature": 0.0, "top_p": 1.0,
        "top_k": 0, "seed": None, "max_new_tokens": 5, "system": "Be brief.",
    }


def test_resume_with_other_settings_is_refused_naming_what_differs(run, tmp_path, monkeypatch):
    assert run("-n", "5", "--limit", "1").exit_code == 0
    before = (tmp_path / "out.jsonl").read_bytes()
    monkeypatch.setattr(batch.ModelGeneration, "load", lambda *a, **k: pytest.fail("loaded the models"))
    result = run("-n", "50", "--k", "2", "--resume")
    assert result.exit_code == 2, result.output
    assert result.stderr == (
        f"error: {tmp_path / 'out.jsonl'} was made with other settings: k \"auto\" → 2, "
        f"max_new_tokens 5 → 50 — run with the same settings, pass --force to mix them in one file, or --overwrite "
        "to start again\n")
    assert (tmp_path / "out.jsonl").read_bytes() == before


def test_resume_with_the_same_settings_continues(run, tmp_path):
    assert run("-n", "5", "--limit", "1").exit_code == 0
    result = run("-n", "5", "--resume")
    assert result.exit_code == 0, result.output
    assert _other_notes(result.stderr) == []
    assert [json.loads(line)["id"] for line in (tmp_path / "out.jsonl").read_text().splitlines()] == ["r0", "r1", "r2"]


def test_force_resumes_with_other_settings_and_says_so(run, tmp_path):
    assert run("-n", "5", "--limit", "1").exit_code == 0
    result = run("-n", "6", "--temperature", "0.5", "--resume", "--force")
    assert result.exit_code == 0, result.output
    assert (f"note: --force: resuming {tmp_path / 'out.jsonl'} with other settings than it was made with "
            "(temperature 0.0 → 0.5, max_new_tokens 5 → 6)") in result.stderr
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 3
    assert stored(tmp_path)["max_new_tokens"] == 5  # the file's first settings stay on record


def test_overwrite_replaces_the_settings_file(run, tmp_path):
    assert run("-n", "5").exit_code == 0
    assert run("-n", "7", "--overwrite").exit_code == 0
    assert stored(tmp_path)["max_new_tokens"] == 7


def test_an_output_without_a_settings_file_resumes_with_a_note(run, tmp_path):
    assert run("-n", "5", "--limit", "1").exit_code == 0
    (tmp_path / "out.jsonl.settings.json").unlink()
    result = run("-n", "50", "--resume")
    assert result.exit_code == 0, result.output
    assert (f"note: {tmp_path / 'out.jsonl'} has no settings file (made by an older specdec), so resuming cannot "
            "check that the settings match\n") in result.stderr
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 3


def test_a_broken_settings_file_is_one_line(run, tmp_path):
    assert run("-n", "5", "--limit", "1").exit_code == 0
    (tmp_path / "out.jsonl.settings.json").write_text("[1, 2]")
    result = run("-n", "5", "--resume")
    assert result.exit_code == 2
    assert result.stderr == (f"error: {tmp_path / 'out.jsonl.settings.json'} is not a specdec settings file — pass "
                             "--force to resume without checking the settings, or --overwrite to start again\n")


def test_an_overwrite_that_fails_to_load_leaves_the_file_and_its_settings_as_they_were(run, tmp_path):
    """A mistake in the command that replaces a file (here a target path that does not exist) must not rewrite the
    settings beside records that were made with others: --resume with the file's own settings still continues."""
    assert run("-n", "5", "--limit", "1").exit_code == 0
    records, settings = (tmp_path / "out.jsonl").read_bytes(), (tmp_path / "out.jsonl.settings.json").read_bytes()
    result = run("-n", "5", "--overwrite", "--target", str(tmp_path / "no-such-model"))
    assert result.exit_code == 2, result.output
    assert "no such file or folder" in result.stderr
    assert (tmp_path / "out.jsonl").read_bytes() == records
    assert (tmp_path / "out.jsonl.settings.json").read_bytes() == settings
    resumed = run("-n", "5", "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 3


def test_a_run_that_fails_to_load_leaves_no_settings_file(run, tmp_path):
    result = run("-n", "5", "--target", str(tmp_path / "no-such-model"))
    assert result.exit_code == 2, result.output
    assert not (tmp_path / "out.jsonl.settings.json").exists()


# Requests: the same ids, other requests. Lines without an id take their line number: a second file's line 1 was
# counted as answered by the first file's record 1, and never run.

def _write_lines(path, prompts):
    path.write_text("".join(json.dumps({"prompt": prompt}) + "\n" for prompt in prompts))


@pytest.fixture
def run_file(tiny_pair, tmp_path):
    def invoke(name, *args):
        arguments = ["run", str(tmp_path / name), "-o", str(tmp_path / "out.jsonl"), "--target", tiny_pair.target,
                     "--dtype", "float32", "-t", "0", "-n", "4", *map(str, args)]
        return CliRunner().invoke(app, arguments)
    return invoke


def test_resume_with_another_input_is_refused_before_loading_and_changes_nothing(run_file, tmp_path, monkeypatch):
    _write_lines(tmp_path / "a.jsonl", ["Say hi", "Say bye"])
    _write_lines(tmp_path / "b.jsonl", ["Name a colour", "Name a fruit", "Name a tree"])
    assert run_file("a.jsonl").exit_code == 0
    before = {name: (tmp_path / name).read_bytes() for name in ("out.jsonl", "out.jsonl.settings.json")}
    monkeypatch.setattr(batch.ModelGeneration, "load", lambda *a, **k: pytest.fail("loaded the models"))
    result = run_file("b.jsonl", "--resume")
    assert result.exit_code == 2, result.output
    assert result.stderr == (
        f"error: {tmp_path / 'out.jsonl'} answers another request than line 1 (id 1) and 1 more of "
        f"{tmp_path / 'b.jsonl'} under the same id: it was made from another input, or those lines changed since — "
        "resume with the input it was made from, write to another -o, or pass --force to keep those answers\n")
    assert {name: (tmp_path / name).read_bytes() for name in before} == before


def test_an_input_that_grew_resumes_and_its_new_lines_are_checked_next_time(run_file, tmp_path):
    _write_lines(tmp_path / "a.jsonl", ["Say hi", "Say bye"])
    assert run_file("a.jsonl").exit_code == 0
    _write_lines(tmp_path / "a.jsonl", ["Say hi", "Say bye", "Say yes"])  # appended to: its answers still hold
    result = run_file("a.jsonl", "--resume")
    assert result.exit_code == 0, result.output
    assert _other_notes(result.stderr) == []
    assert [json.loads(line)["id"] for line in (tmp_path / "out.jsonl").read_text().splitlines()] == [1, 2, 3]
    _write_lines(tmp_path / "a.jsonl", ["Say hi", "Say bye", "Say no", "Say maybe"])  # line 3 edited since
    edited = run_file("a.jsonl", "--resume")
    assert edited.exit_code == 2 and "another request than line 3 (id 3) of" in edited.stderr


def test_a_request_left_unanswered_takes_the_digest_of_the_input_that_answers_it(run_file, tmp_path, monkeypatch):
    """A resume that stops before answering leaves its digests behind; another input answering those lines later must
    not be refused for them the time after."""
    _write_lines(tmp_path / "a.jsonl", ["Say hi", "Say bye"])
    assert run_file("a.jsonl").exit_code == 0
    first = (tmp_path / "out.jsonl").read_text().splitlines()[0]
    (tmp_path / "out.jsonl").write_text(first + "\n")  # stopped after line 1: the digests of both lines are stored
    _write_lines(tmp_path / "b.jsonl", ["Say hi", "Something else"])  # line 2 not answered yet: b may answer it
    assert run_file("b.jsonl", "--resume").exit_code == 0
    again = run_file("b.jsonl", "--resume")
    assert again.exit_code == 0, again.output
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2
    assert run_file("a.jsonl", "--resume").exit_code == 2  # its line 2 is not what the file answers


def test_force_keeps_the_answers_under_those_ids_and_says_so(run_file, tmp_path):
    _write_lines(tmp_path / "a.jsonl", ["Say hi"])
    _write_lines(tmp_path / "b.jsonl", ["Name a colour", "Name a fruit"])
    assert run_file("a.jsonl").exit_code == 0
    result = run_file("b.jsonl", "--resume", "--force")
    assert result.exit_code == 0, result.output
    assert (f"note: --force: {tmp_path / 'out.jsonl'} keeps its answers to other requests under the ids of line 1 "
            f"(id 1) of {tmp_path / 'b.jsonl'}") in result.stderr
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2


def test_a_settings_file_from_before_the_digests_resumes_unchecked(run_file, tmp_path):
    _write_lines(tmp_path / "a.jsonl", ["Say hi"])
    _write_lines(tmp_path / "b.jsonl", ["Name a colour", "Name a fruit"])
    assert run_file("a.jsonl").exit_code == 0
    path = tmp_path / "out.jsonl.settings.json"
    content = json.loads(path.read_text())
    del content["requests"]
    path.write_text(json.dumps(content))
    result = run_file("b.jsonl", "--resume")
    assert result.exit_code == 0, result.output
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2
    assert set(json.loads(path.read_text())["requests"]) == {"2"}  # what it answered is on record from now on


def test_a_line_with_spaces_around_it_or_a_byte_order_mark_is_still_the_same_request():
    from specdec_cli.batch import read_requests

    plain, = read_requests([b'{"prompt": "Say hi"}\n'])
    spaced, = read_requests([b'\xef\xbb\xbf  {"prompt": "Say hi"}  \r\n'])
    other, = read_requests([b'{"prompt": "Say hi!"}\n'])
    assert plain.digest == spaced.digest != other.digest and len(plain.digest) == 16


def test_a_settings_file_the_disk_had_no_room_for_leaves_no_partial_file(tmp_path, monkeypatch):
    import errno

    from specdec_cli.batch import sidecar

    def cut_short(content, file, **kwargs):
        file.write(json.dumps(content)[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sidecar.json, "dump", cut_short)
    with pytest.raises(sidecar.InputError, match="No space left on device"):
        sidecar.write_settings(tmp_path / "out.jsonl", {"k": 3}, {"1": "0" * 16})
    assert list(tmp_path.iterdir()) == []


# A repeated id: the later line is an error record ("duplicate id"), and the id's digest stays the first line's.

DUPLICATED = [{"id": f"g{number}", "prompt": f"Hello {number}"} for number in range(1, 15)]
DUPLICATED[3] = "not json"
DUPLICATED[6] = {"id": "g7"}  # no prompt
DUPLICATED += [{"id": "g1", "prompt": "Something else"}, {"id": "g16", "prompt": "Hello 16"}]  # line 15 repeats g1


@pytest.fixture
def run_duplicated(tiny_pair, tmp_path):
    (tmp_path / "mixed.jsonl").write_text("".join(
        (line if isinstance(line, str) else json.dumps(line)) + "\n" for line in DUPLICATED))

    def invoke(output, *args):
        arguments = ["run", str(tmp_path / "mixed.jsonl"), "-o", str(tmp_path / output), "--target", tiny_pair.target,
                     "--draft", tiny_pair.draft, "--dtype", "float32", "-t", "0", "-n", "8", "--batch-size", "4",
                     *args]
        return CliRunner().invoke(app, arguments)
    return invoke


def _records(path) -> list[dict]:
    """Each record without its timings (its stats)."""
    return [{key: value for key, value in json.loads(line).items() if key != "stats"}
            for line in path.read_text().splitlines()]


def test_a_finished_output_of_an_input_with_a_repeated_id_resumes(run_duplicated, tmp_path, monkeypatch):
    assert run_duplicated("out.jsonl").exit_code == 1  # error records for the bad lines and the duplicate
    before = {name: (tmp_path / name).read_bytes() for name in ("out.jsonl", "out.jsonl.settings.json")}
    monkeypatch.setattr(batch.BatchedGeneration, "load", lambda *a, **k: pytest.fail("loaded the models"))
    result = run_duplicated("out.jsonl", "--resume")
    assert result.exit_code == 1, result.output  # nothing left to do; the error records still count as failed
    assert "error:" not in result.stderr and _other_notes(result.stderr) == []
    assert "records    │ 16 of 16 (16 already done)" in result.stderr
    assert {name: (tmp_path / name).read_bytes() for name in before} == before


@pytest.mark.parametrize("force", [[], ["--force"]])
@pytest.mark.parametrize("stopped_after", [2, 14, 15])  # before the repeat is answered, just before it, after it
def test_an_interrupted_run_over_a_repeated_id_resumes_to_the_uninterrupted_records(
        run_duplicated, tmp_path, monkeypatch, stopped_after, force):
    assert run_duplicated("full.jsonl").exit_code == 1
    original = batch.DurableWriter.write

    def interrupted(self, record):
        if len(self.output.read_text().splitlines()) == stopped_after:
            raise KeyboardInterrupt
        original(self, record)

    with monkeypatch.context() as patched:
        patched.setattr(batch.DurableWriter, "write", interrupted)
        assert run_duplicated("out.jsonl").exit_code == 130
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == stopped_after
    result = run_duplicated("out.jsonl", "--resume", *force)
    assert result.exit_code == 1, result.output
    assert "error:" not in result.stderr and _other_notes(result.stderr) == []
    assert _records(tmp_path / "out.jsonl") == _records(tmp_path / "full.jsonl")  # one per line, the same texts
    again = run_duplicated("out.jsonl", "--resume")  # and the file stays resumable
    assert again.exit_code == 1 and "error:" not in again.stderr, again.output
