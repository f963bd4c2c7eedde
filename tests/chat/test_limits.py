"""Chat against the model's context (the tiny pair takes 256 positions), non-finite temperatures, /save
on a folder, and a closed stdin."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from specdec_cli.errors import PromptTooLongError
from tests.chat.test_chat_command import chat  # noqa: F401  (the fixture)
from tests.cli_result import assert_exited

SENTENCE = "The quick brown fox jumps over the lazy dog. "
NEAR_FULL = SENTENCE * 7 + "for i in range(10):"  # 248 tokens through the template: 8 positions left


def test_a_message_past_the_context_is_one_line_and_the_chat_goes_on(chat):  # noqa: F811
    result = chat(f"{SENTENCE * 20}\nHello\n")
    assert_exited(result, 2)  # piped, a line refused: the exit code says so once the input ends
    assert result.stderr.splitlines()[-1] == (
        "error: the prompt has 637 tokens but the model takes at most 256 (prompt and reply together) — send a "
        "shorter message, or /reset to start a new conversation")
    assert re.fullmatch(r"[^\n]*\n\d+ tokens? · [^\n]*\n", result.stdout)  # Hello got its reply


def test_a_system_prompt_past_the_context_is_named_as_what_to_shorten(chat):  # noqa: F811
    """A 50k-character /system was taken, and the next message refused with "send a shorter message"."""
    result = chat(f"/system {SENTENCE * 20}\nHello\n/system\nHello\n")
    assert_exited(result, 2)  # piped, a line refused: the exit code says so once the input ends
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        "error: the prompt has 650 tokens but the model takes at most 256 (prompt and reply together) — the system "
        "prompt takes 646 of them: set a shorter one with /system TEXT, or remove it with /system"]
    assert re.search(r"\n\d+ tokens? · [^\n]*\n$", result.stdout)  # without it, Hello got its reply


def test_a_refused_message_leaves_no_trace_and_runs_no_forward(make_conversation):
    conversation = make_conversation("draft", k=3)
    "".join(piece.text for piece in conversation.reply("Hello"))
    history, forwards = list(conversation.history.messages), conversation.decoder.target.forwards
    with pytest.raises(PromptTooLongError):
        "".join(piece.text for piece in conversation.reply(SENTENCE * 2000))
    assert conversation.history.messages == history
    assert (conversation.decoder.target.forwards, conversation.replies) == (forwards, 1)


def test_a_reply_cut_by_the_context_says_so(chat):  # noqa: F811
    result = chat(f"{NEAR_FULL}\n")
    assert result.exit_code == 0, result.output
    assert re.fullmatch(r"8 tokens · .* · cut at 8 tokens: the model's 256-token context is full \(/reset to start over\)",
                        result.stdout.splitlines()[-1]), result.stdout


def test_the_conversation_budget_is_cut_and_reported(make_conversation):
    conversation = make_conversation("draft", k=3)
    "".join(piece.text for piece in conversation.reply(NEAR_FULL))
    budget = conversation.budget
    assert (budget.max_new_tokens, budget.asked, budget.cut, budget.prompt_tokens) == (8, 12, True, 248)
    assert conversation.last_reply.finish_reason == "length"
    assert conversation.last_reply.stats["new_tokens"] == 8


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "infinity"])
def test_a_non_finite_temperature_is_refused_and_the_chat_goes_on(chat, value):  # noqa: F811
    result = chat(f"/temp {value}\nHello\n")
    assert_exited(result, 2)  # piped, a line refused: the exit code says so once the input ends
    assert result.stderr.splitlines()[-1].startswith("error: temperature must be a finite number >= 0, got ")
    assert "Traceback" not in result.output
    assert re.search(r"\d+ tokens? · ", result.stdout)  # greedy as before, not a crash


def test_minus_zero_is_a_temperature_of_zero(chat):  # noqa: F811
    result = chat("/temp -0\n")
    assert_exited(result, 0)
    assert "temperature 0 (greedy)" in result.stdout and "-0" not in result.stdout


def test_save_to_a_folder_says_it_is_a_folder(chat, tmp_path):  # noqa: F811
    result = chat(f"Hello\n/save {tmp_path}\n")
    assert_exited(result, 2)
    assert result.stderr.splitlines()[-1] == f"error: {tmp_path} is a folder — give a file name, e.g. /save {tmp_path / 'chat.jsonl'}"


def test_chat_with_stdin_closed_is_one_line_before_loading_models(tmp_path):
    missing = tmp_path / "not-a-model"  # never loaded: the check comes first
    command = [sys.executable, "-m", "specdec_cli", "chat", "--target", str(missing)]
    result = subprocess.run(command, stdin=None, capture_output=True, text=True, timeout=300,
                            preexec_fn=lambda: os.close(0), env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 2, result.stderr
    assert result.stderr == ("error: standard input is closed, so chat has nothing to read — run it in a terminal, "
                             "or pipe the messages in (echo hi | specdec chat)\n")
    assert result.stdout == ""
