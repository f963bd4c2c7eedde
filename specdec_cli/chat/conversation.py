"""A chat conversation on one speculative decoder: the history, the decoding settings, the totals.

One `SpeculativeDecoder` lives as long as the conversation. Each turn renders the whole conversation
through the chat template and hands it to the decoder, whose caches keep the prefix it shares with
the previous turn: only the new tokens are fed. No Rich here: replies come out as `Piece`s."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from specdec_cli.chat.history import History, Message, write_jsonl
from specdec_cli.chat.text import Piece, ReplyText
from specdec_cli.engine import Budget, GenerationStats
from specdec_cli.errors import InputError, PromptTooLongError
from specdec_cli.models import LoadedModel
from specdec_cli.models.loading.prefill import finish_loading
from specdec_cli.session import build_decoder, encode_folding_system, make_drafter, policy_for
from specdec_cli.settings import DecodingSettings, parse_k, sampling_params


class Conversation:
    def __init__(
        self, target: LoadedModel, draft: LoadedModel | None, drafter: str, settings: DecodingSettings
    ) -> None:
        if not getattr(target.tokenizer, "chat_template", None):
            raise InputError(
                f"{target.name} has no chat template", "chat needs an instruct/chat model; use `specdec run` for plain completion"
            )
        self.target = target
        self.draft = draft
        self.drafter_name = drafter
        self.settings = settings
        self.decoder = build_decoder(target, draft, drafter, settings.k)
        self.history = History(system=settings.system)
        self.totals = GenerationStats()  # every reply of the session, across /reset
        self.replies = 0
        self.budget: Budget | None = None  # the last reply's token budget, as the context left it
        self._saved: set[Path] = set()  # files this session wrote, which /save may overwrite
        self.said_folded = False  # a notice said the system prompt opens the first message (no system role)
        self.notices: list[str] = []  # for the screen, before the reply that caused them

    # ---- a turn -------------------------------------------------------------------------------

    def prompt_ids(self) -> list[int]:
        """The conversation through the chat template. A template without a system role (Gemma's) gets the system
        prompt at the start of the first user message (session.encode_folding_system); `notices` says so once."""
        ids, folded = encode_folding_system(self.target.tokenizer, self.history.template_messages())
        if folded and not self.said_folded:
            self.said_folded = True
            self.notices.append("this model's chat template has no system role: the system prompt opens your first "
                                "message instead")
        return ids

    def reply(self, user_text: str) -> Iterator[Piece]:
        """Stream the reply to `user_text`, one piece of text per token. However the stream ends —
        finished, closed early, or interrupted (Ctrl-C) — the reply as far as it went joins the history. An error
        before generation (a --prefill copy that did not load, a conversation past the context) leaves the history
        as it was, so the message can be sent again."""
        self.history.messages.append(Message("user", user_text))
        try:
            finish_loading(self.target.model)  # --prefill's copy, where it is still loading (cli/chat.py)
            prompt = self.prompt_ids()
            self.budget = self._fit(len(prompt))
        except BaseException:
            self.history.messages.pop()
            raise
        text = ReplyText(self.target.tokenizer)
        stats = GenerationStats()
        finish_reason = "interrupted"
        started = time.perf_counter()
        try:
            for event in self.decoder.stream(prompt, self.sampling(), self.budget.max_new_tokens):
                stats.add_step(event)
                yield from text.push(event.tokens, event.provenance)
                finish_reason = event.finish_reason or finish_reason
        finally:
            stats.seconds = time.perf_counter() - started
            self._record(text.shown, finish_reason, stats)

    def _fit(self, prompt_tokens: int) -> Budget:
        """The reply's budget, checked before any forward: a conversation past the context is refused."""
        try:
            return self.decoder.fit(prompt_tokens, self.settings.max_new_tokens)
        except PromptTooLongError as error:
            raise PromptTooLongError(error.prompt_tokens, error.context, self._what_to_shorten()) from None

    def _what_to_shorten(self) -> str:
        """The hint for a prompt past the context: the system prompt where it leaves no room by itself (a long
        /system was taken, and the next message blamed), else the message or the conversation."""
        if self.history.system:
            alone = History(system=self.history.system, messages=[Message("user", "")])
            system_tokens = len(encode_folding_system(self.target.tokenizer, alone.template_messages())[0])
            try:
                self.decoder.fit(system_tokens, self.settings.max_new_tokens)
            except PromptTooLongError:
                return (f"the system prompt takes {system_tokens} of them: set a shorter one with /system TEXT, or "
                        "remove it with /system")
        return "send a shorter message, or /reset to start a new conversation"

    def _record(self, content: str, finish_reason: str, stats: GenerationStats) -> None:
        self.history.messages.append(Message("assistant", content, finish_reason, stats.as_dict()))
        self.totals.merge(stats)
        self.replies += 1

    @property
    def last_reply(self) -> Message | None:
        messages = self.history.messages
        return messages[-1] if messages and messages[-1].role == "assistant" else None

    def sampling(self):
        return self.settings.sampling()

    # ---- what the slash commands change -------------------------------------------------------

    def reset(self) -> None:
        """Forget the history and both models' caches (the system prompt and the totals stay)."""
        finish_loading(self.target.model)  # no torch beside a load (models/prefill.py: load_meanwhile)
        self.history.messages.clear()
        self.decoder.reset()

    def set_system(self, text: str | None) -> None:
        """A new system prompt for the whole conversation (the next turn re-feeds from where it changed)."""
        self.history.system = text or None

    def set_k(self, value: str) -> int | str:
        """A new draft length; the drafter (and its cache) stays, obeying the new policy's stop rule."""
        k = parse_k(value)
        finish_loading(self.target.model)  # a drafter may be made: no torch beside a load
        drafter = self.decoder.drafter
        if drafter is None and k != 0:
            drafter = make_drafter(self.drafter_name, self.draft, k, self.target)
        self.decoder.set_drafting(drafter, policy_for(k, self.target, self.draft))
        self.settings = replace(self.settings, k=k)
        return k

    def set_temperature(self, value: str) -> float:
        try:
            temperature = float(value) + 0.0  # -0 is 0 (it read "temperature -0")
        except ValueError:
            raise InputError(f"invalid temperature {value!r}", "use a number, e.g. /temp 0.7 (0 = greedy)") from None
        settings = self.settings
        sampling_params(temperature, settings.top_p, settings.top_k, settings.seed)  # validates
        self.settings = replace(settings, temperature=temperature)
        return temperature

    def save(self, path: Path) -> int:
        """Write the transcript as JSON lines; returns the number of lines. Never overwrites a file
        this session did not write itself."""
        path = path.expanduser()
        if path.is_dir():
            raise InputError(f"{path} is a folder", f"give a file name, e.g. /save {path / 'chat.jsonl'}")
        if path.exists() and path.resolve() not in self._saved:
            raise InputError(f"{path} already exists", "pick a new file name (or remove that file first)")
        records = self.history.records()
        write_jsonl(path, records)
        self._saved.add(path.resolve())
        return len(records)
