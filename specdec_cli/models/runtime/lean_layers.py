"""A leaner forward for the decoder layers of Llama-style models quantised to int8 or q4 (Llama, Qwen2, Qwen3,
Mistral, Phi-3, Gemma 2 and 3: architectures.py).

Why: with specdec's own matmuls a one-token forward spends a large part of its time outside the matmuls,
most of it in per-call overhead: transformers' layer makes ~13 module calls and ~60 tensor operations. Here a
layer makes one matmul call for q, k and v together, one for gate and up together, one C call per RMSNorm
(native/layer_kernels.c), and the rotary embedding once for q and k together.

The arithmetic is transformers' own, element for element: the projections are the same rows of the same
int8/q4 weights (a fused layer's rows are computed exactly as the separate layers' rows were), and the one
rotary pass does per element what transformers' code does. The RMSNorm sums its squares in double, so it
may differ from transformers' float32 one in the last bit; it is the same for every forward (each row on
its own), so a verify still equals one-token decoding bit for bit (tested). The cache, the attention function (row-wise for a target), masks and
positions are transformers' too, so trees, batches and caches behave as before.

Where a forward is a batch of one in float32 with a causal or boolean mask (every forward of the engine's
caches) and the C kernels run, the layer goes further: the two halves around its attention are one C call each
(native/layer_kernels.c: norm, q/k/v, rotary; o, residual, norm, gate/up, SiLU, down, residual) and the attention is
specdec's C attention (native/attention.c, through runtime/attention.py), so a layer is three calls and the cache
update instead of ~45 torch operations. Its SiLU takes exp from native/vector_math.h (exp_avx2), not torch's, so
these logits equal transformers' up to rounding (tested), and still each row's alone.

A decoder (LlamaModel, Qwen3Model, ...) all of whose layers are lean goes one step further for a batch of one over
the engine's growing cache: its whole forward in one call into C (decoder_stack.py).

Only the exact classes named in architectures.LAYER_CLASSES with SiLU MLPs are changed; other models keep
transformers' layers. Qwen3's RMSNorm over each head of q and k runs between the projection and the rotary embedding
(the same C norm, per head); Phi-3's q/k/v and gate/up come fused already and are kept as they are. Gemma's layer
adds norms of o's and down's outputs (`mlp_norms`), its norms scale by 1 + weight (kept once: `prepare_norms`), its
MLP takes GELU's tanh form, and Gemma 2's attention scores are soft-capped (in the C attention too)."""

from __future__ import annotations

import ctypes
import sys

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from specdec_cli.models.formats import levels, q4
from specdec_cli.models.formats.int8 import PerTokenInt8Linear
from specdec_cli.models.formats.levels import LevelsLinear
from specdec_cli.models.formats.q4 import Q4Linear
from specdec_cli.models.native import binding
from specdec_cli.models.runtime.architectures import LAYER_CLASSES
from specdec_cli.models.runtime.attention import attend_rows

Q4_FAMILY = (Q4Linear, LevelsLinear)  # a .gguf's layers in q4: the 4-bit ones and those of the types q4 cannot hold


def fused(layers: list[torch.nn.Module]) -> torch.nn.Module:
    """One layer whose output rows are `layers`' rows side by side, computed the same way."""
    if any(isinstance(layer, LevelsLinear) for layer in layers):
        return levels.fused(layers, _fused_bias(layers))
    if all(isinstance(layer, Q4Linear) for layer in layers):
        kind, bias, width = type(layers[0]), _fused_bias(layers), layers[0].in_features
        if all(type(layer) is kind for layer in layers):
            if all(layer.out_features % q4.ROWS == 0 for layer in layers):  # whole blocks of rows: the bytes, joined
                packed = torch.cat([layer.packed_weight for layer in layers])
                return kind(packed, bias, width, sum(layer.out_features for layer in layers))
            if kind is q4.Q4KLinear:
                parts = (torch.cat(tensors) for tensors in zip(*(layer.k_parts() for layer in layers)))
                return q4.Q4KLinear.from_k_parts(*parts, bias, width)
        # Layout 0 for all (a .gguf's Q4_K q and k beside its Q6_K v: their steps rounded to float16)
        parts = (torch.cat(tensors) for tensors in zip(*(layer.q4_parts() for layer in layers)))
        return Q4Linear.from_parts(*parts, bias, width)
    weight = torch.cat([layer.int8_weight() for layer in layers])
    scales = torch.cat([layer.weight_scales for layer in layers])
    return PerTokenInt8Linear(weight, scales, _fused_bias(layers), layers[0].bits)


def _fused_bias(layers: list[torch.nn.Module]) -> torch.Tensor | None:
    if all(layer.bias is None for layer in layers):
        return None
    return torch.cat([layer.bias if layer.bias is not None else torch.zeros(layer.out_features) for layer in layers])


def takes_lean_forward(layer: torch.nn.Module) -> bool:
    if not has_lean_shape(layer) or getattr(layer.forward, "__func__", None) is lean_forward:
        return False
    projections = qkv_parts(layer.self_attn) + gate_up_parts(layer.mlp)
    kinds = {Q4Linear if isinstance(projection, Q4_FAMILY) else type(projection) for projection in projections}
    return len(kinds) == 1 and kinds <= {Q4Linear, PerTokenInt8Linear}


def has_lean_shape(layer: torch.nn.Module) -> bool:
    """Whether `layer` is a layer the lean forward computes, whatever its projections' format: a fast architecture's
    layer class, an activation the C layers have and RMSNorms."""
    return (type(layer).__name__ in LAYER_CLASSES and activation_kind(getattr(layer, "mlp", None)) is not None
            and type(layer.input_layernorm).__name__.endswith("RMSNorm"))


ACTIVATIONS = {"SiLU": 0, "SiLUActivation": 0, "GELUTanh": 1, "PytorchGELUTanh": 1}  # the C's `activation`


def activation_kind(mlp: torch.nn.Module) -> int | None:
    """The MLP's activation as the C layers take it (0: SiLU, 1: GELU's tanh form), None for another."""
    return ACTIVATIONS.get(type(_activation(mlp)).__name__)


def _activation(mlp: torch.nn.Module) -> torch.nn.Module | None:
    return getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)  # Phi-3's name


def mlp_norms(layer: torch.nn.Module) -> tuple[torch.nn.Module | None, torch.nn.Module, torch.nn.Module | None]:
    """(the norm of o's output, the norm before the MLP, the norm of down's output): Gemma's four-norm layer has the
    first and last (its post_attention_layernorm is the first); every other layer only the middle one."""
    parts = layer._modules
    if "pre_feedforward_layernorm" in parts:
        return (parts["post_attention_layernorm"], parts["pre_feedforward_layernorm"],
                parts["post_feedforward_layernorm"])
    return None, parts["post_attention_layernorm"], None


def prepare_norms(layer: torch.nn.Module) -> None:
    """Gemma's RMSNorms scale by 1 + weight (in float32): that sum once, kept beside each (`norm_weight`)."""
    for norm in layer.modules():
        if type(norm).__name__.startswith("Gemma") and type(norm).__name__.endswith("RMSNorm"):
            norm.__dict__["lean_weight"] = (1.0 + norm.weight.detach().float()).contiguous()


def norm_weight(norm: torch.nn.Module) -> torch.Tensor:
    """What the RMSNorm multiplies by: its weight, or Gemma's 1 + weight (`prepare_norms`)."""
    return norm.__dict__.get("lean_weight", norm._parameters["weight"])


QKV_PARTS, GATE_UP_PARTS = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")  # fused as qkv_proj, gate_up_proj


def qkv_parts(attention: torch.nn.Module) -> list:
    """The q/k/v projections to fuse: Phi-3's one fused layer as it is, else q, k and v."""
    if hasattr(attention, "qkv_proj"):
        return [attention.qkv_proj]
    return [getattr(attention, name, None) for name in QKV_PARTS]


def gate_up_parts(mlp: torch.nn.Module) -> list:
    """The gate/up projections to fuse: Phi-3's one fused layer as it is, else gate and up."""
    if hasattr(mlp, "gate_up_proj"):
        return [mlp.gate_up_proj]
    return [getattr(mlp, name, None) for name in GATE_UP_PARTS]


def head_norms(attention: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """Qwen3's RMSNorms over each head of q and of k, None where the attention has none."""
    modules = attention._modules
    if "q_norm" not in modules:
        return None
    return modules["q_norm"], modules["k_norm"]


def _rms_norm(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """RMSNorm in one C call (through native/binding.py: a fraction of the per-call cost of torch's CPU rms_norm)
    where the kernels run and the model computes in float32; else transformers' own module's forward."""
    library, _, problem = binding.library()
    weight = norm_weight(norm)
    if problem or hidden.dtype != torch.float32 or weight.dtype != torch.float32:
        return type(norm).forward(norm, hidden)  # the module's own (a decoder's norm calls this: `lean_norm`)
    hidden = hidden.contiguous()
    out = torch.empty_like(hidden)
    library.specdec_rms_norm(hidden.data_ptr(), weight.data_ptr(), _epsilon(norm),
                             hidden.numel() // hidden.shape[-1], hidden.shape[-1], out.data_ptr())
    return out


def _epsilon(norm: torch.nn.Module) -> float:
    return norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps  # Gemma's is `eps`


def lean_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """The forward a lean decoder's final RMSNorm gets (`use_lean_layers`): the C norm the layers use, which the
    decoder stack (decoder_stack.py) applies in its own call, so a forward that goes the layered way (a batch,
    transformers' cache) normalises as the stack does, bit for bit; the module's own forward where that does not
    run."""
    return _rms_norm(self, hidden_states)


def _rotate(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on (B, heads, T, D): states·cos + rotate_half(states)·sin."""
    half = states.shape[-1] // 2
    rotated = torch.cat((-states[..., half:], states[..., :half]), dim=-1)
    return states * cos + rotated * sin


class CLinear(ctypes.Structure):
    """One projection for the C layers (native/kernels.h's `specdec_linear`: the same fields in order)."""

    _fields_ = [("kind", ctypes.c_int64), ("in_features", ctypes.c_int64), ("out_features", ctypes.c_int64),
                ("width", ctypes.c_int64), ("limit", ctypes.c_int64), ("packed", ctypes.c_void_p),
                ("row_sums", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


def _described(layer: torch.nn.Module) -> CLinear | None:
    """`layer` as the C layers take it, or None where it runs another way (int8 on oneDNN)."""
    bias = None if layer.bias is None else layer.bias.data_ptr()
    if isinstance(layer, Q4Linear):
        packed = layer.packed_weight
        return CLinear(2 + layer.layout, layer.in_features, layer.out_features, q4.packed_groups(packed, layer.layout),
                       0, packed.data_ptr(), None, None, bias)
    if isinstance(layer, LevelsLinear):
        packed = layer.packed_weight
        return CLinear(4, layer.in_features, layer.out_features, levels.packed_groups(packed, layer.form), layer.form,
                       packed.data_ptr(), None, None, bias)
    if isinstance(layer, PerTokenInt8Linear) and layer.own_kernel:
        packed = layer.packed_weight
        return CLinear(1, layer.in_features, layer.out_features, packed.shape[1], 2 ** (layer.bits - 1) - 1,
                       packed.data_ptr(), layer.row_sums.data_ptr(), layer.weight_scales.data_ptr(), bias)
    return None


class Held(tuple):
    """A (key, value) of descriptors made for C, kept on a module: pointers into that module's tensors. A deep copy
    of the model gets None instead (its tensors are elsewhere, and ctypes objects holding pointers cannot be
    copied), so the copy describes its own on its first forward."""

    def __deepcopy__(self, memo) -> None:
        return None


def c_projections(layer: torch.nn.Module) -> tuple[CLinear, ...] | None:
    """The layer's four projections for C, described once and again whenever their weights moved (a copy of
    the model, a `.to()`); None where one of them does not run in C."""
    projections = layer_projections(layer)
    where = tuple(address(projection) for projection in projections)
    held = getattr(layer, "_c_projections", None)
    if held is None or held[0] != where:
        described = tuple(_described(projection) for projection in projections)
        layer._c_projections = held = Held((where, None if None in described else described))
    return held[1]


def layer_projections(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """A lean layer's four projections (q/k/v, o, gate/up, down), read from the modules' own dicts: nn.Module's
    attribute lookup is slow next to a dict's, and the decoder stack asks for them every forward."""
    attention, mlp = layer._modules["self_attn"]._modules, layer._modules["mlp"]._modules
    return attention["qkv_proj"], attention["o_proj"], mlp["gate_up_proj"], mlp["down_proj"]


def address(projection: torch.nn.Module) -> int:
    """Where a projection's packed weight lies; 0 for oneDNN's (a prepacked tensor without storage, whose address
    cannot be taken; the C never reads it): an int8 layer without specdec's kernel (no C compiler, not x86-64,
    SPECDEC_KERNELS=onednn)."""
    if not projection.__dict__.get("own_kernel", True):
        return 0
    return projection._buffers["packed_weight"].data_ptr()


def _runs_in_c(layer: torch.nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    return (hidden_states.shape[0] == 1 and hidden_states.dtype == torch.float32
            and (attention_mask is None or attention_mask.dtype == torch.bool) and layer_in_c(layer))


def layer_in_c(layer: torch.nn.Module) -> bool:
    """What `_runs_in_c` asks of the layer itself, whatever the input."""
    attention = layer.self_attn
    norms = [layer.input_layernorm, *mlp_norms(layer), *(head_norms(attention) or ())]
    # A sliding-window layer's window is in the mask transformers made for it, which the C attention applies.
    return (attention.config._attn_implementation in ("specdec_rowwise", "sdpa")
            and all(norm is None or norm_weight(norm).dtype == torch.float32 for norm in norms)
            and binding.library()[2] is None)


def c_head_norms(attention: torch.nn.Module) -> tuple[int | None, int | None, float]:
    """(q norm's weight address, k norm's, their epsilon) for the C layers; (None, None, 0.0) without them."""
    norms = head_norms(attention)
    if norms is None:
        return None, None, 0.0
    return norm_weight(norms[0]).data_ptr(), norm_weight(norms[1]).data_ptr(), _epsilon(norms[0])


def c_mlp_norms(layer: torch.nn.Module) -> tuple[int | None, int, float, int | None, float]:
    """(o's output norm's weight address or None, the MLP's norm's, its epsilon, down's output norm's or None, the
    epsilon of those two) for the C layers (`mlp_norms`)."""
    before, norm, after = mlp_norms(layer)
    address_of = (lambda module: None if module is None else norm_weight(module).data_ptr())
    return (address_of(before), norm_weight(norm).data_ptr(), _epsilon(norm), address_of(after),
            _epsilon(before) if before is not None else 0.0)


def _forward_in_c(self, projections: tuple[CLinear, ...], hidden_states: torch.Tensor, attention_mask, cache,
                  position_embeddings, kwargs) -> torch.Tensor:
    """The layer as three C calls and the cache update (see the module): hidden (1, T, H) → (1, T, H)."""
    library, isa, _ = binding.library()
    attention, threads = self.self_attn, torch.get_num_threads()
    q_norm, k_norm, qk_eps = c_head_norms(attention)
    tokens, width = hidden_states.shape[1:]
    hidden = hidden_states.contiguous()
    head_dim, (q_size, k_size) = attention.head_dim, attention.qk_sizes
    heads, kv_heads = q_size // head_dim, k_size // head_dim
    cos, sin = (part.float().contiguous() for part in position_embeddings)  # (1, T, rotary dims)
    # The C writes float32 into them, whatever torch's default dtype is now (a model loading sets it for a while).
    query = torch.empty(tokens, heads, head_dim, dtype=torch.float32)
    key, value = (torch.empty(1, kv_heads, tokens, head_dim, dtype=torch.float32) for _ in range(2))
    qkv, o_proj, gate_up, down = projections
    norm = self.input_layernorm
    failed = library.specdec_lean_qkv(isa, threads, hidden.data_ptr(), tokens, width, norm_weight(norm).data_ptr(),
                                      _epsilon(norm), ctypes.byref(qkv), q_norm, k_norm, qk_eps,
                                      cos.data_ptr(), sin.data_ptr(), heads, kv_heads, head_dim, cos.shape[-1],
                                      query.data_ptr(), key.data_ptr(), value.data_ptr())
    if failed:
        raise MemoryError(f"specdec's layer kernels could not allocate their buffers for {tokens} tokens")
    if cache is not None:
        key, value = cache.update(key, value, attention.layer_idx, kwargs=kwargs)
    softcap = getattr(attention, "attn_logit_softcapping", None) or 0.0  # Gemma 2's
    attended = attend_rows(library, query, key, value, attention_mask, attention.scaling, softcap)  # (T, heads, D)
    out = torch.empty_like(hidden)
    before, norm, norm_eps, after, out_eps = c_mlp_norms(self)
    failed = library.specdec_lean_mlp(isa, threads, attended.data_ptr(), hidden.data_ptr(), tokens, width,
                                      ctypes.byref(o_proj), before, norm, norm_eps, ctypes.byref(gate_up),
                                      activation_kind(self.mlp), ctypes.byref(down), after, out_eps, out.data_ptr())
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
    if _runs_in_c(self, hidden_states, attention_mask) and (projections := c_projections(self)) is not None:
        return _forward_in_c(self, projections, hidden_states, attention_mask, cache, position_embeddings, kwargs)
    batch, tokens = hidden_states.shape[:2]
    head_dim = attention.head_dim
    q_size, k_size = attention.qk_sizes
    qkv = attention.qkv_proj(_rms_norm(self.input_layernorm, hidden_states))  # (B, T, q + k + v)
    qk = qkv[..., :q_size + k_size].view(batch, tokens, -1, head_dim)  # (B, T, heads + kv, D)
    if (norms := head_norms(attention)) is not None:
        heads = q_size // head_dim
        qk = torch.cat([_rms_norm(norms[0], qk[:, :, :heads]), _rms_norm(norms[1], qk[:, :, heads:])], dim=2)
    qk = qk.transpose(1, 2)  # (B, heads + kv, T, D)
    cos, sin = position_embeddings  # (B, T, rotary dims): D, or fewer (a partial rotary embedding)
    rotary = cos.shape[-1]
    turned = _rotate(qk[..., :rotary], cos.unsqueeze(1), sin.unsqueeze(1))
    qk = turned if rotary == head_dim else torch.cat([turned, qk[..., rotary:]], dim=-1)
    query, key = qk[:, : q_size // head_dim], qk[:, q_size // head_dim:]
    value = qkv[..., q_size + k_size:].view(batch, tokens, -1, head_dim).transpose(1, 2)
    if cache is not None:
        key, value = cache.update(key, value, attention.layer_idx, kwargs=kwargs)
    eager = sys.modules[type(attention).__module__].eager_attention_forward
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(attention.config._attn_implementation, eager)
    extra = {"sliding_window": attention.sliding_window} if hasattr(attention, "sliding_window") else {}
    if getattr(attention, "attn_logit_softcapping", None) is not None:  # Gemma 2
        extra["softcap"] = attention.attn_logit_softcapping
    out, _ = attend(attention, query, key, value, attention_mask, dropout=0.0, scaling=attention.scaling,
                    **extra, **kwargs)
    before, norm, after = mlp_norms(self)
    attended = attention.o_proj(out.reshape(batch, tokens, -1))
    hidden_states = hidden_states + (attended if before is None else _rms_norm(before, attended))
    gate, up = self.mlp.gate_up_proj(_rms_norm(norm, hidden_states)).chunk(2, dim=-1)
    acted = torch.nn.functional.silu(gate) if activation_kind(self.mlp) == 0 else _activation(self.mlp)(gate)
    mlp_out = self.mlp.down_proj(acted * up)
    return hidden_states + (mlp_out if after is None else _rms_norm(after, mlp_out))
