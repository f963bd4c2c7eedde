"""A model's quantised layers (q4, and int8 on specdec's matmul) kept on disk between runs, under the specdec
home (`layers/`).

Why: making them is work every load repeated for the same bytes — for q4 a .gguf's Q4_K blocks unpacked and
packed again and every other layer quantised from the loaded weights, for int8 every layer quantised and packed
into the kernel's blocks: a large part of every chat's, run's and compare's load. Reading them back is one file
read.

An entry is keyed by what decides those bytes: the format (int8: its activation bits too), the model's files
(name, size and modification time of each), the .gguf the layers come from, the dtype the weights loaded at,
and the code that makes them (the quantisers' and packers' Python and C): a change to any of them misses and
makes a new entry, which replaces the model's older ones. An entry is written whole or not at all
(paths.atomic_file), and only where the disk keeps twice its size free besides: a full disk, a read-only home
or a damaged entry only means the layers are made again, as before. Each layer read back is checked against
the module it replaces (its class, shape and bias), and anything that does not fit makes the whole entry a miss.
Layers on torch's oneDNN int8 matmul (an opaque packed tensor) are not stored."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from specdec_cli.errors import CacheWriteError
from specdec_cli.models.formats import int8, levels
from specdec_cli.models.formats.int8 import PerTokenInt8Linear, replace_linears
from specdec_cli.models.formats.levels import LevelsLinear
from specdec_cli.models.formats.q4 import Q4KLinear, Q4Linear
from specdec_cli.models.native import binding
from specdec_cli.models.paths import atomic_file, specdec_home

KIND = "layers"
FORMAT = 5  # the entry's own layout (below); bump on a change to it
# the formats' code beside this module; with the native code, the bytes
_CODE = ("q4.py", "gguf_q4.py", "levels.py", "gguf_levels.py", "int8.py")
NOTE = "_specdec_q4_from_gguf"  # a model's note on its layers that an entry keeps (q4: taken from the .gguf, of all)


def entry_key(model_files: Path | None, gguf_path: Path | list[Path] | None, dtype: torch.dtype,
              quantization: str) -> str | None:
    """The key of the `quantization` layers of the model in folder `model_files` (loaded at `dtype`, with its
    4-bit layers from `gguf_path` where given: a file, or a split set's parts; a .gguf read in place has no folder);
    None where a file cannot be read (then nothing is stored)."""
    bits = int8.activation_bits() if quantization == "int8" else None
    digest = hashlib.sha256(f"specdec stored layers {FORMAT} {quantization} {bits} {dtype}".encode())
    try:
        here = Path(__file__).parent
        for path in (*(here / name for name in _CODE), Path(binding.__file__), *binding.SOURCES, *binding.HEADERS):
            digest.update(path.read_bytes())
        files = [] if model_files is None else sorted(path for path in Path(model_files).iterdir() if path.is_file())
        gguf_files = [] if gguf_path is None else [gguf_path] if isinstance(gguf_path, (str, Path)) else gguf_path
        for path in files + [Path(gguf_file) for gguf_file in gguf_files]:
            stat = path.stat()
            digest.update(f"{path.resolve()} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    except OSError:
        return None
    return f"{quantization}-{digest.hexdigest()[:32]}"


def replace_linears_stored(model: torch.nn.Module, store: tuple[str, str] | None,
                           make: Callable[[torch.nn.Module], torch.nn.Module]) -> torch.nn.Module:
    """`make(model)` (every nn.Linear to a quantised layer, in place), or the same layers read from the entry
    `store` = (key, label) where it has them; what `make` made is stored there for the next load."""
    names = {id(module): name for name, module in model.named_modules()}
    linears = {name: module for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    stored = None if store is None else read(*store, linears)
    if stored is not None:
        model = replace_linears(model, lambda linear: stored["layers"][names[id(linear)]])
        if stored["note"] is not None:
            setattr(model, NOTE, tuple(stored["note"]))
        return model
    model = make(model)
    if store is not None:
        note = getattr(model, NOTE, None)
        write(*store, {name: model.get_submodule(name) for name in linears}, None if note is None else list(note))
    return model


def _entry(key: str, label: str) -> Path:
    return specdec_home() / KIND / f"{_slug(label)}-{key}.safetensors"


def _slug(label: str) -> str:
    return "".join(char if char.isalnum() or char in "._" else "-" for char in label)[-80:] or "model"


def read(key: str, label: str, linears: dict[str, torch.nn.Linear]) -> dict | None:
    """{"layers": {module name: quantised layer} for every Linear in `linears`, "note": the model's note}, or None
    (no entry, or one that does not fit these modules: each layer must replace a Linear of its shape and bias)."""
    from safetensors import SafetensorError, safe_open

    path = _entry(key, label)
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as entry:
            described = json.loads(entry.metadata()["layers"])
            note = json.loads(entry.metadata()["note"])
            if sorted(described) != sorted(linears):
                return None
            layers = {}
            for name, linear in linears.items():
                kind, in_features, out_features, has_bias, *extra = described[name]
                if (in_features, out_features, has_bias) != (linear.in_features, linear.out_features,
                                                             linear.bias is not None):
                    return None
                layer = _layer(kind, lambda part: entry.get_tensor(f"{name}.{part}"), in_features, out_features,
                               has_bias, extra)
                if layer is None:
                    return None
                layers[name] = layer
    except (OSError, SafetensorError, KeyError, ValueError, TypeError, json.JSONDecodeError):
        return None
    return {"layers": layers, "note": note}


def _layer(kind: str, part: Callable[[str], torch.Tensor], in_features: int, out_features: int, has_bias: bool,
           extra: list) -> torch.nn.Module | None:
    bias = part("bias") if has_bias else None
    if kind in ("q4", "q4k"):
        return (Q4Linear if kind == "q4" else Q4KLinear)(part("packed"), bias, in_features, out_features)
    if kind == "levels":
        packed, form = part("packed"), extra[0]
        fits = (packed.dim() == 3 and packed.shape[-1] == levels.unit_bytes(form)
                and packed.shape[0] * levels.ROWS >= out_features)
        return LevelsLinear(packed, form, bias, in_features, out_features) if fits else None
    if kind == "int8":
        return PerTokenInt8Linear.from_packed(part("packed"), part("row_sums"), part("scales"), bias, extra[0],
                                              in_features)
    return None


def _parts(layer: torch.nn.Module) -> tuple[str, dict[str, torch.Tensor], list] | None:
    """(kind, tensors, extra description) of a quantised layer; None for one that cannot be stored."""
    if isinstance(layer, Q4Linear):
        return "q4k" if isinstance(layer, Q4KLinear) else "q4", {"packed": layer.packed_weight}, []
    if isinstance(layer, LevelsLinear):
        return "levels", {"packed": layer.packed_weight}, [layer.form]
    if isinstance(layer, PerTokenInt8Linear) and layer.own_kernel:
        parts = {"packed": layer.packed_weight, "row_sums": layer.row_sums, "scales": layer.weight_scales}
        return "int8", parts, [layer.bits]
    return None


def write(key: str, label: str, layers: dict[str, torch.nn.Module], note: list | None) -> bool:
    """Store `layers` ({module name: quantised layer}) as the entry for `key`, replacing the model's older entries
    (the same label); False where it was not written (a layer that cannot be stored, too little free disk, or it
    could not be)."""
    from safetensors.torch import save_file

    tensors, described = {}, {}
    for name, layer in layers.items():
        found = _parts(layer)
        if found is None:
            return False
        kind, parts, extra = found
        if layer.bias is not None:
            parts = {**parts, "bias": layer.bias}
        tensors.update({f"{name}.{part}": tensor.contiguous() for part, tensor in parts.items()})
        described[name] = [kind, layer.in_features, layer.out_features, layer.bias is not None, *extra]
    size = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    path = _entry(key, label)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(path.parent).free < 2 * size:
            return False
        with atomic_file(path) as staging:
            save_file(tensors, str(staging), metadata={"layers": json.dumps(described), "note": json.dumps(note)})
        for older in path.parent.glob(f"{_slug(label)}-{key.split('-')[0]}-*.safetensors"):
            if older != path:
                older.unlink(missing_ok=True)
    except (OSError, RuntimeError, ValueError, CacheWriteError):  # a full disk, a read-only home: made next time
        return False
    return True
