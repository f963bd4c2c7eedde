"""Generation on the loaded models: the per-request `GenerateOne` that `specdec run` uses for one request
at a time, and the `Stream` of the batched engine (`BatchedGeneration`, `run --batch-size`).

The session and the models are imported inside the methods, so that importing `specdec_cli.batch`
(reading, records, the writer, the loop) loads no torch."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from specdec_cli.batch.records import Completion
from specdec_cli.batch.requests import Request
from specdec_cli.errors import SpecdecError, first_line

if TYPE_CHECKING:
    from specdec_cli.batch.loop import Outcome
    from specdec_cli.engine import DraftLengthPolicy, GenerationResult, SamplingParams, SpeculativeDecoder
    from specdec_cli.engine.batched import BatchedDecoder
    from specdec_cli.session import StopStrings
    from specdec_cli.settings import DecodingSettings, ModelChoice, Printer


class GenerationError(SpecdecError):
    """One request failed inside the model's generation; it becomes that request's error record."""


class ModelGeneration:
    """Runs one request through the speculative decoder (a `GenerateOne`)."""

    def __init__(self, tokenizer, decoder: SpeculativeDecoder, settings: DecodingSettings,
                 sampled_policy: DraftLengthPolicy | None = None) -> None:
        self.tokenizer = tokenizer
        self.decoder = decoder
        self.settings = settings
        self.greedy_policy = decoder.policy
        self.sampled_policy = sampled_policy or decoder.policy

    @classmethod
    def load(cls, choice: ModelChoice, settings: DecodingSettings, console: Printer | None = None) -> ModelGeneration:
        """Load the chosen pair (`on`)."""
        from specdec_cli.settings import load_choice

        target, draft = load_choice(choice, console)
        return cls.on(target, draft, choice.drafter, settings)

    @classmethod
    def on(cls, target, draft, drafter: str, settings: DecodingSettings) -> ModelGeneration:
        """One request at a time on the loaded pair; k = auto never reads the clock here, so the same input gives
        the same file. A greedy request drafts as this machine's calibrated costs say (its tokens are the target's
        whatever is drafted); a sampled one as far as the draft's odds say, which no machine's costs change, so
        its record is the same on every machine and Ray worker (the drafts decide which draws it takes)."""
        from specdec_cli.session import build_decoder, make_policy

        decoder = build_decoder(target, draft, drafter, settings.k, clock_free=True)
        sampled = make_policy(settings.k, clock_free=True) if decoder.drafter is not None else None
        return cls(target.tokenizer, decoder, settings, sampled)

    def __call__(self, request: Request) -> Completion:
        prompt_ids, params, stops, max_new_tokens = prepare(self.tokenizer, request, self.settings)
        # Each request starts from nothing (no learned draft length, no cache but a row-wise target's entries,
        # which give a shared prefix bit for bit as computing it would), so its output depends on it alone:
        # resuming, --limit or reordering the file never changes a record.
        policy = self.greedy_policy if params.greedy else self.sampled_policy
        if policy is not self.decoder.policy:
            self.decoder.set_drafting(self.decoder.drafter, policy)
        self.decoder.reset()
        try:
            result = self.decoder.generate(prompt_ids, params, max_new_tokens, stop=stops if stops.stops else None)
        except (RuntimeError, ValueError, IndexError, MemoryError) as error:
            # A request the model cannot run (out of memory, a kernel that refuses an input) fails alone:
            # its record says why and the batch goes on. The decoder is reset before the next request.
            raise generation_failed(error) from error
        return completion_of(self.tokenizer, result, stops, len(prompt_ids))


class BatchedGeneration:
    """A `Stream` on the batched engine: up to B requests decoded together, a finished one replaced by the
    next at once (continuous batching). Outcomes come back in input order, each as soon as it and every
    request before it are done; a request's seconds are its own, from its admission to its last token."""

    def __init__(self, tokenizer, decoder: BatchedDecoder, settings: DecodingSettings) -> None:
        self.tokenizer = tokenizer
        self.decoder = decoder
        self.settings = settings

    @classmethod
    def load(cls, choice: ModelChoice, settings: DecodingSettings, batch_size: int | str,
             console: Printer | None = None, requests: int | None = None) -> BatchedGeneration | ModelGeneration:
        """The pair loaded and the batch size chosen (auto: `batch_size_for` the target's forward-cost curve),
        never more than `requests`, all the job holds (counted in the whole input, done or not, so a resumed
        job takes the same size: each row's k is priced for a batch of that many rows); ModelGeneration (one
        at a time) when that is 1 or the models cannot take a packed batch."""
        from specdec_cli.session import batch_size_for, batched_note, build_batched_decoder, forward_curve
        from specdec_cli.settings import load_choice

        target, draft = load_choice(choice, console)
        note = batched_note(target, draft, choice.drafter)
        curve = forward_curve(target)
        size = 1 if note else (batch_size_for(curve) if batch_size == "auto" else int(batch_size))
        why = _why(note, batch_size, curve)
        if requests is not None and 1 <= requests < size:
            size, why = requests, f" (all the input holds, fewer than {size})"
        if console is not None:
            console.print(f"batch: {size} request{'s' if size > 1 else ''} at a time{why}", markup=False)
        if size == 1:
            return ModelGeneration.on(target, draft, choice.drafter, settings)
        decoder = build_batched_decoder(target, draft, choice.drafter, settings.k, size, curve)
        return cls(target.tokenizer, decoder, settings)

    def __call__(self, runnable: Sequence[Request]) -> Iterator[Outcome]:
        from specdec_cli.engine.batched import RowRequest

        prepared: dict[int, tuple] = {}
        outcomes: dict[int, Outcome] = {}
        for position, request in enumerate(runnable):
            try:
                prepared[position] = prepare(self.tokenizer, request, self.settings)
            except SpecdecError as error:
                outcomes[position] = (error, 0.0)
        positions = list(prepared)
        rows = (RowRequest(prompt_ids, params, max_new_tokens, stops if stops.stops else None)
                for prompt_ids, params, stops, max_new_tokens in prepared.values())
        following = 0
        for row, result in self.decoder.stream(rows):
            position = positions[row]
            outcomes[position] = self._outcome(result, prepared[position])
            while following in outcomes:
                yield outcomes.pop(following)
                following += 1
        while following in outcomes:  # requests that failed before decoding, after the last decoded one
            yield outcomes.pop(following)
            following += 1

    def _outcome(self, result: GenerationResult | Exception, prepared: tuple) -> Outcome:
        if isinstance(result, SpecdecError):
            return result, 0.0
        if isinstance(result, Exception):
            return generation_failed(result), 0.0
        prompt_ids, _params, stops, _budget = prepared
        return completion_of(self.tokenizer, result, stops, len(prompt_ids)), result.stats.seconds


def prepare(tokenizer, request: Request, settings: DecodingSettings) -> tuple[list[int], SamplingParams, StopStrings, int]:
    """A request's prompt ids, sampling parameters (its own, else the run's), stop strings and token budget."""
    from specdec_cli.session import StopStrings
    from specdec_cli.settings import sampling_params

    params = sampling_params(
        _given(request.temperature, settings.temperature),
        _given(request.top_p, settings.top_p),
        _given(request.top_k, settings.top_k),
        _given(request.seed, settings.seed),
    )
    stops = StopStrings(tokenizer, request.stop)
    return _encode(tokenizer, request, settings), params, stops, _given(request.max_new_tokens, settings.max_new_tokens)


def completion_of(tokenizer, result: GenerationResult, stops: StopStrings, prompt_tokens: int) -> Completion:
    text = stops.cut(tokenizer.decode(result.tokens, skip_special_tokens=True))
    return Completion.of(text, result.finish_reason, prompt_tokens, result.stats, result.budget.note() or None)


def generation_failed(error: Exception) -> GenerationError:
    return GenerationError(
        f"generation failed ({type(error).__name__}: {first_line(error)})",
        "the other records go on; if this looks like a bug in specdec, please report it with this line",
    )


def _encode(tokenizer, request: Request, settings: DecodingSettings) -> list[int]:
    """The request's ids; --system (or the profile's) is added where the messages have none, and opens the first user
    message where the template has no system role. A system message the line holds stays as written."""
    from specdec_cli.session import encode_chat, encode_completion, encode_folding_system

    if not request.chat:
        return encode_completion(tokenizer, request.prompt)
    messages = list(request.messages)
    template = {"add_generation_prompt": request.generation_prompt, "continue_final_message": request.continue_final}
    if settings.system and messages[0]["role"] != "system":
        return encode_folding_system(tokenizer, [{"role": "system", "content": settings.system}, *messages],
                                     **template)[0]
    return encode_chat(tokenizer, messages, **template)


def _why(note: str | None, batch_size: int | str, curve: dict | None) -> str:
    if note:
        return f" ({note})"
    if batch_size != "auto":
        return ""
    if curve:
        return " (chosen from the target's forward costs that specdec calibrate measured here)"
    return " (the default; after `specdec calibrate` this machine's forward costs choose it)"


def _given(value, default):
    return default if value is None else value
