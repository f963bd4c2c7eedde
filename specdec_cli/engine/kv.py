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

Token trees (see tree.py): `extend_tree` feeds tree nodes in one forward, each at position
len(ids) + depth under a 4D mask that lets it see the sequence and its own ancestors; their entries sit
after `ids` in the cache, outside `self.ids`, until `keep_path` keeps one branch (the others are
dropped) or the next forward crops them. `tree_capable` says whether a model takes such a mask.

Caches are transformers 5.x `DynamicCache` objects whose full-attention layers grow in place (cache_layers.py).

A model may carry a prefill path (`PREFILL_PATH`, attached by models/prefill.py) that reads a prompt faster than
the model itself (bfloat16 on AMX: a q4 target's own weights, else a bfloat16 copy of its decoder). `prefill(ids)`
feeds the part of `ids` the cache lacks through it, where that part is long enough; what the path computes is not
what the model computes, so it is used only where a caller asks (the prompt before its last token), never by
`extend`: a verify still equals one-token decoding. After a reset that kept the cache, `prefill(ids, fresh=True)`
makes the entries what reading `ids` into an empty cache gives: a row-exact path's kept prefix, then the rest."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

from specdec_cli.engine.cache_layers import filled_layers, new_cache, truncate_layers
from specdec_cli.engine.tree import ancestry, depths, path_to


def tree_capable(model: torch.nn.Module) -> bool:
    """Whether `model` takes a custom 4D mask and position ids over a cache, as `extend_tree` needs:
    transformers 5.24 passes a 4D mask untouched to an attention whose mask builder is `sdpa_mask` (sdpa,
    and the row-wise attention of int8/int4 models) or `eager_mask` (checked for Llama, Qwen2, Gemma 1-3);
    flash and flex attention build their own, and a sliding-window layer would not apply its window."""
    return _tree_mask_form(model) is not None and full_attention(model.config)


def full_attention(config) -> bool:
    """Whether every layer of a model with this config attends to the whole sequence (no sliding window)."""
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return False
    return not (getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None))


PREFILL_PATH = "_specdec_prefill"  # the attribute, in a model's __dict__, holding its prefill path


def prefill_path(model: torch.nn.Module):
    """The model's prefill path (a callable `(cache, new_ids) -> None` with `min_tokens`), None where it has none."""
    return model.__dict__.get(PREFILL_PATH)


def _tree_mask_form(model: torch.nn.Module) -> str | None:
    """The form of 4D mask the model's own mask builder makes, "bool" or "additive", which its attention
    expects (the row-wise attention computes row by row only under a boolean mask; eager adds the mask
    to its scores); None when it builds neither."""
    builder = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(getattr(model.config, "_attn_implementation", None))
    return {sdpa_mask: "bool", eager_mask: "additive"}.get(builder)


# Tokens per prefill forward. Ctrl-C lands between torch ops, so what matters is the longest op: with
# 512-token chunks no op has more than 512 query rows, however long the prompt (up to the context), so Ctrl-C
# during a long prefill is honoured at once. Chunks this large cost a prefill little against one forward; much
# smaller ones cost too much on a CPU.
# Verification (k + 1 <= 21 tokens) always fits in one forward.
PREFILL_CHUNK = 512


class CachedModel:
    def __init__(self, model: torch.nn.Module, prefill_chunk: int | None = None) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.prefill_chunk = prefill_chunk or PREFILL_CHUNK
        self.cache = new_cache(model.config)
        self.ids: list[int] = []  # the tokens whose keys/values the cache holds, in order
        self.tree_nodes: list[int] = []  # tree nodes whose entries follow `ids` in the cache, in cache order
        self._tree_paths: dict[int, tuple[int, ...]] = {}  # cached node -> the tokens of its path
        self.path_entries = 0  # the first cached entries, read by the prefill path from position 0 on
        self.forwards = 0  # forward passes run, for stats and tests

    def __len__(self) -> int:
        return len(self.ids)

    def reset(self) -> None:
        self.cache = new_cache(self.model.config)
        self.ids = []
        self.tree_nodes = []
        self.path_entries = 0

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
        if length < len(self.ids) or self.tree_nodes:
            self._truncate_layers(length)

    def keep(self, positions: Sequence[int]) -> None:
        """Keep only the cached entries at `positions` (ascending), in that order."""
        index = torch.tensor(list(positions), dtype=torch.long, device=self.device)
        for layer in self._layers():
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)
        self.ids = [self.ids[p] for p in positions]
        in_place = 0
        while in_place < min(self.path_entries, len(positions)) and positions[in_place] == in_place:
            in_place += 1
        self.path_entries = in_place

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

    @torch.inference_mode()
    def prefill(self, ids: Sequence[int], keep_at_most: int | None = None, fresh: bool = False) -> None:
        """Make the cache hold `ids` through the model's prefill path, where it has one and the part of `ids` the
        cache lacks has at least its `min_tokens`; else leave the cache as it is (`extend` feeds them then). The
        cache first keeps at most `keep_at_most` of its entries: a caller that knows what a target decoding alone
        would hold (a speculative decoder's cache may hold more) makes the path read the same tokens as that would.
        `fresh` (a prompt after a reset that kept the cache, for a path whose rows do not depend on the forward,
        `row_exact`): the entries become what reading `ids` into an empty cache gives, bit for bit, the shared
        prefix kept where its entries were made as that read makes them (`_fresh_start`)."""
        path = prefill_path(self.model)
        if path is None:
            return
        if fresh:
            start = self._fresh_start(ids, path)
            self.crop(start)
            if start == len(ids) or len(ids) < path.min_tokens:
                return  # all there, or `extend` feeds the rest as into an empty cache
        else:
            start = min(self.shared_prefix(ids), len(ids) if keep_at_most is None else keep_at_most)
            if len(ids) - start < path.min_tokens:
                return
            self.crop(start)
        while len(self.ids) < len(ids):
            fed = len(self.ids)
            chunk = list(ids[fed: fed + self.prefill_chunk])
            try:
                path(self.cache, chunk)
            except BaseException:
                self._truncate_layers(fed)  # an interrupted forward may have appended to some layers only
                raise
            self.ids.extend(chunk)
            if fed == self.path_entries:
                self.path_entries = len(self.ids)
            self.forwards += 1

    def _fresh_start(self, ids: Sequence[int], path) -> int:
        """How many cached entries reading `ids` into an empty cache would make as they are. That read takes the
        path for all of `ids` where they are `min_tokens` or more, else the model's own forward: the shared prefix
        counts as far as the path made it (from position 0), or, for a short `ids`, where the path made none of
        the first entries. Rows that depend on the others in their forward (a copy's) keep nothing."""
        if not getattr(path, "row_exact", False):
            return 0
        shared = self.shared_prefix(ids)
        if len(ids) >= path.min_tokens:
            return min(shared, self.path_entries)
        return shared if self.path_entries == 0 else 0

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

    @torch.inference_mode()
    def extend_tree(
        self, ids: Sequence[int], tree_ids: Sequence[int], parents: list[int],
        feed: Sequence[int] | None = None, sequence_logits: bool = False,
    ) -> torch.Tensor:
        """Make the cache hold `ids` and then tree nodes `feed` (default: all; a node's parent must be
        cached already or come earlier in `feed`), in one forward. Returns (len(feed), V) logits, row i
        scoring the token after node feed[i]'s path; with `sequence_logits`, one more row first,
        scoring the token after `ids`. Nodes cached by an earlier call for the same `ids` and the same
        paths stay (a drafter grows its tree level by level); anything else after the shared prefix goes."""
        feed = list(range(len(tree_ids))) if feed is None else list(feed)
        if sequence_logits or not self._holds_tree_of(ids, tree_ids, parents):
            self.crop(min(self.shared_prefix(ids), len(ids) - int(sequence_logits)))
        # A long unfed prefix goes in plain chunks first (see `extend`); the tree forward takes the rest.
        while len(ids) - len(self.ids) > self.prefill_chunk:
            self._forward(ids[len(self.ids): len(self.ids) + self.prefill_chunk], 1)
        start, cached_nodes = len(self.ids), list(self.tree_nodes)
        if set(feed) & set(cached_nodes):
            raise ValueError("a tree node is fed twice")
        kv_nodes = cached_nodes + feed
        tokens = list(ids[start:]) + [tree_ids[node] for node in feed]
        node_depths = depths(parents)
        positions = list(range(start, len(ids))) + [len(ids) + node_depths[node] for node in feed]
        mask = self._tree_mask(start, len(ids), ancestry(parents)[feed][:, kv_nodes])
        try:
            output = self.model(
                input_ids=torch.tensor([tokens], dtype=torch.long, device=self.device), cache=self.cache,
                use_cache=True, attention_mask=mask,
                position_ids=torch.tensor([positions], dtype=torch.long, device=self.device),
                logits_to_keep=len(feed) + int(sequence_logits),
            )
        except BaseException:
            self._truncate_layers(start)  # an interrupted forward may have appended to some layers only
            raise
        self.ids.extend(ids[start:])
        self.tree_nodes = kv_nodes
        self._tree_paths = {node: _path_tokens(node, tree_ids, parents) for node in kv_nodes}
        self.forwards += 1
        return output.logits[0]  # (len(feed) + sequence_logits, V)

    @torch.inference_mode()
    def keep_path(self, path: Sequence[int]) -> None:
        """Commit one branch of the cached tree: its nodes (root first) join `ids` as far as they are
        cached; every other tree entry is dropped. Only the tree's entries move (no re-forward)."""
        slot = {node: i for i, node in enumerate(self.tree_nodes)}
        kept = []
        for node in path:
            if node not in slot:
                break
            kept.append(node)
        base = len(self.ids)
        if any(slot[node] != place for place, node in enumerate(kept)):  # else the branch is in place already
            tail = torch.tensor([base + slot[node] for node in kept], dtype=torch.long, device=self.device)
            for layer in self._layers():
                layer.keys[..., base : base + len(kept), :] = layer.keys.index_select(-2, tail)
                layer.values[..., base : base + len(kept), :] = layer.values.index_select(-2, tail)
        tokens = list(self._tree_paths[kept[-1]]) if kept else []  # the path of its last node
        self.ids.extend(tokens)
        self._truncate_layers(len(self.ids))

    def _holds_tree_of(self, ids: Sequence[int], tree_ids: Sequence[int], parents: list[int]) -> bool:
        """The cache holds exactly `ids`, then only nodes of this tree (same paths as when fed)."""
        if len(self.ids) != len(ids) or self.shared_prefix(ids) != len(ids):
            return False
        return all(node < len(tree_ids) and self._tree_paths.get(node) == _path_tokens(node, tree_ids, parents)
                   for node in self.tree_nodes)

    def _tree_mask(self, start: int, length: int, node_sees_node: torch.Tensor) -> torch.Tensor:
        """(1, 1, Q, K) mask, boolean or additive as the model takes it (`_tree_mask_form`): fed sequence
        tokens ids[start:length] see causally; fed nodes see all of ids and their cached or fed ancestors
        (node_sees_node: (nodes fed, tree entries))."""
        fed_ids, fed_nodes = length - start, node_sees_node.shape[0]
        keys = length + node_sees_node.shape[1]
        allowed = torch.zeros(fed_ids + fed_nodes, keys, dtype=torch.bool)
        allowed[:fed_ids, :length] = torch.ones(fed_ids, length, dtype=torch.bool).tril(start)
        allowed[fed_ids:, :length] = True
        allowed[fed_ids:, length:] = node_sees_node
        if _tree_mask_form(self.model) == "bool":
            return allowed[None, None].to(self.device)
        dtype = next(self.model.parameters()).dtype
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        return mask[None, None].to(self.device)

    def _layers(self) -> list:
        return filled_layers(self.cache)

    def _truncate_layers(self, length: int) -> None:
        truncate_layers(self.cache, length)
        del self.ids[length:]
        self.tree_nodes = []
        self.path_entries = min(self.path_entries, length)


def _path_tokens(node: int, tree_ids: Sequence[int], parents: list[int]) -> tuple[int, ...]:
    return tuple(tree_ids[step] for step in path_to(node, parents))
