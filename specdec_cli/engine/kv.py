"""A causal LM together with its KV cache and the token ids that cache holds.

Every forward goes through `CachedModel.extend(ids, n_logits)`: the cache is cut back to the longest
prefix it shares with `ids` and only the rest is fed. That one rule covers prefill, verification,
rollback after a rejection (the rejected drafts fall outside the shared prefix), the bonus token that
the draft model has not seen yet, and a new chat turn that re-uses the whole conversation so far.

`keep(positions)` keeps an arbitrary subset of cached positions (index select along the sequence
axis). Speculation over a token tree needs it to compact the accepted branch's entries.

Caches are transformers 5.x `DynamicCache` objects; their layers hold `keys` / `values` tensors shaped
(batch, kv_heads, seq, head_dim)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache


class CachedModel:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.cache = DynamicCache(config=model.config)
        self.ids: list[int] = []  # the tokens whose keys/values the cache holds, in order
        self.forwards = 0  # forward passes run, for stats and tests

    def __len__(self) -> int:
        return len(self.ids)

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.ids = []

    def shared_prefix(self, ids: Sequence[int]) -> int:
        """Length of the longest common prefix of the cached ids and `ids`."""
        cached = self.ids
        limit = min(len(cached), len(ids))
        if list(ids[:limit]) == cached[:limit]:  # the usual case, compared in C
            return limit
        for position in range(limit):
            if cached[position] != ids[position]:
                return position
        return limit

    def crop(self, length: int) -> None:
        """Drop every cached position from `length` on."""
        if length < len(self.ids):
            self._truncate_layers(length)

    def keep(self, positions: Sequence[int]) -> None:
        """Keep only the cached entries at `positions` (ascending), in that order."""
        index = torch.tensor(list(positions), dtype=torch.long, device=self.device)
        for layer in self._layers():
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)
        self.ids = [self.ids[p] for p in positions]

    @torch.inference_mode()
    def extend(self, ids: Sequence[int], n_logits: int = 1) -> torch.Tensor:
        """Make the cache hold `ids` and return the logits of its last `n_logits` positions:
        (n_logits, V), row i scoring the token that follows ids[: len(ids) - n_logits + i + 1]."""
        if not 1 <= n_logits <= len(ids):
            raise ValueError(f"need 1 <= n_logits <= len(ids), got {n_logits} for {len(ids)} ids")
        start = min(self.shared_prefix(ids), len(ids) - n_logits)
        self.crop(start)
        new_ids = torch.tensor([list(ids[start:])], dtype=torch.long, device=self.device)  # (1, T)
        try:
            output = self.model(
                input_ids=new_ids, cache=self.cache, use_cache=True, logits_to_keep=n_logits
            )
            self.ids.extend(ids[start:])
        except BaseException:
            # An interrupted forward (Ctrl-C) may have appended to some layers only.
            self._truncate_layers(start)
            raise
        self.forwards += 1
        return output.logits[0, -n_logits:]  # (n_logits, V)

    def _layers(self) -> list:
        return [layer for layer in self.cache.layers if getattr(layer, "keys", None) is not None
                and layer.keys.numel()]

    def _truncate_layers(self, length: int) -> None:
        for layer in self._layers():
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]
        del self.ids[length:]
