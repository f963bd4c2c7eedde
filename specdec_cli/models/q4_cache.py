"""A model's q4 layers kept on disk between runs, under the specdec home (`q4/`).

Why: making them is work every load repeated — a .gguf's Q4_K blocks unpacked and packed again, every other
layer quantised from the loaded weights — about 2.5 s of the demo pair's 4.6 s load on every chat, run and
compare (AMD EPYC, 2 cores), for the same bytes each time. Reading them back is one file read.

An entry is keyed by what decides those bytes: the model's files (name, size and modification time of each),
the .gguf the layers come from, the dtype the weights loaded at, and the code that makes them (q4.py,
gguf_q4.py and the C quantiser's source): a change to any of them misses and makes a new entry, which replaces
the model's older ones. An entry is written whole or not at all (paths.atomic_file), and only where the disk
keeps twice its size free besides: a full disk, a read-only home or a damaged entry only means the layers are
made again, as before. Each layer read back is checked against the module it replaces (its class, shape and
bias), and anything that does not fit makes the whole entry a miss."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from specdec_cli.models.paths import atomic_file, specdec_home

KIND = "q4"
FORMAT = 1  # the entry's own layout (below); bump on a change to it
_CODE = ("q4.py", "gguf_q4.py", "q4_gemm.c")  # what makes the bytes, beside this module


def entry_key(model_files: Path, gguf_path: Path | None, dtype: torch.dtype) -> str | None:
    """The key of the q4 layers of the model in folder `model_files` (loaded at `dtype`, with its 4-bit layers
    from `gguf_path` where given); None where a file cannot be read (then nothing is cached)."""
    digest = hashlib.sha256(f"specdec q4 cache {FORMAT} {dtype}".encode())
    try:
        here = Path(__file__).parent
        for name in _CODE:
            digest.update((here / name).read_bytes())
        files = sorted(path for path in Path(model_files).iterdir() if path.is_file())
        for path in files + ([Path(gguf_path)] if gguf_path is not None else []):
            stat = path.stat()
            digest.update(f"{path.resolve()} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    except OSError:
        return None
    return digest.hexdigest()[:32]


def _entry(key: str, label: str) -> Path:
    return specdec_home() / KIND / f"{_slug(label)}-{key}.safetensors"


def _slug(label: str) -> str:
    return "".join(char if char.isalnum() or char in "._" else "-" for char in label)[-80:] or "model"


def read(key: str, label: str, names: list[str], linears: dict[str, torch.nn.Linear]) -> dict | None:
    """{module name: q4 layer} for every Linear in `linears` and the entry's note on them (`from_gguf`), or None
    (no entry, or one that does not fit these modules: each layer must replace a Linear of its shape and bias)."""
    from safetensors import SafetensorError, safe_open

    from specdec_cli.models.q4 import Q4KLinear, Q4Linear

    path = _entry(key, label)
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as entry:
            described = json.loads(entry.metadata()["layers"])
            note = json.loads(entry.metadata()["from_gguf"])
            if sorted(described) != sorted(names):
                return None
            layers = {}
            for name in names:
                kind, in_features, out_features, has_bias = described[name]
                linear = linears[name]
                if (in_features, out_features, has_bias) != (linear.in_features, linear.out_features,
                                                             linear.bias is not None):
                    return None
                layer_class = {"q4": Q4Linear, "q4k": Q4KLinear}[kind]
                bias = entry.get_tensor(f"{name}.bias") if has_bias else None
                layers[name] = layer_class(entry.get_tensor(f"{name}.packed"), bias, in_features, out_features)
    except (OSError, SafetensorError, KeyError, ValueError, TypeError, json.JSONDecodeError):
        return None
    return {"layers": layers, "from_gguf": note}


def write(key: str, label: str, layers: dict[str, torch.nn.Module], from_gguf: list[int] | None) -> bool:
    """Store `layers` ({module name: Q4Linear}) as the entry for `key`, replacing the model's older entries (the
    same label); False where it was not written (too little free disk, or it could not be)."""
    from safetensors.torch import save_file

    from specdec_cli.models.q4 import Q4KLinear

    tensors, described = {}, {}
    for name, layer in layers.items():
        tensors[f"{name}.packed"] = layer.packed_weight.contiguous()
        if layer.bias is not None:
            tensors[f"{name}.bias"] = layer.bias.contiguous()
        described[name] = ["q4k" if isinstance(layer, Q4KLinear) else "q4", layer.in_features, layer.out_features,
                           layer.bias is not None]
    size = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    path = _entry(key, label)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(path.parent).free < 2 * size:
            return False
        with atomic_file(path) as staging:
            save_file(tensors, str(staging), metadata={"layers": json.dumps(described),
                                                       "from_gguf": json.dumps(from_gguf)})
        for older in path.parent.glob(f"{_slug(label)}-*.safetensors"):
            if older != path:
                older.unlink(missing_ok=True)
    except (OSError, RuntimeError, ValueError):  # a full disk or a read-only home: the layers are made next time
        return False
    return True

