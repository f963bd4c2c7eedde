"""Models: resolving a user's string (hub id, local folder, .gguf file, demo pair) to loaded weights,
choosing device/dtype/quantisation, and the pre-flight checks made before loading.

This is the contract the engine, chat and CLI code against."""

import logging

# Once torchao (the `quant` extra) is installed, transformers imports it on every model load, and its
# import logs warnings about GPU libraries this machine cannot load and torch.compile deprecations:
# noise for a specdec user, so those two loggers show errors only.
for _logger_name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_logger_name).setLevel(logging.ERROR)

from specdec_cli.models.demo import DEMO_MODELS, INSTALL_DEMO
from specdec_cli.models.device import resolve_device, resolve_dtype
from specdec_cli.models.loaded import LoadedModel, load_model, load_pair
from specdec_cli.models.paths import specdec_home
from specdec_cli.models.preflight import check_tokenizers_compatible, estimate_weight_bytes
from specdec_cli.models.quant import ALIASES as QUANTIZATION_ALIASES
from specdec_cli.models.quant import CPU_ONLY as CPU_ONLY_QUANTIZATIONS
from specdec_cli.models.quant import FORMATS as QUANTIZATION_FORMATS
from specdec_cli.models.quant import canonical as canonical_quantization
from specdec_cli.models.quant import resolve_auto as resolve_auto_quantization

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
    "specdec_home",
]
