"""A Llama-style decoder's whole forward in one call into C, for a batch of one over the engine's growing cache
(engine/kv.py), where all of its layers are lean (lean_layers.py) and the C kernels run.

native/layer_kernels.c's specdec_decoder_forward gathers the embedding rows, runs every layer (per layer the
same three calls the lean layers make one by one, in the same order) and applies the final RMSNorm, the same C norm
the decoder's norm module runs on the layered way (lean_layers.lean_norm). So the numbers are the layered way's bit
for bit (tested through prefill, growth, verify, rollback, trees), and what goes is the Python between the layers
and the embedding's and the norm's torch calls, which ran with cold caches after the weights streamed through them
(what that saves: docs/cpu-runtime.md). Anything else (another cache, a batch, an additive mask, hidden states asked
for) goes through transformers' forward and the lean layers."""

from __future__ import annotations

import ctypes
import types

import torch

from specdec_cli.models.formats.gguf_rows import BlockRows
from specdec_cli.models.native import binding
from specdec_cli.models.runtime.architectures import DECODER_CLASSES, sliding_window, slow_path_reason
from specdec_cli.models.runtime.lean_layers import (GATE_UP_PARTS, QKV_PARTS, CLinear, Held, activation_kind, address,
                                                    c_head_norms, c_mlp_norms, c_projections, fused, gate_up_parts,
                                                    has_lean_shape, head_norms, layer_in_c, layer_projections,
                                                    lean_forward, lean_norm, mlp_norms, norm_weight, prepare_norms,
                                                    qkv_parts, takes_lean_forward)


class _Layer(ctypes.Structure):
    """One decoder layer for the C decoder stack (native/kernels.h's `specdec_layer`: the same fields in order)."""

    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("input_eps", ctypes.c_float),
                ("post_eps", ctypes.c_float), ("qkv", CLinear), ("o", CLinear), ("gate_up", CLinear),
                ("down", CLinear), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p), ("qk_eps", ctypes.c_float),
                ("attention_out_norm", ctypes.c_void_p), ("mlp_out_norm", ctypes.c_void_p), ("out_eps", ctypes.c_float),
                ("activation", ctypes.c_int64), ("rotary_dim", ctypes.c_int64)]


def _stack_layers(decoder: torch.nn.Module):
    """The decoder's layers as one ctypes array for specdec_decoder_forward, made again whenever a layer's weights
    moved or the attention changed; None where a layer does not run in C (`layer_in_c`, asked when it is made:
    what it asks changes only with the weights or the attention). Checked each forward through the modules' own
    dicts (`_stack_where`): per layer `c_projections` and `layer_in_c` made some 15 of nn.Module's attribute
    lookups, slow next to a dict's, which added up to a noticeable part of a small draft's forward."""
    where = (decoder.config._attn_implementation, _stack_where(decoder))
    held = getattr(decoder, "_c_stack", None)
    if held is None or held[0] != where:
        layers = list(decoder.layers)
        described = [c_projections(layer) for layer in layers]
        array = None
        if None not in described and all(layer_in_c(layer) for layer in layers):
            array = (_Layer * len(described))(*(
                _layer(layer, projections)
                for layer, projections in zip(layers, described)))
        decoder._c_stack = held = Held((where, array))
    return held[1]


def _layer(layer: torch.nn.Module, projections: tuple[CLinear, ...]) -> _Layer:
    before, norm, norm_eps, after, out_eps = c_mlp_norms(layer)
    first = layer.input_layernorm
    attention = layer.self_attn
    # the dims the rotary embedding turns, as transformers' rope initialisation counts them
    rotary = int(attention.head_dim * float(getattr(attention.config, "partial_rotary_factor", None) or 1.0))
    return _Layer(norm_weight(first).data_ptr(), norm, first.variance_epsilon, norm_eps, *projections,
                  *c_head_norms(attention), before, after, out_eps, activation_kind(layer.mlp), rotary)


def _stack_where(decoder: torch.nn.Module) -> tuple[int, ...]:
    """The address of every weight tensor the C stack reads (each layer's four projections and its norms)."""
    where = []
    for layer in decoder._modules["layers"]._modules.values():
        where.extend(address(projection) for projection in layer_projections(layer))
        for norm in layer.__dict__.get("_stack_norms") or _layer_norms(layer):
            held = norm.__dict__.get("lean_weight")  # Gemma's 1 + weight (lean_layers.prepare_norms)
            where.append((norm._parameters["weight"] if held is None else held).data_ptr())
    return tuple(where)


def _layer_norms(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """The layer's norm modules the C stack reads, found once and kept on the layer (`_stack_where` asks every
    forward)."""
    found = (layer.input_layernorm, *mlp_norms(layer), *(head_norms(layer.self_attn) or ()))
    norms = layer.__dict__["_stack_norms"] = tuple(norm for norm in found if norm is not None)
    return norms


def _stack_declines(decoder: torch.nn.Module, input_ids, inputs_embeds, cache, kwargs) -> bool:
    """Whether this forward must take transformers' own path (the layers then still run lean, one by one)."""
    if input_ids is None or inputs_embeds is not None or input_ids.shape[0] != 1 or cache is None:
        return True
    if any(kwargs.get(name) for name in ("output_hidden_states", "output_attentions")):
        return True
    layers = getattr(cache, "layers", None)
    if not layers or len(layers) != len(decoder.layers) or not all(hasattr(layer, "reserve") for layer in layers):
        return True
    held = {layer.get_seq_length() for layer in layers}
    return (len(held) != 1 or decoder.embed_tokens.weight.dtype != torch.float32
            or decoder.norm.weight.dtype != torch.float32 or not decoder.embed_tokens.weight.is_contiguous())


def stack_forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                  position_ids: torch.Tensor | None = None, cache=None, inputs_embeds: torch.Tensor | None = None,
                  use_cache: bool | None = None, past_key_values=None, **kwargs):
    """A Llama-style decoder's forward (transformers' signature and result) in one call into C (see the module)
    where it can; else transformers' forward."""
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_outputs import BaseModelOutputWithPast

    cache = cache if cache is not None else past_key_values
    layers = None if _stack_declines(self, input_ids, inputs_embeds, cache, kwargs) else _stack_layers(self)
    if layers is not None:
        cached, tokens = cache.get_seq_length(), input_ids.shape[1]
        # the C's scratch, float32 whatever torch's default dtype is now; its shape tells the mask builder T
        hidden = torch.empty(1, tokens, self.config.hidden_size, dtype=torch.float32)
        in_order = position_ids is None  # the new tokens at cached, cached + 1, ... (not a tree's or a batch's)
        if in_order:
            position_ids = torch.arange(cached, cached + tokens).unsqueeze(0)
        # No mask given: the causal mask transformers would build, which the C attention applies itself (NULL)
        # on the same keys in the same order (one forward's mask building and copy fewer; tested bit for bit).
        mask = None if attention_mask is None else create_causal_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=attention_mask, cache=cache,
            position_ids=position_ids)
        if mask is None or mask.dtype == torch.bool:  # what _runs_in_c asks besides the layers (_stack_layers did)
            rotary = _rotary_rows(self, hidden, position_ids, cached if in_order else None)
            normed = _stack_in_c(self, layers, cache, input_ids, hidden, cached, rotary, mask)
            return BaseModelOutputWithPast(last_hidden_state=normed, cache=cache if use_cache is not False else None)
    return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)


ROTARY_ROWS = 1024  # positions a decoder's rotary table holds at first (it doubles as positions grow)
TABLE_ROPES = ("default", "linear", "llama3", "yarn")  # fixed frequencies: transformers' dynamic_rope_update skips them


def _rotary_rows(decoder: torch.nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor,
                 first: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (1, T, D) float32 for the rotary embedding at `position_ids`. For positions first, first + 1, ...
    (`first` given) and a rope whose frequencies are fixed (TABLE_ROPES), rows of a table the decoder keeps: the
    rotary module's own numbers for those positions, bit for bit (each element is one product and a cos or sin,
    times a fixed factor: it does not depend on the other positions computed with it; tested), without its ~10 torch
    operations a forward, which run with the caches cold after a forward's weights streamed through them. The
    dynamic ropes ("dynamic", "longrope") change their frequencies with the positions asked: computed each time."""
    rotary = decoder.rotary_emb
    if first is None or getattr(rotary, "rope_type", None) not in TABLE_ROPES:
        return tuple(part.float().contiguous() for part in rotary(hidden, position_ids))
    tokens, held = hidden.shape[1], decoder.__dict__.get("_rotary_table")
    source = rotary.inv_freq.data_ptr()
    if held is None or held[0] != source or held[1][0].shape[1] < first + tokens:
        size = max(ROTARY_ROWS, 1 << (first + tokens - 1).bit_length())
        table = tuple(part.float().contiguous() for part in rotary(hidden, torch.arange(size).unsqueeze(0)))
        decoder._rotary_table = held = Held((source, table))
    cos, sin = held[1]
    return cos[:, first:first + tokens], sin[:, first:first + tokens]


def read_prompt(decoder: torch.nn.Module, cache, input_ids: torch.Tensor, isa: int) -> bool:
    """Append input_ids' (1, T) keys and values to `cache` (the engine's) in one call into C with the matmuls of
    `isa` (4: a prompt read's, q4_amx.c's bfloat16 matmul), the positions following the cached ones, no mask; False
    (nothing done) where the decoder's forward would not take the C stack."""
    layers = None if _stack_declines(decoder, input_ids, None, cache, {}) else _stack_layers(decoder)
    if layers is None:
        return False
    cached, tokens = cache.get_seq_length(), input_ids.shape[1]
    hidden = torch.empty(1, tokens, decoder.config.hidden_size, dtype=torch.float32)
    rotary = _rotary_rows(decoder, hidden, torch.arange(cached, cached + tokens).unsqueeze(0), cached)
    _stack_in_c(decoder, layers, cache, input_ids, hidden, cached, rotary, None, isa)
    return True


def stacks_in_c(decoder: torch.nn.Module) -> bool:
    """Whether the decoder has the stack's forward and all its layers run in C (so read_prompt can run)."""
    forward = getattr(decoder.__dict__.get("forward"), "__func__", None)
    return forward is stack_forward and _stack_layers(decoder) is not None


def _stack_in_c(decoder: torch.nn.Module, layers, cache, input_ids: torch.Tensor, hidden: torch.Tensor,
                cached: int, rotary: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                isa: int | None = None) -> torch.Tensor:
    """The decoder's output (1, T, H) for input_ids (1, T), normalised, in one call into C; each cache layer then
    holds its T new entries. hidden (1, T, H): scratch; rotary: cos, sin (1, T, D) float32, contiguous rows; isa:
    the matmuls' (None: the library's)."""
    tokens = hidden.shape[1]
    attention = decoder.layers[0].self_attn
    head_dim, (q_size, k_size) = attention.head_dim, attention.qk_sizes
    kv_heads = k_size // head_dim
    buffers = [layer.reserve((1, kv_heads, tokens, head_dim), torch.float32, hidden.device) for layer in cache.layers]
    keys = (ctypes.c_void_p * len(buffers))(*(key.data_ptr() for key, _ in buffers))
    values = (ctypes.c_void_p * len(buffers))(*(value.data_ptr() for _, value in buffers))
    capacity = (ctypes.c_int64 * len(buffers))(*(key.shape[-2] for key, _ in buffers))
    visible = None if mask is None else mask[0, 0, :, -(cached + tokens):].to(torch.uint8).contiguous()
    cos, sin = rotary  # (1, T, D)
    embed, ids = _embedding_table(decoder.embed_tokens, input_ids)
    norm = decoder.norm
    normed = torch.empty_like(hidden)
    library, library_isa, _ = binding.library()
    isa = library_isa if isa is None else isa
    failed = library.specdec_decoder_forward(
        isa, torch.get_num_threads(), embed.data_ptr(), embed.shape[0], ids.data_ptr(), layers, len(buffers), keys,
        values, capacity, cached, hidden.data_ptr(), tokens, hidden.shape[-1], cos.data_ptr(), sin.data_ptr(),
        None if visible is None else visible.data_ptr(), q_size // head_dim, kv_heads, head_dim, attention.scaling,
        norm.weight.data_ptr(), norm.variance_epsilon, normed.data_ptr())
    if failed == 2:
        raise IndexError(f"token ids must lie in 0..{embed.shape[0] - 1} (the embedding's rows); got {ids.tolist()}")
    if failed:
        raise MemoryError(f"specdec's layer kernels could not allocate their buffers for {tokens} tokens")
    for layer in cache.layers:
        layer.written(tokens)
    return normed


def _embedding_table(embedding: torch.nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a float32 table (rows, H), the ids (1, T) of its rows the C gathers): the embedding's own weight and the ids;
    for one kept as a .gguf's blocks (formats/gguf_rows.py), the ids' rows, dequantised here, and 0..T-1."""
    if isinstance(embedding, BlockRows):
        return embedding.rows(input_ids[0]), torch.arange(input_ids.shape[1]).unsqueeze(0)
    return embedding.weight, input_ids.contiguous()


SLOW_PATH = "_specdec_slow_path"  # the attribute, on a model use_lean_layers left to transformers, saying why


def use_lean_layers(model: torch.nn.Module) -> torch.nn.Module:
    """Fuse q/k/v and gate/up and give every decoder layer that `takes_lean_forward` the lean forward, in place; a
    decoder (the layers' parent model) all of whose layers take it gets the decoder stack's forward (decoder_stack.py).
    A model whose architecture or configuration the fast path does not compute (architectures.slow_path_reason) keeps
    transformers' layers, and the reason is kept on it (SLOW_PATH) for its load line."""
    config = getattr(model, "config", None)
    reason = slow_path_reason(config) if config is not None else None
    if reason is not None:
        model.__dict__[SLOW_PATH] = reason
        return model
    for layer in model.modules():
        if not takes_lean_forward(layer):
            continue
        _fuse(layer.self_attn, layer.mlp, layer.self_attn.config)
        prepare_norms(layer)
        layer.forward = types.MethodType(lean_forward, layer)
    for decoder in model.modules():
        # A sliding window is in the masks transformers' forward makes per layer: no stack (it builds one mask).
        if type(decoder).__name__ in DECODER_CLASSES and sliding_window(config) is None and _all_lean(decoder):
            decoder.forward = types.MethodType(stack_forward, decoder)
            decoder.norm.forward = types.MethodType(lean_norm, decoder.norm)
    return model


FUSED = (("self_attn", "qkv_proj", QKV_PARTS), ("mlp", "gate_up_proj", GATE_UP_PARTS))  # (owner, fused layer, parts)


def fuse_skeleton(model: torch.nn.Module) -> dict[str, list[tuple[str, torch.nn.Linear]]]:
    """In a model whose layers are still nn.Linear (a loader's skeleton), put where `use_lean_layers` will fuse q/k/v
    and gate/up one nn.Linear of the fused shape (on the meta device) in place of the parts; returns {the fused
    layer's name: [(each part's name, its Linear), in row order]}. A loader that makes the fused layers itself
    (`lean_layers.fused` of the parts) keeps, and stores, them as they run: no second copy made as they fuse."""
    if slow_path_reason(getattr(model, "config", None)) is not None:
        return {}
    made = {}
    for layer_name, layer in model.named_modules():
        if not has_lean_shape(layer):
            continue
        for owner_name, fused_name, part_names in FUSED:
            owner = getattr(layer, owner_name)
            parts = [owner._modules.get(name) for name in part_names]
            if not all(type(part) is torch.nn.Linear for part in parts):
                continue  # Phi-3's, fused already
            with torch.device("meta"):
                whole = torch.nn.Linear(parts[0].in_features, sum(part.out_features for part in parts),
                                        bias=any(part.bias is not None for part in parts))
            for name in part_names:
                del owner._modules[name]
            owner._modules[fused_name] = whole
            made[f"{layer_name}.{owner_name}.{fused_name}"] = [
                (f"{layer_name}.{owner_name}.{name}", part) for name, part in zip(part_names, parts)]
    return made


def _fuse(attention: torch.nn.Module, mlp: torch.nn.Module, config) -> None:
    """q/k/v into one layer `qkv_proj` and gate/up into `gate_up_proj` (Phi-3's are fused already: kept)."""
    parts = qkv_parts(attention)
    if len(parts) == 1:  # Phi-3's: q's rows, k's, v's
        head_dim = attention.head_dim
        attention.qk_sizes = (config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim)
    else:
        attention.qk_sizes = (parts[0].out_features, parts[1].out_features)
        attention.qkv_proj = fused(parts)
        del attention.q_proj, attention.k_proj, attention.v_proj
    parts = gate_up_parts(mlp)
    if len(parts) > 1:
        mlp.gate_up_proj = fused(parts)
        del mlp.gate_proj, mlp.up_proj


def slow_path(model: torch.nn.Module) -> str | None:
    """Why `use_lean_layers` left `model` on transformers' layers, in a few words; None where it did not."""
    return model.__dict__.get(SLOW_PATH)


def _all_lean(decoder: torch.nn.Module) -> bool:
    layers = getattr(decoder, "layers", None)
    return bool(layers) and all(getattr(layer.forward, "__func__", None) is lean_forward for layer in layers)
