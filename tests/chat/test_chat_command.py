"""`specdec chat` end to end with scripted input on the tiny pair (greedy, fp32, fixed k)."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from specdec_cli.cli import app

from tests.cli_result import assert_exited

TOK_S = r"\d+\.\d tok/s"
TIMES = r"draft \d+\.\d\ds, verify \d+\.\d\ds"
ANSI = "\x1b["


@pytest.fixture
def chat(tiny_pair):
    """chat(input, *flags, env=None) -> CliRunner result of `specdec chat` on target + low-acceptance draft."""

    def run(user_input: str, *flags: str, env: dict | None = None):
        arguments = ["chat", "--target", tiny_pair.target, "--draft", tiny_pair.draft, "--dtype", "float32",
                     "--device", "cpu", "--temperature", "0", "--k", "3", "--max-new-tokens", "12", *flags]
        environment = {"NO_COLOR": None, "FORCE_COLOR": None, **(env or {})}
        return CliRunner().invoke(app, arguments, input=user_input, env=environment)

    return run


def expected_replies(make_conversation, messages: list[str]) -> list:
    """The same conversation held directly: its replies, as the command should print them."""
    conversation = make_conversation("draft", k=3, max_new_tokens=12)
    for message in messages:
        "".join(piece.text for piece in conversation.reply(message))
    return [m for m in conversation.history.messages if m.role == "assistant"]


def stats_pattern(stats: dict, note: str = "") -> str:
    drafting = f"{round(100 * stats['acceptance_rate'])}% accepted \\({stats['accepted']}/{stats['drafted']} drafted\\)"
    tail = re.escape(f" · {note}") if note else ""
    return (f"{stats['new_tokens']} token{'' if stats['new_tokens'] == 1 else 's'} · {TOK_S} · {drafting} · {stats['tokens_per_step']:.2f} tokens/step"
            f" · {TIMES}{tail}")


def transcript_pattern(replies) -> str:
    parts = []
    for reply in replies:
        ending = "" if reply.content.endswith("\n") else "\n"
        note = "cut at 12 tokens (--max-new-tokens)" if reply.finish_reason == "length" else ""
        parts.append(re.escape(reply.content + ending) + stats_pattern(reply.stats, note) + "\n")
    return "".join(parts)


def test_a_piped_chat_prints_each_reply_and_its_stats_line(chat, make_conversation):
    result = chat("Hello, how are you?\ndef add(a, b):\n")
    assert result.exit_code == 0, result.output
    replies = expected_replies(make_conversation, ["Hello, how are you?", "def add(a, b):"])
    assert re.fullmatch(transcript_pattern(replies), result.stdout), result.stdout
    assert ANSI not in result.stdout  # not a terminal: plain text, no legend, no prompts


def test_a_line_ending_in_backslash_continues_the_message(chat, make_conversation):
    result = chat("def add(a, b): \\\n    return a + b\n")
    replies = expected_replies(make_conversation, ["def add(a, b): \n    return a + b"])
    assert re.fullmatch(transcript_pattern(replies), result.stdout), result.stdout


def test_on_a_colour_terminal_tokens_are_styled_after_a_legend(chat):
    result = chat("Hello, how are you?\n", env={"FORCE_COLOR": "1"})
    assert result.exit_code == 0
    first_line = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout.splitlines()[0])
    assert first_line == "tokens: accepted draft · target's correction · bonus token · plain: target alone"
    assert result.stdout.count(ANSI) > 6


@pytest.mark.parametrize("plain", [("--no-color",), ("NO_COLOR",)])
def test_no_color_and_NO_COLOR_give_plain_text_on_a_terminal(chat, plain):
    flags, env = ((), {"FORCE_COLOR": "1", "NO_COLOR": "1"}) if plain == ("NO_COLOR",) else (plain, {"FORCE_COLOR": "1"})
    result = chat("Hello, how are you?\n", *flags, env=env)
    assert result.exit_code == 0 and result.stdout.strip()
    assert ANSI not in result.stdout and "tokens: accepted draft" not in result.stdout


def test_help_lists_every_command_and_how_to_write_several_lines(chat):
    result = chat("/help\n")
    assert result.exit_code == 0
    for command in ("/help", "/reset", "/system TEXT", "/k N|auto", "/temp X", "/stats", "/save FILE", "/exit"):
        assert command in result.stdout
    assert "End a line with \\ to continue" in result.stdout


def test_stats_gives_the_session_totals(chat):
    result = chat("Hello, how are you?\ndef add(a, b):\n/stats\n")
    lines = result.stdout.splitlines()
    per_reply = [int(line.split(" token")[0]) for line in lines if re.match(r"\d+ tokens? · ", line)]
    assert len(per_reply) == 2
    assert re.fullmatch(f"session, 2 replies: {sum(per_reply)} tokens · {TOK_S} · .* · {TIMES}", lines[-1])


def test_reset_starts_the_conversation_again(chat):
    result = chat("Hello, how are you?\n/reset\nHello, how are you?\n")
    chunks = result.stdout.split("conversation cleared\n")
    assert len(chunks) == 2
    first_reply, second_reply = (re.sub(TOK_S + "|" + TIMES, "", chunk) for chunk in chunks)
    assert first_reply == second_reply  # the same question on a fresh conversation: the same answer


def test_system_k_and_temp_are_acknowledged(chat):
    result = chat("/system You are terse.\n/system\n/k 0\n/k auto\n/temp 0.5\n/temp 0\nHello\n")
    assert result.stdout.splitlines()[:6] == [
        "system prompt set", "system prompt removed", "draft length 0 (target alone)", "draft length auto",
        "temperature 0.5", "temperature 0 (greedy)",
    ]
    assert result.exit_code == 0


def test_k_zero_means_nothing_is_drafted(chat):
    result = chat("/k 0\nHello\n")
    assert re.search(r"\d+ tokens · .* · nothing drafted · 1\.00 tokens/step", result.stdout)


def test_save_writes_json_lines(chat, tmp_path):
    path = tmp_path / "chat.jsonl"
    result = chat(f"Hello\n/save {path}\n", "--system", "Be brief.")
    assert result.exit_code == 0
    assert f"saved 3 messages to {path}" in result.stdout
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert [record["role"] for record in records] == ["system", "user", "assistant"]
    assert records[1]["content"] == "Hello" and records[0]["content"] == "Be brief."
    assert records[2]["content"] in result.stdout


@pytest.mark.parametrize("quote", ['"', "'", ""])
def test_save_reads_a_quoted_file_name_as_a_shell_does(chat, tmp_path, quote):
    """`/save "my chat.jsonl"` wrote a file named with the quote marks; the whole line after /save is the name."""
    path = tmp_path / "my chat.jsonl"
    result = chat(f"Hello\n/save {quote}{path}{quote}\n")
    assert_exited(result, 0)
    assert [made for made in tmp_path.iterdir() if made.name != "specdec-home"] == [path]  # the home: the tests'
    assert f"saved 2 messages to {path}" in result.stdout


def test_exit_ends_the_chat_and_later_lines_are_not_read(chat):
    result = chat("/exit\nHello\n")
    assert result.exit_code == 0 and result.stdout == ""


@pytest.mark.parametrize(
    ("line", "complaint"),
    [
        ("/k 99", "error: invalid draft length '99' — use a number from 0 to 16, or auto"),
        ("/temp hot", "error: invalid temperature 'hot' — use a number, e.g. /temp 0.7 (0 = greedy)"),
        ("/save /proc/no/such/place.jsonl", "error: cannot write /proc/no/such/place.jsonl: No such file or directory — pick a folder you can write to"),
        ("/dance", "error: unknown command /dance — type /help for the list, or start the line with // to send it as "
                   "a message"),
        # "/exit code 1 means what?" ended the chat, and the conversation with it
        ("/exit code 1 means what?", "error: /exit takes no argument — type /exit alone, or start the line with // to "
                                     "send it as a message"),
        ("/Reset all", "error: /Reset takes no argument — type /reset alone, or start the line with // to send it as a "
                       "message"),
    ],
)
def test_a_bad_command_is_one_line_and_the_chat_goes_on(chat, line, complaint):
    result = chat(f"{line}\nHello\n")
    assert_exited(result, 2)  # piped: once the input ends, the exit code says a line was refused
    assert result.stderr.splitlines()[-1] == complaint
    assert re.search(r"\d+ tokens? · ", result.stdout)  # the next message still got its reply


def test_a_line_starting_with_two_slashes_is_a_message_with_one(chat, tmp_path):
    """A message that begins with / (a path, a regex) read as an unknown command, and nothing could send it."""
    path = tmp_path / "chat.jsonl"
    result = chat(f"//usr/bin/python is slow\n/save {path}\n")
    assert_exited(result, 0)
    assert "unknown command" not in result.stderr
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert [(record["role"], record["content"]) for record in records][0] == ("user", "/usr/bin/python is slow")
    assert records[1]["role"] == "assistant" and records[1]["content"] in result.stdout


def _chat_process(tiny_pair, folder, env: dict | None = None, **run):
    """`specdec chat` on the tiny target in a process of its own (greedy, 3 new tokens), run in `folder`; `run` gives
    subprocess.run its stdin or input."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "NO_COLOR": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "specdec_cli", "chat", "--target", tiny_pair.target, "--dtype",
                           "float32", "-t", "0", "-n", "3"], cwd=folder, env=env, capture_output=True, timeout=300,
                          **run)


def _piped_chat(tiny_pair, folder, data: bytes, exit_code: int, env: dict | None = None):
    """`data` piped into _chat_process, ending with `exit_code`; the records `/save chat.jsonl` wrote."""
    process = _chat_process(tiny_pair, folder, env, input=data)
    assert process.returncode == exit_code, process.stderr.decode()
    assert "Traceback" not in process.stderr.decode()
    records = [json.loads(line) for line in (folder / "chat.jsonl").read_text(encoding="utf-8").splitlines()]
    return process, [(record["role"], record["content"]) for record in records]


@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])
def test_a_message_that_is_not_utf8_is_one_line_and_crlf_lines_lose_their_cr(tiny_pair, tmp_path, errors):
    """A Latin-1 "é" (a terminal in another encoding, a file piped in) ended the chat in a traceback: a
    UnicodeDecodeError where the locale is UTF-8 (stdin decodes strictly), a TypeError from the tokenizer where it
    is C (stdin keeps the byte as an escape). A file written on Windows sent every message with its "\r"."""
    process, records = _piped_chat(tiny_pair, tmp_path, b"caf\xe9 au lait\r\nHello\r\n/save chat.jsonl\r\n", 2,
                                   env={"PYTHONIOENCODING": f"utf-8:{errors}"})
    assert ("error: this message is not UTF-8 text (it holds the byte 0xe9) — set the terminal to UTF-8 (a UTF-8 "
            "locale), or convert piped text with iconv -t UTF-8") in process.stderr.decode().splitlines()
    assert records[0] == ("user", "Hello")  # the one sent


def test_text_piped_in_utf16_is_refused_line_by_line_and_never_reaches_the_model(tiny_pair, tmp_path):
    """UTF-16's first line starts with a byte-order mark (refused as not UTF-8), but each line after it holds NUL
    characters, which are UTF-8: they went to the model as garbled messages and got replies."""
    process, records = _piped_chat(tiny_pair, tmp_path,
                                   "Hello\nWorld\n".encode("utf-16") + b"\nHi\n/save chat.jsonl\n", 2)
    hint = "convert piped text with iconv -f UTF-16 -t UTF-8"
    errors = [line for line in process.stderr.decode().splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: this message starts with a UTF-16 byte-order mark: the text is UTF-16, not UTF-8 — {hint}",
        *2 * [f"error: this message holds NUL characters: the text is UTF-16 (or another wide encoding), not UTF-8 — "
              f"{hint}"]]
    assert [role for role, _ in records] == ["user", "assistant"] and records[0] == ("user", "Hi")


def test_a_utf8_byte_order_mark_before_the_first_line_is_not_part_of_it(tiny_pair, tmp_path):
    """A file saved by a Windows editor starts with one: it went to the model as the first message's first
    character, and before a /command it made the command a message."""
    _process, records = _piped_chat(tiny_pair, tmp_path, b"\xef\xbb\xbf/k 2\nHello\n/save chat.jsonl\n", 0)
    assert [role for role, _ in records] == ["user", "assistant"] and records[0] == ("user", "Hello")


def test_a_refused_line_typed_at_a_terminal_leaves_the_exit_code_0(tiny_pair, tmp_path):
    """A person saw the error and went on; only a piped chat ends with 2 for it (the tests above)."""
    import os

    primary, secondary = os.openpty()
    try:
        os.write(primary, b"/k 99\n/exit\n")  # the terminal holds the lines until chat reads them
        process = _chat_process(tiny_pair, tmp_path, stdin=secondary)
    finally:
        os.close(primary)
        os.close(secondary)
    assert "error: invalid draft length '99'" in process.stderr.decode()
    assert process.returncode == 0, process.stderr.decode()


def test_a_bad_model_is_one_line_and_exit_2(tiny_pair, tmp_path):
    result = CliRunner().invoke(app, ["chat", "--target", str(tmp_path / "missing"), "--dtype", "float32"], input="Hello\n")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1
    assert result.stdout == ""


def test_a_bad_decoding_option_fails_before_loading_anything(chat):
    result = chat("Hello\n", "--k", "many")
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: invalid draft length 'many' — use a number from 0 to 16, or auto"


def test_a_terminal_that_cannot_print_a_character_gets_a_question_mark_not_a_crash(tiny_pair, tmp_path):
    """With an ASCII (or Latin-1) terminal encoding, chat's stats line ("·") or a reply's emoji raised
    UnicodeEncodeError after the first reply: the session ended with a traceback."""
    import os
    import subprocess
    import sys

    command = [sys.executable, "-m", "specdec_cli", "chat", "--target", tiny_pair.target, "--draft", tiny_pair.draft,
               "--dtype", "float32", "--temperature", "0", "--k", "3", "--max-new-tokens", "6"]
    env = {**os.environ, "PYTHONIOENCODING": "ascii", "SPECDEC_HOME": str(tmp_path / "home")}
    done = subprocess.run(command, input=b"hello\n/stats\n", capture_output=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    out = done.stdout.decode("ascii")
    assert re.search(r"6 tokens \? \d+\.\d tok/s \? ", out) and "session, 1 reply: 6 tokens ?" in out


def test_with_a_template_without_a_system_role_the_system_prompt_opens_the_first_message(tiny_pair, tmp_path):
    """Gemma's template (the gemma-2-9b profile) raises on a system role: `chat --system ...` ended in a jinja2
    traceback at the first message. It now says once where the system prompt went, and answers."""
    import shutil

    folder = tmp_path / "no-system"
    shutil.copytree(tiny_pair.target, folder)
    template = folder / "chat_template.jinja"
    guard = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    template.write_text(guard + template.read_text())
    arguments = ["chat", "--target", str(folder), "--draft", tiny_pair.draft, "--dtype", "float32", "--temperature",
                 "0", "--k", "3", "--max-new-tokens", "4", "--system", "Be brief."]
    result = CliRunner().invoke(app, arguments, input="hello\nagain\n", env={"NO_COLOR": "1"})
    assert_exited(result, 0)
    notice = "this model's chat template has no system role: the system prompt opens your first message instead"
    assert result.stdout.lower().count(notice) == 1 and "error" not in result.stderr
    assert len(re.findall(r"4 tokens · ", result.stdout)) == 2
