"""Prompt files: the three line kinds, categories, --n-prompts per category, and one-line errors."""

import json

import pytest

from specdec_cli.errors import InputError
from specdec_cli.prompts import builtin_prompts, read_prompt_file, select_prompts


def write_lines(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def spec_bench_lines():
    """Spec-Bench's shape: MT-bench rows with two turns, then a category of single-turn rows."""
    rows = [{"question_id": 81 + i, "category": "writing", "turns": [f"write {i}", "now rewrite it"]} for i in range(3)]
    rows += [{"question_id": 131 + i, "category": "coding", "turns": [f"code {i}", "again"]} for i in range(3)]
    rows += [{"question_id": 200 + i, "category": "translation", "turns": [f"translate {i}"]} for i in range(4)]
    return rows


def test_spec_bench_lines_give_the_first_turn_as_a_user_message(tmp_path):
    prompts = read_prompt_file(write_lines(tmp_path / "q.jsonl", spec_bench_lines()))
    assert len(prompts) == 10
    assert (prompts[0].id, prompts[0].category, prompts[0].text, prompts[0].as_user_turn) == ("81", "writing", "write 0", True)


def test_n_prompts_is_per_category_in_file_order(tmp_path):
    prompts = read_prompt_file(write_lines(tmp_path / "q.jsonl", spec_bench_lines()))
    chosen = select_prompts(prompts, per_category=2)
    assert [(p.category, p.id) for p in chosen] == [
        ("writing", "81"), ("writing", "82"), ("coding", "131"), ("coding", "132"), ("translation", "200"), ("translation", "201"),
    ]


def test_categories_choose_prompts(tmp_path):
    prompts = read_prompt_file(write_lines(tmp_path / "q.jsonl", spec_bench_lines()))
    chosen = select_prompts(prompts, ["coding", "translation"], per_category=1)
    assert [p.id for p in chosen] == ["131", "200"]


def test_an_unknown_category_names_the_available_ones(tmp_path):
    prompts = read_prompt_file(write_lines(tmp_path / "q.jsonl", spec_bench_lines()))
    with pytest.raises(InputError) as caught:
        select_prompts(prompts, ["poetry"])
    assert caught.value.one_line() == "no prompts in category 'poetry' — choose from: writing, coding, translation"


def test_prompt_and_messages_lines(tmp_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    path = write_lines(tmp_path / "p.jsonl", [{"prompt": "def add(", "category": "code"}, "", {"messages": messages}])
    raw, chat = read_prompt_file(path)
    assert (raw.text, raw.as_user_turn, raw.category, raw.id) == ("def add(", False, "code", "1")
    assert (chat.messages, chat.category, chat.id) == (tuple(messages), "default", "3")


@pytest.mark.parametrize(
    ("line", "complaint"),
    [
        ("{not json", "line 2 of {path} is not valid JSON"),
        ('["a list"]', "line 2 of {path} is not a JSON object"),
        ('{"text": "wrong key"}', "line 2 of {path} has no usable prompt"),
        ('{"messages": [{"content": "no role"}]}', "line 2 of {path} has no usable prompt"),
    ],
)
def test_a_bad_line_is_named_by_its_number(tmp_path, line, complaint):
    path = write_lines(tmp_path / "bad.jsonl", [{"prompt": "fine"}, line])
    with pytest.raises(InputError, match=complaint.format(path=path)):
        read_prompt_file(path)


def test_a_near_miss_of_a_key_is_refused_with_the_key_it_resembles(tmp_path):
    """Other keys are ignored, so a "catgory" put its line in the default category, and compare's per-category table
    showed a category short and a "default" row nobody asked for."""
    path = write_lines(tmp_path / "p.jsonl", [{"prompt": "fine", "category": "code"},
                                              {"prompt": "typo", "catgory": "code"}])
    with pytest.raises(InputError) as caught:
        read_prompt_file(path)
    assert caught.value.one_line() == (
        f'line 2 of {path} has "catgory": did you mean "category"? — rename it (a prompt file\'s lines take '
        "'prompt', 'messages', 'turns', 'category', 'id', 'question_id'; other keys are ignored)")
    # metadata keys stay metadata; a near miss of a key the line has is not a typo of it
    path = write_lines(tmp_path / "q.jsonl", [{"prompt": "a", "category": "c", "reference": ["x"], "categry": "old"}])
    assert [(p.text, p.category) for p in read_prompt_file(path)] == [("a", "c")]


def test_half_a_character_is_named_with_its_line(tmp_path):
    """A lone surrogate escape in a prompt ended compare in the tokenizer's TypeError, after the models loaded."""
    path = write_lines(tmp_path / "p.jsonl", ['{"prompt": "fine"}', '{"turns": ["cut \\ud83d"], "category": "c"}'])
    with pytest.raises(InputError) as caught:
        read_prompt_file(path)
    assert caught.value.one_line() == (
        f"line 2 of {path}: turns[0] holds \\ud83d alone, half of a UTF-16 character (as text cut inside an emoji by a "
        "UTF-16 substring leaves it), which no tokenizer or UTF-8 file takes — mend the text where it was cut")


def test_a_line_nested_past_the_recursion_limit_is_named(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", ['{"prompt": "fine"}', '{"prompt": "x", "m": ' + "[" * 100_000 + "]" * 100_000 + "}"])
    with pytest.raises(InputError) as caught:
        read_prompt_file(path)
    assert caught.value.one_line() == (f"line 2 of {path} is nested too deeply to read (lists or objects inside each "
                                       "other past Python's recursion limit) — write one flat JSON object per line")


def test_a_missing_or_empty_file_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="no prompt file"):
        read_prompt_file(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(InputError, match="holds no prompts"):
        read_prompt_file(tmp_path / "empty.jsonl")


def test_a_byte_order_mark_is_not_part_of_the_first_line(tmp_path):
    """A file saved by a Windows editor starts with a UTF-8 byte-order mark: `run` read it, compare refused line 1."""
    path = tmp_path / "q.jsonl"
    path.write_bytes("\ufeff".encode() + json.dumps({"prompt": "hi"}).encode() + b"\r\n" + json.dumps({"prompt": "yo"}).encode())
    assert [prompt.text for prompt in read_prompt_file(path)] == ["hi", "yo"]


@pytest.mark.parametrize(("encoding", "name"), [("utf-16", "UTF-16"), ("utf-16-be", "UTF-16"), ("utf-32", "UTF-32")])
def test_a_utf16_or_utf32_file_is_named_as_such_by_compare_and_run(tmp_path, encoding, name):
    """Windows PowerShell 5's `>` writes UTF-16: compare said only that the file was not UTF-8, and run failed every
    line alone as "not UTF-8", plus lines the NUL bytes made up."""
    from specdec_cli.batch import read_input

    path = tmp_path / "q.jsonl"
    mark = "\ufeff" if encoding == "utf-16-be" else ""  # the plain codecs write their own mark
    path.write_bytes((mark + json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"prompt": "yo"}) + "\n").encode(encoding))
    says = (f"{path} is {name} text, not UTF-8 — save it as UTF-8 (PowerShell: Out-File -Encoding utf8), or convert it: "
            f"iconv -f {name} -t UTF-8 {path} > {tmp_path / 'q'}-utf8.jsonl")
    for read in (read_prompt_file, read_input):
        with pytest.raises(InputError) as raised:
            read(path) if read is read_prompt_file else read(str(path))
        assert raised.value.one_line() == says


@pytest.mark.parametrize(("text", "says"), [
    (json.dumps(spec_bench_lines()), "q.json is one JSON list of 10 items, not JSON lines — write one object per line, "
                                     "e.g. jq -c '.[]' {folder}/q.json > {folder}/q.jsonl"),
    (json.dumps(spec_bench_lines()[:2], indent=1), "q.json is one JSON list of 2 items"),
    (json.dumps({"prompt": "hi", "category": "chat"}, indent=2), "q.json is one JSON object over 4 lines, not JSON lines"),
])
def test_a_file_that_is_one_json_document_is_named_as_such(tmp_path, text, says):
    """A prompt set written with json.dump was "line 1 is not a JSON object" (or not valid JSON): true, but not what
    to do about it."""
    (tmp_path / "q.json").write_text(text)
    with pytest.raises(InputError) as raised:
        read_prompt_file(tmp_path / "q.json")
    assert raised.value.one_line().startswith(f"{tmp_path}/" + says.format(folder=tmp_path))


def test_the_builtin_set_has_two_prompts_in_each_of_six_categories():
    prompts = builtin_prompts()
    categories = [p.category for p in prompts]
    assert {c: categories.count(c) for c in categories} == {
        "chat": 2, "code": 2, "summarisation": 2, "qa": 2, "translation": 2, "math": 2,
    }
    assert len({p.id for p in prompts}) == 12 and all(p.as_user_turn and p.text for p in prompts)


def test_the_conversion_line_for_a_name_with_a_space_quotes_the_output_too(tmp_path):
    """The suggested output name was the quoted input with "-utf8.jsonl" glued after the closing quote."""
    path = tmp_path / "my questions.jsonl"
    path.write_bytes(json.dumps({"prompt": "hi"}).encode("utf-16"))
    with pytest.raises(InputError) as raised:
        read_prompt_file(path)
    assert raised.value.one_line().endswith(f"iconv -f UTF-16 -t UTF-8 '{path}' > '{tmp_path}/my questions-utf8.jsonl'")
