"""Attention that computes each query row on its own, exactly as a one-token forward would.

Why: verifying k tokens in one forward must give what k one-token forwards give. The int8 layers do
(exact integer sums, a scale per token), but SDPA over k query rows sums in another order than over
one, and int8 activations turn that last-bit difference into whole quantisation steps, layer after
layer, until row i of a k-token forward is visibly off from the one-token forward of token i, and
speculative greedy output leaves the target's own at near-ties. With each row attended alone, over
the same cached keys a one-token forward would see, the forward of row i is the same arithmetic either
way, so the logits are bit-identical and speculation reproduces the quantised target token for token.

In float32 with the native library loaded the rows go to one C call (native/attention.c). Otherwise the
cost is k SDPA calls per layer instead of one, and a copy of the keys each row sees, which a long verify
feels and a short one hardly does. Batch size 1 only (the engine's); other batches, or masks that are not
boolean, fall back to transformers' SDPA. A token tree's 4D mask comes boolean (engine/kv.py makes the
form the attention's mask builder, sdpa_mask, makes), so each node attends to exactly the keys that
one-token decoding along its path would see, in the same order: a tree verify is bit-identical too.
Gemma 2 soft-caps its scores (tanh(s / cap) · cap), which SDPA does not: the C attention does it (its tanh from
exp_avx2), and where C does not run its rows are computed in torch as transformers' eager attention computes them,
each row on its own."""

from __future__ import annotations

import torch

from specdec_cli.models.native import binding

NAME = "specdec_rowwise"


def _visible_keys(attention_mask: torch.Tensor | None, row: int, rows: int, keys: int) -> slice | torch.Tensor:
    """The key positions query `row` (of `rows`) may attend to: a prefix slice, or indices (a tree mask)."""
    if attention_mask is None:  # causal, skipped by the mask builder: the cache plus the rows up to this one
        return slice(0, keys - rows + row + 1)
    allowed = attention_mask[0, 0, row, -keys:].nonzero().flatten()  # (n,)
    if len(allowed) and int(allowed[-1]) == len(allowed) - 1:
        return slice(0, len(allowed))
    return allowed


class _LastMask:
    """Every layer of a forward gets the same mask tensor: its rows' visible keys are worked out once (for a
    packed batch of 16 rows that is 16 nonzero() calls per forward instead of 16 per layer)."""

    mask: torch.Tensor | None = None
    visible: list = []

    bytes_mask: torch.Tensor | None = None
    bytes_of: torch.Tensor | None = None

    @classmethod
    def visible_bytes(cls, attention_mask: torch.Tensor, keys: int) -> torch.Tensor:
        """(rows, keys) uint8, nonzero where a row may attend: the mask's last `keys` columns, once per mask."""
        if attention_mask is not cls.bytes_of or cls.bytes_mask is None or cls.bytes_mask.shape[1] != keys:
            cls.bytes_mask = attention_mask[0, 0, :, -keys:].to(torch.uint8).contiguous()
            cls.bytes_of = attention_mask
        return cls.bytes_mask

    @classmethod
    def visible_keys(cls, attention_mask: torch.Tensor | None, rows: int, keys: int) -> list:
        if attention_mask is None or attention_mask is not cls.mask or len(cls.visible) != rows:
            cls.visible = [_visible_keys(attention_mask, row, rows, keys) for row in range(rows)]
            cls.mask = attention_mask
        return cls.visible


def rowwise_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query (1, heads, rows, dim); key, value (1, kv_heads, keys, dim); mask (1, 1, rows, keys) bool or None.
    Returns ((1, rows, heads, dim), None), as transformers' attention functions do. A one-token forward
    takes the same path (rows = 1), so its arithmetic is the same call as a verify row's."""
    if query.shape[0] != 1 or (attention_mask is not None and attention_mask.dtype != torch.bool):
        if kwargs.get("softcap") is not None:  # SDPA has none
            return _softcapped(query, key, value, attention_mask, scaling, kwargs["softcap"]), None
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    library, _, problem = binding.library()
    softcap = kwargs.get("softcap")
    if problem is None and query.dtype == key.dtype == value.dtype == torch.float32:
        return _attention_in_c(library, query, key, value, attention_mask, scaling, softcap or 0.0), None
    rows, keys = query.shape[2], key.shape[2]
    if softcap is not None:
        return _softcapped_rows(query, key, value, _LastMask.visible_keys(attention_mask, rows, keys), scaling,
                                softcap), None
    outputs = []
    for row, visible in enumerate(_LastMask.visible_keys(attention_mask, rows, keys)):
        # contiguous, as a cache holds them in a one-token forward (a no-op for a whole contiguous cache)
        row_key, row_value = key[:, :, visible].contiguous(), value[:, :, visible].contiguous()
        outputs.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, row : row + 1], row_key, row_value, dropout_p=dropout, scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        ))  # (1, heads, 1, dim)
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def _softcapped_rows(query, key, value, visible_keys: list, scaling: float | None, softcap: float) -> torch.Tensor:
    """Gemma 2's attention, each row on its own: scores·scaling soft-capped (tanh(s / cap) · cap, as transformers'
    eager attention does; SDPA and the C attention have no soft-capping), softmax in float32, then the values.
    query (1, heads, rows, dim); key, value (1, kv heads, keys, dim) → (1, rows, heads, dim)."""
    scaling = query.shape[3] ** -0.5 if scaling is None else scaling
    groups = query.shape[1] // key.shape[1]
    outputs = []
    for row, visible in enumerate(visible_keys):
        row_key = key[0, :, visible].repeat_interleave(groups, dim=0)  # (heads, n, dim)
        row_value = value[0, :, visible].repeat_interleave(groups, dim=0)
        scores = torch.matmul(query[0, :, row:row + 1], row_key.transpose(1, 2)) * scaling  # (heads, 1, n)
        scores = torch.tanh(scores / softcap) * softcap
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        outputs.append(torch.matmul(weights, row_value))  # (heads, 1, dim)
    return torch.cat(outputs, dim=1).unsqueeze(0).transpose(1, 2).contiguous()


def _softcapped(query, key, value, attention_mask, scaling: float | None, softcap: float) -> torch.Tensor:
    """Soft-capped attention of a whole batch as transformers' eager attention computes it, under a boolean or
    additive mask (or none: causal). query (B, heads, T, dim); key, value (B, kv heads, keys, dim) → (B, T, heads,
    dim)."""
    scaling = query.shape[3] ** -0.5 if scaling is None else scaling
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, heads, T, keys)
    scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is None:
        rows, keys = scores.shape[-2:]
        attention_mask = torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows)
    if attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + attention_mask[..., -scores.shape[-1]:]
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous()


def _attention_in_c(library, query, key, value, attention_mask, scaling, softcap: float = 0.0) -> torch.Tensor:
    """The same rows, all in one call into C (native/attention.c: specdec_attention), reading the keys in place (a
    cache layer's view into its buffer too), where the torch way makes k SDPA calls and a copy of the keys for
    every row but the last."""
    queries = query[0].transpose(0, 1).contiguous()  # (rows, heads, dim)
    scaling = query.shape[3] ** -0.5 if scaling is None else scaling
    out = attend_rows(library, queries, key, value, attention_mask, scaling, softcap)  # (rows, heads, dim)
    return out.unsqueeze(0)


def attend_rows(library, queries: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, scaling: float, softcap: float = 0.0) -> torch.Tensor:
    """queries (rows, heads, dim) over key, value (1, kv heads, keys, dim) → (rows, heads, dim), in C; softcap > 0:
    Gemma 2's soft-capped scores."""
    rows, heads, dim = queries.shape
    key, value = _rows_in_place(key[0]), _rows_in_place(value[0])  # (kv heads, keys, dim)
    if key.stride(0) != value.stride(0):
        key, value = key.contiguous(), value.contiguous()
    keys = key.shape[1]
    visible = None if attention_mask is None else _LastMask.visible_bytes(attention_mask, keys)
    out = torch.empty(rows, heads, dim, dtype=torch.float32)
    failed = library.specdec_attention(torch.get_num_threads(), queries.data_ptr(), key.data_ptr(), value.data_ptr(),
                                       None if visible is None else visible.data_ptr(), rows, heads, key.shape[0],
                                       keys, dim, key.stride(0), scaling, softcap, out.data_ptr())
    if failed:
        raise MemoryError(f"specdec's attention could not allocate its buffer for {keys} keys")
    return out


def _rows_in_place(states: torch.Tensor) -> torch.Tensor:
    """(kv heads, keys, dim) whose (keys, dim) rows are contiguous, heads any stride apart: as it is, else a copy."""
    if states.stride(2) == 1 and (states.stride(1) == states.shape[2] or states.shape[1] == 1):
        return states
    return states.contiguous()


def use_rowwise_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Register the row-wise attention with transformers (once) and switch `model` to it, in place."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, rowwise_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # the masks SDPA gets: boolean, None when causal
    model.set_attn_implementation(NAME)
    return model
