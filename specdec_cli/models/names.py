"""The names a profile or a flag may give a dtype or a quantisation format, without torch: `specdec --help`,
a usage mistake and a profile's checks read them before anything imports torch (importing torch is a large part
of what a command spends before it can print its help)."""

from __future__ import annotations

DTYPE_NAMES = ("bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32")  # device.DTYPES' keys
FORMATS = ("none", "int8", "int4", "q4", "nf4", "bnb8", "auto")
ALIASES = {"4bit": "nf4", "8bit": "bnb8"}
QUANTIZATIONS = (None, *FORMATS, *ALIASES)  # every value a profile or caller may pass
CPU_ONLY = ("int8", "int4", "q4")
