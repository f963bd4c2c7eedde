"""Hugging Face hub ids: downloaded with huggingface-hub into the standard HF cache.

HF_HOME, HF_HUB_CACHE, HF_TOKEN and HF_HUB_OFFLINE are honoured by huggingface-hub itself."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from specdec_cli.errors import ModelNotFoundError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")

# Enough to read the config and the tokenizer before committing to a multi-GB weight download.
METADATA_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.tiktoken",
    "chat_template*",
]
SAFETENSORS_PATTERNS = ["*.safetensors", "*.safetensors.index.json"]
PICKLE_PATTERNS = ["*.bin", "*.bin.index.json", "*.pt"]


# llama.cpp's `-hf org/name:Q4_K_M`: a repository of .gguf files and the quantisation tag of one of them.
_GGUF_TAG = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(@(?P<revision>[\w.-]+))?:(?P<tag>[A-Za-z0-9][\w.-]*)$")
_SPLIT = re.compile(r"-\d{5}-of-\d{5}$")  # llama-gguf-split's parts: name-00001-of-00003.gguf


def is_hub_id(spec: str) -> bool:
    return bool(_HUB_ID.match(spec))


def gguf_tag(spec: str) -> tuple[str, str | None, str] | None:
    """(repo id, revision, tag) of `org/name[@revision]:TAG`; None for any other spec."""
    found = _GGUF_TAG.match(spec)
    return (found["repo"], found["revision"], found["tag"]) if found else None


def download_gguf(spec: str) -> Path:
    """The .gguf file of `org/name[@revision]:TAG` (its name ends in TAG, in any case, as llama.cpp's -hf picks it),
    downloaded into the HF cache (offline: found there), or the first part of a split set (every part downloaded);
    one line where the repository has none, or several."""
    repo_id, revision, tag = gguf_tag(spec)
    variants = {tag, tag.lower(), tag.upper()}
    patterns = [f"*[-_.]{variant}{part}.gguf" for variant in variants for part in ("", "-*-of-*")]
    folder = download(f"{repo_id}@{revision}" if revision else repo_id, patterns)
    found = sorted(path for path in folder.rglob("*.gguf")
                   if re.search(rf"[-_.]{re.escape(tag)}$", _SPLIT.sub("", path.stem), re.IGNORECASE))
    if not found:
        raise ModelNotFoundError(f"{repo_id} has no .gguf file whose name ends in {tag}",
                                 f"check the tag against the repository's files (hf download {repo_id} --include "
                                 "'*.gguf' --dry-run lists them), e.g. :Q4_K_M")
    if found and all(_SPLIT.search(path.stem) for path in found):
        return found[0]  # a split set, all its parts downloaded: its first part names it (loading/gguf_model.py)
    if len(found) > 1:
        names = ", ".join(path.name for path in found[:4])
        raise ModelNotFoundError(f"{repo_id} has {len(found)} .gguf files ending in {tag} ({names})",
                                 "download the one you mean (hf download) and pass that file")
    return found[0]


def split_revision(spec: str) -> tuple[str, str | None]:
    repo_id, _, revision = spec.partition("@")
    return repo_id, revision or None


def _set(value: str | None) -> bool:
    """An environment switch as huggingface_hub reads it: 1, ON, YES or TRUE, in any case."""
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _hub_error(spec: str, error: Exception) -> ModelNotFoundError:
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(error, GatedRepoError):
        return ModelNotFoundError(f"{spec} is gated on the Hugging Face hub", "accept its licence on huggingface.co and set HF_TOKEN")
    if isinstance(error, RevisionNotFoundError):
        return ModelNotFoundError(f"{spec}: revision not found on the hub", "check the @revision")
    if isinstance(error, RepositoryNotFoundError):
        return ModelNotFoundError(f"{spec} was not found on the Hugging Face hub", "check the name, or set HF_TOKEN for a private model")
    if isinstance(error, LocalEntryNotFoundError):
        offline = [name for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") if _set(os.environ.get(name))]
        if offline:  # the user's own switch: say which
            return ModelNotFoundError(
                f"{spec} is not in the local Hugging Face cache and {offline[0]} is set",
                f"unset {offline[0]} to download it once, or pass a local folder or .gguf file",
            )
        return ModelNotFoundError(  # no switch: the network (or a proxy) did not reach huggingface.co
            f"{spec} is not in the local Hugging Face cache and the hub cannot be reached",
            "check the connection to huggingface.co (or HTTPS_PROXY, or HF_ENDPOINT for a mirror) to download it "
            "once, or pass a local folder or .gguf file",
        )
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return ModelNotFoundError(f"cannot download {spec} from the hub: {first_line}", "check the connection or HF_TOKEN")


def download(spec: str, patterns: list[str]) -> Path:
    """snapshot_download of `spec` (org/name[@revision]) restricted to `patterns`; its own tqdm bar shows progress."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo_id, revision = split_revision(spec)
    quiet = logging.getLogger("huggingface_hub._snapshot_download")  # its "No files matched allow_patterns=[...]"
    level = quiet.level  # came before specdec's own line on what the repository lacks
    quiet.setLevel(logging.ERROR)
    try:
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as error:
        raise _hub_error(spec, error) from None
    finally:
        quiet.setLevel(level)
    return Path(folder)
