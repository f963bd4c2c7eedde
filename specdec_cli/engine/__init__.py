"""The speculative decoding engine: pure token ids in and out (no text, no Rich, no files)."""

from specdec_cli.engine.decode import (
    GenerationResult,
    GenerationStats,
    Provenance,
    SpeculativeDecoder,
    StepEvent,
)
from specdec_cli.engine.kv import CachedModel
from specdec_cli.engine.policy import AdaptiveK, DraftLengthPolicy, FixedK
from specdec_cli.engine.sampling import SamplingParams, logits_to_probs, make_generator

__all__ = [
    "AdaptiveK", "CachedModel", "DraftLengthPolicy", "FixedK", "GenerationResult", "GenerationStats",
    "Provenance", "SamplingParams", "SpeculativeDecoder", "StepEvent", "logits_to_probs", "make_generator",
]
