"""One resolver: a user's string → where its config, tokenizer and weights are.

Accepted: `demo:<name>` (the offline pair), a `.gguf` file, a local folder (config + safetensors), a
hub id `org/name[@revision]`, or a hub repository's .gguf file by its tag, `org/name[@revision]:Q4_K_M`.
Resolving reads metadata only; weights are fetched by `weights_folder`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specdec_cli.errors import ModelLoadError, ModelNotFoundError
from specdec_cli.models.loading import demo, gguf, hub
from specdec_cli.models.progress import library_bars


@dataclass(frozen=True)
class ModelSource:
    spec: str  # what the user typed
    kind: str  # "folder" | "gguf" | "hub"
    location: str  # a local path, or hub id@revision
    metadata_folder: Path | None  # config + tokenizer files (None for a .gguf not converted yet)
    gguf_path: Path | None = None
    gguf_identity: str | None = None  # cache key of a .gguf conversion

    def converted_folder(self, dtype: torch.dtype) -> Path | None:
        """For a .gguf source: its cached safetensors folder at `dtype`, if converted already and whole."""
        if self.gguf_path is None:
            return None
        folder = gguf.converted_folder(self.gguf_path, dtype, self.gguf_identity)
        return folder if folder.exists() and gguf.conversion_problem(folder) is None else None


def _demo_source(spec: str, progress: bool) -> ModelSource:
    model = demo.demo_model(spec)
    path = demo.ensure_joined(model, progress)
    return ModelSource(spec, "gguf", str(path), None, gguf_path=path, gguf_identity=model.sha256[:16])


def _path_source(spec: str, path: Path) -> ModelSource:
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{spec} is a folder without a config.json", _what_the_folder_holds(path))
        if not _has(path, hub.SAFETENSORS_PATTERNS + hub.PICKLE_PATTERNS):  # said now, not after a memory estimate
            raise _no_weights(spec)
        return ModelSource(spec, "folder", str(path.resolve()), path)
    if path.suffix.lower() == ".gguf":
        return ModelSource(spec, "gguf", str(path.resolve()), None, gguf_path=path)
    raise ModelLoadError(f"{spec} is a file but not a .gguf", "pass a .gguf file, a model folder or a hub id")


def _what_the_folder_holds(path: Path) -> str:
    """The hint for a folder that is not a model folder: the .gguf files in it (llama.cpp's downloads), the hub id of
    a Hugging Face cache entry (models--org--name), else what a model folder is."""
    ggufs = sorted(child.name for child in path.glob("*.gguf") if child.is_file())
    if len(ggufs) == 1:
        return f"it holds {ggufs[0]}: pass {path / ggufs[0]}"
    if ggufs:
        return f"pass one of the .gguf files it holds: {', '.join(ggufs[:4])}{', ...' if len(ggufs) > 4 else ''}"
    parts = path.resolve().name.split("--")
    if len(parts) == 3 and parts[0] == "models":
        return f"it is a Hugging Face cache entry: pass its hub id, {parts[1]}/{parts[2]}"
    return "pass a folder saved with save_pretrained, a .gguf file or a hub id"


def _hub_source(spec: str) -> ModelSource:
    folder = hub.download(spec, hub.METADATA_PATTERNS)
    repo_id, revision = hub.split_revision(spec)
    if not (folder / "config.json").is_file():  # llama.cpp users' repositories hold .gguf files and no config
        raise ModelNotFoundError(f"{spec} has no config.json on the hub (a repository of .gguf files?)",
                                 f"name one of its .gguf files by its quantisation, as llama.cpp's -hf does: "
                                 f"{spec}:Q4_K_M")
    return ModelSource(spec, "hub", f"{repo_id}@{revision or 'main'}", folder)


def resolve(spec: str, progress: bool = True) -> ModelSource:
    if demo.is_demo_spec(spec):
        return _demo_source(spec, progress)
    path = Path(spec).expanduser()
    if path.exists():
        return _path_source(spec, path)
    if spec.lower().endswith(".gguf") or spec.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"{spec}: no such file or folder", "check the path")
    if hub.is_hub_id(spec):
        with library_bars(progress):  # huggingface_hub's "Fetching N files", not with -q
            return _hub_source(spec)
    if hub.gguf_tag(spec) is not None:
        with library_bars(progress):
            path = hub.download_gguf(spec)
        return ModelSource(spec, "gguf", str(path), None, gguf_path=path)
    raise ModelNotFoundError(
        f"{spec!r} is not a file, folder, demo model or hub id",
        "pass org/name for a hub model, a local folder, a .gguf file, or demo:qwen2.5-coder-1.5b",
    )


def _has(folder: Path, patterns: list[str]) -> bool:
    return any(next(folder.glob(pattern), None) is not None for pattern in patterns)


def check_weight_format(folder: Path, spec: str, allow_pickle: bool) -> bool:
    """True when the folder has safetensors weights; refuse pickle-only weights unless allowed."""
    if _has(folder, hub.SAFETENSORS_PATTERNS):
        return True
    if _has(folder, hub.PICKLE_PATTERNS):
        if allow_pickle:
            return False
        raise ModelLoadError(
            f"{spec} has only pickle weights (.bin/.pt), which can run code when loaded",
            "convert it to safetensors, or pass --allow-pickle if you trust it",
        )
    raise _no_weights(spec)


def _no_weights(spec: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"{spec} has no weights (no .safetensors files)",
        "check the folder or hub id; a model with only .bin weights needs --allow-pickle",
    )


def weights_folder(source: ModelSource, dtype: torch.dtype, allow_pickle: bool, progress: bool = True) -> Path:
    """A local folder holding config, tokenizer and weights: downloads or converts as needed."""
    if source.kind == "gguf":
        return gguf.ensure_converted(source.gguf_path, dtype, source.gguf_identity, progress)
    if source.kind == "hub":
        folder = hub.download(source.spec, hub.METADATA_PATTERNS + hub.SAFETENSORS_PATTERNS)
        if allow_pickle and not _has(folder, hub.SAFETENSORS_PATTERNS):  # pickle weights only where they are the only
            folder = hub.download(source.spec, hub.PICKLE_PATTERNS)  # ones (not both formats), into the same snapshot
        return folder
    return source.metadata_folder


def _cached_demo_config(spec: str) -> Path | None:
    model = demo.demo_model(spec)
    conversions = gguf.existing_conversions(demo.joined_path(model), model.sha256[:16])
    return conversions[0] / "config.json" if conversions else None


def _cached_hub_config(spec: str) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    repo_id, revision = hub.split_revision(spec)
    found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    return Path(found) if isinstance(found, str) else None


def local_config_folder(spec: str) -> Path | None:
    """A folder holding `spec`'s config.json if one is on this machine already; never touches the network."""
    if demo.is_demo_spec(spec):
        config = _cached_demo_config(spec) if spec.removeprefix(demo.DEMO_PREFIX) in demo.DEMO_MODELS else None
    elif Path(spec).expanduser().is_dir():
        config = Path(spec).expanduser() / "config.json"
    elif hub.is_hub_id(spec):
        config = _cached_hub_config(spec)
    else:
        config = None
    return config.parent if config is not None and config.is_file() else None


def local_config(spec: str):
    """`spec`'s config (a transformers PretrainedConfig) from what this machine holds, never the network; None where
    it holds none: the config.json of its folder (`local_config_folder`), else the metadata of its .gguf — a local
    file, or the demo's (joined now where it is not yet, as loading it joins it). So what is decided from a config
    before loading (`--prefill auto`) does not change once a bfloat16 conversion of the file happens to be made: on
    a machine where the demo target ran in place, `--prefill auto` resolved to "none" until some command converted
    it, and to "bf16" after, and the same `run` then gave other text (issue 61's flaky identity test)."""
    from transformers import AutoConfig

    try:
        folder = local_config_folder(spec)
        if folder is not None:
            return AutoConfig.from_pretrained(folder)
        if demo.is_demo_spec(spec):
            path = demo.ensure_joined(demo.demo_model(spec), progress=False)
        elif (path := Path(spec).expanduser()).suffix.lower() != ".gguf" or not path.is_file():
            return None
        return gguf.config_of(path)
    except Exception:  # not installed, unreadable, a config transformers refuses: loading it says what is wrong
        return None

