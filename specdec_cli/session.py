"""Glue between loaded models and the engine, shared by chat, run and compare: the drafter and
draft-length policy for a drafter name and k, EOS ids, prompt encoding, and stop strings.

The engine sees token ids only; everything that touches text lives here or above. Settings (which
models, which k, which sampling) are chosen in `settings.py`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdec_cli.drafters import CascadeDrafter, DraftModelDrafter, NgramDrafter
from specdec_cli.engine import DraftLengthPolicy, DraftOrNot, FixedK, SpeculativeDecoder
from specdec_cli.engine.draft import DraftRule, Drafter
from specdec_cli.errors import InputError
from specdec_cli.models import LoadedModel
from specdec_cli.models.calibrate import calibrated_seconds
from specdec_cli.profiles import DRAFTERS, MAX_K

# End-of-turn tokens that chat templates close an assistant turn with. Some checkpoints (GGUF
# conversions especially) list only one of them as EOS; generation must stop at any.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>")

# k = auto: draft up to AUTO_MAX_K tokens, stopping once the draft's own odds that its whole draft survives
# (the product of its probabilities) fall below AUTO_SURVIVAL; the cost model decides whether to draft at all.
# What these values measured lives in README / benchmarks, not here.
AUTO_MAX_K = 20
AUTO_SURVIVAL = 0.3


def draft_rule(k: int | str) -> DraftRule:
    """auto: the draft model stops on its own odds; a fixed k drafts exactly k."""
    return DraftRule(min_survival=AUTO_SURVIVAL if k == "auto" else 0.0)


def make_policy(k: int | str, clock_free: bool = False, verify_curve: dict[int, float] | None = None) -> DraftLengthPolicy:
    """auto: the cost model says whether to draft (0 when drafting does not pay; up to AUTO_MAX_K when it
    does, the draft model stopping on its own odds); a number: always that many. The policy carries the
    drafter's stop rule (`draft_rule`).

    clock_free: decisions that never read the clock, for `run`'s promise that the same input and seed give
    the same file — the cost model's timings differ from run to run, and with them which tokens are
    drafted, which changes the random draws of sampling (the distribution stays exact, the sample not).
    auto then always drafts up to AUTO_MAX_K and the odds cut alone decides how far, without the
    fallback to plain decoding.

    verify_curve: the target's calibrated forward seconds per token count on this machine (`specdec
    calibrate`), which the cost model scales by the run's timings; None: it learns the curve from the run."""
    rule = draft_rule(k)
    if k != "auto":
        return FixedK(int(k), rule)
    if clock_free:
        return FixedK(AUTO_MAX_K, rule)
    return DraftOrNot(max_k=AUTO_MAX_K, rule=rule, verify_curve=verify_curve)


def make_drafter(drafter: str, draft: LoadedModel | None, k: int | str = "auto") -> Drafter | None:
    """model: the draft model; ngram: prompt lookup; cascade: prompt lookup when it matches, else
    the draft model; none: the target alone. It obeys k's stop rule (`draft_rule`) from the start."""
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
    chosen.obey(draft_rule(k))
    return chosen


def eos_token_ids(model: LoadedModel) -> tuple[int, ...]:
    vocab = model.tokenizer.get_vocab()
    extra = (vocab[token] for token in END_OF_TURN_TOKENS if token in vocab)
    return tuple(sorted(set(model.eos_token_ids) | set(extra)))


def build_decoder(
    target: LoadedModel, draft: LoadedModel | None, drafter: str, k: int | str, clock_free: bool = False
) -> SpeculativeDecoder:
    """drafter: "model", "ngram", "cascade" or "none" (the target alone); k: an int or "auto" (see
    make_policy). The policy's rule binds the drafter (`SpeculativeDecoder.set_drafting`)."""
    chosen = make_drafter(drafter, draft, k) if k != 0 else None
    policy = make_policy(k, clock_free, verify_curve(target)) if chosen else FixedK(0)
    return SpeculativeDecoder(target.model, chosen, policy, eos_token_ids(target))


def verify_curve(target: LoadedModel) -> dict[int, float] | None:
    """What `specdec calibrate` measured on this machine for the target as loaded (None: not measured)."""
    return calibrated_seconds(target.name, target.quantization, str(target.dtype).removeprefix("torch."))


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
