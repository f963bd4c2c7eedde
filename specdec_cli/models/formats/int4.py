"""int4 on the CPU: weight-only int4 (asymmetric, a scale and a zero per group of input channels)
through torchao's CPU int4 config (`PrototypeInt4WeightOnlyConfig`, an Int4OpaqueTensor weight),
which runs torch's own int4 matmul, `aten._weight_int4pack_mm_for_cpu`.

Weight-only, so a token's logits never depend on the other tokens of a forward. Activations stay
bfloat16: that kernel is many times slower with float32 or float16 activations (seen on a CPU with
AVX512-BF16; an AVX2-only one is untried). torchao is the optional `quant` extra, imported here only,
lazily."""

from __future__ import annotations

import functools
import importlib

import torch

from specdec_cli.errors import MissingExtraError

GROUP_SIZES = (128, 64, 32)  # the largest that divides a layer's input width is used
ROW_MULTIPLE = 16  # the CPU int4 packing needs the output width to be a multiple of 16
COMPUTE_DTYPE = torch.bfloat16
INSTALL_QUANT = "pip install 'specdec[quant]'"


def import_torchao():
    """The torchao module, or MissingExtraError naming the extra."""
    try:
        return importlib.import_module("torchao")  # its import-time log lines are muted in models/__init__.py
    except ImportError:
        raise MissingExtraError("int4 needs torchao, which is not installed", INSTALL_QUANT) from None


def group_size(in_features: int, out_features: int) -> int | None:
    """The group size a layer of this shape gets, or None when it stays unquantised (at the compute dtype)."""
    if out_features % ROW_MULTIPLE:
        return None
    return next((size for size in GROUP_SIZES if in_features % size == 0), None)


def _config(size: int):
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

    return PrototypeInt4WeightOnlyConfig(group_size=size, set_inductor_config=False)


def quantize_int4(model: torch.nn.Module, dtype: torch.dtype = COMPUTE_DTYPE) -> torch.nn.Module:
    """Every nn.Linear whose shape the kernel takes (`group_size`; the output layer too) to int4, in place;
    the model in `dtype` (bfloat16: the kernel's fast path). A tied output layer gets its own int4 copy
    beside the float embedding."""
    import_torchao()
    from torchao.quantization import quantize_

    model.to(dtype)
    for size in GROUP_SIZES:
        def takes(module: torch.nn.Module, _name: str, size: int = size) -> bool:
            return isinstance(module, torch.nn.Linear) and group_size(module.in_features, module.out_features) == size
        quantize_(model, _config(size), filter_fn=takes)
    return model


def int4_kernel_problem() -> str | None:
    """None when torch's CPU int4 matmul runs here; else why not. MissingExtraError without torchao."""
    import_torchao()  # not cached: a missing package is reported every time
    return _probe()


@functools.cache
def _probe() -> str | None:
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return "this torch build has no CPU int4 matmul"
    try:
        layer = quantize_int4(torch.nn.Sequential(torch.nn.Linear(128, 16)))
        layer(torch.randn(2, 128, dtype=COMPUTE_DTYPE))
    except (RuntimeError, AssertionError, NotImplementedError) as error:
        return f"torch's CPU int4 matmul does not run here ({type(error).__name__})"
    return None
