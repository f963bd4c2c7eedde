"""Quantisation formats, one name per model:

- `none`: the weights at the chosen dtype.
- `int8`: int8 weights per output channel, int8 activations per token, CPU (torch's oneDNN; int8.py).
- `int4`: int4 weights in groups, bfloat16 activations, CPU (torchao's CPU int4 config; int4.py).
- `q4`: 4-bit weights in groups of 32, int8 activations per token and group of 32, CPU (specdec's own
  matmul, llama.cpp's Q4_1 × Q8_0 recipe; q4.py).
- `nf4`, `bnb8`: bitsandbytes 4-bit (nf4) and 8-bit (LLM.int8), CUDA and x86 CPUs.
- `auto`: chosen per machine (`resolve_auto`).

Old names stay accepted: "4bit" = nf4, "8bit" = bnb8 (and "int8" keeps its name). bitsandbytes and
torchao are imported lazily and only in models/."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
        from specdec_cli.models.calibrate import auto_score, calibrated_seconds

        label = None if dtype is None else dtype_name(dtype)
        measured = {name: calibrated_seconds(spec, name, label) for name in runnable}
        measured = {name: seconds for name, seconds in measured.items() if seconds}
        if measured:
            return canonical(min(measured, key=lambda name: auto_score(role, measured[name])))
    return uncalibrated_format(runnable) if device.type == "cpu" else None


# What `auto` means on a CPU that `specdec calibrate` has not measured, per CPU kind, first allowed and runnable:
# - AVX512-VNNI: q4, then int8. Measured there in turn (AMD EPYC, demo pair; README "Choosing the formats"): the q4
#   target 19% faster than int8 by auto's score, whole generations 22.0 against 16.9 tok/s alone and 25.9 against
#   22.6 with the cascade; the q4 draft 17.6 / 20.5 / 22.7 ms against 24.0 / 26.5 / 28.7 for 1 / 2 / 4 tokens. A target
#   gets q4 only where its profile allows it (AUTO_FORMATS: int8 by default, closer to the float model).
# - AVX2 only: int8, the format measured on such a CPU (torch's dynamic int8: 4x faster than float32, flat to 4
#   tokens); q4 has not run on one (only its AVX2 code on an AVX512 CPU), so it waits for a calibration there.
UNCALIBRATED = {"AVX512-VNNI + AMX": ("q4", "int8"), "AVX512-VNNI": ("q4", "int8"), "AVX2": ("int8",)}


def uncalibrated_format(runnable: list[str]) -> str | None:
    """The format `auto` takes among `runnable` without a calibration (UNCALIBRATED for this CPU's kernels)."""
    from specdec_cli.models import int8_kernel

    _, isa, problem = int8_kernel._library()
    preferred = UNCALIBRATED["AVX2"] if problem else UNCALIBRATED[int8_kernel.ISA_NAMES[isa]]
    return next((name for name in preferred if name in runnable), None)


def _runs_here(name: str) -> bool:
    try:
        return _kernel_problem(name) is None
    except MissingExtraError:  # int4 without torchao: `auto` passes it over
        return False


def _kernel_problem(name: str) -> str | None:
    if name == "int8":
        from specdec_cli.models.int8 import int8_kernel_problem

        return int8_kernel_problem()
    if name == "q4":
        from specdec_cli.models.q4 import kernel_problem

        return kernel_problem()
    from specdec_cli.models.int4 import int4_kernel_problem

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


def quantize(model: torch.nn.Module, quantization: str | None, exact_rows: bool = True,
             gguf_path: Path | None = None, store: tuple[str, str] | None = None) -> torch.nn.Module:
    """Apply int8, int4 or q4 to a loaded model in place (the others are applied while loading). exact_rows: also
    compute attention row by row, so a k-token forward gives k one-token forwards' logits bit for bit — what
    a target needs for speculation to reproduce it; a draft does not (the target checks every draft token),
    and row-wise attention makes its multi-token catch-up forwards dearer (int8 0.5B, 8 tokens: 78 vs 55 ms).
    gguf_path: the `.gguf` the model was loaded from, whose 4-bit layers q4 then takes as they are (gguf_q4.py);
    store: (key, label) of the model's stored int8 or q4 layers (stored_layers.py), read or made and stored."""
    name = canonical(quantization)
    if name == "int8":
        return quantize_int8_dynamic(model, exact_rows, store)
    if name == "int4":
        from specdec_cli.models.int4 import quantize_int4

        return _rows(quantize_int4(model), exact_rows)
    if name == "q4":
        from specdec_cli.models.lean_layers import use_lean_layers
        from specdec_cli.models.q4 import quantize_q4

        return _rows(use_lean_layers(quantize_q4(model, gguf_path, store)), exact_rows)
    return model


def quantize_int8_dynamic(model: torch.nn.Module, exact_rows: bool = True,
                          store: tuple[str, str] | None = None) -> torch.nn.Module:
    """Every nn.Linear to int8 weights with int8 activations quantised per token on the fly, in place,
    CPU only; the rest in float32 (see int8.py); attention row by row when `exact_rows` (rowwise_attention.py)."""
    from specdec_cli.models.int8 import quantize_int8
    from specdec_cli.models.lean_layers import use_lean_layers

    return _rows(use_lean_layers(quantize_int8(model, store)), exact_rows)


def computes_rows_alone(model: torch.nn.Module) -> bool:
    """Whether `model` was quantised with `exact_rows` (its attention row by row): each position's logits are
    then the same bit for bit however its sequence is split into forwards, so entries cached for one
    sequence are exactly what another that shares them would compute."""
    from specdec_cli.engine.kv import prefill_path
    from specdec_cli.models.rowwise_attention import NAME

    # A copy's bfloat16 forwards round each row by how many rows they hold; the AMX path's do not (models/prefill.py).
    path = prefill_path(model)
    return (getattr(getattr(model, "config", None), "_attn_implementation", None) == NAME
            and (path is None or getattr(path, "row_exact", False)))


def _rows(model: torch.nn.Module, exact_rows: bool) -> torch.nn.Module:
    if not exact_rows:
        return model
    from specdec_cli.models.rowwise_attention import use_rowwise_attention

    return use_rowwise_attention(model)


def compute_dtype(quantization: str | None, dtype: torch.dtype) -> torch.dtype:
    """The dtype activations and the non-Linear weights run at: int8 and q4 float32, int4 bfloat16, else `dtype`."""
    from specdec_cli.models.int4 import COMPUTE_DTYPE

    return {"int8": torch.float32, "q4": torch.float32, "int4": COMPUTE_DTYPE}.get(canonical(quantization), dtype)


def precision(quantization: str | None, dtype_label: str) -> str:
    """What a model runs at, in words: `bfloat16`, or `int8 weights, per-token int8 activations`."""
    return PRECISIONS.get(canonical(quantization), dtype_label)


def linear_bytes(quantization: str | None, in_features: int, out_features: int, dtype: torch.dtype) -> int:
    """Bytes an (out × in) Linear weight takes in `quantization` (float: at `dtype`), scales included."""
    name = canonical(quantization)
    weights = in_features * out_features
    if name == "int8":
        from specdec_cli.models.int8 import matmul_name
        from specdec_cli.models.int8_kernel import packed_bytes

        if matmul_name() != "oneDNN":  # specdec's kernel: padded blocks + an int32 row sum per row
            return packed_bytes(out_features, in_features) + 8 * out_features
        return weights + 4 * out_features  # int8 values + a float32 scale per output channel
    if name == "int4":
        from specdec_cli.models.int4 import group_size

        size = group_size(in_features, out_features)
        if size is None:  # left unquantised, in bfloat16
            return 2 * weights
        return weights // 2 + 2 * 2 * out_features * (in_features // size)  # + a bf16 scale and zero per group
    if name == "q4":
        from specdec_cli.models.q4 import packed_bytes

        return packed_bytes(out_features, in_features)  # 4 bits a weight + fp16 scale and minimum per 32, padded
    if name in _BYTES_PER_WEIGHT:
        return int(weights * _BYTES_PER_WEIGHT[name])
    return weights * dtype.itemsize
