"""The KV cache's layers: transformers 5.x `DynamicCache` objects (`new_cache`) whose layers hold `keys` / `values`
tensors shaped (batch, kv_heads, seq, head_dim). Each full-attention layer is a `GrowingLayer`: its tensors are views
into a longer buffer and a forward writes its new entries in place, where transformers' own layer concatenates
(copying the layer's whole cache in every forward, a cost that grows with the context). It also lets the C
attention read the cache where it is, and a forward that writes its entries itself (models/lean_layers.py's decoder
stack in C) takes the buffers from `reserve` and says `written`. Cropping stays a view; `keep` (kv.py) and others
that make new tensors are taken into a new buffer at the next forward."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


class GrowingLayer(DynamicLayer):
    """transformers' `DynamicLayer` whose `keys` / `values` are prefix views of buffers with room to grow: an
    update copies only the new entries (in place at the end of the view). Anything that sets `keys` to a
    tensor of its own (index_select, cat) is fine: the next update takes it into a new buffer."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self._key_buffer = _appended(self.keys, getattr(self, "_key_buffer", None), key_states)
        self.values, self._value_buffer = _appended(self.values, getattr(self, "_value_buffer", None), value_states)
        self._own_views = None  # (which would keep a buffer this update replaced alive)
        return self.keys, self.values

    def reserve(self, new_shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(key buffer, value buffer), each (B, heads, capacity, dim) holding this layer's entries at its start
        with room for `new_shape` (B, heads, T, dim) more: for a forward that writes them itself (models/
        lean_layers.py's decoder stack) and then calls `written(T)`."""
        if self._views_own_buffers(new_shape[-2], dtype):
            return self._key_buffer, self._value_buffer
        if not self.is_initialized:
            empty = torch.empty(0, dtype=dtype, device=device)
            self.lazy_initialization(empty, empty)
        # `keys` / `values` stay what they were until `written`: if the forward fails they still hold the entries
        # (a new buffer holds a copy of them at its start, which `written` then points at).
        self._key_buffer = _with_room(self.keys, getattr(self, "_key_buffer", None), new_shape, dtype, device)
        self._value_buffer = _with_room(self.values, getattr(self, "_value_buffer", None), new_shape, dtype, device)
        return self._key_buffer, self._value_buffer

    def written(self, entries: int) -> None:
        """`reserve`'s caller wrote `entries` new ones after the held ones: they are held now."""
        length = _held_length(self.keys) + entries
        self.keys, self.values = self._key_buffer.narrow(-2, 0, length), self._value_buffer.narrow(-2, 0, length)
        self._own_views = (self.keys, self.values)

    def _views_own_buffers(self, entries: int, dtype: torch.dtype) -> bool:
        """Whether keys / values are still the prefix views `written` set (nothing replaced them: a crop, a
        `keep`, an update) and their buffers have room for `entries` more: then `reserve` has nothing to check.
        A decode step's forwards take this path (once per layer: the full check's Python adds up over a forward,
        the more with the caches cold after the weights streamed through them)."""
        views = getattr(self, "_own_views", None)
        return (views is not None and views[0] is self.keys and views[1] is self.values
                and self.keys.shape[-2] + entries <= self._key_buffer.shape[-2] and self._key_buffer.dtype == dtype)

    def keep_first(self, length: int) -> None:
        """Keep the first `length` entries; views `written` set stay such views (of the same buffers)."""
        own = self._views_own_buffers(0, self.keys.dtype)
        self.keys, self.values = _first(self.keys, length), _first(self.values, length)
        if own:
            self._own_views = (self.keys, self.values)

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = self._own_views = None
        super().reset()


def _appended(held: torch.Tensor, buffer: torch.Tensor | None, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the view of `buffer` holding `held` then `new`, that buffer): `new` is written after `held` in place when
    `held` is the buffer's prefix view and there is room; else into a new buffer ~1.5x as long as needed."""
    length = _held_length(held)
    buffer = _with_room(held, buffer, new.shape, new.dtype, new.device)
    buffer.narrow(-2, length, new.shape[-2]).copy_(new)
    return buffer.narrow(-2, 0, length + new.shape[-2]), buffer


def _first(held: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` entries of a layer's keys or values. A layer's first forward replaces the empty 1-D
    tensors it starts with, keys first: a forward interrupted there (Ctrl-C, SIGTERM) leaves values empty while
    keys hold entries, and the rollback after it must not fail on that (it keeps none of either: it was the
    layer's first forward)."""
    return held[..., :length, :] if held.dim() == 4 else held


def _held_length(held: torch.Tensor) -> int:
    return held.shape[-2] if held.dim() == 4 else 0  # (B, heads, seq, dim); an empty 1-D tensor before any entry


def _with_room(held: torch.Tensor, buffer: torch.Tensor | None, new_shape: Sequence[int], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """A buffer whose prefix is `held` with room after it for `new_shape[-2]` entries: `buffer` itself when
    `held` is its prefix view and it has the room, else a new one ~1.5x as long as needed (`held` copied in)."""
    length = _held_length(held)
    needed = length + new_shape[-2]
    fits = (buffer is not None and needed <= buffer.shape[-2] and tuple(buffer.shape[:2]) == tuple(new_shape[:2])
            and buffer.shape[-1] == new_shape[-1] and buffer.dtype == dtype
            and (length == 0 or _is_prefix_view(held, buffer)))
    if fits:
        return buffer
    capacity = -(-(needed * 3 // 2) // 256) * 256
    grown = torch.empty(*new_shape[:2], capacity, new_shape[-1], dtype=dtype, device=device)
    if length:
        grown.narrow(-2, 0, length).copy_(held)
    return grown


def _is_prefix_view(held: torch.Tensor, buffer: torch.Tensor) -> bool:
    return (held.data_ptr() == buffer.data_ptr() and held.stride() == buffer.stride()
            and held.shape[:2] == buffer.shape[:2] and held.shape[-1] == buffer.shape[-1])


def new_cache(config) -> DynamicCache:
    """transformers' `DynamicCache` for `config`, its full-attention and sliding-window layers `GrowingLayer`s
    (other kinds keep their own class). A sliding-window layer holds every key, not only the window's: transformers'
    own sliding layer drops the keys that leave the window, which a rollback after a rejected draft then needs back;
    the window is the attention mask's (it masks keys past the window by position), so the outputs are the same."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) else layer
                    for layer in cache.layers]
    return cache


def filled_layers(cache: DynamicCache) -> list:
    """The cache's layers that hold entries (a layer is empty until its first forward)."""
    return [layer for layer in cache.layers if getattr(layer, "keys", None) is not None and layer.keys.numel()]


def truncate_layers(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` entries of every filled layer."""
    for layer in filled_layers(cache):
        if isinstance(layer, GrowingLayer):
            layer.keep_first(length)
        else:
            layer.keys, layer.values = _first(layer.keys, length), _first(layer.values, length)
