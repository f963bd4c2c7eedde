"""Reading input lines: both shapes, every malformed case, ids, duplicates (no model involved)."""

import json

import pytest

from specdec_cli.batch import Request, parse_line, read_requests


def parse(value, number=1) -> Request:
    return parse_line(number, (value if isinstance(value, str) else json.dumps(value)).encode())


def openai_line(url="/v1/chat/completions", **body):
    return {"custom_id": "r1", "method": "POST", "url": url, "body": body}


def test_a_prompt_record_with_every_option():
    request = parse({"id": "a", "prompt": "def f(", "max_new_tokens": 7, "temperature": 0.5, "top_p": 0.9,
                     "top_k": 40, "seed": 3, "stop": ["\n\n", "END"], "category": "kept out of the way"})
    assert request == Request(1, "a", openai=False, chat=False, prompt="def f(", max_new_tokens=7, temperature=0.5,
                              top_p=0.9, top_k=40, seed=3, stop=("\n\n", "END"))


def test_a_messages_record_and_unset_options():
    request = parse({"id": 7, "messages": [{"role": "user", "content": "Hi"}], "temperature": None, "stop": "x"})
    assert request == Request(1, 7, openai=False, chat=True, messages=({"role": "user", "content": "Hi"},), stop=("x",))


def test_vllms_template_options_are_read():
    """`continue_final_message` (vLLM's, HF's) was kept as metadata: the line got a new assistant turn, not the one it
    had begun."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}]
    request = parse({"messages": messages, "continue_final_message": True})
    assert (request.continue_final, request.generation_prompt, request.error) == (True, False, None)
    assert parse(openai_line(messages=messages, continue_final_message=True, add_generation_prompt=False)).continue_final
    plain = parse({"messages": messages, "add_generation_prompt": False})
    assert (plain.continue_final, plain.generation_prompt) == (False, False)
    assert (parse({"messages": messages}).continue_final, parse({"messages": messages}).generation_prompt) == (False, True)


def test_a_prompt_records_limit_may_be_named_max_tokens_as_vllm_names_it():
    assert parse({"id": "a", "prompt": "x", "max_tokens": 9}).max_new_tokens == 9
    assert parse({"prompt": "x", "max_tokens": 0}).error == 'line 1: "max_tokens" must be at least 1, got 0'
    assert parse({"prompt": "x", "max_tokens": 3, "max_new_tokens": 3}).error == (
        'line 1: both "max_new_tokens" and "max_tokens": give one')
    assert parse({"prompt": "x", "max_tokens": None, "max_new_tokens": 4}).max_new_tokens == 4  # null is unset


def test_an_openai_chat_line_maps_its_body():
    request = parse(openai_line(model="gpt-4o", messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                                max_tokens=5, temperature=0, top_p=1, seed=9, stop="\n", n=1, presence_penalty=0,
                                logprobs=False, response_format={"type": "text"}))
    assert request == Request(1, "r1", openai=True, chat=True, messages=({"role": "user", "content": "ab"},),
                              max_new_tokens=5, temperature=0.0, top_p=1.0, seed=9, stop=("\n",))


@pytest.mark.parametrize(("field", "value", "neutral"), [
    ("presence_penalty", 0.1, "0"), ("frequency_penalty", -1, "0"), ("repetition_penalty", 1.2, "1"),
    ("logit_bias", {"50256": -100}, "{}"), ("min_p", 0.05, "0"), ("num_beams", 4, "1"), ("best_of", 2, "1"),
    ("logprobs", True, "false"), ("logprobs", 5, "false"), ("top_logprobs", 3, "0"), ("echo", True, "false"),
    ("response_format", {"type": "json_object"}, '{"type": "text"}'), ("tools", [{"type": "function"}], "[]"),
    ("tool_choice", "auto", '"none"'), ("num_beams", True, "1"), ("use_beam_search", True, "false"),
    ("no_repeat_ngram_size", 3, "0"), ("bad_words", ["x"], "[]"),
])
@pytest.mark.parametrize("shape", ["plain", "openai"])
def test_a_setting_specdec_does_not_do_is_that_lines_error_unless_it_changes_nothing(field, value, neutral, shape):
    """vLLM's and OpenAI's penalties, logprobs, JSON mode ... were ignored: the line got another answer than it asked
    for (a penalty not applied, free text where JSON was asked for) and no one was told."""
    line = (openai_line(messages=[{"role": "user", "content": "hi"}], **{field: value}) if shape == "openai"
            else {"prompt": "x", field: value})
    assert parse(line).error == (f'line 1: unsupported "{field}": {json.dumps(value)} (specdec samples the model\'s '
                                 f"own distribution: temperature, top_p, top_k, seed, stop); leave it out or set it "
                                 f"to {neutral}")
    neutral_line = ({**line, "body": {**line["body"], field: json.loads(neutral)}} if shape == "openai"
                    else {**line, field: json.loads(neutral)})
    assert parse(neutral_line).error is None


@pytest.mark.parametrize(("field", "value", "neutral"), [
    ("ignore_eos", True, "false"), ("min_tokens", 16, "0"), ("min_new_tokens", 4, "0"), ("stop_token_ids", [2], "[]"),
    ("skip_special_tokens", False, "true"), ("include_stop_str_in_output", True, "false"),
])
def test_a_setting_of_how_a_request_ends_is_that_lines_error_unless_it_changes_nothing(field, value, neutral):
    """vLLM's `ignore_eos` (benchmark scripts set it for fixed lengths), `min_tokens`, `stop_token_ids` ... were kept
    as metadata: the line ended at the end of text it asked to decode past, or past the token it asked to stop at."""
    line = {"prompt": "x", field: value}
    assert parse(line).error == (f'line 1: unsupported "{field}": {json.dumps(value)} (specdec ends a request at the '
                                 "model's end of text, a stop string or the token limit, and its text leaves out "
                                 f"special tokens and the stop string); leave it out or set it to {neutral}")
    assert parse({**line, field: json.loads(neutral)}).error is None
    body = openai_line(messages=[{"role": "user", "content": "hi"}], **{field: value})
    assert parse(body).error.startswith(f'line 1: unsupported "{field}"')


HALF = ("holds \\ud83d alone, half of a UTF-16 character (as text cut inside an emoji by a UTF-16 substring leaves it), "
        "which no tokenizer or UTF-8 file takes; mend the text where it was cut")


@pytest.mark.parametrize(("line", "where"), [
    ('{"prompt": "smile \\ud83d"}', '"prompt"'),
    ('{"messages": [{"role": "user", "content": "hi \\ud83d"}]}', "messages[0].content"),
    ('{"prompt": "x", "stop": ["ok", "\\ud83d"]}', "stop[1]"),
    ('{"prompt": "x", "source": {"title": "\\ud83d"}}', "source.title"),  # metadata, written back in the record
    ('{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "\\ud83d"}}', "body.prompt"),
])
def test_half_a_character_is_that_lines_error_record(line, where):
    """JSON may hold a lone surrogate escape, which json.loads keeps: in a prompt it stopped the whole batch with the
    tokenizer's TypeError traceback (every record after it lost); in metadata the record could not be written."""
    request = parse_line(1, line.encode())
    assert request.error == f"line 1: {where} {HALF}"
    assert request.id == ("c" if "custom_id" in line else 1)


def test_a_line_nested_past_the_recursion_limit_is_its_error_record_and_shallower_nesting_runs():
    """json.loads raises RecursionError (no ValueError) on lists nested past Python's limit: the batch stopped with a
    traceback before any record was written. Nesting it can read is walked without recursion by the other checks."""
    deep = b'{"prompt": "x", "meta": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert parse_line(1, deep).error == ("line 1: the line is nested too deeply to read (lists or objects inside each "
                                         "other past Python's recursion limit)")
    readable = b'{"prompt": "x", "meta": ' + b"[" * 900 + b'"\\ud83d"' + b"]" * 900 + b"}"
    assert parse_line(1, readable).error.startswith("line 1: meta" + "[0]" * 900 + " holds \\ud83d alone")


def test_half_a_character_in_the_id_gives_the_line_its_number():
    request = parse_line(1, b'{"id": "q\\ud83d", "prompt": "x"}')
    assert (request.id, request.id_given, request.error) == (1, False, f'line 1: "id" {HALF}')
    assert parse_line(1, b'{"prompt": "a pair \\ud83d\\ude00 is one character"}').error is None


def test_top_k_minus_one_keeps_every_token_as_in_vllm():
    """vLLM's default top_k is -1 (every token), so lines written for it carry -1: each got an error record."""
    assert parse({"prompt": "x", "top_k": -1}).top_k == 0
    assert parse(openai_line(messages=[{"role": "user", "content": "hi"}], top_k=-1)).top_k == 0
    assert parse({"prompt": "x", "top_k": 0, "n": 1}).top_k == 0


def test_do_sample_false_is_greedy_as_in_hf_generate():
    assert parse({"prompt": "x", "do_sample": False, "temperature": 0.7}).temperature == 0.0
    assert parse({"prompt": "x", "do_sample": True, "temperature": 0.7}).temperature == 0.7
    assert parse({"prompt": "x", "do_sample": True}).temperature is None  # the command's
    assert parse({"prompt": "x", "do_sample": "no"}).error == 'line 1: "do_sample" must be true or false, got a string'


def test_an_openai_completions_line_prefers_max_completion_tokens():
    request = parse(openai_line("/v1/completions", prompt="The", max_tokens=5, max_completion_tokens=3, top_k=4))
    assert (request.chat, request.prompt, request.max_new_tokens, request.top_k, request.error) == (False, "The", 3, 4, None)


def test_a_record_without_an_id_gets_its_line_number():
    assert parse({"prompt": "x"}, number=12).id == 12
    assert parse({k: v for k, v in openai_line(messages=[{"role": "user", "content": "x"}]).items() if k != "custom_id"}, 4).id == 4


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("{not json", "line 1: not valid JSON (Expecting property name enclosed in double quotes at column 2)"),
        ('["a list"]', "line 1: expected a JSON object, got a list"),
        ({"id": "a"}, 'line 1: no "prompt" or "messages"'),
        ({"id": "a", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 'line 1: both "prompt" and "messages": give one'),
        ({"id": "a", "prompt": 5}, 'line 1: "prompt" must be a string, got a number'),
        ({"id": "a", "prompt": ""}, 'line 1: "prompt" is empty'),
        ({"id": "a", "messages": []}, 'line 1: "messages" is empty'),
        ({"id": "a", "messages": "hi"}, 'line 1: "messages" must be a list of {"role", "content"} objects, got a string'),
        ({"id": "a", "messages": [{"content": "x"}]}, 'line 1: messages[0] must be an object with a "role" string'),
        ({"id": "a", "messages": [{"role": "user", "content": None}]}, "line 1: messages[0].content must be a string or a list of text parts, got null"),
        ({"id": "a", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 'line 1: messages[0].content holds a part of type "image_url": specdec runs text models, so a message\'s parts must all be {"type": "text", "text": ...}'),
        ({"id": "a", "messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "line 1: messages[0].content must be a string or a list of text parts, got a list"),
        ({"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]}, 'line 1: messages[1] holds "tool_calls": specdec does not run tools, so a conversation cannot hold tool calls or their results'),
        ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True, "add_generation_prompt": True}, 'line 1: "continue_final_message" and "add_generation_prompt" cannot both be true: the last message is continued, or a new assistant turn begins'),
        ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": "yes"}, 'line 1: "continue_final_message" must be true or false, got a string'),
        ({"prompt": "x", "continue_final_message": True}, 'line 1: "continue_final_message" is for "messages" (the chat template): a "prompt" goes to the model as it is'),
        (openai_line("/v1/completions", prompt="x", add_generation_prompt=False), 'line 1: "add_generation_prompt" is for "messages" (the chat template): a "prompt" goes to the model as it is'),
        ({"messages": [{"role": "user", "content": "x"}], "continue_final_mesage": True}, 'line 1: unknown "continue_final_mesage": did you mean "continue_final_message"? (a line\'s other keys are kept as metadata: rename it if it is one)'),
        ({"id": ["a"], "prompt": "x"}, 'line 1: "id" must be a string or an integer, got a list'),
        ({"id": True, "prompt": "x"}, 'line 1: "id" must be a string or an integer, got a boolean'),
        ({"prompt": "x", "max_new_tokens": "5"}, 'line 1: "max_new_tokens" must be an integer, got a string'),
        ({"prompt": "x", "max_new_tokens": 0}, 'line 1: "max_new_tokens" must be at least 1, got 0'),
        ({"prompt": "x", "max_new_tokens": 2.5}, 'line 1: "max_new_tokens" must be an integer, got a number'),
        ({"prompt": "x", "temperature": -1}, 'line 1: "temperature" must be at least 0, got -1'),
        ({"prompt": "x", "temperature": "hot"}, 'line 1: "temperature" must be a number, got a string'),
        ({"prompt": "x", "top_p": 0}, 'line 1: "top_p" must be in (0, 1], got 0'),
        ({"prompt": "x", "top_k": -3}, 'line 1: "top_k" must be at least 0 (or -1, as vLLM has it: every token), got -3'),
        ({"prompt": "x", "top_k": True}, 'line 1: "top_k" must be an integer, got a boolean'),
        ({"prompt": "x", "n": 2}, 'line 1: "n" must be 1 (one completion per request), got 2'),
        ({"messages": [{"role": "user", "content": "x"}], "n": True}, 'line 1: "n" must be 1 (one completion per request), got true'),
        ({"prompt": "x", "seed": 2**64}, f'line 1: "seed" must be at least 0 and at most {2**64 - 1}, got {2**64}'),
        ({"prompt": "x", "stop": [1]}, 'line 1: "stop" must be a string or a list of strings, got a list holding a number'),
        ({"prompt": "x", "stop": ["a", None]}, 'line 1: "stop" must be a string or a list of strings, got a list holding null'),
        ({"prompt": "x", "stop": 5}, 'line 1: "stop" must be a string or a list of strings, got a number'),
        ({"prompt": "x", "stop": ""}, 'line 1: "stop" holds an empty string'),
        (openai_line("/v1/embeddings", input="x"), "line 1: unsupported url '/v1/embeddings': use /v1/chat/completions or /v1/completions"),
        ({**openai_line(messages=[{"role": "user", "content": "x"}]), "method": "GET"}, "line 1: unsupported method 'GET': OpenAI batch lines use \"POST\""),
        ({**openai_line(), "body": "x"}, 'line 1: "body" must be an object, got a string'),
        (openai_line(prompt="x"), 'line 1: /v1/chat/completions needs "messages" in "body", not "prompt"'),
        (openai_line("/v1/completions", prompt=["a", "b"]), 'line 1: "prompt" must be a string, got a list'),
        (openai_line(messages=[{"role": "user", "content": "x"}], n=2), 'line 1: "n" must be 1 (one completion per request), got 2'),
        (openai_line(messages=[{"role": "user", "content": "x"}], max_tokens=0), 'line 1: "max_tokens" must be at least 1, got 0'),
    ],
)
def test_a_malformed_line_carries_the_problem(line, problem):
    request = parse(line)
    assert request.error == problem


def test_a_malformed_line_keeps_its_id_and_shape_when_it_can():
    assert (parse({"id": "x", "prompt": 3}).id, parse(openai_line(prompt="x")).id) == ("x", "r1")
    assert parse(openai_line(prompt="x")).openai and not parse("nope").openai
    assert parse("nope", number=5).id == 5


def test_read_requests_skips_blank_lines_but_counts_them():
    requests = read_requests([b'{"prompt": "a"}', b"", b"   ", b'{"prompt": "b"}'])
    assert [(r.line, r.id, r.prompt) for r in requests] == [(1, 1, "a"), (4, 4, "b")]


def test_a_later_duplicate_id_is_an_error_and_the_first_runs():
    requests = read_requests([b'{"id": "a", "prompt": "x"}', b'{"id": "b", "prompt": "y"}', b'{"id": "a", "prompt": "z"}'])
    assert [r.error for r in requests] == [None, None, "line 3: duplicate id 'a' (first on line 1)"]
    assert requests[2].id == "a"


def test_a_duplicate_of_a_line_number_taken_as_id_says_so():
    requests = read_requests([b'{"id": "a", "prompt": "x"}', b'{"prompt": "y"}', b'{"id": 2, "prompt": "z"}'])
    assert [r.error for r in requests] == [
        None, None, "line 3: duplicate id 2: line 2 has no id, so it took its line number 2 as id"]


def test_a_line_without_an_id_that_repeats_an_earlier_id_says_so():
    requests = read_requests([b'{"id": 2, "prompt": "x"}', b'{"prompt": "y"}'])
    assert [r.error for r in requests] == [
        None, "line 2: duplicate id 2 (first on line 1): this line has no id, so it took its line number as id"]


def test_ids_7_and_the_string_7_are_different():
    requests = read_requests([b'{"id": 7, "prompt": "x"}', b'{"id": "7", "prompt": "y"}'])
    assert [r.error for r in requests] == [None, None]


def test_a_line_that_is_not_utf8_fails_alone_and_a_bom_is_ignored():
    requests = read_requests(['\ufeff{"prompt": "a"}'.encode(), b'{"prompt": "\xff"}'])
    assert [r.error for r in requests] == [None, "line 2: not UTF-8 (byte 13)"]


@pytest.mark.parametrize(("line", "meant"), [
    ({"prompt": "x", "max_token": 50}, ("max_token", "max_tokens")),
    ({"prompt": "x", "temprature": 0}, ("temprature", "temperature")),
    ({"prompt": "x", "topp": 0.5}, ("topp", "top_p")),
    ({"prompts": "x"}, ("prompts", "prompt")),
    (openai_line(messages=[{"role": "user", "content": "hi"}], max_complete_tokens=5),
     ("max_complete_tokens", "max_completion_tokens")),
])
def test_a_key_one_slip_from_a_setting_is_that_lines_error(line, meant):
    """Other keys are metadata, so "max_token": 50 ran to the command's limit and "temprature": 0 sampled, silently."""
    key, setting = meant
    assert parse(line).error == (f'line 1: unknown "{key}": did you mean "{setting}"? (a line\'s other keys are kept '
                                 "as metadata: rename it if it is one)")


def test_metadata_keys_stay_metadata():
    request = parse({"prompt": "x", "category": "qa", "source": "web", "tags": ["a"], "question_id": 3, "turns": 1,
                     "model": "m", "user": "u", "stream": False, "top_n": 3, "max_tokens": 4, "max_token": "meta"})
    assert request.error is None and request.max_new_tokens == 4  # beside the setting itself, a near name is metadata
