"""The interactive loop: read a message (or a slash command), stream the reply, print its stats."""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console
from rich.text import Text

from specdec_cli import render
from specdec_cli.chat.commands import CONTINUATION, as_message, is_command, run_command
from specdec_cli.chat.conversation import Conversation
from specdec_cli.chat.history import Message
from specdec_cli.chat.text import Piece
from specdec_cli.engine import Budget
from specdec_cli.errors import InputError, SpecdecError
from specdec_cli.settings import refuse_undecodable

ReadLine = Callable[[str], str]  # like `input`: shows the prompt, returns a line; EOFError at the end

PROMPT = "> "
MORE = "... "
BYTE_ORDER_MARK = "\ufeff"  # what a Windows editor puts before UTF-8 text
UTF16_MARKS = ("\udcff\udcfe", "\udcfe\udcff")  # UTF-16's byte-order marks, as stdin keeps bytes that are not UTF-8
TO_UTF8 = "convert piped text with iconv -f UTF-16 -t UTF-8"


class Screen:
    """Where the chat prints: replies and notices on `console`, errors on `errors`. When `styled` is
    False everything is plain text (no colours, no legend)."""

    def __init__(self, console: Console, errors: Console, styled: bool, interactive: bool) -> None:
        self.console = console
        self.errors = errors
        self.styled = styled
        self.interactive = interactive  # a person types: show prompts and the greeting
        self.refused = 0  # lines answered with an error instead of a reply or a command's effect

    def greet(self) -> None:
        if self.styled:
            self.console.print(render.legend())
        if self.interactive:
            self.console.print(render.notice("/help for commands · end a line with \\ to go on · Ctrl-D to quit"))

    def piece(self, piece: Piece) -> None:
        self.console.print(render.token(piece.text, piece.provenance, self.styled), end="")

    def end_reply(self, reply: Message, budget: Budget) -> None:
        if not reply.content.endswith("\n"):
            self.console.print()
        self.console.print(render.stats_line(reply.stats, note=_note(reply.finish_reason, budget)))

    def totals(self, conversation: Conversation) -> None:
        label = f"session, {conversation.replies} {'reply' if conversation.replies == 1 else 'replies'}"
        self.console.print(render.stats_line(conversation.totals.as_dict(), label=label))

    def notice(self, message: str) -> None:
        self.console.print(render.notice(message))

    def error(self, error: SpecdecError) -> None:
        self.refused += 1
        self.errors.print(Text.assemble(("error:", "bold red"), " ", error.one_line()))


def _note(finish_reason: str | None, budget: Budget) -> str:
    if finish_reason == "interrupted":
        return "interrupted"
    if finish_reason == "length" and budget.cut:
        return f"cut at {budget.max_new_tokens} tokens: the model's {budget.context}-token context is full (/reset to start over)"
    if finish_reason == "length":
        return f"cut at {budget.max_new_tokens} tokens (--max-new-tokens)"
    return ""


def read_message(read_line: ReadLine, interactive: bool) -> str | None:
    """One message; a line ending in a backslash goes on on the next line. None at end of input."""
    lines: list[str] = []
    while True:
        prompt = (MORE if lines else PROMPT) if interactive else ""
        try:
            line = read_line(prompt).removesuffix("\r")  # a file written on Windows, piped in: no "\r" in the message
            if not lines:
                line = line.removeprefix(BYTE_ORDER_MARK)  # nor its byte-order mark, which would hide a /command
        except EOFError:
            return "\n".join(lines) if lines else None
        if not line.endswith(CONTINUATION):
            return "\n".join([*lines, line])
        lines.append(line[: -len(CONTINUATION)])


def refuse_utf16(message: str) -> None:
    """InputError for text piped in UTF-16: its first line starts with a byte-order mark that is not UTF-8, and
    every line after it holds NUL characters, which are UTF-8 and went to the model as a garbled message."""
    if message.startswith(UTF16_MARKS):
        raise InputError("this message starts with a UTF-16 byte-order mark: the text is UTF-16, not UTF-8", TO_UTF8)
    if "\x00" in message:
        raise InputError("this message holds NUL characters: the text is UTF-16 (or another wide encoding), not UTF-8",
                         TO_UTF8)


def stream_reply(conversation: Conversation, screen: Screen, user_text: str) -> None:
    """Print the reply as it is verified; Ctrl-C stops it and keeps what was shown."""
    replies_before = conversation.replies
    pieces = conversation.reply(user_text)
    try:
        for piece in pieces:
            while conversation.notices:  # said before the reply they came with
                screen.notice(conversation.notices.pop(0))
            screen.piece(piece)
    except KeyboardInterrupt:
        pieces.close()  # records the reply so far, if the interrupt came while printing
    if conversation.replies > replies_before:  # not interrupted before the reply began
        screen.end_reply(conversation.last_reply, conversation.budget)


def handle(conversation: Conversation, screen: Screen, message: str) -> bool:
    """Act on one message; False when the chat should end."""
    if not message.strip():
        return True
    try:
        refuse_utf16(message)
        refuse_undecodable(message, "this message",  # a Latin-1 terminal's "é", another encoding piped in
                           "set the terminal to UTF-8 (a UTF-8 locale), or convert piped text with iconv -t UTF-8")
        if not is_command(message):
            stream_reply(conversation, screen, as_message(message))
            return True
        outcome = run_command(conversation, message)
    except SpecdecError as error:
        screen.error(error)
        return True
    if outcome.notice:
        screen.notice(outcome.notice)
    if outcome.totals:
        screen.totals(conversation)
    return not outcome.exit


def run_chat(conversation: Conversation, screen: Screen, read_line: ReadLine = input) -> None:
    """The loop, until /exit, end of input (Ctrl-D) or Ctrl-C at the prompt."""
    screen.greet()
    while True:
        try:
            message = read_message(read_line, screen.interactive)
        except KeyboardInterrupt:
            screen.console.print()
            return
        if message is None:
            if screen.interactive:
                screen.console.print()
            return
        if not handle(conversation, screen, message):
            return
