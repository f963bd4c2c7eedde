"""4-bit / 8-bit loading through bitsandbytes, imported lazily and only here."""

from __future__ import annotations

import importlib.util

import torch

from specdec_cli.errors import MissingExtraError, ModelLoadError

QUANTIZATIONS = (None, "4bit", "8bit")


def check_quantization(quantization: str | None) -> None:
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"unknown quantization {quantization!r}", "use 4bit or 8bit")


def require_bitsandbytes() -> None:
    if importlib.util.find_spec("bitsandbytes") is None:
        raise MissingExtraError(
            "4-bit/8-bit loading needs bitsandbytes, which is not installed",
            "pip install 'specdec[4bit]'",
        )


def quantization_config(quantization: str | None):
    """A transformers BitsAndBytesConfig for "4bit" (nf4, bf16 compute) or "8bit"; None for no quantization."""
    check_quantization(quantization)
    if quantization is None:
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
