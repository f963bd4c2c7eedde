"""Profiles: named model pairs with their generation defaults, one TOML file each.

Shipped profiles live in `profiles/` (inside the wheel as `specdec_cli/profiles/`); files in
`$SPECDEC_HOME/profiles/` add new ones or override shipped ones of the same name."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path

from specdec_cli.errors import ProfileError
from specdec_cli.models.paths import specdec_home
from specdec_cli.models.quant import ALIASES, FORMATS, QUANTIZATIONS

DEFAULT_PROFILE = "demo"
DRAFTERS = ("model", "ngram", "cascade")


@dataclass(frozen=True)
class Profile:
    name: str
    target: str
    draft: str | None = None  # None when drafter == "ngram"
    drafter: str = "model"  # "model" | "ngram" | "cascade" (lookup when it matches, else the draft model)
    description: str = ""
    dtype: str = "auto"
    device: str = "auto"
    # None | "int8" | "int4" | "nf4" | "bnb8" | "auto" (models/quant.py); "none" reads as None; old "4bit", "8bit" kept
    target_quantization: str | None = None
    draft_quantization: str | None = None
    k: str | int = "auto"  # draft length: "auto" (adaptive) or a fixed number of tokens
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    system: str | None = None
    max_new_tokens: int = 512
    weights_gb: float | None = None  # hint for `profiles list` when no config is cached locally
    path: Path | None = None  # the file it was read from


_TOML_KEYS = {field.name for field in fields(Profile)} - {"name", "path"}


# ---- reading ----------------------------------------------------------------------------------


def shipped_profiles_dir() -> Path:
    return Path(str(resources.files("specdec_cli") / "profiles"))


def user_profiles_dir() -> Path:
    return specdec_home() / "profiles"


def _profile_files() -> dict[str, Path]:
    """name → file; a user file overrides a shipped one of the same name."""
    found: dict[str, Path] = {}
    for folder in (shipped_profiles_dir(), user_profiles_dir()):
        if folder.is_dir():
            found.update({path.stem: path for path in sorted(folder.glob("*.toml"))})
    return found


def _read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as error:
        # tomllib's message ends with "(at line L, column C)".
        raise ProfileError(f"profile file {path} is not valid TOML: {error}", "fix the file or remove it") from None
    except OSError as error:
        raise ProfileError(f"cannot read profile file {path}: {error.strerror}", "check the file") from None


# ---- validating -------------------------------------------------------------------------------


def _bad(path: Path, what: str) -> ProfileError:
    return ProfileError(f"profile file {path}: {what}", "fix the file or remove it")


def _check_keys(path: Path, data: dict) -> None:
    unknown = sorted(set(data) - _TOML_KEYS)
    if unknown:
        raise _bad(path, f"unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_TOML_KEYS))}")
    if not isinstance(data.get("target"), str) or not data["target"]:
        raise _bad(path, "`target` (a model name) is required")


def _check_drafter(path: Path, drafter: str, draft: str | None) -> None:
    if drafter not in DRAFTERS:
        raise _bad(path, f"drafter must be one of {', '.join(DRAFTERS)}, not {drafter!r}")
    if drafter != "ngram" and not draft:
        raise _bad(path, f'drafter "{drafter}" needs a `draft`, or set drafter = "ngram"')


def _check_numbers(path: Path, profile: Profile) -> None:
    if profile.target_quantization not in QUANTIZATIONS or profile.draft_quantization not in QUANTIZATIONS:
        names = ", ".join(f'"{name}"' for name in (*FORMATS, *ALIASES))
        raise _bad(path, f"quantization must be one of {names} (or left out)")
    if profile.k != "auto" and not (isinstance(profile.k, int) and profile.k >= 1):
        raise _bad(path, f'k must be "auto" or a positive integer, not {profile.k!r}')
    if not (profile.temperature >= 0 and 0 < profile.top_p <= 1 and profile.top_k >= 0):
        raise _bad(path, "need temperature >= 0, 0 < top_p <= 1 and top_k >= 0")
    if not (isinstance(profile.max_new_tokens, int) and profile.max_new_tokens >= 1):
        raise _bad(path, "max_new_tokens must be a positive integer")


def _parse(name: str, path: Path) -> Profile:
    data = _read_toml(path)
    _check_keys(path, data)
    drafter = data.get("drafter") or ("model" if data.get("draft") else "ngram")
    _check_drafter(path, drafter, data.get("draft"))
    if drafter == "ngram":
        data = {**data, "draft": None, "draft_quantization": None}
    data = {key: None if key.endswith("_quantization") and value == "none" else value for key, value in data.items()}
    try:
        profile = Profile(name=name, path=path, **{**data, "drafter": drafter})
    except TypeError as error:
        raise _bad(path, str(error)) from None
    try:
        _check_numbers(path, profile)
    except TypeError:
        raise _bad(path, "a number field holds text") from None
    return profile


# ---- public -----------------------------------------------------------------------------------


def list_profiles() -> list[Profile]:
    """All profiles, shipped and user, sorted by name."""
    return [_parse(name, path) for name, path in sorted(_profile_files().items())]


def load_profile(name: str) -> Profile:
    """The profile called `name`; ProfileError listing the known names if there is none."""
    files = _profile_files()
    if name not in files:
        known = ", ".join(sorted(files)) or "none"
        raise ProfileError(f"unknown profile {name!r}", f"known profiles: {known}; add one in {user_profiles_dir()}")
    return _parse(name, files[name])
