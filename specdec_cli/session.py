"""Glue between loaded models and the engine, shared by chat, run and compare: the drafter and
draft-length policy named on the command line, EOS ids, prompt encoding, and stop strings.

The engine sees token ids only; everything that touches text lives here or above."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdec_cli.drafters import CascadeDrafter, DraftModelDrafter, Drafter, NgramDrafter
from specdec_cli.engine import DraftLengthPolicy, DraftOrNot, FixedK, SamplingParams, SpeculativeDecoder
from specdec_cli.errors import InputError
from specdec_cli.models import LoadedModel
from specdec_cli.profiles import DRAFTERS, MAX_K

# End-of-turn tokens that chat templates close an assistant turn with. Some checkpoints (GGUF
# conversions especially) list only one of them as EOS; generation must stop at any.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>")

# k = auto: draft up to AUTO_MAX_K tokens, stopping once the draft's own odds that its whole draft survives
# (the product of its probabilities) fall below AUTO_SURVIVAL; the cost model decides whether to draft at all.
# On the demo pair a cut anywhere in 0.2-0.4 measured within noise (x1.96-x2.01).
AUTO_MAX_K = 20
AUTO_SURVIVAL = 0.3


def parse_k(value: str | int) -> int | str:
    """`auto` or a draft length 0..16 (0 = the target alone)."""
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    if text.isdigit() and int(text) <= MAX_K:
        return int(text)
    raise InputError(f"invalid draft length {value!r}", f"use a number from 0 to {MAX_K}, or auto")


def make_policy(k: int | str, clock_free: bool = False) -> DraftLengthPolicy:
    """auto: the cost model says whether to draft (0 when drafting does not pay; up to AUTO_MAX_K when it
    does, the draft model stopping on its own odds); a number: always that many.

    clock_free: decisions that never read the clock, for `run`'s promise that the same input and seed give
    the same file — the cost model's timings differ from run to run, and with them which tokens are
    drafted, which changes the random draws of sampling (the distribution stays exact, the sample not).
    auto then always drafts up to AUTO_MAX_K and the odds cut alone decides how far (as fast on the demo
    pair: x1.98 vs x1.96), without the fallback to plain decoding."""
    if k != "auto":
        return FixedK(int(k))
    return FixedK(AUTO_MAX_K) if clock_free else DraftOrNot(max_k=AUTO_MAX_K)


def make_drafter(drafter: str, draft: LoadedModel | None, k: int | str = "auto") -> Drafter | None:
    """model: the draft model; ngram: prompt lookup; cascade: prompt lookup when it matches, else
    the draft model; none: the target alone. With k = auto the draft model stops drafting once its
    odds fall below AUTO_SURVIVAL; a fixed k drafts exactly k."""
    if drafter == "none":
        return None
    if drafter == "ngram":
        return NgramDrafter()
    if drafter not in DRAFTERS:
        raise InputError(f"unknown drafter {drafter!r}", f"use one of: {', '.join(DRAFTERS)}")
    if draft is None:
        raise InputError(f"the {drafter} drafter needs a draft model", "pass --draft NAME, or --drafter ngram")
    model_drafter = DraftModelDrafter(draft.model)
    chosen = CascadeDrafter(model_drafter) if drafter == "cascade" else model_drafter
    fit_drafter_to_k(chosen, k)
    return chosen


def fit_drafter_to_k(drafter: Drafter, k: int | str) -> None:
    """Turn the draft model's odds cut on for k = auto, off for a fixed k (which drafts exactly k).
    In place: the draft model's cache survives a change of k in chat."""
    model_drafter = getattr(drafter, "model_drafter", drafter)
    if isinstance(model_drafter, DraftModelDrafter):
        model_drafter.min_survival = AUTO_SURVIVAL if k == "auto" else 0.0


def eos_token_ids(model: LoadedModel) -> tuple[int, ...]:
    vocab = model.tokenizer.get_vocab()
    extra = (vocab[token] for token in END_OF_TURN_TOKENS if token in vocab)
    return tuple(sorted(set(model.eos_token_ids) | set(extra)))


def build_decoder(
    target: LoadedModel, draft: LoadedModel | None, drafter: str, k: int | str, clock_free: bool = False
) -> SpeculativeDecoder:
    """drafter: "model", "ngram" or "none" (the target alone); k: an int or "auto" (see make_policy)."""
    chosen = make_drafter(drafter, draft, k) if k != 0 else None
    policy = make_policy(k, clock_free) if chosen else FixedK(0)
    return SpeculativeDecoder(target.model, chosen, policy, eos_token_ids(target))


def sampling_params(temperature: float, top_p: float, top_k: int, seed: int | None) -> SamplingParams:
    try:
        return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    except ValueError as error:
        raise InputError(str(error), "fix the sampling option") from None


def encode_chat(tokenizer, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation through the model's own chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise InputError("this model has no chat template", "give a raw prompt instead of messages")
    ids = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def encode_completion(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if not ids:
        raise InputError("the prompt is empty", "give at least one character of prompt")
    return list(ids)


@dataclass
class StopStrings:
    """A stop callback for the engine: True once the decoded output contains any stop string.
    `cut(text)` then removes the stop string and what follows (as OpenAI's API does)."""

    tokenizer: object
    stops: tuple[str, ...]

    def __call__(self, generated: list[int]) -> bool:
        if not self.stops:
            return False
        # Only the tail can hold a new match: decode enough tokens to cover the longest stop string.
        tail = self.tokenizer.decode(generated[-(max(map(len, self.stops)) + 8):], skip_special_tokens=False)
        return any(stop in tail for stop in self.stops)

    def cut(self, text: str) -> str:
        positions = [text.find(stop) for stop in self.stops if stop in text]
        return text[: min(positions)] if positions else text
