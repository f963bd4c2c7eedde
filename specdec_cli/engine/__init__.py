"""The speculative decoding engine: pure token ids in and out (no text, no Rich, no files)."""

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
    "AdaptiveK", "CachedModel", "CostModelK", "DraftLengthPolicy", "DraftOrNot", "FixedK", "GenerationResult", "GenerationStats",
    "Provenance", "SamplingParams", "SpeculativeDecoder", "StepEvent", "expected_tokens", "logits_to_probs", "make_generator",
]
