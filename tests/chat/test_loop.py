"""The loop itself, with a scripted `input`: prompts, continuation lines, Ctrl-D and Ctrl-C at the prompt."""

from __future__ import annotations

from rich.console import Console

from specdec_cli.chat.loop import Screen, read_message, run_chat


def scripted(*lines: str | BaseException):
    """A stand-in for `input`: returns the lines in turn (raising those that are exceptions), then EOFError."""
    prompts: list[str] = []
    remaining = list(lines)

    def read_line(prompt: str) -> str:
        prompts.append(prompt)
        if not remaining:
            raise EOFError
        line = remaining.pop(0)
        if isinstance(line, BaseException):
            raise line
        return line

    return read_line, prompts


def screen(interactive: bool) -> tuple[Screen, Console]:
    console = Console(record=True, width=200, soft_wrap=True, color_system=None)
    return Screen(console, console, styled=False, interactive=interactive), console


def test_continuation_lines_join_and_show_a_continuation_prompt():
    read_line, prompts = scripted("first \\", "second\\", "third")
    assert read_message(read_line, interactive=True) == "first \nsecond\nthird"
    assert prompts == ["> ", "... ", "... "]


def test_end_of_input_sends_a_half_written_message_then_ends():
    read_line, _ = scripted("unfinished \\")
    assert read_message(read_line, interactive=False) == "unfinished "
    assert read_message(read_line, interactive=False) is None


def test_ctrl_c_at_the_prompt_ends_the_chat_cleanly(make_conversation):
    conversation = make_conversation("draft")
    read_line, prompts = scripted("Hello", KeyboardInterrupt(), "never read")
    chat_screen, console = screen(interactive=True)
    run_chat(conversation, chat_screen, read_line)  # returns: no exception escapes
    assert len(prompts) == 2 and conversation.replies == 1
    assert console.export_text().startswith("/help for commands")


def test_ctrl_d_ends_the_chat(make_conversation):
    conversation = make_conversation("draft")
    read_line, prompts = scripted("/k 2")
    run_chat(conversation, screen(interactive=False)[0], read_line)
    assert prompts == ["", ""] and conversation.settings.k == 2 and conversation.replies == 0
