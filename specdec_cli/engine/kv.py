"""A causal LM together with its KV cache and the token ids that cache holds.

Every forward goes through `CachedModel.extend(ids, n_logits)`: the cache is cut back to the longest
prefix it shares with `ids` and only the rest is fed. That one rule covers prefill, verification,
rollback after a rejection (the rejected drafts fall outside the shared prefix), the bonus token that
the draft model has not seen yet, and a new chat turn that re-uses the whole conversation so far.

A long prompt is fed in chunks of `prefill_chunk` tokens, one forward each: Ctrl-C (raised between
Python steps, never inside one torch op) then waits for one op over at most a chunk's queries, never
an attention op over the whole prompt, and no (prompt x prompt) score matrix is ever held. Chunking
changes no result: each chunk attends to the cache of the chunks before it, as one forward would.

`keep(positions)` keeps an arbitrary subset of cached positions (index select along the sequence
axis). Speculation over a token tree needs it to compact the accepted branch's entries.

Caches are transformers 5.x `DynamicCache` objects; their layers hold `keys` / `values` tensors shaped
(batch, kv_heads, seq, head_dim)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

# Tokens per prefill forward. Ctrl-C lands between torch ops, so what matters is the longest op: with
# 512-token chunks no op has more than 512 query rows, however long the prompt (up to the context).
# Measured on the demo target (bf16, 2 CPU cores, under heavy load from other processes, so only
# roughly): Ctrl-C during an 8,192-token prefill was honoured 0.02 s after the signal; a 1,024-token
# prefill took 49 s in 512-token chunks, 43 s in 256-token ones, 36 s in one forward; 64-token chunks
# made a 512-token prefill 3x slower than one forward, so much smaller chunks cost too much on a CPU.
# Verification (k + 1 <= 21 tokens) always fits in one forward.
PREFILL_CHUNK = 512


class CachedModel:
    def __init__(self, model: torch.nn.Module, prefill_chunk: int | None = None) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.prefill_chunk = prefill_chunk or PREFILL_CHUNK
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
        # Every chunk but the last is fed for its cache entries only; the last holds the n_logits positions.
        while (unfed := len(ids) - len(self.ids)) > self.prefill_chunk and unfed > n_logits:
            fed = len(self.ids)
            self._forward(ids[fed: fed + min(self.prefill_chunk, unfed - n_logits)], 1)
        return self._forward(ids[len(self.ids):], n_logits)

    def _forward(self, new_ids: Sequence[int], n_logits: int) -> torch.Tensor:
        """One forward of `new_ids` after the cached ones; (n_logits, V) logits of its last positions."""
        start = len(self.ids)
        input_ids = torch.tensor([list(new_ids)], dtype=torch.long, device=self.device)  # (1, T)
        try:
            output = self.model(
                input_ids=input_ids, cache=self.cache, use_cache=True, logits_to_keep=n_logits
            )
            self.ids.extend(new_ids)
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
