"""Attention that computes each query row on its own, exactly as a one-token forward would.

Why: verifying k tokens in one forward must give what k one-token forwards give. The int8 layers do
(exact integer sums, a scale per token), but SDPA over k query rows sums in another order than over
one, and int8 activations turn that 1e-6 into whole quantisation steps, layer after layer: on the
1.5B demo target, row i of an 8-token forward was ~1 logit away from the one-token forward of token i,
and speculative greedy output left the target's own at near-ties. With each row attended alone, over
the same cached keys a one-token forward would see, the forward of row i is the same arithmetic either
way, so the logits are bit-identical and speculation reproduces the quantised target token for token.

Cost: k SDPA calls per layer instead of one (attention is a small part of a CPU forward at short
contexts). Batch size 1 only (the engine's); other batches, or masks that are not boolean, fall back
to transformers' SDPA."""

from __future__ import annotations

import torch

NAME = "specdec_rowwise"


def _visible_keys(attention_mask: torch.Tensor | None, row: int, rows: int, keys: int) -> slice | torch.Tensor:
    """The key positions query `row` (of `rows`) may attend to: a prefix slice, or indices (a tree mask)."""
    if attention_mask is None:  # causal, skipped by the mask builder: the cache plus the rows up to this one
        return slice(0, keys - rows + row + 1)
    allowed = attention_mask[0, 0, row, -keys:].nonzero().flatten()  # (n,)
    if len(allowed) and int(allowed[-1]) == len(allowed) - 1:
        return slice(0, len(allowed))
    return allowed


def rowwise_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query (1, heads, rows, dim); key, value (1, kv_heads, keys, dim); mask (1, 1, rows, keys) bool or None.
    Returns ((1, rows, heads, dim), None), as transformers' attention functions do."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[0] != 1 or (attention_mask is not None and attention_mask.dtype != torch.bool):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    rows, keys = query.shape[2], key.shape[2]
    outputs = []
    for row in range(rows):
        visible = _visible_keys(attention_mask, row, rows, keys)
        # contiguous, as the cache holds them in a one-token forward (a no-op for a whole contiguous cache)
        row_key, row_value = key[:, :, visible].contiguous(), value[:, :, visible].contiguous()
        output, _ = sdpa_attention_forward(module, query[:, :, row : row + 1], row_key, row_value, None, dropout,
                                           scaling, is_causal=False, **kwargs)
        outputs.append(output)  # (1, 1, heads, dim)
    return torch.cat(outputs, dim=1), None


def use_rowwise_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Register the row-wise attention with transformers (once) and switch `model` to it, in place."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, rowwise_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # the masks SDPA gets: boolean, None when causal
    model.set_attn_implementation(NAME)
    return model
