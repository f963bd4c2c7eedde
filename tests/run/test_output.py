"""Output records, the durable writer, resuming and the loop, with a fake generation (no model)."""

import json

import pytest

from specdec_cli.batch import (
    BatchSummary, Completion, DurableWriter, check_output, error_record, parse_line, pending_requests,
    read_finished, read_requests, run_batch, success_record,
)
from specdec_cli.errors import InputError, SpecdecError

COMPLETION = Completion("hello", "length", prompt_tokens=4, completion_tokens=6, steps=2, drafted=8, accepted=4,
                        drafted_steps=2)
STATS = {"steps": 2, "drafted": 8, "accepted": 4, "acceptance_rate": 0.5, "tokens_per_step": 3.0,
         "tokens_per_second": 3.0, "seconds": 2.0, "drafted_steps": 2, "held_steps": 0, "policy": None}


def request(value: dict, number: int = 1):
    return parse_line(number, json.dumps(value).encode())


def test_a_plain_record():
    record = success_record(request({"id": "a", "prompt": "x"}), COMPLETION, seconds=2.0, model="m")
    assert record == {"id": "a", "text": "hello", "finish_reason": "length", "prompt_tokens": 4,
                      "completion_tokens": 6, "stats": STATS, "error": None}


def test_an_openai_chat_record_has_the_batch_output_shape():
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}]}}
    record = success_record(request(line, 3), COMPLETION, seconds=2.0, model="m")
    assert isinstance(record["response"]["body"].pop("created"), int)
    assert record == {
        "id": "batch_req_3", "custom_id": "c",
        "response": {"status_code": 200, "request_id": "req_3", "body": {
            "id": "chatcmpl-3", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "logprobs": None, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}}},
        "error": None, "specdec": STATS,
    }


def test_an_openai_completion_record_has_text_choices():
    line = {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}
    body = success_record(request(line), COMPLETION, seconds=2.0, model="m")["response"]["body"]
    assert (body["object"], body["id"], body["choices"][0]["text"]) == ("text_completion", "cmpl-1", "hello")


def test_error_records_in_both_shapes():
    plain = error_record(request({"id": "a", "prompt": 1}), "line 1: bad")
    assert plain == {"id": "a", "text": None, "finish_reason": "error", "prompt_tokens": None,
                     "completion_tokens": None, "stats": None, "error": "line 1: bad"}
    openai = error_record(request({"custom_id": "c", "url": "/x"}, 2), "line 2: bad")
    assert openai == {"id": "batch_req_2", "custom_id": "c", "response": None, "error": {"code": "invalid_request", "message": "line 2: bad"}}


def test_no_drafts_means_no_acceptance_rate():
    record = success_record(request({"prompt": "x"}), Completion("t", "stop", 1, 1, 1, 0, 0), 1.0, "m")
    assert record["stats"]["acceptance_rate"] is None


# ---- OUTPUT exists ----------------------------------------------------------------------------


def test_an_existing_output_is_refused_naming_both_flags(tmp_path):
    output = tmp_path / "out.jsonl"
    output.write_text('{"id": 1}\n')
    with pytest.raises(InputError) as refused:
        check_output(output, resume=False, overwrite=False)
    assert refused.value.one_line() == f"{output} already exists — pass --resume to continue it (same settings), or --overwrite to replace it"
    check_output(output, resume=True, overwrite=False)
    check_output(output, resume=False, overwrite=True)


def test_an_empty_or_missing_output_needs_no_flag(tmp_path):
    check_output(tmp_path / "new.jsonl", False, False)
    (tmp_path / "empty.jsonl").touch()
    check_output(tmp_path / "empty.jsonl", False, False)


@pytest.mark.parametrize(
    ("name", "flags", "complaint"),
    [
        ("out.jsonl", (True, True), "--resume and --overwrite contradict each other — pick one"),
        ("missing/out.jsonl", (False, False), "does not exist — create it first, or choose another -o"),
        (".", (False, False), "is a folder — give a file name for -o"),
    ],
)
def test_bad_output_paths(tmp_path, name, flags, complaint):
    with pytest.raises(InputError) as refused:
        check_output(tmp_path / name, *flags)
    assert refused.value.one_line().endswith(complaint)


# ---- resuming ---------------------------------------------------------------------------------


def test_resume_cuts_a_torn_last_line(tmp_path):
    output = tmp_path / "out.jsonl"
    output.write_bytes(b'{"id": "a"}\n{"id": "b"}\n{"id": "c", "te')
    assert read_finished(output) == [{"id": "a"}, {"id": "b"}]
    assert output.read_bytes() == b'{"id": "a"}\n{"id": "b"}\n'


@pytest.mark.parametrize("second", ["some notes", "[" * 100_000 + "]" * 100_000])  # the second: a RecursionError
def test_resume_refuses_a_file_that_is_not_run_output(tmp_path, second):
    output = tmp_path / "notes.jsonl"
    output.write_text(f'{{"id": "a"}}\n{second}\n')
    with pytest.raises(InputError) as refused:
        read_finished(output)
    assert refused.value.one_line() == f"{output} line 2 is not a specdec run record, so it cannot be resumed — pass --overwrite to replace the file, or choose another -o"
    assert output.read_text() == f'{{"id": "a"}}\n{second}\n'


def test_pending_skips_answered_ids_counting_duplicates():
    requests = read_requests([b'{"id": "a", "prompt": "x"}', b'{"id": "b", "prompt": "x"}', b'{"id": "a", "prompt": "y"}',
                              b'{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}'])
    # A crash after line 1: the duplicate on line 3 (an error record, same id) is still owed.
    assert [r.line for r in pending_requests(requests, [{"id": "a"}])] == [2, 3, 4]
    assert [r.line for r in pending_requests(requests, [{"id": "a"}, {"id": "b"}, {"id": "a"}, {"custom_id": "c"}])] == []


# ---- the writer and the loop ------------------------------------------------------------------


def fake_generate(seen: list):
    def generate(req):
        seen.append(req.id)
        if req.prompt == "boom":
            raise SpecdecError("the model refused", "try another prompt")
        return Completion(req.prompt.upper(), "stop", 1, len(req.prompt), 1, 0, 0)
    return generate


def test_records_are_written_in_input_order_with_errors_in_place(tmp_path):
    output = tmp_path / "out.jsonl"
    requests = read_requests([b'{"id": "a", "prompt": "one"}', b"oops", b'{"id": "c", "prompt": "boom"}', b'{"id": "d", "prompt": "four"}'])
    summary = BatchSummary(total=4)
    with DurableWriter(output, replace=False) as writer:
        run_batch(requests, fake_generate([]), writer.write, summary, model="m")
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [(r["id"], r["text"], r["finish_reason"], r["error"]) for r in records] == [
        ("a", "ONE", "stop", None),
        (2, None, "error", "line 2: not valid JSON (Expecting value at column 1)"),
        ("c", None, "error", "line 3: the model refused — try another prompt"),
        ("d", "FOUR", "stop", None),
    ]
    assert (summary.written, summary.failed, summary.completion_tokens) == (4, 2, 7)


def test_each_record_is_on_disk_before_the_next_request_starts(tmp_path):
    output = tmp_path / "out.jsonl"
    lines_seen_at_start = []

    def generate(req):
        lines_seen_at_start.append(len(output.read_bytes().splitlines()))
        return Completion("t", "stop", 1, 1, 1, 0, 0)

    with DurableWriter(output, replace=False) as writer:
        run_batch(read_requests([b'{"prompt": "a"}'] * 3), generate, writer.write, BatchSummary(total=3))
    assert lines_seen_at_start == [0, 1, 2]


def test_an_unexpected_exception_is_not_swallowed(tmp_path):
    def generate(req):
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        run_batch(read_requests([b'{"prompt": "a"}']), generate, lambda record: None, BatchSummary(total=1))


def test_appending_keeps_what_is_there_and_replace_starts_over(tmp_path):
    output = tmp_path / "out.jsonl"
    output.write_text('{"id": "old"}\n')
    with DurableWriter(output, replace=False) as writer:
        writer.write({"id": "new", "text": "é"})
    assert output.read_text(encoding="utf-8") == '{"id": "old"}\n{"id": "new", "text": "é"}\n'
    with DurableWriter(output, replace=True) as writer:
        writer.write({"id": "only"})
    assert output.read_text() == '{"id": "only"}\n'


def test_a_lone_surrogate_id_is_written_as_valid_json(tmp_path):
    output = tmp_path / "out.jsonl"
    with DurableWriter(output, replace=False) as writer:
        writer.write({"id": "\ud800x"})
    assert json.loads(output.read_bytes()) == {"id": "\ud800x"}
