"""The conversation on the decoder: history, caches kept across turns, interruption, settings."""

from __future__ import annotations

import json

import pytest

from specdec_cli.engine import SamplingParams, SpeculativeDecoder
from specdec_cli.errors import InputError
from specdec_cli.session import encode_chat, eos_token_ids, fold_system

QUESTIONS = ["Hello, how are you?", "def add(a, b):", "The quick brown fox"]


def record_tokens(conversation) -> list[list[int]]:
    """Spy on the decoder: one list of generated token ids per turn."""
    turns: list[list[int]] = []
    stream = conversation.decoder.stream

    def recording_stream(*args, **kwargs):
        turns.append([])
        for event in stream(*args, **kwargs):
            turns[-1].extend(event.tokens)
            yield event

    conversation.decoder.stream = recording_stream
    return turns


def from_scratch(target, messages: list[dict], max_new_tokens: int) -> list[int]:
    """The reference: a fresh target-alone greedy decoder on the whole conversation so far."""
    decoder = SpeculativeDecoder(target.model, eos_token_ids=eos_token_ids(target))
    prompt = encode_chat(target.tokenizer, messages)
    return decoder.generate(prompt, SamplingParams(), max_new_tokens).tokens


def talk(conversation, text: str) -> str:
    return "".join(piece.text for piece in conversation.reply(text))


def test_a_multi_turn_greedy_chat_equals_decoding_each_turn_from_scratch(make_conversation, loaded):
    conversation = make_conversation("draft", k=3, system="Be brief.")
    turns = record_tokens(conversation)
    for question in QUESTIONS:
        talk(conversation, question)
    messages = conversation.history.template_messages()
    assert [m["role"] for m in messages] == ["system"] + ["user", "assistant"] * 3
    for turn, tokens in enumerate(turns):
        user_at = 1 + 2 * turn
        assert tokens == from_scratch(loaded.target, messages[: user_at + 1], 12)
        shown = loaded.target.tokenizer.decode(tokens, skip_special_tokens=True)
        assert messages[user_at + 1]["content"] == shown.rstrip("\ufffd")


def test_the_second_turn_feeds_only_the_new_tokens(make_conversation, loaded):
    conversation = make_conversation("draft", k=3)
    talk(conversation, QUESTIONS[0])
    first_prompt = encode_chat(loaded.target.tokenizer, conversation.history.template_messages()[:1])
    fed: list[int] = []
    hook = loaded.target.model.register_forward_pre_hook(
        lambda module, args, kwargs: fed.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        second_prompt = encode_chat(
            loaded.target.tokenizer, conversation.history.template_messages() + [{"role": "user", "content": QUESTIONS[1]}]
        )
        reused = conversation.decoder.target.shared_prefix(second_prompt)
        talk(conversation, QUESTIONS[1])
    finally:
        hook.remove()
    assert reused > len(first_prompt)  # the first prompt and (part of) the first reply stay cached
    assert fed[0] == len(second_prompt) - reused + 3  # the new tokens and the 3 drafts, nothing else
    assert fed[0] < len(second_prompt)


class Interrupt:
    """Raise KeyboardInterrupt (as Ctrl-C does) from the target's Nth forward pass or the drafter's Nth draft."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["target forward", "drafter"])
def test_ctrl_c_keeps_the_partial_reply_and_the_next_turn_is_exact(make_conversation, loaded, where, monkeypatch):
    from rich.console import Console

    from specdec_cli.chat.loop import Screen, stream_reply

    conversation = make_conversation("draft", k=3, max_new_tokens=16)
    turns = record_tokens(conversation)
    interrupt = Interrupt(at=4)
    if where == "target forward":
        hook = loaded.target.model.register_forward_pre_hook(interrupt)
    else:
        drafter = conversation.decoder.drafter
        propose = drafter.propose
        monkeypatch.setattr(drafter, "propose", lambda *a, **k: interrupt() or propose(*a, **k))
    console = Console(record=True, width=200, soft_wrap=True, color_system=None)
    try:
        stream_reply(conversation, Screen(console, console, styled=False, interactive=False), QUESTIONS[0])
    finally:
        if where == "target forward":
            hook.remove()
    partial = conversation.last_reply
    assert interrupt.calls == 4 and partial.finish_reason == "interrupted"
    assert 0 < len(turns[0]) < 16
    shown = console.export_text()
    assert partial.content and shown.startswith(partial.content)
    assert shown.rstrip("\n").endswith("· interrupted")
    assert partial.content == loaded.target.tokenizer.decode(turns[0], skip_special_tokens=True).rstrip("\ufffd")

    talk(conversation, QUESTIONS[1])
    messages = conversation.history.template_messages()
    assert turns[1] == from_scratch(loaded.target, messages[:3], 16)


def styles_on_a_terminal(pieces) -> dict[str, set[str]]:
    """Print the pieces as the chat does on a colour terminal; SGR codes in force -> the texts printed with them."""
    from specdec_cli.chat.loop import Screen
    from tests.chat.ansi import styled_runs, terminal

    console = terminal()
    screen = Screen(console, console, styled=True, interactive=False)
    for piece in pieces:
        screen.piece(piece)
    found: dict[str, set[str]] = {}
    for codes, text in styled_runs(console.export_text(styles=True)):
        found.setdefault(codes, set()).add(text)
    return found


def code_of(provenance: str) -> str:
    from specdec_cli.chat.text import Piece

    (code,) = styles_on_a_terminal([Piece("x", provenance)])
    return code


def test_the_target_as_its_own_draft_shows_only_accepted_and_bonus_styles(make_conversation):
    conversation = make_conversation("same", k=4, max_new_tokens=24)
    pieces = list(conversation.reply(QUESTIONS[0]))
    assert {piece.provenance for piece in pieces} <= {"accepted", "bonus"}
    styles = styles_on_a_terminal(pieces)
    assert set(styles) <= {code_of("accepted"), code_of("bonus")} and code_of("accepted") in styles


def test_a_mismatched_draft_shows_resampled_tokens_in_their_style(make_conversation):
    conversation = make_conversation("draft", k=4, max_new_tokens=24)
    pieces = list(conversation.reply(QUESTIONS[0]))
    resampled = {piece.text for piece in pieces if piece.provenance == "resampled"}
    assert resampled
    assert resampled <= styles_on_a_terminal(pieces)[code_of("resampled")]


def test_reset_forgets_history_and_caches(make_conversation):
    conversation = make_conversation("draft")
    first = talk(conversation, QUESTIONS[0])
    talk(conversation, QUESTIONS[1])
    conversation.reset()
    assert conversation.history.messages == [] and len(conversation.decoder.target) == 0
    assert talk(conversation, QUESTIONS[0]) == first
    assert conversation.replies == 3


def test_system_prompt_goes_first_in_the_template(make_conversation, loaded):
    conversation = make_conversation("draft")
    conversation.set_system("You are terse.")
    assert conversation.prompt_ids() == encode_chat(loaded.target.tokenizer, [{"role": "system", "content": "You are terse."}])
    conversation.set_system("")
    assert conversation.history.system is None


def test_k_zero_is_the_target_alone_and_auto_drafts_again(make_conversation):
    conversation = make_conversation("draft", k=0)
    assert conversation.decoder.drafter is None
    assert {piece.provenance for piece in conversation.reply(QUESTIONS[0])} == {"target"}
    assert conversation.last_reply.stats["drafted"] == 0
    assert conversation.set_k("auto") == "auto"
    talk(conversation, QUESTIONS[1])
    assert conversation.last_reply.stats["drafted"] > 0


def test_switching_between_auto_and_a_fixed_k_switches_the_survival_cut(make_conversation):
    conversation = make_conversation("draft", k="auto")
    assert conversation.decoder.drafter.min_survival > 0
    conversation.set_k("3")
    assert conversation.decoder.drafter.min_survival == 0.0
    talk(conversation, QUESTIONS[0])
    assert set(conversation.last_reply.stats["drafted_at_position"][3:]) <= {0}  # never past 3
    conversation.set_k("auto")
    assert conversation.decoder.drafter.min_survival > 0
    drafter = conversation.decoder.drafter
    conversation.set_k("0")
    conversation.set_k("4")  # through k = 0 too: the same drafter (its cache kept), cut off
    assert conversation.decoder.drafter is drafter and drafter.min_survival == 0.0


def test_a_bad_k_or_temperature_is_refused_and_changes_nothing(make_conversation):
    conversation = make_conversation("draft", k=3)
    for value in ("17", "-1", "lots"):
        with pytest.raises(InputError, match="invalid draft length"):
            conversation.set_k(value)
    with pytest.raises(InputError, match="invalid temperature 'hot'"):
        conversation.set_temperature("hot")
    with pytest.raises(InputError, match="temperature must be a finite number >= 0"):
        conversation.set_temperature("-0.5")
    assert (conversation.settings.k, conversation.settings.temperature) == (3, 0.0)
    assert conversation.set_temperature("0.5") == 0.5 and conversation.sampling().temperature == 0.5


def test_save_writes_the_transcript_as_json_lines(make_conversation, tmp_path):
    conversation = make_conversation("draft", system="Be brief.")
    reply = talk(conversation, QUESTIONS[0])
    path = tmp_path / "chat.jsonl"
    assert conversation.save(path) == 3
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert records[:2] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTIONS[0]}]
    assert records[2]["role"] == "assistant" and records[2]["content"] == reply
    assert records[2]["finish_reason"] in ("stop", "length")
    assert records[2]["stats"]["new_tokens"] == conversation.totals.new_tokens > 0
    talk(conversation, QUESTIONS[1])
    assert conversation.save(path) == 5  # its own file may be rewritten with the longer transcript


def test_save_never_overwrites_someone_elses_file_or_fails_halfway(make_conversation, tmp_path):
    conversation = make_conversation("draft")
    talk(conversation, QUESTIONS[0])
    existing = tmp_path / "notes.txt"
    existing.write_text("precious")
    with pytest.raises(InputError, match="already exists"):
        conversation.save(existing)
    assert existing.read_text() == "precious"
    with pytest.raises(InputError, match="cannot write"):
        conversation.save(tmp_path / "no-such-folder" / "chat.jsonl")
    assert list(tmp_path.iterdir()) == [existing]


def test_totals_add_up_every_reply(make_conversation):
    conversation = make_conversation("draft")
    talk(conversation, QUESTIONS[0])
    talk(conversation, QUESTIONS[1])
    replies = [m.stats for m in conversation.history.messages if m.role == "assistant"]
    assert conversation.totals.new_tokens == sum(stats["new_tokens"] for stats in replies)
    assert conversation.totals.drafted == sum(stats["drafted"] for stats in replies)
    assert conversation.replies == 2


def _loading_copy_on(model, gate, monkeypatch, failure: BaseException | None = None):
    """Give `model` a --prefill copy still loading (models/prefill.py's LoadingPath) until `gate` opens; the loaded
    path takes no prompt part (min_tokens too large), so the turns below are the target's own."""
    from specdec_cli.models.loading import prefill

    class Unused:
        min_tokens = 10 ** 9

    def load():
        assert gate.wait(30)
        if failure is not None:
            raise failure
        return Unused()

    monkeypatch.setattr(prefill, "warm", lambda path, config: None)
    model.__dict__["_specdec_prefill"] = prefill.LoadingPath(model, load, Unused.min_tokens)
    prefill.load_meanwhile(model)
    return model.__dict__["_specdec_prefill"]


def test_a_turn_waits_for_a_prompt_copy_still_loading(make_conversation, monkeypatch):
    """No forward runs beside the copy's load (transformers' loading sets the process-wide default dtype): a
    message sent meanwhile waits for it, short as it is."""
    import threading

    conversation = make_conversation("draft", k=3)
    gate = threading.Event()
    loading = _loading_copy_on(conversation.target.model, gate, monkeypatch)
    try:
        turns = record_tokens(conversation)
        replier = threading.Thread(target=talk, args=(conversation, QUESTIONS[0]))
        replier.start()
        replier.join(0.3)
        assert replier.is_alive() and turns == []  # waiting, no forward yet
        gate.set()
        replier.join(30)
        assert not replier.is_alive() and len(turns) == 1 and turns[0]
        assert conversation.target.model.__dict__["_specdec_prefill"] is loading._loaded
    finally:
        gate.set()
        conversation.target.model.__dict__.pop("_specdec_prefill", None)


def test_a_copy_that_did_not_load_costs_one_turn_and_nothing_else(make_conversation, monkeypatch):
    import threading

    from specdec_cli.errors import InsufficientMemoryError, ModelLoadError

    conversation = make_conversation("draft", k=3)
    gate = threading.Event()
    gate.set()
    failure = InsufficientMemoryError("2.9 GB needed, 1.0 GB free", "close something")
    _loading_copy_on(conversation.target.model, gate, monkeypatch, failure)
    try:
        with pytest.raises(ModelLoadError, match="did not load"):
            talk(conversation, QUESTIONS[0])
        assert conversation.history.messages == [] and "_specdec_prefill" not in conversation.target.model.__dict__
        talk(conversation, QUESTIONS[0])  # sent again: the target reads it
        assert [m.role for m in conversation.history.messages] == ["user", "assistant"]
    finally:
        conversation.target.model.__dict__.pop("_specdec_prefill", None)


def test_a_template_without_a_system_role_gets_the_system_prompt_in_the_first_message(make_conversation, loaded,
                                                                                      monkeypatch):
    """Gemma's chat template raises on a system role (its raise_exception, a jinja2 TemplateError): with --system,
    each turn was a traceback and chat ended. The system prompt now opens the first user message, as llama.cpp does
    for such templates, and the screen is told once; every turn is what decoding that conversation alone gives."""
    guard = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    monkeypatch.setattr(loaded.target.tokenizer, "chat_template", guard + loaded.target.tokenizer.chat_template)
    conversation = make_conversation("draft", k=3, system="Be brief.")
    turns = record_tokens(conversation)
    talk(conversation, QUESTIONS[0])
    talk(conversation, QUESTIONS[1])
    assert conversation.notices == [
        "this model's chat template has no system role: the system prompt opens your first message instead"]
    messages = fold_system(conversation.history.template_messages())
    assert messages[0] == {"role": "user", "content": f"Be brief.\n\n{QUESTIONS[0]}"}
    assert turns == [from_scratch(loaded.target, messages[:1], 12), from_scratch(loaded.target, messages[:3], 12)]


def test_a_chat_template_that_refuses_the_messages_costs_one_turn(make_conversation, loaded, monkeypatch):
    """Any other refusal of the template is one line, and the message is not kept."""
    guard = "{% if 'secret' in messages[-1]['content'] %}{{ raise_exception('No secrets here') }}{% endif %}"
    monkeypatch.setattr(loaded.target.tokenizer, "chat_template", guard + loaded.target.tokenizer.chat_template)
    conversation = make_conversation("draft", k=3, system="Be brief.")
    with pytest.raises(InputError, match="chat template refuses these messages: No secrets here"):
        talk(conversation, "a secret")
    assert conversation.history.messages == [] and conversation.notices == []  # the system prompt was not the cause
    assert talk(conversation, QUESTIONS[0])
    assert [m.role for m in conversation.history.messages] == ["user", "assistant"]
