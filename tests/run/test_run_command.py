"""`specdec run` end to end on the tiny saved pair (fp32): records checked against the target alone."""

import json

import pytest
import torch
from typer.testing import CliRunner

from specdec_cli import batch
from specdec_cli.cli import app

from tests.cli_result import assert_exited

WIDE = {"COLUMNS": "200"}
TIMINGS = ("seconds", "tokens_per_second", "created")
# A greedy row in a batch drafts where the run's clock measured drafting faster (engine/gate.py): its text is the
# target's, its drafting counts follow the clock like its timings do.
DRAFTING = ("steps", "drafted", "accepted", "acceptance_rate", "tokens_per_step", "drafted_steps", "held_steps", "policy")

MIXED = [
    {"id": "z", "prompt": "def add(a, b):", "max_new_tokens": 6},
    {"id": "a", "messages": [{"role": "user", "content": "Hello, how are you?"}]},
    {"custom_id": "m", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "any", "messages": [{"role": "user", "content": "The quick brown fox"}], "max_tokens": 5}},
    {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": "for i in range(10):", "max_completion_tokens": 7}},
    {"prompt": "Speculative decoding drafts"},
]


def jsonl(records) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def without_timings(value, left_out=TIMINGS):
    if isinstance(value, dict):
        return {key: without_timings(item, left_out) for key, item in value.items() if key not in left_out}
    if isinstance(value, list):
        return [without_timings(item, left_out) for item in value]
    return value


@pytest.fixture
def run(tiny_pair, tmp_path):
    """Invoke `specdec run` on the tiny pair, greedy unless told otherwise (later flags win)."""
    def invoke(*args, stdin=None):
        defaults = ["--target", tiny_pair.target, "--draft", tiny_pair.draft, "--dtype", "float32", "--max-new-tokens", "8", "-t", "0"]
        return CliRunner().invoke(app, ["run", *defaults, *map(str, args)], input=stdin, env=WIDE)
    return invoke


@pytest.fixture(scope="module")
def reference(tiny_pair):
    """Greedy output of the target alone (HF generate), stopping at the end-of-turn ids as specdec does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_pair.target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair.target)
    eos = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])

    def greedy(prompt=None, messages=None, max_new_tokens=8):
        ids = tokenizer(prompt)["input_ids"] if prompt else tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        with torch.no_grad():
            output = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens,
                                    eos_token_id=eos, pad_token_id=eos[1])
        new = output[0, len(ids):].tolist()
        finish = "stop" if new[-1] in eos else "length"
        return tokenizer.decode(new, skip_special_tokens=True), finish, len(ids), len(new)

    return greedy


@pytest.mark.parametrize("batch_size", ["1", "auto", "3"])
def test_mixed_shapes_give_the_targets_own_output_in_input_order(run, tmp_path, reference, tiny_pair, batch_size,
                                                                 monkeypatch):
    """One at a time and batched (auto: 8 at a time, the default without a calibration, cut to the 5 requests the
    file holds, all in one batch; 3: rows finish and are refilled) give the same records: the target's own
    greedy output, drafted on the way. A tiny model's forward costs about the same at any token count, so the batch
    policy is given the flat assumed curve (a CPU's, uncalibrated, stops a batch of 3 or more from drafting)."""
    from specdec_cli.engine import batch_policy

    monkeypatch.setitem(batch_policy._ASSUMED, "cpu", batch_policy._ASSUMED["flat"])
    (tmp_path / "in.jsonl").write_text(jsonl(MIXED))
    result = run(tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", "--batch-size", batch_size)
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    assert {"1": "batch: 1 request at a time\n", "3": "batch: 3 requests at a time\n",
            "auto": "batch: 5 requests at a time (all the input holds, fewer than 8)\n"}[batch_size] in result.stderr
    z, a, m, b, five = read(tmp_path / "out.jsonl")
    assert [z["id"], a["id"], m["custom_id"], b["custom_id"], five["id"]] == ["z", "a", "m", "b", 5]
    for record, expected in ((z, reference("def add(a, b):", max_new_tokens=6)),
                             (a, reference(messages=MIXED[1]["messages"])),
                             (five, reference("Speculative decoding drafts"))):
        assert (record["text"], record["finish_reason"], record["prompt_tokens"], record["completion_tokens"]) == expected
        assert record["error"] is None and record["stats"]["drafted"] > 0
    text, finish, prompt_tokens, completion_tokens = reference(messages=MIXED[2]["body"]["messages"], max_new_tokens=5)
    body = m["response"]["body"]
    assert (m["id"], m["error"], m["response"]["status_code"], body["object"], body["model"]) == (
        "batch_req_3", None, 200, "chat.completion", tiny_pair.target)
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}]
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}
    assert set(m["specdec"]) == {"steps", "drafted", "accepted", "acceptance_rate", "tokens_per_step", "tokens_per_second", "seconds",
                                 "drafted_steps", "held_steps", "policy"}
    text, finish, *_ = reference("for i in range(10):", max_new_tokens=7)
    assert (b["response"]["body"]["object"], b["response"]["body"]["choices"][0]["text"]) == ("text_completion", text)



def test_stdin_input_gives_the_same_records(run, tmp_path):
    (tmp_path / "in.jsonl").write_text(jsonl(MIXED[:2]))
    assert run(tmp_path / "in.jsonl", "-o", tmp_path / "from-file.jsonl").exit_code == 0
    result = run("-", "-o", tmp_path / "from-stdin.jsonl", stdin=jsonl(MIXED[:2]))
    assert result.exit_code == 0, result.output
    assert (without_timings(read(tmp_path / "from-stdin.jsonl"), TIMINGS + DRAFTING)
            == without_timings(read(tmp_path / "from-file.jsonl"), TIMINGS + DRAFTING))


def test_limit_runs_only_the_first_records(run, tmp_path):
    (tmp_path / "in.jsonl").write_text(jsonl(MIXED))
    result = run(tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", "--limit", "2")
    assert result.exit_code == 0, result.output
    assert [r["id"] for r in read(tmp_path / "out.jsonl")] == ["z", "a"]
    assert "records    │ 2 of 2" in result.stderr


def test_malformed_lines_become_error_records_and_the_batch_goes_on(run, tmp_path):
    lines = [MIXED[0], "{oops", {"id": "e", "messages": []},
             {"custom_id": "u", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}, MIXED[4]]
    (tmp_path / "in.jsonl").write_text(jsonl(lines))
    result = run(tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl")
    assert_exited(result, 1)  # the failed records' exit code, not a crash
    records = read(tmp_path / "out.jsonl")
    assert [r["finish_reason"] for r in records[:3]] == ["length", "error", "error"]
    assert [records[1]["error"], records[2]["error"]] == ["line 2: not valid JSON (Expecting property name enclosed in double quotes at column 2)", 'line 3: "messages" is empty']
    assert records[3]["error"] == {"code": "invalid_request", "message": "line 4: unsupported url '/v1/embeddings': use /v1/chat/completions or /v1/completions"}
    assert records[4]["id"] == 5 and records[4]["text"]
    assert "failed     │ 3" in result.stderr
    assert result.stderr.strip().endswith(f'3 of 5 records failed — their lines in {tmp_path / "out.jsonl"} have finish_reason "error" (or an "error" object) saying why')


def test_a_file_of_only_bad_lines_needs_no_model(run, tmp_path):
    (tmp_path / "in.jsonl").write_text("nope\n")
    result = CliRunner().invoke(app, ["run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--target", str(tmp_path / "absent")])
    assert_exited(result, 1)  # the failed record's exit code, not a crash (CliRunner gives a crash exit code 1 too)
    assert read(tmp_path / "out.jsonl")[0]["error"] == "line 1: not valid JSON (Expecting value at column 1)"
    assert "target:" not in result.stderr  # no model was loaded
    assert result.stderr.strip().endswith(
        f'1 of 1 records failed — their lines in {tmp_path / "out.jsonl"} have finish_reason "error" (or an "error" object) saying why')


@pytest.mark.parametrize(("text", "says"), [
    (json.dumps(MIXED[:2]), "is one JSON list of 2 items, not JSON lines"),
    (json.dumps(MIXED[:2], indent=2), "is one JSON list of 2 items, not JSON lines"),
    (json.dumps(MIXED[0], indent=2), "is one JSON object over 5 lines, not JSON lines"),
])
def test_a_file_that_is_one_json_document_is_refused_whole(run, tmp_path, text, says):
    """A prompts file written with json.dump (a list, or indented) made an error record of every line it has (a
    pretty-printed list of 100 requests: hundreds of records saying "not valid JSON") and exit 1."""
    (tmp_path / "requests.json").write_text(text + "\n")
    for source, stdin, name in ((tmp_path / "requests.json", None, tmp_path / "requests.json"), ("-", text, "standard input")):
        result = run(source, "-o", tmp_path / "out.jsonl", stdin=stdin)
        assert_exited(result, 2)
        assert result.stderr.startswith(f"error: {name} {says} — write ") and len(result.stderr.splitlines()) == 1
        assert result.stderr.rstrip().endswith("requests.jsonl" if stdin is None else "FILE > lines.jsonl")
        assert not (tmp_path / "out.jsonl").exists() and not batch.settings_path(tmp_path / "out.jsonl").exists()


def test_a_json_lines_file_with_one_good_line_is_not_refused(run, tmp_path):
    """The same check leaves real JSON lines alone: a one-object file, and a file whose every line is bad JSON."""
    (tmp_path / "in.jsonl").write_text(json.dumps(MIXED[0]) + "\n")
    assert_exited(run(tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl"), 0)
    (tmp_path / "bad.jsonl").write_text("[1, 2]\n[3]\n")
    assert_exited(run(tmp_path / "bad.jsonl", "-o", tmp_path / "bad-out.jsonl"), 1)  # each line: an error record
    assert len(read(tmp_path / "bad-out.jsonl")) == 2


def test_a_line_the_chat_template_refuses_is_an_error_record(run, tiny_pair, tmp_path):
    """Gemma's chat template raises on a system role: such a line stopped the whole batch with a jinja2 traceback,
    before any record was written. It is that line's error record now; the others run."""
    import shutil

    from transformers import AutoTokenizer

    from specdec_cli.session import encode_chat

    folder = tmp_path / "no-system"
    shutil.copytree(tiny_pair.target, folder)
    template = folder / "chat_template.jinja"
    guard = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    template.write_text(guard + template.read_text())
    lines = [{"id": "s", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
             {"id": "u", "messages": [{"role": "user", "content": "Hi"}]}]
    (tmp_path / "in.jsonl").write_text(jsonl(lines))
    result = run(tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", "--target", folder, "--draft", tiny_pair.draft)
    assert_exited(result, 1)  # the failed record's exit code, not a crash
    records = read(tmp_path / "out.jsonl")
    assert records[0]["error"].startswith("line 1: the model's chat template refuses these messages: System role not")
    assert records[1]["finish_reason"] == "length" and records[1]["text"]
    # --system (the command's, not the line's) opens the first user message there, as llama.cpp does: answered
    result = run(tmp_path / "in.jsonl", "-o", tmp_path / "with-system.jsonl", "--target", folder, "--draft",
                 tiny_pair.draft, "--system", "Be brief.")
    records = read(tmp_path / "with-system.jsonl")
    assert records[0]["error"].startswith("line 1: the model's chat template refuses these messages")  # as written
    assert records[1]["finish_reason"] == "length"
    folded = [{"role": "user", "content": "Be brief.\n\nHi"}]
    assert records[1]["prompt_tokens"] == len(encode_chat(AutoTokenizer.from_pretrained(folder), folded))


def test_a_role_the_chat_template_leaves_out_is_an_error_record_and_developer_is_system(run, tiny_pair, tmp_path):
    """A template that renders only the roles it names (Qwen's) skipped a "System" or "developer" message: its line
    was answered without that text, and nothing said so. "developer" (OpenAI's newer name for the system message)
    now goes in as "system"; another role the template leaves out is that line's error record."""
    import shutil

    from transformers import AutoTokenizer

    from specdec_cli.session import encode_chat

    folder = tmp_path / "known-roles"
    shutil.copytree(tiny_pair.target, folder)
    template = folder / "chat_template.jinja"
    text = template.read_text()
    assert text.count("{% for message in messages %}") == 1
    template.write_text(text.replace("{% for message in messages %}", "{% for message in messages %}"
                                     "{% if message['role'] in ['system', 'user', 'assistant'] %}")
                        .replace("{% endfor %}", "{% endif %}{% endfor %}"))
    question = {"role": "user", "content": "Hi"}
    lines = [{"id": "d", "messages": [{"role": "developer", "content": "Be brief."}, question]},
             {"id": "S", "messages": [{"role": "System", "content": "Be brief."}, question]},
             {"id": "s", "messages": [{"role": "system", "content": "Be brief."}, question]}]
    (tmp_path / "in.jsonl").write_text(jsonl(lines))
    result = run(tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", "--target", folder, "--draft", tiny_pair.draft)
    assert_exited(result, 1)  # the failed record's exit code, not a crash
    developer, capital, system = read(tmp_path / "out.jsonl")
    assert capital["error"] == ('line 2: messages[0] has the role "System", which the model\'s chat template leaves '
                                'out of the prompt: its text would never reach the model — write "system"')
    as_system = encode_chat(AutoTokenizer.from_pretrained(folder), lines[2]["messages"])
    assert developer["prompt_tokens"] == system["prompt_tokens"] == len(as_system)
    assert without_timings(developer) == without_timings(system) | {"id": "d"}


def test_continue_final_message_goes_on_with_the_last_message(run, tiny_pair, tmp_path):
    """A line that begins the reply for the model (vLLM's `continue_final_message`) is answered from the end of that
    message: the record's tokens are what the target decodes after the open message, not after a new turn."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec_cli.session import encode_chat

    messages = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "hello"}]
    lines = [{"id": "open", "messages": messages, "continue_final_message": True, "max_new_tokens": 6},
             {"id": "new", "messages": messages, "max_new_tokens": 6}]
    (tmp_path / "in.jsonl").write_text(jsonl(lines))
    assert_exited(run(tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl"), 0)
    opened, new = read(tmp_path / "out.jsonl")
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair.target)
    model = AutoModelForCausalLM.from_pretrained(tiny_pair.target, dtype=torch.float32)
    for record, continued in ((opened, True), (new, False)):
        ids = encode_chat(tokenizer, messages, add_generation_prompt=not continued, continue_final_message=continued)
        assert record["prompt_tokens"] == len(ids)
        output = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None)
        assert record["text"] == tokenizer.decode(output[0, len(ids):], skip_special_tokens=True)
    assert opened["prompt_tokens"] < new["prompt_tokens"]  # no end of the message, no new turn's header


def test_half_a_character_fails_its_line_and_the_batch_goes_on(run, tmp_path):
    """A prompt with a lone surrogate escape stopped the whole batch with a traceback: no record was written."""
    (tmp_path / "in.jsonl").write_text('{"id": "cut", "prompt": "smile \\ud83d"}\n{"id": "q\\ud83d", "prompt": "x"}\n'
                                       '{"id": "fine", "prompt": "Hello"}\n')
    result = run(tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl")
    assert_exited(result, 1)  # two records failed, no crash
    cut, bad_id, fine = read(tmp_path / "out.jsonl")
    assert cut["id"] == "cut" and cut["error"].startswith('line 1: "prompt" holds \\ud83d alone')
    assert bad_id["id"] == 2 and bad_id["error"].startswith('line 2: "id" holds \\ud83d alone')
    assert fine["finish_reason"] == "length" and fine["text"]


def test_a_system_prompt_that_is_not_utf8_is_refused_before_the_load(run, tmp_path):
    """A shell argument with a byte that is not UTF-8 reaches Python as a lone surrogate: --system ended run (and
    chat) in a traceback after the models had loaded."""
    (tmp_path / "in.jsonl").write_text(jsonl(MIXED[:1]))
    result = run(tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", "--system", "caf\udce9",
                 "--target", tmp_path / "not-loaded")
    assert_exited(result, 2)
    assert result.stderr == ("error: --system is not UTF-8 text (it holds the byte 0xe9) — pass UTF-8 text (a shell in "
                             "a UTF-8 locale)\n")
    assert not (tmp_path / "out.jsonl").exists()


def test_an_existing_output_is_refused_and_left_alone(run, tmp_path):
    (tmp_path / "in.jsonl").write_text(jsonl(MIXED[:1]))
    (tmp_path / "out.jsonl").write_text('{"id": "precious"}\n')
    result = run(tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl")
    assert result.exit_code == 2
    assert result.stderr == f"error: {tmp_path / 'out.jsonl'} already exists — pass --resume to continue it (same settings), or --overwrite to replace it\n"
    assert (tmp_path / "out.jsonl").read_text() == '{"id": "precious"}\n'


def test_overwrite_replaces_the_output(run, tmp_path):
    (tmp_path / "in.jsonl").write_text(jsonl(MIXED[:1]))
    (tmp_path / "out.jsonl").write_text('{"id": "old"}\n')
    assert run(tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", "--overwrite").exit_code == 0
    assert [r["id"] for r in read(tmp_path / "out.jsonl")] == ["z"]


def test_resume_repairs_a_torn_last_line_and_finishes_the_batch(run, tmp_path):
    (tmp_path / "in.jsonl").write_text(jsonl(MIXED))
    assert run(tmp_path / "in.jsonl", "-o", tmp_path / "full.jsonl").exit_code == 0
    full = (tmp_path / "full.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "out.jsonl").write_text(full[0] + full[1] + full[2][:40])  # a crash in the middle of line 3
    result = run(tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", "--resume")
    assert result.exit_code == 0, result.output
    assert "records    │ 5 of 5 (2 already done)" in result.stderr
    resumed = read(tmp_path / "out.jsonl")
    assert resumed[:2] == [json.loads(line) for line in full[:2]]  # untouched
    assert without_timings(resumed, TIMINGS + DRAFTING) == without_timings([json.loads(line) for line in full],
                                                                           TIMINGS + DRAFTING)


def test_resume_with_nothing_left_loads_no_model_and_changes_nothing(run, tmp_path):
    (tmp_path / "in.jsonl").write_text(jsonl(MIXED[:2]))
    assert run(tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl").exit_code == 0
    before = (tmp_path / "out.jsonl").read_bytes()
    result = run(tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", "--resume")
    assert result.exit_code == 0
    assert "target:" not in result.stderr
    assert (tmp_path / "out.jsonl").read_bytes() == before


def test_same_input_and_seed_give_the_same_file(run, tmp_path):
    sampled = [{"id": "s1", "prompt": "Hello", "temperature": 1.5, "seed": 5},
               {"id": "s2", "prompt": "Hello", "temperature": 1.5, "seed": 5},
               {"id": "s3", "prompt": "Hello", "temperature": 1.5, "seed": 6},
               {"id": "g", "prompt": "Hello", "temperature": 1.5}]  # takes --seed
    (tmp_path / "in.jsonl").write_text(jsonl(sampled))
    first = run(tmp_path / "in.jsonl", "-o", tmp_path / "one.jsonl", "--seed", "1")
    second = run(tmp_path / "in.jsonl", "-o", tmp_path / "two.jsonl", "--seed", "1")
    assert first.exit_code == second.exit_code == 0
    one, two = read(tmp_path / "one.jsonl"), read(tmp_path / "two.jsonl")
    assert without_timings(one) == without_timings(two)
    assert one[0]["text"] == one[1]["text"] != one[2]["text"]  # a record's seed alone decides its text


def test_one_at_a_time_a_greedy_request_drafts_by_the_calibration_and_a_sampled_one_by_the_odds(
        run, tiny_pair, tmp_path, monkeypatch):
    """With this machine's calibration, run's one-request decoder prices a greedy request's drafts by the
    calibrated costs (never the clock; its tokens are the target's either way), and drafts a sampled one on the
    draft's odds alone, which no machine's costs change: the same input and seed give the same file."""
    from specdec_cli.engine import CalibratedDraftOrNot, FixedK, SpeculativeDecoder
    from specdec_cli.models.formats.calibration import machine, save_calibration

    curve = {1: 0.03, 2: 0.031, 4: 0.034, 8: 0.06}
    save_calibration({"machine": machine(), "entries": [
        {"role": role, "model": path, "quantization": "none", "dtype": "float32", "seconds": seconds}
        for role, path, seconds in (("target", tiny_pair.target, curve), ("draft", tiny_pair.draft, {1: 0.005}))]})
    used = []
    generating = SpeculativeDecoder.generate

    def seen(self, prompt_ids, params, *args, **kwargs):
        used.append((params.greedy, type(self.policy)))
        return generating(self, prompt_ids, params, *args, **kwargs)

    monkeypatch.setattr(SpeculativeDecoder, "generate", seen)
    records = [{"id": "s1", "prompt": "Hello there", "temperature": 1.0, "seed": 5},
               {"id": "g", "prompt": "Hello there", "temperature": 0},
               {"id": "s2", "prompt": "Hello there", "temperature": 1.0, "seed": 6}]
    (tmp_path / "in.jsonl").write_text(jsonl(records))
    first = run(tmp_path / "in.jsonl", "-o", tmp_path / "one.jsonl", "--batch-size", "1", "--max-new-tokens", "24")
    second = run(tmp_path / "in.jsonl", "-o", tmp_path / "two.jsonl", "--batch-size", "1", "--max-new-tokens", "24")
    assert first.exit_code == second.exit_code == 0, first.output
    assert used[:3] == [(False, FixedK), (True, CalibratedDraftOrNot), (False, FixedK)], used
    assert without_timings(read(tmp_path / "one.jsonl")) == without_timings(read(tmp_path / "two.jsonl"))


@pytest.mark.parametrize("batch_size", ["1", "3"])
def test_k_0_runs_the_target_alone_in_a_batch_too(run, tmp_path, reference, batch_size):
    """`--k 0` with the profile's drafter (a draft model's): the batched engine was still built with that
    drafter and no draft model, a ValueError traceback."""
    (tmp_path / "in.jsonl").write_text(jsonl(MIXED[:2] + MIXED[4:]))
    result = run(tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", "--batch-size", batch_size, "--k", "0")
    assert_exited(result, 0)
    z, a, five = read(tmp_path / "out.jsonl")
    for record, expected in ((z, reference("def add(a, b):", max_new_tokens=6)),
                             (a, reference(messages=MIXED[1]["messages"])),
                             (five, reference("Speculative decoding drafts"))):
        assert (record["text"], record["finish_reason"], record["prompt_tokens"], record["completion_tokens"]) == expected
        assert record["stats"]["drafted"] == 0


@pytest.mark.parametrize("batch_size", ["1", "3"])
def test_a_row_wise_target_gives_a_record_the_same_text_whatever_came_before_it(run, tmp_path, batch_size):
    """An int8 target keeps a prompt's cache entries for the next prompt (the shared system prompt is computed
    once, tests/engine/test_prompt_reuse.py): what it keeps is bit for bit what computing it gives, so a record,
    greedy or sampled, is the same in the file's order, reversed, or alone."""
    system = {"role": "system", "content": "You answer in one short line, with no preamble and no apologies."}
    questions = ["Hello, how are you?", "Name a colour.", "What is two plus two?", "Say something kind."]
    records = [{"id": f"q{i}", "messages": [system, {"role": "user", "content": question}], "seed": i,
                **({"temperature": 0.9} if i % 2 else {})} for i, question in enumerate(questions)]

    def texts(file_records, name):
        (tmp_path / f"{name}.in.jsonl").write_text(jsonl(file_records))
        result = run(tmp_path / f"{name}.in.jsonl", "-o", tmp_path / f"{name}.jsonl", "--target-quant", "int8",
                     "--batch-size", batch_size)
        assert_exited(result, 0)
        return {record["id"]: (record["text"], record["completion_tokens"]) for record in read(tmp_path / f"{name}.jsonl")}

    in_order = texts(records, "in-order")
    assert texts(records[::-1], "reversed") == in_order
    assert texts(records[2:3], "alone") == {"q2": in_order["q2"]}


def test_a_stop_string_ends_the_record_and_is_cut(run, tmp_path, reference):
    text, *_ = reference("def add(a, b):", max_new_tokens=8)
    stop = next(char for char in text[2:] if char != "\ufffd" and char.strip())
    (tmp_path / "in.jsonl").write_text(jsonl([{"id": "s", "prompt": "def add(a, b):", "stop": [stop]}]))
    result = run(tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl")
    assert result.exit_code == 0, result.output
    record = read(tmp_path / "out.jsonl")[0]
    assert (record["text"], record["finish_reason"]) == (text[: text.index(stop)], "stop")


def test_ctrl_c_keeps_the_finished_records_and_says_how_to_resume(run, tmp_path, monkeypatch):
    calls = []
    original = batch.ModelGeneration.__call__

    def interrupted_on_the_third(self, request):
        calls.append(request.id)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(self, request)

    monkeypatch.setattr(batch.ModelGeneration, "__call__", interrupted_on_the_third)
    (tmp_path / "in.jsonl").write_text(jsonl(MIXED))
    result = run(tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", "--batch-size", "1")
    assert result.exit_code == 130
    assert [r["id"] for r in read(tmp_path / "out.jsonl")] == ["z", "a"]
    assert result.stderr.strip().endswith(
        f"interrupted: 2 of 5 records are in {tmp_path / 'out.jsonl'} — run the same command with --resume to finish")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.jsonl", "-o", "out.jsonl"], "error: cannot read missing.jsonl: No such file or directory — check the input path"),
        (["in.jsonl", "-o", "in.jsonl"], "error: INPUT and OUTPUT are the same file — write the results to another file with -o"),
        (["in.jsonl", "-o", "out.jsonl", "--temperature", "-1"], "error: temperature must be a finite number >= 0, got -1.0 — fix the sampling option"),
        (["in.jsonl", "-o", "out.jsonl", "--seed", "-1"], "error: seed must be from 0 to 18446744073709551615, got -1 (no seed: a random one) — fix the sampling option"),
        (["in.jsonl", "-o", "out.jsonl", "--seed", str(2**80)], f"error: seed must be from 0 to 18446744073709551615, got {2**80} (no seed: a random one) — fix the sampling option"),
        (["in.jsonl", "-o", "out.jsonl", "--batch-size", "0"], "error: --batch-size must be at least 1, not 0 — give e.g. --batch-size 8, or 1 for one request at a time"),
        (["in.jsonl", "-o", "out.jsonl", "--batch-size", "many"], "error: --batch-size must be a whole number or auto, not 'many' — give e.g. --batch-size 8"),
        (["in.jsonl", "-o", "out.jsonl", "--batch-size", "4", "--engine", "ray"], "error: --batch-size is an option of --engine local (Ray workers answer one request at a time) — leave out --batch-size, or run with --engine local"),
    ],
)
def test_command_line_mistakes_are_one_line(run, tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text(jsonl(MIXED[:1]))
    result = run(*args)
    assert result.exit_code == 2
    assert result.stderr == message + "\n"


@pytest.mark.parametrize("flag", ["--overwrite", "--resume", None])
@pytest.mark.parametrize("link", ["hard", "symbolic"])
def test_an_output_that_is_another_name_of_the_input_is_refused(run, tmp_path, flag, link):
    """A hard link is the same file under another name: `run in.jsonl -o copy.jsonl --overwrite` replaced the input with
    the records (and --resume would have appended them to it)."""
    source = tmp_path / "in.jsonl"
    source.write_text(jsonl(MIXED[:1]))
    other = tmp_path / "copy.jsonl"
    other.hardlink_to(source) if link == "hard" else other.symlink_to(source)
    result = run(source, "-o", other, *([flag] if flag else []))
    assert_exited(result, 2)
    assert result.stderr == "error: INPUT and OUTPUT are the same file — write the results to another file with -o\n"
    assert source.read_text() == jsonl(MIXED[:1])
