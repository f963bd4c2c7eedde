"""`.gguf` files: converted once (dequantised by transformers + gguf) to a cached safetensors folder.

A conversion is keyed by the file (its identity), the dtype and the versions of transformers and gguf
that made it: a conversion bug fixed by an upgrade (or brought by one) gets a fresh entry instead of
being read back from the cache for ever. One process converts a file at a time (paths.one_maker), only where
the disk and the free RAM hold it, and a cached conversion found damaged is converted again. Each load also
removes the conversions the one it reads supersedes (`superseded_conversions`), once they have gone unread for a
week (KEEP_UNUSED_SECONDS): without that, every upgrade of transformers left the old conversions behind, and the
disk filled with specdec's own dead entries.

A load that reads a .gguf's config and tokenizer from its metadata keeps them (`keep_metadata`, under gguf-metadata/ in
the specdec home) for the next load, which reads them in half a second instead of parsing every value again."""

from __future__ import annotations

import copy
import functools
import glob
import hashlib
import importlib.util
import json
import os
import shutil
import struct
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from specdec_cli.errors import InsufficientMemoryError, MissingExtraError, ModelLoadError, SpecdecError
from specdec_cli.models.device import available_memory_bytes, dtype_name, format_gib
from specdec_cli.models.formats.gguf_q4 import element_count
from specdec_cli.models.paths import atomic_folder, cache_dir, check_room, one_maker
from specdec_cli.models.progress import status


def require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise MissingExtraError("loading .gguf files needs the gguf package", "pip install 'specdec[gguf]'")


def file_identity(path: Path) -> str:
    """A cheap identity for a file: its absolute path, size and mtime (a changed file gets a new cache entry)."""
    stat = path.stat()
    text = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "none"


def converter_versions() -> str:
    """The versions of the two packages that read and dequantise a .gguf, as part of a cache key."""
    return f"tf{_version('transformers')}-gguf{_version('gguf')}"


def _conversion_key(path: Path, identity: str | None) -> str:
    return f"{path.stem}-{identity or file_identity(path)}-{converter_versions()}"


def converted_folder(path: Path, dtype: torch.dtype, identity: str | None = None) -> Path:
    """Where the safetensors conversion of `path` at `dtype` lives (it may not exist yet)."""
    return cache_dir("gguf") / f"{_conversion_key(path, identity)}-{dtype_name(dtype)}"


def existing_conversions(path: Path, identity: str | None = None) -> list[Path]:
    """The cached conversions of `path` by today's converter, at any dtype (the file itself need not exist
    when `identity` is given)."""
    return sorted(cache_dir("gguf").glob(f"{_conversion_key(path, identity)}-*"))


# The readers of the shared_readers() in force, by file (empty: none is).
_SHARED_READERS: list[dict[Path, object]] = []


def config_of(path: Path):
    """A .gguf's transformers config (from its metadata), read once per process and version of the file, a copy
    each time (callers set attributes on theirs), from the file's kept metadata (`kept_metadata`) where a load kept
    it. Reading it from the file parses every metadata value (the vocabulary: a string per token), ~11 s for a
    Qwen2.5-7B-shaped file's on an AMD EPYC here, and `--prefill auto`'s resolution before loading and the load
    itself each need it."""
    stat = path.stat()
    kept = kept_metadata(path)
    return copy.deepcopy(_config_of(str(path.resolve()), stat.st_size, stat.st_mtime_ns, kept and str(kept)))


@functools.lru_cache(maxsize=8)
def _config_of(path: str, size: int, mtime_ns: int, kept: str | None):
    from transformers import AutoConfig

    file = Path(path)
    if kept is None:
        return AutoConfig.from_pretrained(str(file.parent), gguf_file=file.name)
    config = AutoConfig.from_pretrained(kept)
    config._name_or_path = str(file.parent)  # as read from the file
    return config


# What a kept metadata folder holds: the config, and in TOKENIZER the tokenizer's files as save_pretrained writes them
# (apart: AutoTokenizer beside a config.json takes the config's model class, which rebuilds the pipeline; see below).
TOKENIZER = "tokenizer"
_KEPT = ("config.json", f"{TOKENIZER}/tokenizer_config.json")


def metadata_folder(path: Path) -> Path:
    """Where `path`'s config and tokenizer, as transformers reads them from its metadata, are kept once a load has
    read them (`keep_metadata`): config.json and the tokenizer's files (in TOKENIZER), no weights. Reading them back
    takes half a second where the file's metadata took ~20 s for a Qwen2.5-7B-shaped file here (the config and the
    tokenizer each parse every value); keyed like a conversion, by the file's identity and the readers' versions."""
    return cache_dir("gguf-metadata") / _conversion_key(path, None)


def kept_metadata(path: Path) -> Path | None:
    """`metadata_folder(path)` where a load kept it whole, else None."""
    try:
        folder = metadata_folder(path)
    except (OSError, SpecdecError):  # a home that cannot be made: read from the file, as before
        return None
    return folder if all((folder / name).is_file() for name in _KEPT) else None


def keep_metadata(path: Path, config, tokenizer) -> None:
    """Keep the config and tokenizer read from `path`'s metadata for the next load (whole or not at all; where it
    cannot be written, or reads back as another tokenizer, the next load reads the file again).

    The tokenizer is kept as its own tokenizers pipeline (tokenizer.json) read back by the generic fast class:
    transformers' model classes (Qwen2Tokenizer, ...) rebuild their class's normaliser and pre-tokeniser from the
    vocabulary instead of the file's, and a tokenizer made from a .gguf has its own (Qwen2's read back by its class
    split "\n    " otherwise). What is kept is read back before it is kept and must be the same tokenizer."""
    if kept_metadata(path) is not None:
        return
    from transformers import AutoTokenizer

    try:
        with atomic_folder(metadata_folder(path)) as staging:
            config.save_pretrained(staging)
            tokenizer.save_pretrained(staging / TOKENIZER)
            settings = json.loads((staging / TOKENIZER / "tokenizer_config.json").read_text())
            settings["tokenizer_class"] = "PreTrainedTokenizerFast"  # the pipeline as saved (see above)
            (staging / TOKENIZER / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
            if not _same_tokenizer(tokenizer, AutoTokenizer.from_pretrained(staging / TOKENIZER)):
                raise _NotKept
    except (_NotKept, OSError, ValueError, TypeError, KeyError, AttributeError, SpecdecError):
        pass


class _NotKept(Exception):
    pass


def _same_tokenizer(read, kept) -> bool:
    """Whether the tokenizer `kept` reads back as is `read`: the same pipeline, special and added tokens, chat
    template and decoding settings."""
    settings = ("all_special_tokens", "all_special_ids", "added_tokens_decoder", "chat_template",
                "clean_up_tokenization_spaces", "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    return (getattr(read, "backend_tokenizer", None) is not None
            and json.loads(read.backend_tokenizer.to_str()) == json.loads(kept.backend_tokenizer.to_str())
            and all(getattr(read, name, None) == getattr(kept, name, None) for name in settings))


@contextmanager
def shared_readers() -> Iterator[None]:
    """While it lasts, every gguf.GGUFReader of one file is the same reader. A first load of a .gguf reads it
    for the memory pre-flight's config, the tokenizer, then (transformers) for the conversion's config,
    weights and tokenizer again, and each read parses every metadata value (the vocabulary: a string per
    token), seconds a read. transformers imports GGUFReader from gguf when it reads, so a
    version that imports it otherwise just reads as often as before. Re-entrant; a file's reader (its numpy
    views of the metadata, its mapped weights) is let go after the file's conversion, the rest at the end."""
    if _SHARED_READERS or importlib.util.find_spec("gguf") is None:  # no gguf: reading a .gguf says what to install
        yield
        return
    import gguf

    original = gguf.GGUFReader
    readers: dict[Path, object] = {}

    def reader(file, *args, **kwargs):
        if args or kwargs:
            return original(file, *args, **kwargs)
        path = Path(file).resolve()
        if path not in readers:
            readers[path] = original(file)
        return readers[path]

    _SHARED_READERS.append(readers)
    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original
        _SHARED_READERS.clear()


def _convert(path: Path, dtype: torch.dtype, destination: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # dequantize=True: a plain dense model that save_pretrained can write (packed GGUF blocks cannot be saved).
    unpack = GgufConfig(dequantize=True)
    try:
        with shared_readers():
            model = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=dtype, quantization_config=unpack
            )
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            for readers in _SHARED_READERS:  # the conversion is the file's last read
                readers.pop(path.resolve(), None)
    except (ValueError, OSError, KeyError) as error:
        raise ModelLoadError(f"cannot read {path.name} as a GGUF model: {error}", "check the file is a complete .gguf") from None
    model.save_pretrained(destination)
    tokenizer.save_pretrained(destination)


def ensure_converted(path: Path, dtype: torch.dtype, identity: str | None = None, progress: bool = True) -> Path:
    """Return the cached safetensors folder for `path`, converting it first if this is the first time, or again
    where the cached one is damaged (a file cut short or gone: `conversion_problem`)."""
    folder = converted_folder(path, dtype, identity)
    if folder.exists() and conversion_problem(folder) is None:
        return _used(folder, path, dtype, identity)
    require_gguf()
    with one_maker(folder, status(f"another specdec is converting {path.name}; waiting ...", progress)):
        what = "converting"
        if folder.exists():
            problem = conversion_problem(folder)
            if problem is None:  # another process made it meanwhile
                return _used(folder, path, dtype, identity)
            what = f"its cached conversion is damaged ({problem}): converting"
            shutil.rmtree(folder, ignore_errors=True)
        _drop_unused(path, dtype, identity)  # before the room check: they may be what fills the disk
        size = element_count(path) * dtype.itemsize
        check_room(folder.parent, size, f"converting {path.name} to safetensors")
        _check_memory(path, int(CONVERSION_MEMORY * size))
        with status(f"{what} {path.name} to safetensors (once) ...", progress):
            with atomic_folder(folder) as staging:
                _convert(path, dtype, staging)
                (staging / SOURCE).write_text(json.dumps(_source_record(path, dtype)), encoding="utf-8")
    return folder  # made just now: its time is its stamp, and what it supersedes was dropped before


# How long a superseded conversion stays unread before it goes: another install beside this one (another venv with
# another transformers, sharing the home) still reads its own, and removing it at once made the two convert in turn
# at every start (a long conversion holding gigabytes of memory, each time).
KEEP_UNUSED_SECONDS = 7 * 24 * 3600


def _used(folder: Path, path: Path, dtype: torch.dtype, identity: str | None) -> Path:
    """Mark `folder` read now (its own modification time: a file in it would change the key of the layers stored
    from it, stored_layers.entry_key, and remake them at every load), drop the conversions it supersedes that have
    gone unread, and return it."""
    try:
        os.utime(folder)
    except OSError:  # a read-only home: nothing is dropped for want of a stamp
        pass
    _drop_unused(path, dtype, identity)
    return folder


def _drop_unused(path: Path, dtype: torch.dtype, identity: str | None) -> None:
    now = time.time()
    for older in superseded_conversions(path, dtype, identity):
        if now - _last_read(older) > KEEP_UNUSED_SECONDS:
            shutil.rmtree(older, ignore_errors=True)


def _last_read(folder: Path) -> float:
    """When a load last read `folder` (a conversion from before the stamps: when it was made)."""
    try:
        return folder.stat().st_mtime
    except OSError:
        return time.time()


SOURCE = "specdec-source.json"  # in each conversion: the .gguf (its absolute path) and dtype it was made from


def _source_record(path: Path, dtype: torch.dtype) -> dict:
    return {"gguf": str(path.resolve()), "dtype": dtype_name(dtype)}


def superseded_conversions(path: Path, dtype: torch.dtype, identity: str | None = None) -> list[Path]:
    """The cached conversions of `path` at `dtype` other than today's: those of the same file by other versions of
    transformers or gguf (an upgrade; the key says so), and those of what the path held before (a file changed or
    downloaded again: their SOURCE names the path). This install can read none of them again. Another dtype's
    conversion stays, and so do conversions from before SOURCE of a file since changed (nothing names their file)."""
    identity = identity or file_identity(path)
    current = converted_folder(path, dtype, identity)
    home = current.parent
    if not home.is_dir():
        return []
    stem = glob.escape(path.stem)
    older = set(home.glob(f"{stem}-{identity}-tf*-gguf*-{dtype_name(dtype)}"))
    record = _source_record(path, dtype)
    for folder in home.glob(f"{stem}-*-{dtype_name(dtype)}"):
        try:
            if json.loads((folder / SOURCE).read_text(encoding="utf-8")) == record:
                older.add(folder)
        except (OSError, ValueError):
            continue
    return sorted(folder for folder in older if folder != current and folder.is_dir())


# What a conversion holds at its peak, in multiples of the converted weights' size: transformers keeps every
# dequantised tensor and the model's own copy (read from the demo pair's conversions: peak RSS over the process's
# start, the file's mapped pages included).
CONVERSION_MEMORY = 1.6


def _check_memory(path: Path, needed: int) -> None:
    """InsufficientMemoryError where the conversion would not fit in the free RAM: the kernel would kill the
    process half-way, with no message."""
    available = available_memory_bytes(torch.device("cpu"))
    if needed > available:
        raise InsufficientMemoryError(
            f"converting {path.name} to safetensors (once) needs ~{format_gib(needed)} of RAM, "
            f"but only {format_gib(available)} is free", "close other programs and run it again")


def conversion_problem(folder: Path) -> str | None:
    """What is wrong with a finished conversion folder, read from its files' sizes and safetensors headers only
    (no tensor data is read): no config, no weights, a shard its index names missing, a file shorter or longer than its
    header says. None where nothing is."""
    if not (folder / "config.json").is_file():
        return "no config.json"
    files = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    try:
        if index.is_file():
            named = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
            missing = sorted(name for name in named if not (folder / name).is_file())
            if missing:
                return f"{missing[0]} missing"
        if not files:
            return "no weights"
        for file in files:
            if _safetensors_size(file) != file.stat().st_size:
                return f"{file.name} cut short"
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return "unreadable"
    return None


def _safetensors_size(file: Path) -> int:
    """The size a safetensors file must have: 8 bytes, its JSON header, then its tensors' data to the last offset."""
    with file.open("rb") as handle:
        (header_size,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_size))
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    return 8 + header_size + max(ends, default=0)
