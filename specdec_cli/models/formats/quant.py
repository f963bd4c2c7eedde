"""Quantisation formats, one name per model:

- `none`: the weights at the chosen dtype.
- `int8`: int8 weights per output channel, int8 activations per token, CPU (specdec's own matmul, else torch's
  oneDNN; int8.py).
- `int4`: int4 weights in groups, bfloat16 activations, CPU (torchao's CPU int4 config; int4.py).
- `q4`: 4-bit weights in groups of 32, int8 activations per token and group of 32, CPU (specdec's own
  matmul, llama.cpp's Q4_1 × Q8_0 recipe; q4.py).
- `nf4`, `bnb8`: bitsandbytes 4-bit (nf4) and 8-bit (LLM.int8), CUDA and x86 CPUs.
- `auto`: chosen per machine (`resolve_auto`).

Old names stay accepted: "4bit" = nf4, "8bit" = bnb8 (and "int8" keeps its name). bitsandbytes and
torchao are imported lazily and only in models/."""

from __future__ import annotations

import importlib.util

import torch

from specdec_cli.errors import MissingExtraError, ModelLoadError
from specdec_cli.models.device import dtype_name
from specdec_cli.models.names import ALIASES, CPU_ONLY, FORMATS

PRECISIONS = {  # what describe() says a model runs at
    "int8": "int8 weights, per-token int8 activations",
    "int4": "int4 weights (groups of up to 128), bfloat16 activations",
    "q4": "4-bit weights (groups of 32), int8 activations per group of 32",
    "nf4": "nf4 weights (bitsandbytes), bfloat16 compute",
    "bnb8": "int8 weights (bitsandbytes LLM.int8)",
}
# Bytes per weight of the bitsandbytes formats: nf4 stores 4 bits per weight plus one fp32 absmax per
# 64 weights (double-quantised: ~0.127 bits). int8/int4 are counted exactly in linear_bytes.
_BYTES_PER_WEIGHT = {"nf4": 4.25 / 8, "bnb8": 1.0}


def canonical(quantization: str | None) -> str | None:
    """The format a name stands for (None for no quantisation, `auto` as is); ModelLoadError if unknown."""
    name = ALIASES.get(quantization, quantization)
    if name not in (None, *FORMATS):
        names = ", ".join(FORMATS)
        raise ModelLoadError(f"unknown quantization {quantization!r}", f"use one of {names} (or the old 4bit, 8bit)")
    return None if name == "none" else name


# What `auto` may pick per role when a profile does not say. A draft's format never changes the output
# (the target checks every draft token), so any format that runs may be picked; a target's changes what it
# says, so by default only int8 (per-channel weights, per-token activations: close to the float model).
AUTO_FORMATS = {"target": ("none", "int8"), "draft": ("none", "int8", "int4", "q4")}


def resolve_auto(role: str, device: torch.device, spec: str | None = None, dtype: torch.dtype | None = None,
                 allowed: tuple[str, ...] | None = None) -> str | None:
    """What `auto` means for `role` on `device`: among the `allowed` formats (a profile's
    `target_auto_formats`; else AUTO_FORMATS) that run here, the fastest one `specdec calibrate` measured on
    this machine for `spec` (a target by its 1-, 4- and 8-token forwards, where verification lives; a
    draft by its 1-, 2- and 4-token forwards: a step's first draft forward also takes in the tokens the
    last step accepted). Without a calibration: `uncalibrated_format` on the CPU, no quantisation elsewhere."""
    allowed = tuple(canonical(name) or "none" for name in (allowed or AUTO_FORMATS[role]))
    runnable = [name for name in allowed if name == "none" or (device.type == "cpu" and name in CPU_ONLY
                                                                and _runs_here(name))]
    if spec is not None:
        from specdec_cli.models.formats.calibration import auto_score, calibrated_seconds

        label = None if dtype is None else dtype_name(dtype)
        measured = {name: calibrated_seconds(spec, name, label) for name in runnable}
        measured = {name: seconds for name, seconds in measured.items() if seconds}
        if measured:
            return canonical(min(measured, key=lambda name: auto_score(role, measured[name])))
    return uncalibrated_format(runnable) if device.type == "cpu" else None


# What `auto` means on a CPU that `specdec calibrate` has not measured, per CPU kind, first allowed and runnable:
# - AVX512-VNNI: q4, then int8: every interleaved measurement there put q4 ahead of int8, for the target (by auto's
#   score and in whole generations) and for the draft (docs/models-and-formats.md, "How auto chooses"). A target
#   gets q4 only where its profile allows it (AUTO_FORMATS: int8 by default, closer to the float model).
# - AVX2 only: int8, the format measured on such a CPU (torch's dynamic int8 there: faster than float32, and flat
#   over a few tokens); q4 has not run on one (only its AVX2 code on an AVX512 CPU), so it waits for a calibration
#   there.
UNCALIBRATED = {"AVX512-VNNI + AMX": ("q4", "int8"), "AVX512-VNNI": ("q4", "int8"), "AVX2": ("int8",)}


def uncalibrated_format(runnable: list[str]) -> str | None:
    """The format `auto` takes among `runnable` without a calibration (UNCALIBRATED for this CPU's kernels)."""
    from specdec_cli.models.native import binding

    _, isa, problem = binding.library()
    preferred = UNCALIBRATED["AVX2"] if problem else UNCALIBRATED[binding.ISA_NAMES[isa]]
    return next((name for name in preferred if name in runnable), None)


def _runs_here(name: str) -> bool:
    try:
        return _kernel_problem(name) is None
    except MissingExtraError:  # int4 without torchao: `auto` passes it over
        return False


def _kernel_problem(name: str) -> str | None:
    if name == "int8":
        from specdec_cli.models.formats.int8 import int8_kernel_problem

        return int8_kernel_problem()
    if name == "q4":
        from specdec_cli.models.formats.q4 import kernel_problem

        return kernel_problem()
    from specdec_cli.models.formats.int4 import int4_kernel_problem

    return int4_kernel_problem()


def _instead(name: str) -> str:
    return {"int8": "use int4, nf4 or none instead", "int4": "use int8, q4, nf4 or none instead",
            "q4": "use int8 or int4 instead (q4 needs an x86-64 CPU with AVX2 and a C compiler: gcc, or set CC)"}[name]


def check_quantization(quantization: str | None, device: torch.device | None = None) -> str | None:
    """The canonical name, after checking that it can run on `device` (extras installed, kernel present)."""
    name = canonical(quantization)
    if name in CPU_ONLY and device is not None:
        if device.type != "cpu":
            raise ModelLoadError(
                f"{name} runs on the CPU only, not on {device.type}",
                "on a GPU use nf4 or bnb8 (bitsandbytes), or pass --device cpu",
            )
        problem = _kernel_problem(name)  # raises MissingExtraError when int4's torchao is missing
        if problem:
            raise ModelLoadError(f"{name} cannot run on this machine: {problem}", _instead(name))
    if name in ("nf4", "bnb8") and device is not None:
        require_bitsandbytes()
    return name


def require_bitsandbytes() -> None:
    """bitsandbytes can be imported: not installed names the extra; installed but failing to import (its native
    library built for another CUDA or CPU, a known way for it to break) says so in one line instead of the
    traceback transformers' import of it would print. The import is the one loading makes next anyway."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise MissingExtraError(
            "nf4/bnb8 (4-bit/8-bit) loading needs bitsandbytes, which is not installed",
            "pip install 'specdec[4bit]'",
        )
    try:
        importlib.import_module("bitsandbytes")
    except Exception as error:
        reason = next(iter(str(error).splitlines()), "") or type(error).__name__
        raise ModelLoadError(
            f"bitsandbytes is installed but does not load ({reason})",
            "reinstall it (pip install --force-reinstall bitsandbytes), or use another format (--target-quant "
            "int8, q4 or none on a CPU)",
        ) from None


def quantization_config(quantization: str | None):
    """A transformers BitsAndBytesConfig for nf4 (bf16 compute) or bnb8; None for the others, which are
    applied after loading (`quantize`)."""
    name = canonical(quantization)
    if name not in ("nf4", "bnb8"):
        return None
    require_bitsandbytes()
    from transformers import BitsAndBytesConfig

    if name == "nf4":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
    return BitsAndBytesConfig(load_in_8bit=True)


def compute_dtype(quantization: str | None, dtype: torch.dtype) -> torch.dtype:
    """The dtype activations and the non-Linear weights run at: int8 and q4 float32, int4 bfloat16, else `dtype`."""
    from specdec_cli.models.formats.int4 import COMPUTE_DTYPE

    return {"int8": torch.float32, "q4": torch.float32, "int4": COMPUTE_DTYPE}.get(canonical(quantization), dtype)


def precision(quantization: str | None, dtype_label: str) -> str:
    """What a model runs at, in words: `bfloat16`, or `int8 weights, per-token int8 activations`."""
    return PRECISIONS.get(canonical(quantization), dtype_label)


def linear_bytes(quantization: str | None, in_features: int, out_features: int, dtype: torch.dtype) -> int:
    """Bytes an (out × in) Linear weight takes in `quantization` (float: at `dtype`), scales included."""
    name = canonical(quantization)
    weights = in_features * out_features
    if name == "int8":
        from specdec_cli.models.formats.int8 import matmul_name
        from specdec_cli.models.native.binding import packed_bytes

        if matmul_name() != "oneDNN":  # specdec's kernel: padded blocks + an int32 row sum per row
            return packed_bytes(out_features, in_features) + 8 * out_features
        return weights + 4 * out_features  # int8 values + a float32 scale per output channel
    if name == "int4":
        from specdec_cli.models.formats.int4 import group_size

        size = group_size(in_features, out_features)
        if size is None:  # left unquantised, in bfloat16
            return 2 * weights
        return weights // 2 + 2 * 2 * out_features * (in_features // size)  # + a bf16 scale and zero per group
    if name == "q4":
        from specdec_cli.models.formats.q4 import packed_bytes

        return packed_bytes(out_features, in_features)  # 4 bits a weight + fp16 scale and minimum per 32, padded
    if name in _BYTES_PER_WEIGHT:
        return int(weights * _BYTES_PER_WEIGHT[name])
    return weights * dtype.itemsize
