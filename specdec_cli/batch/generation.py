"""Generation on the loaded models: the per-request `GenerateOne` that `specdec run` uses.

The session and the models are imported inside the methods, so that importing `specdec_cli.batch`
(reading, records, the writer, the loop) loads no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specdec_cli.batch.records import Completion
from specdec_cli.batch.requests import Request
from specdec_cli.errors import SpecdecError

if TYPE_CHECKING:
    from specdec_cli.engine import SpeculativeDecoder
    from specdec_cli.settings import DecodingSettings, ModelChoice, Printer


class GenerationError(SpecdecError):
    """One request failed inside the model's generation; it becomes that request's error record."""


class ModelGeneration:
    """Runs one request through the speculative decoder (a `GenerateOne`)."""

    def __init__(self, tokenizer, decoder: SpeculativeDecoder, settings: DecodingSettings) -> None:
        self.tokenizer = tokenizer
        self.decoder = decoder
        self.settings = settings

    @classmethod
    def load(cls, choice: ModelChoice, settings: DecodingSettings, console: Printer | None = None) -> ModelGeneration:
        """Load the chosen pair; k = auto never reads the clock here, so the same input gives the same file."""
        from specdec_cli.session import build_decoder
        from specdec_cli.settings import load_choice

        target, draft = load_choice(choice, console)
        decoder = build_decoder(target, draft, choice.drafter, settings.k, clock_free=True)
        return cls(target.tokenizer, decoder, settings)

    def __call__(self, request: Request) -> Completion:
        from specdec_cli.session import StopStrings
        from specdec_cli.settings import sampling_params

        settings = self.settings
        prompt_ids = self._encode(request)
        params = sampling_params(
            _given(request.temperature, settings.temperature),
            _given(request.top_p, settings.top_p),
            _given(request.top_k, settings.top_k),
            _given(request.seed, settings.seed),
        )
        stops = StopStrings(self.tokenizer, request.stop)
        # Each request starts from nothing (no cache, no learned draft length), so its output
        # depends on it alone: resuming, --limit or reordering the file never changes a record.
        self.decoder.reset()
        max_new_tokens = _given(request.max_new_tokens, settings.max_new_tokens)
        try:
            result = self.decoder.generate(prompt_ids, params, max_new_tokens, stop=stops if stops.stops else None)
        except (RuntimeError, ValueError, IndexError, MemoryError) as error:
            # A request the model cannot run (out of memory, a kernel that refuses an input) fails alone:
            # its record says why and the batch goes on. The decoder is reset before the next request.
            raise GenerationError(
                f"generation failed ({type(error).__name__}: {first_line(error)})",
                "the other records go on; if this looks like a bug in specdec, please report it with this line",
            ) from error
        text = stops.cut(self.tokenizer.decode(result.tokens, skip_special_tokens=True))
        return Completion.of(text, result.finish_reason, len(prompt_ids), result.stats, result.budget.note() or None)

    def _encode(self, request: Request) -> list[int]:
        from specdec_cli.session import encode_chat, encode_completion

        if not request.chat:
            return encode_completion(self.tokenizer, request.prompt)
        messages = list(request.messages)
        if self.settings.system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.settings.system})
        return encode_chat(self.tokenizer, messages)


def _given(value, default):
    return default if value is None else value


def first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else "no message"
