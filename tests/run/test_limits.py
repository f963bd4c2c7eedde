"""`specdec run` against the model's context (the tiny pair takes 256 positions) and non-finite numbers."""

import json

import pytest
from typer.testing import CliRunner

from specdec_cli.cli import app
from specdec_cli.engine.kv import CachedModel

from tests.cli_result import assert_exited

CONTEXT = 256  # tests/tiny.py: max_position_embeddings
SENTENCE = "The quick brown fox jumps over the lazy dog. "


def jsonl(records) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def run(tiny_pair, tmp_path):
    def invoke(lines, *args):
        (tmp_path / "in.jsonl").write_text(lines if isinstance(lines, str) else jsonl(lines))
        arguments = ["run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--target", tiny_pair.target,
                     "--draft", tiny_pair.draft, "--dtype", "float32", "-n", "8", "-t", "0", *map(str, args)]
        return CliRunner().invoke(app, arguments)
    return invoke


@pytest.fixture
def positions_checked(monkeypatch):
    """Every forward must stay inside the context: without the check a long prompt fails here at once
    instead of running for minutes."""
    forward = CachedModel._forward

    def checked(self, new_ids, n_logits):
        assert len(self.ids) + len(new_ids) <= CONTEXT, f"a forward past the context ({len(self.ids) + len(new_ids)})"
        return forward(self, new_ids, n_logits)

    monkeypatch.setattr(CachedModel, "_forward", checked)


def test_a_prompt_past_the_context_gets_an_error_record_and_the_batch_goes_on(run, tmp_path, positions_checked):
    result = run([{"id": "long", "prompt": SENTENCE * 20}, {"id": "short", "prompt": "def add(a, b):"}])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    long, short = read(tmp_path / "out.jsonl")
    assert long["finish_reason"] == "error"
    assert long["error"] == ("line 1: the prompt has 620 tokens but the model takes at most 256 (prompt and reply "
                             "together) — shorten the prompt to fewer than 256 tokens, or use a model with a longer context")
    assert short["error"] is None and short["completion_tokens"] > 0


def test_a_huge_prompt_is_refused_before_any_forward(run, tmp_path, positions_checked):
    huge = SENTENCE * 25_000  # 1.1 MB, 775,000 tokens
    result = run([{"id": "huge", "prompt": huge}, {"id": "after", "messages": [{"role": "user", "content": "Hi"}]}])
    assert result.exit_code == 1, result.output
    huge_record, after = read(tmp_path / "out.jsonl")
    assert huge_record["error"].startswith("line 1: the prompt has 775000 tokens but the model takes at most 256")
    assert after["error"] is None


def test_a_budget_past_the_context_is_cut_to_what_fits(run, tmp_path, positions_checked):
    prompt = SENTENCE * 8  # 248 tokens: 8 positions left
    result = run([{"id": "near", "prompt": prompt}], "-n", "1000000000", "--drafter", "model", "--k", "3")
    assert result.exit_code == 0, result.output
    [record] = read(tmp_path / "out.jsonl")
    assert (record["prompt_tokens"], record["completion_tokens"], record["finish_reason"]) == (248, 8, "length")
    assert record["note"] == ("max_new_tokens cut from 1000000000 to 8: the prompt's 248 tokens leave no more of "
                              "the model's 256-token context")


def test_a_cut_budget_shows_in_the_openai_shape_too_and_an_uncut_one_has_no_note(run, tmp_path, positions_checked):
    near = {"custom_id": "near", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": SENTENCE * 8, "max_tokens": 50}}
    result = run([near, {"id": "short", "prompt": "def add(a, b):"}])
    assert result.exit_code == 0, result.output
    cut, short = read(tmp_path / "out.jsonl")
    assert cut["response"]["body"]["choices"][0]["finish_reason"] == "length"
    assert cut["specdec"]["note"] == ("max_new_tokens cut from 50 to 8: the prompt's 248 tokens leave no more of the "
                                      "model's 256-token context")
    assert "note" not in short


@pytest.mark.parametrize(("line", "problem"), [
    ('{"id": "n", "prompt": "x", "temperature": NaN}', '"temperature" must be a finite number, got nan'),
    ('{"id": "i", "prompt": "x", "temperature": Infinity}', '"temperature" must be a finite number, got inf'),
    ('{"id": "p", "prompt": "x", "top_p": NaN}', '"top_p" must be a finite number, got nan'),
    ('{"custom_id": "o", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "temperature": -Infinity}}',
     '"temperature" must be a finite number, got -inf'),
])
def test_a_non_finite_number_on_a_line_is_an_error_record(run, tmp_path, line, problem):
    result = run(line + "\n" + jsonl([{"id": "ok", "prompt": "def add(a, b):"}]))
    assert result.exit_code == 1, result.output
    bad, ok = read(tmp_path / "out.jsonl")
    message = bad["error"]["message"] if isinstance(bad["error"], dict) else bad["error"]
    assert message == f"line 1: {problem}"
    assert ok["error"] is None


@pytest.mark.parametrize("option", [("--temperature", "nan"), ("--temperature", "inf"), ("--top-p", "nan")])
def test_a_non_finite_option_is_one_line_before_loading(run, tmp_path, option):
    result = run([{"prompt": "x"}], *option, "--target", str(tmp_path / "absent"))
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1
    assert "must be a finite number" in result.stderr or "top_p must be in (0, 1]" in result.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_a_request_that_fails_inside_generation_becomes_an_error_record(tiny_pair, tmp_path, monkeypatch):
    """A failure inside the model's forward (here: the second request's) is that record's error; the batch goes on."""
    import json as _json

    from typer.testing import CliRunner as _Runner

    from specdec_cli.cli import app as _app
    from specdec_cli.engine.decode import SpeculativeDecoder

    real_generate, calls = SpeculativeDecoder.generate, []

    def failing_second(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a kernel refused this input\nsecond line")
        return real_generate(self, *args, **kwargs)

    monkeypatch.setattr(SpeculativeDecoder, "generate", failing_second)
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(_json.dumps({"id": name, "prompt": "def add(a, b):"}) + "\n" for name in "abc"))
    result = _Runner().invoke(_app, ["run", str(source), "-o", str(output), "--target", tiny_pair.target, "--dtype",
                                     "float32", "-n", "4", "-t", "0", "--batch-size", "1"])
    assert isinstance(result.exception, SystemExit) and result.exit_code == 1, result.exception  # a record failed
    records = [_json.loads(line) for line in output.read_text().splitlines()]
    assert [record["id"] for record in records] == ["a", "b", "c"]
    assert [record["finish_reason"] for record in records] == ["length", "error", "length"]
    assert records[1]["error"].startswith("line 2: generation failed (RuntimeError: a kernel refused this input)")


@pytest.mark.parametrize("failing", ["the third forward", "every forward holding b"])
def test_a_forward_that_fails_in_a_batch_costs_only_the_request_that_fails_alone(tiny_pair, tmp_path, monkeypatch,
                                                                                failing):
    """Batched, one forward serves every live row. When it fails, each row it held is decoded again alone: a failure
    that does not come back (here the target's third forward) costs nothing; a request that fails every forward it
    is in (b) gets its error record, and its batch mate and the next requests are answered as usual."""
    import json as _json

    from typer.testing import CliRunner as _Runner

    from specdec_cli.cli import app as _app
    from specdec_cli.engine.packed import PackedCache

    real_extend, calls = PackedCache.extend, []

    def failing_forward(self, sequences, n_logits):
        calls.append(1)
        if (len(calls) == 3) if failing == "the third forward" else (1 in sequences):
            raise RuntimeError("a kernel refused this input")
        return real_extend(self, sequences, n_logits)

    monkeypatch.setattr(PackedCache, "extend", failing_forward)
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(_json.dumps({"id": name, "prompt": "def add(a, b):"}) + "\n" for name in "abcd"))
    result = _Runner().invoke(_app, ["run", str(source), "-o", str(output), "--target", tiny_pair.target, "--dtype",
                                     "float32", "-n", "4", "-t", "0", "--batch-size", "2"])
    records = [_json.loads(line) for line in output.read_text().splitlines()]
    assert [record["id"] for record in records] == ["a", "b", "c", "d"]
    if failing == "the third forward":
        assert_exited(result, 0)
        assert [record["finish_reason"] for record in records] == ["length"] * 4
    else:
        assert_exited(result, 1)  # a record failed
        assert [record["finish_reason"] for record in records] == ["length", "error", "length", "length"]
        assert records[1]["error"] == ("line 2: generation failed (RuntimeError: a kernel refused this input) — the "
                                       "other records go on; if this looks like a bug in specdec, please report it "
                                       "with this line")
    answered = [record["text"] for record in records if record["finish_reason"] == "length"]
    assert len(set(answered)) == 1 and answered[0] != ""  # the same prompt, greedy: the same answer wherever it ran
