"""Many sequences in one KV cache, packed: the batched engine's cache.

Every row (one sequence being decoded) owns some slots of one long cached sequence (batch dimension 1).
A forward feeds each row's new tokens one after the other, so N new tokens cost N rows of every matmul
and no padding; a 4D boolean mask lets each new token see only its own row's slots and the row's fed
tokens before it, and position ids give each token its place in its own row. A slot that no row owns (a
rejected draft, a finished row) is a hole the mask hides; when holes make up half of the cache it is
compacted (one index-select per layer).

The same shared-prefix rule as `CachedModel.extend`, per row: `extend({row: ids}, {row: n_logits})` cuts
each row back to what it shares with its `ids` and feeds only the rest, so rollback after a rejection and
the catch-up of a draft model that skipped steps need no call of their own. A row's prompt is prefilled
alone (`admit`: in chunks, as `CachedModel` does) and its entries appended.

With the row-wise attention of int8/int4 targets (models/rowwise_attention.py) each query attends to its
row's slots in order, gathered: exactly the keys, in the same order, of a one-token forward over that
row's own cache, so a packed forward's logits equal a lone sequence's bit for bit. Under transformers'
SDPA the masked-out keys add exact zeros, but in another summation order: equal up to rounding.

`reuse_prompts` (for such a row-wise model only): the prompt prefill keeps the last prompt it computed, so
a prompt that shares a prefix with it (a system prompt, few-shot examples) computes only the rest. The
entries are the ones computing it would give, bit for bit, so a row's output still depends on its
request alone; under SDPA a prefill split at another place could round otherwise, so it starts over."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from specdec_cli.engine.cache_layers import filled_layers, new_cache, truncate_layers
from specdec_cli.engine.kv import CachedModel, _tree_mask_form

Row = int
HOLE = -1


@dataclass
class _RowSlots:
    ids: list[int] = field(default_factory=list)    # the row's tokens, in order
    slots: list[int] = field(default_factory=list)  # where each sits in the packed cache


class PackedCache:
    def __init__(self, model: torch.nn.Module, prefill_chunk: int | None = None, reuse_prompts: bool = False) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.single = CachedModel(model, prefill_chunk)  # prefills one row's prompt alone
        self.reuse_prompts = reuse_prompts
        self.forwards = 0
        self.reset()

    def reset(self) -> None:
        self.cache = new_cache(self.model.config)
        self.owner: list[Row] = []  # slot -> the row that owns it, or HOLE
        self.rows: dict[Row, _RowSlots] = {}

    def __contains__(self, row: Row) -> bool:
        return row in self.rows

    def ids(self, row: Row) -> list[int]:
        return self.rows[row].ids

    @property
    def holes(self) -> int:
        return len(self.owner) - sum(len(state.slots) for state in self.rows.values())

    @torch.inference_mode()
    def admit(self, row: Row, ids: Sequence[int]) -> None:
        """Row `row` (new, or replacing itself) holds `ids`, prefilled on their own."""
        self.release(row)
        state = self.rows[row] = _RowSlots()
        if not ids:
            return
        if not self.reuse_prompts:
            self.single.reset()
        # `ids` are a row's prompt but its last token, which the row's first step feeds: a model's prefill path reads
        # all of them, as the one-sequence decoder reads a prompt but its last token (kv.py), from what reading it
        # alone would hold; what the path does not take, the model's own forward reads (only what it does not share
        # with the prompt it holds). Reading all but the last of `ids` by the path and that one by the model gave a
        # row another entry at that place than the one-sequence decoder has, and another greedy text.
        self.single.prefill(list(ids), fresh=True)
        if self.single.ids != list(ids):
            self.single.extend(ids, 1)
        start = len(self.owner)
        for layer, source in zip(self.cache.layers, self.single.cache.layers):
            layer.update(source.keys, source.values)  # appended after the rows already held
        if not self.reuse_prompts:
            self.single.reset()
        self.owner.extend([row] * len(ids))
        state.ids, state.slots = list(ids), list(range(start, start + len(ids)))

    def release(self, row: Row) -> None:
        """Forget a row: its slots become holes."""
        if row in self.rows:
            self._crop_row(row, 0)
            del self.rows[row]

    @torch.inference_mode()
    def extend(self, sequences: Mapping[Row, Sequence[int]], n_logits: Mapping[Row, int]) -> dict[Row, torch.Tensor]:
        """Make each row hold its sequence, in one forward for all rows; per row the (n_logits, V) logits
        of its last positions (row i scoring the token after sequence[: len - n_logits + i + 1])."""
        feeds: dict[Row, list[int]] = {}
        for row, ids in sequences.items():
            wanted = n_logits[row]
            if not 1 <= wanted <= len(ids):
                raise ValueError(f"need 1 <= n_logits <= len(ids), got {wanted} for {len(ids)} ids")
            keep = min(self.shared_prefix(row, ids), len(ids) - wanted)
            self._crop_row(row, keep)
            feeds[row] = list(ids[keep:])
        logits = self._forward(feeds, n_logits)
        self._compact_if_sparse()
        return logits

    def _forward(self, feeds: dict[Row, list[int]], n_logits: Mapping[Row, int]) -> dict[Row, torch.Tensor]:
        start = len(self.owner)
        tokens, positions, keep_index = [], [], []
        for row, feed in feeds.items():
            offset = len(tokens)
            tokens.extend(feed)
            positions.extend(range(len(self.rows[row].ids), len(self.rows[row].ids) + len(feed)))
            keep_index.extend(range(offset + len(feed) - n_logits[row], offset + len(feed)))
        mask = self._mask(feeds)
        try:
            output = self.model(
                input_ids=torch.tensor([tokens], dtype=torch.long, device=self.device), cache=self.cache,
                use_cache=True, attention_mask=mask,
                position_ids=torch.tensor([positions], dtype=torch.long, device=self.device),
                logits_to_keep=torch.tensor(keep_index, dtype=torch.long, device=self.device),
            )
        except BaseException:
            truncate_layers(self.cache, start)  # an interrupted forward may have appended to some layers only
            raise
        self.forwards += 1
        logits, taken, slot = output.logits[0], 0, start  # (sum of n_logits, V)
        result = {}
        for row, feed in feeds.items():
            state = self.rows[row]
            state.ids.extend(feed)
            state.slots.extend(range(slot, slot + len(feed)))
            self.owner.extend([row] * len(feed))
            slot += len(feed)
            result[row] = logits[taken: taken + n_logits[row]]
            taken += n_logits[row]
        return result

    def _mask(self, feeds: dict[Row, list[int]]) -> torch.Tensor:
        """(1, 1, N, S + N): fed token j of a row sees the row's cached slots and its fed tokens up to j."""
        cached = len(self.owner)
        fed = sum(map(len, feeds.values()))
        owner = torch.tensor(self.owner, dtype=torch.long)
        allowed = torch.zeros(fed, cached + fed, dtype=torch.bool)
        offset = 0
        for row, feed in feeds.items():
            queries = slice(offset, offset + len(feed))
            allowed[queries, :cached] = owner == row
            allowed[queries, cached + offset: cached + offset + len(feed)] = torch.ones(
                len(feed), len(feed), dtype=torch.bool).tril()
            offset += len(feed)
        if _tree_mask_form(self.model) == "bool":
            return allowed[None, None].to(self.device)
        dtype = next(self.model.parameters()).dtype
        additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        return additive[None, None].to(self.device)

    def shared_prefix(self, row: Row, ids: Sequence[int]) -> int:
        cached = self.rows[row].ids
        limit = min(len(cached), len(ids))
        if list(ids[:limit]) == cached[:limit]:
            return limit
        return next(position for position in range(limit) if cached[position] != ids[position])

    def _crop_row(self, row: Row, length: int) -> None:
        state = self.rows[row]
        for slot in state.slots[length:]:
            self.owner[slot] = HOLE
        del state.ids[length:], state.slots[length:]

    def _compact_if_sparse(self) -> None:
        """Drop the holes once they are half the cache (and more than a few): one index-select per layer."""
        holes = self.holes
        if holes < 64 or 2 * holes < len(self.owner):
            return
        kept = [slot for slot, row in enumerate(self.owner) if row != HOLE]
        index = torch.tensor(kept, dtype=torch.long, device=self.device)
        for layer in filled_layers(self.cache):
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)
        new_slot = {old: new for new, old in enumerate(kept)}
        for state in self.rows.values():
            state.slots = [new_slot[slot] for slot in state.slots]
        self.owner = [self.owner[slot] for slot in kept]

