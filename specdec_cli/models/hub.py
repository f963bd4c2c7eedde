"""Hugging Face hub ids: downloaded with huggingface-hub into the standard HF cache.

HF_HOME, HF_HUB_CACHE, HF_TOKEN and HF_HUB_OFFLINE are honoured by huggingface-hub itself."""

from __future__ import annotations

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


def is_hub_id(spec: str) -> bool:
    return bool(_HUB_ID.match(spec))


def split_revision(spec: str) -> tuple[str, str | None]:
    repo_id, _, revision = spec.partition("@")
    return repo_id, revision or None


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
        return ModelNotFoundError(
            f"{spec} is not in the local Hugging Face cache and the hub cannot be reached (offline)",
            "connect and unset HF_HUB_OFFLINE to download it once, or pass a local folder or .gguf file",
        )
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return ModelNotFoundError(f"cannot download {spec} from the hub: {first_line}", "check the connection or HF_TOKEN")


def download(spec: str, patterns: list[str]) -> Path:
    """snapshot_download of `spec` (org/name[@revision]) restricted to `patterns`; its own tqdm bar shows progress."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo_id, revision = split_revision(spec)
    try:
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as error:
        raise _hub_error(spec, error) from None
    return Path(folder)
