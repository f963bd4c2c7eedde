"""Applying a quantisation format to a loaded model, in place: its Linear layers to the format's (formats/), read
from or kept in the stored layers, then the runtime's lean layers and decoder stack where they run, and attention
row by row where verifying k tokens must give k one-token forwards' logits bit for bit."""

from __future__ import annotations


import torch

from specdec_cli.engine.kv import prefill_path
from specdec_cli.models.formats import stored_layers
from specdec_cli.models.formats.int4 import quantize_int4
from specdec_cli.models.formats.int8 import PerTokenInt8Linear, replace_linears
from specdec_cli.models.formats.q4 import Q4Linear
from specdec_cli.models.formats.quant import canonical
from specdec_cli.models.runtime import decoder_stack
from specdec_cli.models.runtime.attention import NAME, use_rowwise_attention


def quantize(model: torch.nn.Module, quantization: str | None, exact_rows: bool = True,
             store: tuple[str, str] | None = None) -> torch.nn.Module:
    """Apply int8, int4 or q4 to a loaded model in place (the others are applied while loading). exact_rows: also
    compute attention row by row, so a k-token forward gives k one-token forwards' logits bit for bit — what
    a target needs for speculation to reproduce it; a draft does not (the target checks every draft token),
    and row-wise attention makes its multi-token catch-up forwards dearer.
    store: (key, label) of the model's stored int8 or q4 layers (formats/stored_layers.py), read or made and stored."""
    name = canonical(quantization)
    if name == "int8":
        return quantize_int8_dynamic(model, exact_rows, store)
    if name == "int4":
        return _rows(quantize_int4(model), exact_rows)
    if name == "q4":
        return _rows(decoder_stack.use_lean_layers(quantize_q4(model, store)), exact_rows)
    return model


def quantized_in_place(model: torch.nn.Module, exact_rows: bool = True) -> torch.nn.Module:
    """A model whose Linear layers were made q4 as it loaded (loading/gguf_model.py): the lean layers and the decoder
    stack where they run, and attention row by row when `exact_rows`, as `quantize` gives a q4 model."""
    return _rows(decoder_stack.use_lean_layers(model), exact_rows)


def quantize_int8_dynamic(model: torch.nn.Module, exact_rows: bool = True,
                          store: tuple[str, str] | None = None) -> torch.nn.Module:
    """Every nn.Linear to int8 weights with int8 activations quantised per token on the fly, in place,
    CPU only; the rest in float32 (see formats/int8.py); attention row by row when `exact_rows`
    (runtime/attention.py)."""
    return _rows(decoder_stack.use_lean_layers(quantize_int8(model, store)), exact_rows)


def computes_rows_alone(model: torch.nn.Module) -> bool:
    """Whether `model` was quantised with `exact_rows` (its attention row by row): each position's logits are
    then the same bit for bit however its sequence is split into forwards, so entries cached for one
    sequence are exactly what another that shares them would compute."""
    # A copy's bfloat16 forwards round each row by how many rows they hold; the AMX path's do not (loading/prefill.py).
    path = prefill_path(model)
    return (getattr(getattr(model, "config", None), "_attn_implementation", None) == NAME
            and (path is None or getattr(path, "row_exact", False)))


def _rows(model: torch.nn.Module, exact_rows: bool) -> torch.nn.Module:
    if not exact_rows:
        return model
    return use_rowwise_attention(model)


def quantize_int8(model: torch.nn.Module, store: tuple[str, str] | None = None) -> torch.nn.Module:
    """Every nn.Linear (the output layer too) to `PerTokenInt8Linear`, in place (`replace_linears`). store: (key,
    label) of the model's entry in formats/stored_layers.py: its layers where it has them, else made and stored."""
    return stored_layers.replace_linears_stored(model, store,
                                                lambda whole: replace_linears(whole, PerTokenInt8Linear.from_linear))


def quantize_q4(model: torch.nn.Module, store: tuple[str, str] | None = None) -> torch.nn.Module:
    """Every nn.Linear (the output layer too) to `Q4Linear`, in place (int8.replace_linears). store: (key, label) of
    the model's entry in formats/stored_layers.py: its layers where it has them, else made and stored. (A .gguf's
    own 4-bit blocks are taken as it loads in place: loading/gguf_model.py.)"""
    return stored_layers.replace_linears_stored(model, store, lambda whole: replace_linears(whole, Q4Linear.from_linear))
