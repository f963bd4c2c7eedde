"""Quantised loading: 4-bit / 8-bit through bitsandbytes (imported lazily and only here), and int8
through torch's own dynamic quantisation (CPU only; meant for the draft model)."""

from __future__ import annotations

import importlib.util

import torch

from specdec_cli.errors import MissingExtraError, ModelLoadError

QUANTIZATIONS = (None, "4bit", "8bit", "int8")


def check_quantization(quantization: str | None, device: torch.device | None = None) -> None:
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"unknown quantization {quantization!r}", "use 4bit, 8bit or int8")
    if quantization == "int8" and device is not None and device.type != "cpu":
        raise ModelLoadError(
            f"int8 (torch dynamic quantisation) runs on the CPU only, not on {device.type}",
            "on a GPU use --draft-4bit or --load-in-8bit (bitsandbytes), or pass --device cpu",
        )


def require_bitsandbytes() -> None:
    if importlib.util.find_spec("bitsandbytes") is None:
        raise MissingExtraError(
            "4-bit/8-bit loading needs bitsandbytes, which is not installed",
            "pip install 'specdec[4bit]'",
        )


def quantization_config(quantization: str | None):
    """A transformers BitsAndBytesConfig for "4bit" (nf4, bf16 compute) or "8bit"; None for no quantization."""
    check_quantization(quantization)
    if quantization in (None, "int8"):  # int8 is applied after loading (quantize_int8_dynamic)
        return None
    require_bitsandbytes()
    from transformers import BitsAndBytesConfig

    if quantization == "4bit":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
    return BitsAndBytesConfig(load_in_8bit=True)


def quantize_int8_dynamic(model: torch.nn.Module) -> torch.nn.Module:
    """Every nn.Linear to int8 weights (per output channel) with activations quantised on the fly, in
    place, CPU only. The rest of the model runs in fp32. For a draft model on CPU this halves the bytes
    a forward reads (and fbgemm's int8 kernels are fast): a forward of the 0.5B demo draft takes
    ~42 ms instead of ~90 ms in bf16. Lossless for speculation: the target checks every draft token."""
    import warnings

    from torch.ao import quantization as ao

    model.float()
    with warnings.catch_warnings():  # torch announces a future move of these APIs to torchao, on every call
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        ao.quantize_dynamic(model, {torch.nn.Linear: ao.per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)
    return model
