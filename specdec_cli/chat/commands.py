"""Slash commands: a line starting with `/` changes the conversation instead of going to the model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specdec_cli.chat.conversation import Conversation
from specdec_cli.errors import InputError

CONTINUATION = "\\"

HELP = f"""\
/help            this list
/reset           forget the conversation (history and both models' caches)
/system TEXT     set the system prompt (/system alone removes it)
/k N|auto        draft length: 0 (target alone) to 16, or auto
/temp X          temperature (0 = greedy)
/stats           totals for this session
/save FILE       write the transcript as JSON lines (one message per line)
/exit            quit (also Ctrl-D; Ctrl-C at the prompt)
End a line with {CONTINUATION} to continue your message on the next line; start it with // to send a message that
begins with / (//usr/bin sends /usr/bin). Ctrl-C stops a reply."""


@dataclass(frozen=True)
class Outcome:
    notice: str = ""  # a line to show
    totals: bool = False  # show the session's stats
    exit: bool = False


def is_command(line: str) -> bool:
    return line.startswith("/") and not line.startswith("//")


def as_message(line: str) -> str:
    """A line that is no command as the message it sends: `//` sends one `/` (a path, a regex, a comment)."""
    return line[1:] if line.startswith("//") else line


def _help(conversation: Conversation, argument: str) -> Outcome:
    return Outcome(HELP)


def _reset(conversation: Conversation, argument: str) -> Outcome:
    conversation.reset()
    return Outcome("conversation cleared")


def _system(conversation: Conversation, argument: str) -> Outcome:
    conversation.set_system(argument)
    return Outcome("system prompt set" if argument else "system prompt removed")


def _k(conversation: Conversation, argument: str) -> Outcome:
    if not argument:
        raise InputError("/k needs a value", "use /k N (0 to 16) or /k auto")
    k = conversation.set_k(argument)
    return Outcome(f"draft length {k}" + (" (target alone)" if k == 0 else ""))


def _temperature(conversation: Conversation, argument: str) -> Outcome:
    if not argument:
        raise InputError("/temp needs a value", "use e.g. /temp 0.7 (0 = greedy)")
    temperature = conversation.set_temperature(argument)
    return Outcome(f"temperature {temperature:g}" + (" (greedy)" if conversation.sampling().greedy else ""))


def _stats(conversation: Conversation, argument: str) -> Outcome:
    return Outcome(totals=True)


def _save(conversation: Conversation, argument: str) -> Outcome:
    argument = _unquoted(argument.strip())
    if not argument:
        raise InputError("/save needs a file name", "use /save FILE, e.g. /save chat.jsonl")
    lines = conversation.save(Path(argument))
    return Outcome(f"saved {lines} messages to {argument}")


def _unquoted(argument: str) -> str:
    """A file name as a shell reads it when the whole of it is quoted: `/save "my chat.jsonl"` made a file whose
    name began and ended with a quote mark. The rest of the line is the name either way (spaces included)."""
    if len(argument) >= 2 and argument[0] == argument[-1] and argument[0] in "'\"":
        return argument[1:-1]
    return argument


def _exit(conversation: Conversation, argument: str) -> Outcome:
    return Outcome(exit=True)


COMMANDS: dict[str, Callable[[Conversation, str], Outcome]] = {
    "help": _help,
    "reset": _reset,
    "system": _system,
    "k": _k,
    "temp": _temperature,
    "stats": _stats,
    "save": _save,
    "exit": _exit,
    "quit": _exit,
}


NO_ARGUMENT = (_help, _reset, _stats, _exit)


def run_command(conversation: Conversation, line: str) -> Outcome:
    """Run one slash command line, e.g. `/k 4`. Bad input raises InputError (the chat goes on)."""
    name, _, argument = line[1:].strip().partition(" ")
    command = COMMANDS.get(name.lower())
    if command is None:
        raise InputError(f"unknown command /{name}", "type /help for the list, or start the line with // to send it "
                                                     "as a message")
    if argument.strip() and command in NO_ARGUMENT:  # "/exit code 1 means what?" ended the chat, its history gone
        raise InputError(f"/{name} takes no argument",
                         f"type /{name.lower()} alone, or start the line with // to send it as a message")
    return command(conversation, argument.strip())
