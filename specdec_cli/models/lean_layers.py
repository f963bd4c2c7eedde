"""A leaner forward for the decoder layers of Llama- and Qwen2-style models quantised to int8 or q4.

Why: with specdec's own matmuls a one-token forward of the 1.5B demo target spends ~18 of ~55 ms outside
the matmuls (0.5B draft: ~10 of ~23 ms), most of it in per-call overhead: transformers' layer makes ~13
module calls and ~60 tensor operations. Here a layer makes one matmul call for q, k and v together, one
for gate and up together, one C call per RMSNorm (layer_kernels.c), and the rotary embedding once for q and k
together.

The arithmetic is transformers' own, element for element: the projections are the same rows of the same
int8/q4 weights (a fused layer's rows are computed exactly as the separate layers' rows were), and the one
rotary pass does per element what transformers' code does. The RMSNorm sums its squares in double, so it
may differ from transformers' float32 one in the last bit; it is the same for every forward (each row on
its own), so a verify still equals one-token decoding bit for bit (tested). The cache, the attention function (row-wise for a target), masks and
positions are transformers' too, so trees, batches and caches behave as before.

Where a forward is a batch of one in float32 with a causal or boolean mask (every forward of the engine's
caches) and the C kernels run, the layer goes further: the two halves around its attention are one C call each
(layer_kernels.c: norm, q/k/v, rotary; o, residual, norm, gate/up, SiLU, down, residual) and the attention is
specdec's C attention (rowwise_attention.py), so a layer is three calls and the cache update instead of ~45
torch operations (1-token forward of the 1.5B target: ~11 ms outside the matmuls before). Its SiLU takes
exp from layer_kernels.c, not torch's, so these logits equal transformers' up to rounding (tested), and still
each row's alone.

A decoder (LlamaModel, Qwen2Model) all of whose layers are lean goes one step further for a batch of one over
the engine's growing cache (engine/kv.py): `stack_forward` runs every layer in one call into C, the same three
calls per layer in the same order, so the same numbers bit for bit (tested); the Python between the layers
(~0.1-0.3 ms a layer) goes. Measured in one interleaved run (scripts/layers_ab.py, benchmarks/2026-12-02-layers-ab-
q4-avx512-stack.json): 0.5B q4 draft 21.9 → 18.6 ms a token, 1.5B q4 target 60.0 → 50.9 ms; 8 tokens 94.2 → 85.3 ms.
The same call gathers the embedding rows and applies the final norm (the decoder's norm module gets the same C
norm for the layered way, `_lean_norm`): ~0.4 ms less a draft forward (alternating in one process).

Only the exact classes named in LEAN_CLASSES with SiLU MLPs are changed; other models keep transformers'
layers."""

from __future__ import annotations

import ctypes
import sys
import types

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from specdec_cli.models import int8_kernel
from specdec_cli.models.int8 import PerTokenInt8Linear
from specdec_cli.models.q4 import Q4Linear
from specdec_cli.models.rowwise_attention import attend_rows

LEAN_CLASSES = ("LlamaDecoderLayer", "Qwen2DecoderLayer")
STACK_CLASSES = ("LlamaModel", "Qwen2Model")  # their forward: embed, mask, rotary, the layers, norm


def _fused(layers: list[torch.nn.Module]) -> torch.nn.Module:
    """One layer whose output rows are `layers`' rows side by side, computed the same way."""
    if all(isinstance(layer, Q4Linear) for layer in layers):
        from specdec_cli.models.q4 import unpack

        parts = [unpack(layer.packed_weight, layer.out_features) for layer in layers]
        levels, scales, minimums = (torch.cat(tensors) for tensors in zip(*parts))
        return Q4Linear(levels, scales, minimums, _fused_bias(layers), layers[0].in_features)
    weight = torch.cat([layer.int8_weight() for layer in layers])
    scales = torch.cat([layer.weight_scales for layer in layers])
    return PerTokenInt8Linear(weight, scales, _fused_bias(layers), layers[0].bits)


def _fused_bias(layers: list[torch.nn.Module]) -> torch.Tensor | None:
    if all(layer.bias is None for layer in layers):
        return None
    return torch.cat([layer.bias if layer.bias is not None else torch.zeros(layer.out_features) for layer in layers])


def _takes(layer: torch.nn.Module) -> bool:
    if type(layer).__name__ not in LEAN_CLASSES:
        return False
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    projections = [getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    projections += [getattr(mlp, name, None) for name in ("gate_proj", "up_proj")]
    kinds = {type(projection) for projection in projections}
    return (len(kinds) == 1 and kinds <= {Q4Linear, PerTokenInt8Linear}
            and getattr(mlp.act_fn, "__class__", None).__name__ in ("SiLU", "SiLUActivation")
            and type(layer.input_layernorm).__name__.endswith("RMSNorm"))


def use_lean_layers(model: torch.nn.Module) -> torch.nn.Module:
    """Fuse q/k/v and gate/up and give every decoder layer that `_takes` the lean forward, in place; a decoder
    (the layers' parent model) all of whose layers take it gets the decoder stack's forward (`stack_forward`)."""
    for layer in model.modules():
        if not _takes(layer):
            continue
        attention, mlp = layer.self_attn, layer.mlp
        attention.qkv_proj = _fused([attention.q_proj, attention.k_proj, attention.v_proj])
        attention.qk_sizes = (attention.q_proj.out_features, attention.k_proj.out_features)
        del attention.q_proj, attention.k_proj, attention.v_proj
        mlp.gate_up_proj = _fused([mlp.gate_proj, mlp.up_proj])
        del mlp.gate_proj, mlp.up_proj
        layer.forward = types.MethodType(lean_forward, layer)
    for decoder in model.modules():
        if type(decoder).__name__ in STACK_CLASSES and _all_lean(decoder):
            decoder.forward = types.MethodType(stack_forward, decoder)
            decoder.norm.forward = types.MethodType(_lean_norm, decoder.norm)
    return model


def _all_lean(decoder: torch.nn.Module) -> bool:
    layers = getattr(decoder, "layers", None)
    return bool(layers) and all(getattr(layer.forward, "__func__", None) is lean_forward for layer in layers)


def _rms_norm(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """RMSNorm in one C call (int8_kernel: ~6 µs for one token, torch's CPU rms_norm ~35 µs) where the
    kernels run and the model computes in float32; else transformers' own module."""
    library, _, problem = int8_kernel._library()
    if problem or hidden.dtype != torch.float32 or norm.weight.dtype != torch.float32:
        return type(norm).forward(norm, hidden)  # the module's own (a decoder's norm calls this: `_lean_norm`)
    hidden = hidden.contiguous()
    out = torch.empty_like(hidden)
    library.specdec_rms_norm(hidden.data_ptr(), norm.weight.data_ptr(), norm.variance_epsilon,
                             hidden.numel() // hidden.shape[-1], hidden.shape[-1], out.data_ptr())
    return out


def _rotate(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on (B, heads, T, D): states·cos + rotate_half(states)·sin."""
    half = states.shape[-1] // 2
    rotated = torch.cat((-states[..., half:], states[..., :half]), dim=-1)
    return states * cos + rotated * sin


class _Linear(ctypes.Structure):
    """One projection for layer_kernels.c (its `specdec_linear`)."""

    _fields_ = [("kind", ctypes.c_int64), ("in_features", ctypes.c_int64), ("out_features", ctypes.c_int64),
                ("width", ctypes.c_int64), ("limit", ctypes.c_int64), ("packed", ctypes.c_void_p),
                ("row_sums", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


def _described(layer: torch.nn.Module) -> _Linear | None:
    """`layer` as layer_kernels.c takes it, or None where it runs another way (int8 on oneDNN)."""
    bias = None if layer.bias is None else layer.bias.data_ptr()
    if isinstance(layer, Q4Linear):
        packed = layer.packed_weight
        return _Linear(2, layer.in_features, layer.out_features, packed.shape[1], 0, packed.data_ptr(), None, None, bias)
    if isinstance(layer, PerTokenInt8Linear) and layer.own_kernel:
        packed = layer.packed_weight
        return _Linear(1, layer.in_features, layer.out_features, packed.shape[1], 2 ** (layer.bits - 1) - 1,
                       packed.data_ptr(), layer.row_sums.data_ptr(), layer.weight_scales.data_ptr(), bias)
    return None


class _Held(tuple):
    """A (key, value) of descriptors made for C, kept on a module: pointers into that module's tensors. A deep copy
    of the model gets None instead (its tensors are elsewhere, and ctypes objects holding pointers cannot be
    copied), so the copy describes its own on its first forward."""

    def __deepcopy__(self, memo) -> None:
        return None


def _c_projections(layer: torch.nn.Module) -> tuple[_Linear, ...] | None:
    """The layer's four projections for C, described once and again whenever their weights moved (a copy of
    the model, a `.to()`); None where one of them does not run in C."""
    projections = _projections(layer)
    where = tuple(_address(projection) for projection in projections)
    held = getattr(layer, "_c_projections", None)
    if held is None or held[0] != where:
        described = tuple(_described(projection) for projection in projections)
        layer._c_projections = held = _Held((where, None if None in described else described))
    return held[1]


def _projections(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """A lean layer's four projections (q/k/v, o, gate/up, down), read from the modules' own dicts: nn.Module's
    attribute lookup costs ~1 µs a name, and the decoder stack asks for them every forward."""
    attention, mlp = layer._modules["self_attn"]._modules, layer._modules["mlp"]._modules
    return attention["qkv_proj"], attention["o_proj"], mlp["gate_up_proj"], mlp["down_proj"]


def _address(projection: torch.nn.Module) -> int:
    """Where a projection's packed weight lies; 0 for oneDNN's (a prepacked tensor without storage, whose address
    cannot be taken; the C never reads it): an int8 layer without specdec's kernel (no C compiler, not x86-64,
    SPECDEC_INT8_KERNEL=onednn)."""
    if not projection.__dict__.get("own_kernel", True):
        return 0
    return projection._buffers["packed_weight"].data_ptr()


def _runs_in_c(layer: torch.nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    return (hidden_states.shape[0] == 1 and hidden_states.dtype == torch.float32
            and (attention_mask is None or attention_mask.dtype == torch.bool) and _layer_in_c(layer))


def _layer_in_c(layer: torch.nn.Module) -> bool:
    """What `_runs_in_c` asks of the layer itself, whatever the input."""
    attention = layer.self_attn
    return (attention.config._attn_implementation in ("specdec_rowwise", "sdpa")
            and getattr(attention, "sliding_window", None) is None
            and layer.input_layernorm.weight.dtype == layer.post_attention_layernorm.weight.dtype == torch.float32
            and int8_kernel._library()[2] is None)


def _forward_in_c(self, projections: tuple[_Linear, ...], hidden_states: torch.Tensor, attention_mask, cache,
                  position_embeddings, kwargs) -> torch.Tensor:
    """The layer as three C calls and the cache update (see the module): hidden (1, T, H) → (1, T, H)."""
    library, isa, _ = int8_kernel._library()
    attention, threads = self.self_attn, torch.get_num_threads()
    tokens, width = hidden_states.shape[1:]
    hidden = hidden_states.contiguous()
    head_dim, (q_size, k_size) = attention.head_dim, attention.qk_sizes
    heads, kv_heads = q_size // head_dim, k_size // head_dim
    cos, sin = (part.float().contiguous() for part in position_embeddings)  # (1, T, D)
    query = torch.empty(tokens, heads, head_dim)
    key, value = torch.empty(1, kv_heads, tokens, head_dim), torch.empty(1, kv_heads, tokens, head_dim)
    qkv, o_proj, gate_up, down = projections
    norm = self.input_layernorm
    failed = library.specdec_lean_qkv(isa, threads, hidden.data_ptr(), tokens, width, norm.weight.data_ptr(),
                                      norm.variance_epsilon, ctypes.byref(qkv), cos.data_ptr(), sin.data_ptr(),
                                      heads, kv_heads, head_dim, query.data_ptr(), key.data_ptr(), value.data_ptr())
    if failed:
        raise MemoryError(f"specdec's layer kernels could not allocate their buffers for {tokens} tokens")
    if cache is not None:
        key, value = cache.update(key, value, attention.layer_idx, kwargs=kwargs)
    attended = attend_rows(library, query, key, value, attention_mask, attention.scaling)  # (T, heads, head dim)
    out = torch.empty_like(hidden)
    norm = self.post_attention_layernorm
    failed = library.specdec_lean_mlp(isa, threads, attended.data_ptr(), hidden.data_ptr(), tokens, width,
                                                ctypes.byref(o_proj), norm.weight.data_ptr(), norm.variance_epsilon,
                                                ctypes.byref(gate_up), ctypes.byref(down), out.data_ptr())
    if failed:
        raise MemoryError(f"specdec's layer kernels could not allocate their buffers for {tokens} tokens")
    return out


def lean_forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, cache=None, use_cache: bool | None = False,
                 position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, past_key_values=None,
                 **kwargs) -> torch.Tensor:
    """A decoder layer's forward (transformers' signature and result): hidden (B, T, hidden) → (B, T, hidden)."""
    attention, cache = self.self_attn, cache if cache is not None else past_key_values
    kwargs = {**kwargs, "position_ids": position_ids, "use_cache": use_cache}  # what transformers' attention gets
    if _runs_in_c(self, hidden_states, attention_mask) and (projections := _c_projections(self)) is not None:
        return _forward_in_c(self, projections, hidden_states, attention_mask, cache, position_embeddings, kwargs)
    batch, tokens = hidden_states.shape[:2]
    head_dim = attention.head_dim
    q_size, k_size = attention.qk_sizes
    qkv = attention.qkv_proj(_rms_norm(self.input_layernorm, hidden_states))  # (B, T, q + k + v)
    qk = qkv[..., :q_size + k_size].view(batch, tokens, -1, head_dim).transpose(1, 2)  # (B, heads + kv, T, D)
    cos, sin = position_embeddings  # (B, T, D)
    qk = _rotate(qk, cos.unsqueeze(1), sin.unsqueeze(1))
    query, key = qk[:, : q_size // head_dim], qk[:, q_size // head_dim:]
    value = qkv[..., q_size + k_size:].view(batch, tokens, -1, head_dim).transpose(1, 2)
    if cache is not None:
        key, value = cache.update(key, value, attention.layer_idx, kwargs=kwargs)
    eager = sys.modules[type(attention).__module__].eager_attention_forward
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(attention.config._attn_implementation, eager)
    extra = {"sliding_window": attention.sliding_window} if hasattr(attention, "sliding_window") else {}
    out, _ = attend(attention, query, key, value, attention_mask, dropout=0.0, scaling=attention.scaling,
                    **extra, **kwargs)
    hidden_states = hidden_states + attention.o_proj(out.reshape(batch, tokens, -1))
    gate_up = self.mlp.gate_up_proj(_rms_norm(self.post_attention_layernorm, hidden_states))
    gate, up = gate_up.chunk(2, dim=-1)
    return hidden_states + self.mlp.down_proj(torch.nn.functional.silu(gate) * up)


class _Layer(ctypes.Structure):
    """One decoder layer for layer_kernels.c (its `specdec_layer`)."""

    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("input_eps", ctypes.c_float),
                ("post_eps", ctypes.c_float), ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear),
                ("down", _Linear)]


def _stack_layers(decoder: torch.nn.Module):
    """The decoder's layers as one ctypes array for specdec_decoder_stack, made again whenever a layer's weights
    moved or the attention changed; None where a layer does not run in C (`_layer_in_c`, asked when it is made:
    what it asks changes only with the weights or the attention). Checked each forward through the modules' own
    dicts (`_stack_where`): per layer `_c_projections` and `_layer_in_c` made ~15 of nn.Module's attribute
    lookups (~1 µs each), 0.6-0.9 ms of a 12 ms forward of the 24-layer demo draft."""
    where = (decoder.config._attn_implementation, _stack_where(decoder))
    held = getattr(decoder, "_c_stack", None)
    if held is None or held[0] != where:
        layers = list(decoder.layers)
        described = [_c_projections(layer) for layer in layers]
        array = None
        if None not in described and all(_layer_in_c(layer) for layer in layers):
            array = (_Layer * len(described))(*(
                _Layer(layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                       layer.input_layernorm.variance_epsilon, layer.post_attention_layernorm.variance_epsilon,
                       *projections)
                for layer, projections in zip(layers, described)))
        decoder._c_stack = held = _Held((where, array))
    return held[1]


def _stack_where(decoder: torch.nn.Module) -> tuple[int, ...]:
    """The address of every weight tensor the C stack reads (each layer's four projections and two norms)."""
    where = []
    for layer in decoder._modules["layers"]._modules.values():
        parts = layer._modules
        where.extend(_address(projection) for projection in _projections(layer))
        where.append(parts["input_layernorm"]._parameters["weight"].data_ptr())
        where.append(parts["post_attention_layernorm"]._parameters["weight"].data_ptr())
    return tuple(where)


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
    """A Llama/Qwen2 decoder's forward (transformers' signature and result) in one call into C (layer_kernels.c:
    specdec_decoder_forward: the embedding, every layer, the final norm) for a batch of one over specdec's growing
    cache (engine/kv.py): the same steps as the embedding, the lean layers one by one and the decoder's norm
    (`_lean_norm`), so the same numbers bit for bit (tested), less ~0.1-0.3 ms of Python per layer. Anything else
    (another cache, a batch, an additive mask, hidden states asked for) goes through transformers' forward."""
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_outputs import BaseModelOutputWithPast

    cache = cache if cache is not None else past_key_values
    layers = None if _stack_declines(self, input_ids, inputs_embeds, cache, kwargs) else _stack_layers(self)
    if layers is not None:
        cached, tokens = cache.get_seq_length(), input_ids.shape[1]
        hidden = torch.empty(1, tokens, self.config.hidden_size)  # the C's scratch; its shape tells the mask builder T
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


def _lean_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """The forward a lean decoder's final RMSNorm gets (`use_lean_layers`): the C norm the layers use (`_rms_norm`),
    which the decoder stack applies in its own call, so a forward that goes the layered way (a batch, transformers'
    cache) normalises as the stack does, bit for bit; the module's own forward where that does not run."""
    return _rms_norm(self, hidden_states)


ROTARY_ROWS = 1024  # positions a decoder's rotary table holds at first (it doubles as positions grow)


def _rotary_rows(decoder: torch.nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor,
                 first: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (1, T, D) float32 for the rotary embedding at `position_ids`. For positions first, first + 1, ...
    (`first` given) and the default rope, rows of a table the decoder keeps: the rotary module's own numbers for
    those positions, bit for bit (each element is one product and a cos or sin: it does not depend on the other
    positions computed with it; tested), without its ~10 torch operations a forward — ~0.1 ms warm, several times
    that with the caches cold after a forward's weights streamed through them."""
    rotary = decoder.rotary_emb
    if first is None or getattr(rotary, "rope_type", None) != "default":
        return tuple(part.float().contiguous() for part in rotary(hidden, position_ids))
    tokens, held = hidden.shape[1], decoder.__dict__.get("_rotary_table")
    source = rotary.inv_freq.data_ptr()
    if held is None or held[0] != source or held[1][0].shape[1] < first + tokens:
        size = max(ROTARY_ROWS, 1 << (first + tokens - 1).bit_length())
        table = tuple(part.float().contiguous() for part in rotary(hidden, torch.arange(size).unsqueeze(0)))
        decoder._rotary_table = held = _Held((source, table))
    cos, sin = held[1]
    return cos[:, first:first + tokens], sin[:, first:first + tokens]


def _stack_in_c(decoder: torch.nn.Module, layers, cache, input_ids: torch.Tensor, hidden: torch.Tensor,
                cached: int, rotary: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None) -> torch.Tensor:
    """The decoder's output (1, T, H) for input_ids (1, T), normalised, in one call into C; each cache layer then
    holds its T new entries. hidden (1, T, H): scratch; rotary: cos, sin (1, T, D) float32, contiguous rows."""
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
    ids, embed, norm = input_ids.contiguous(), decoder.embed_tokens.weight, decoder.norm
    normed = torch.empty_like(hidden)
    library, isa, _ = int8_kernel._library()
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
