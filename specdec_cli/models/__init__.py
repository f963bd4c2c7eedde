"""Models: resolving a user's string (hub id, local folder, .gguf file, demo pair) to loaded weights,
choosing device/dtype/quantisation, and the pre-flight checks made before loading. This is the contract the
engine, chat and CLI code against; the names below are its public face.

Inside, imports point one way: `native/` (the C kernels and their one binding) <- `formats/` (quantisation formats,
which one `auto` picks, the stored layers and calibration) <- `runtime/` (attention, lean layers, the decoder stack,
applying a format) <- `loading/` (name -> files -> loaded model, the prompt-reading path) <- `calibrate.py` (timing
loaded models); `paths`, `names`, `device` and `progress` are leaves any of them may import."""

import logging

# Once torchao (the `quant` extra) is installed, transformers imports it on every model load, and its
# import logs warnings about GPU libraries this machine cannot load and torch.compile deprecations:
# noise for a specdec user, so those two loggers show errors only. So does bitsandbytes' CPU backend: on a CPU with
# AVX512-BF16 its import asks the hub for a kernel repository it then does not trust (nor can it reach one offline),
# and logs a warning every time nf4 or bnb8 loads.
for _logger_name in ("torchao", "torch.utils._pytree", "bitsandbytes.backends.cpu.ops"):
    logging.getLogger(_logger_name).setLevel(logging.ERROR)

from specdec_cli.lazy import exports

# Imported on first use, so that a module reading one light name from models/ (paths, names) does not import torch
# and transformers with it.
__getattr__ = exports(__name__, {
    "DEMO_MODELS": (".loading.demo", "DEMO_MODELS"),
    "INSTALL_DEMO": (".loading.demo", "INSTALL_DEMO"),
    "resolve_device": (".device", "resolve_device"),
    "resolve_dtype": (".device", "resolve_dtype"),
    "LoadedModel": (".loading.loaded", "LoadedModel"),
    "load_model": (".loading.loaded", "load_model"),
    "load_pair": (".loading.loaded", "load_pair"),
    "specdec_home": (".paths", "specdec_home"),
    "row_kernels": (".native.binding", "row_kernels"),
    "check_tokenizers_compatible": (".loading.preflight", "check_tokenizers_compatible"),
    "estimate_weight_bytes": (".loading.preflight", "estimate_weight_bytes"),
    "QUANTIZATION_ALIASES": (".names", "ALIASES"),
    "CPU_ONLY_QUANTIZATIONS": (".names", "CPU_ONLY"),
    "QUANTIZATION_FORMATS": (".names", "FORMATS"),
    "canonical_quantization": (".formats.quant", "canonical"),
    "resolve_auto_quantization": (".formats.quant", "resolve_auto"),
})

__all__ = [
    "CPU_ONLY_QUANTIZATIONS",
    "DEMO_MODELS",
    "INSTALL_DEMO",
    "LoadedModel",
    "QUANTIZATION_ALIASES",
    "QUANTIZATION_FORMATS",
    "canonical_quantization",
    "check_tokenizers_compatible",
    "estimate_weight_bytes",
    "load_model",
    "load_pair",
    "resolve_auto_quantization",
    "resolve_device",
    "resolve_dtype",
    "row_kernels",
    "specdec_home",
]
