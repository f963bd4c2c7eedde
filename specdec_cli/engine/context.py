"""The context window: how many positions the models take, and what a prompt leaves of a token budget.

Checked before any forward: a prompt past the context would otherwise run (silently wrong past the
trained positions, or for minutes in attention) before anything failed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec_cli.errors import PromptTooLongError

# Config attributes that hold a model's context length, by family (llama/qwen/mistral, gpt2, bloom/...).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def context_length(model: torch.nn.Module) -> int | None:
    """The positions `model` takes, from its config; None when the config names no limit."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in CONTEXT_KEYS:
        value = getattr(text_config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def smallest_context(*contexts: int | None) -> int | None:
    """The tightest of several limits (None: no limit)."""
    limits = [context for context in contexts if context is not None]
    return min(limits) if limits else None


@dataclass(frozen=True)
class Budget:
    """The new tokens a prompt may have: what was asked, cut to what the context leaves."""

    max_new_tokens: int  # what fits
    asked: int
    prompt_tokens: int
    context: int | None

    @property
    def cut(self) -> bool:
        return self.max_new_tokens < self.asked

    def note(self) -> str:
        """Why the budget is smaller than asked ("" when it is not)."""
        if not self.cut:
            return ""
        return (f"max_new_tokens cut from {self.asked} to {self.max_new_tokens}: the prompt's {self.prompt_tokens} "
                f"tokens leave no more of the model's {self.context}-token context")


def fit_budget(prompt_tokens: int, max_new_tokens: int, context: int | None) -> Budget:
    """The budget a prompt of `prompt_tokens` leaves; PromptTooLongError when not even one new token fits."""
    if context is None:
        return Budget(max_new_tokens, max_new_tokens, prompt_tokens, None)
    room = context - prompt_tokens
    if room < 1:
        raise PromptTooLongError(prompt_tokens, context)
    return Budget(min(max_new_tokens, room), max_new_tokens, prompt_tokens, context)
