"""The speculative decoding engine: pure token ids in and out (no text, no Rich, no files).

Names load on first use (PEP 562), so that `specdec_cli.engine.stats`, `.events` and `.draft`, which need
no torch, can be imported without loading torch."""

from importlib import import_module

_HOMES = {
    "context": ("Budget", "context_length", "fit_budget"),
    "decode": ("GenerationResult", "SpeculativeDecoder", "cut_at_eos"),
    "draft": ("EMPTY_DRAFT", "Draft", "DraftRule", "Drafter"),
    "events": ("Provenance", "StepEvent"),
    "kv": ("CachedModel",),
    "policy": ("AdaptiveK", "CalibratedDraftOrNot", "CostModelK", "DraftLengthPolicy", "DraftOrNot", "FixedK",
               "expected_tokens"),
    "sampling": ("SamplingParams", "logits_to_probs", "make_generator"),
    "stats": ("GenerationStats",),
}
_MODULE_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
