"""The speculative decoding engine: pure token ids in and out (no text, no Rich, no files)."""

from specdec_cli.engine.context import Budget, context_length, fit_budget
from specdec_cli.engine.decode import (
    GenerationResult,
    GenerationStats,
    Provenance,
    SpeculativeDecoder,
    StepEvent,
)
from specdec_cli.engine.kv import CachedModel
from specdec_cli.engine.policy import AdaptiveK, CostModelK, DraftLengthPolicy, DraftOrNot, FixedK, expected_tokens
from specdec_cli.engine.sampling import SamplingParams, logits_to_probs, make_generator

__all__ = [
    "AdaptiveK", "Budget", "CachedModel", "CostModelK", "DraftLengthPolicy", "DraftOrNot", "FixedK", "GenerationResult", "GenerationStats",
    "Provenance", "SamplingParams", "SpeculativeDecoder", "StepEvent", "context_length", "expected_tokens", "fit_budget", "logits_to_probs", "make_generator",
]
