"""`specdec chat`: an interactive chat whose tokens show what the draft got right."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer

from specdec_cli.cli import options
from specdec_cli.cli.app import PipeConsole, error_console, report_errors
from specdec_cli.errors import InputError

if TYPE_CHECKING:
    from specdec_cli.chat import Screen

NoColorOption = Annotated[bool, typer.Option("--no-color", help="Plain text, no colours (also: NO_COLOR, or stdout not a terminal).")]


def _screen(no_color: bool) -> Screen:
    from specdec_cli.chat import Screen

    console = PipeConsole(highlight=False, soft_wrap=True, markup=False, emoji=False)
    styled = console.is_terminal and not console.no_color and not no_color
    if not styled:
        console = PipeConsole(highlight=False, soft_wrap=True, markup=False, emoji=False, color_system=None)
    return Screen(console, error_console(), styled=styled, interactive=sys.stdin.isatty())


def _check_stdin() -> None:
    """Python sets sys.stdin to None when the process starts with file descriptor 0 closed (`<&-`). A byte that is
    not UTF-8 is kept as Python's escape for it, for the chat to refuse that message (chat.loop): under a UTF-8
    locale stdin decodes strictly, and a Latin-1 "é" ended the chat in a UnicodeDecodeError traceback."""
    if sys.stdin is None or sys.stdin.closed:
        raise InputError(
            "standard input is closed, so chat has nothing to read",
            "run it in a terminal, or pipe the messages in (echo hi | specdec chat)",
        )
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")


def _enable_line_editing() -> None:
    try:
        import readline  # noqa: F401  (importing it gives `input` arrow keys and history)
    except ImportError:  # pragma: no cover - platforms without readline
        pass


@report_errors
def chat(
    profile: options.ProfileOption = None,
    target: options.TargetOption = None,
    draft: options.DraftOption = None,
    drafter: options.DrafterOption = None,
    device: options.DeviceOption = None,
    dtype: options.DtypeOption = None,
    target_4bit: options.Target4bitOption = False,
    draft_4bit: options.Draft4bitOption = False,
    load_in_4bit: options.LoadIn4bitOption = False,
    load_in_8bit: options.LoadIn8bitOption = False,
    draft_int8: options.DraftInt8Option = None,
    target_quant: options.TargetQuantOption = None,
    draft_quant: options.DraftQuantOption = None,
    prefill: options.PrefillOption = None,
    trust_remote_code: options.TrustRemoteCodeOption = False,
    allow_pickle: options.AllowPickleOption = False,
    k: options.KOption = None,
    temperature: options.TemperatureOption = None,
    top_p: options.TopPOption = None,
    top_k: options.TopKOption = None,
    seed: options.SeedOption = None,
    max_new_tokens: options.MaxNewTokensOption = None,
    system: options.SystemOption = None,
    no_color: NoColorOption = False,
) -> None:
    """Chat with a model. Tokens are coloured by where they came from: accepted draft tokens, the
    target's corrections, bonus tokens. Type /help in the chat for commands; a line ending in \\
    continues on the next line. Input may be piped: `echo hi | specdec chat` (a line refused there is skipped, and the
    chat exits with code 2 when its input ends)."""
    from specdec_cli.chat import Conversation, run_chat  # torch and the models: not for --help
    from specdec_cli.models.loading.prefill import load_meanwhile, settle
    from specdec_cli.settings import ModelOverrides, choose_models, decoding_settings, load_choice

    _check_stdin()  # before minutes of model loading
    choice = choose_models(ModelOverrides(
        profile=profile, target=target, draft=draft, drafter=drafter, device=device, dtype=dtype,
        target_quant=target_quant, draft_quant=draft_quant, prefill=prefill,
        target_4bit=target_4bit, draft_4bit=draft_4bit, load_in_4bit=load_in_4bit, load_in_8bit=load_in_8bit,
        draft_int8=draft_int8, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle,
    ))
    settings = decoding_settings(choice.profile, k=k, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                 max_new_tokens=max_new_tokens, system=system)
    loaded_target, loaded_draft = load_choice(choice, error_console(), background_prefill=True)
    conversation = Conversation(loaded_target, loaded_draft, choice.drafter, settings)
    screen = _screen(no_color)
    if screen.interactive:
        _enable_line_editing()
    load_meanwhile(loaded_target.model)  # the target's bfloat16 prompt reader (--prefill), if it has one to load
    try:
        run_chat(conversation, screen)
    finally:
        settle(loaded_target.model)
    if screen.refused and not screen.interactive:  # piped: the script's other lines went on; its caller learns of it
        raise typer.Exit(2)
