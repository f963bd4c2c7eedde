"""Profiles: named model pairs with their generation defaults, one TOML file each.

Shipped profiles live in `profiles/` (inside the wheel as `specdec_cli/profiles/`); files in
`$SPECDEC_HOME/profiles/` add new ones or override shipped ones of the same name."""

from __future__ import annotations

import difflib
import math
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path

from specdec_cli.errors import ProfileError
from specdec_cli.models.names import DTYPE_NAMES, QUANTIZATIONS
from specdec_cli.models.paths import specdec_home

DEFAULT_PROFILE = "demo"
DRAFTERS = ("model", "ngram", "cascade", "tree")
MAX_K = 16  # the longest fixed draft length (--k, /k, a profile's k)


@dataclass(frozen=True)
class Profile:
    name: str
    target: str
    draft: str | None = None  # None when drafter == "ngram"
    drafter: str = "model"  # "model" | "ngram" | "cascade" (lookup when it matches, else the draft model)
    description: str = ""
    dtype: str = "auto"
    device: str = "auto"
    target_quantization: str | None = None  # a format name ("none" too); unset: `gguf_target_format`
    draft_quantization: str | None = "auto"  # any format that runs here: it never changes the output
    target_auto_formats: tuple[str, ...] | None = None  # what target_quantization "auto" may pick (None: none, int8)
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
    _check_user_folder()
    found: dict[str, Path] = {}
    for folder in (shipped_profiles_dir(), user_profiles_dir()):
        if folder.is_dir():
            found.update({path.stem: path for path in sorted(folder.glob("*.toml"))})
    return found


def _check_user_folder() -> None:
    """ProfileError where the specdec home, or its profiles folder, is a file: no user profile can be read from it,
    so a name asked for would be called unknown, or a shipped profile taken for the user's own of that name."""
    folder = user_profiles_dir()
    home = folder.parent
    if home.exists() and not home.is_dir():
        raise ProfileError(f"the specdec home {home} is not a folder, so no profile of yours can be read from it",
                           "set SPECDEC_HOME to a folder")
    if folder.exists() and not folder.is_dir():
        raise ProfileError(f"{folder} is not a folder, so no profile of yours can be read from it",
                           "move that file away: your profiles go in a folder of that name")


def _read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as error:
        # tomllib's message ends with "(at line L, column C)".
        raise ProfileError(f"profile file {path} is not valid TOML: {error}", "fix the file or remove it") from None
    except UnicodeDecodeError as error:
        raise ProfileError(f"profile file {path} is not UTF-8 text (a bad byte at offset {error.start})",
                           "save it as UTF-8, as TOML files must be, or remove it") from None
    except OSError as error:
        raise ProfileError(f"cannot read profile file {path}: {error.strerror}", "check the file") from None


# ---- validating -------------------------------------------------------------------------------


def _bad(path: Path, what: str) -> ProfileError:
    return ProfileError(f"profile file {path}: {what}", "fix the file or remove it")


def _is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A finite int or float (TOML has nan and inf; neither is a setting)."""
    return (_is_integer(value) or isinstance(value, float)) and math.isfinite(value)


def _is_name(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _one_of(names) -> tuple[str, Callable[[object], bool]]:
    return f"one of {', '.join(names)}", lambda value: isinstance(value, str) and value in names


_DTYPE_NAMES = ("auto", *DTYPE_NAMES)
_DEVICE = re.compile(r"auto|(cpu|cuda|mps)(:\d+)?")
# Today's quantisation names and those being added (none, int4, nf4, bnb8, auto; 4bit/8bit stay as aliases).
_QUANTIZATION_NAMES = tuple(dict.fromkeys(("none", "auto", "int8", "int4", "q4", "nf4", "bnb8", "4bit", "8bit",
                                           *(name for name in QUANTIZATIONS if name))))

# key → (what is allowed, the check), for every key a profile file may hold.
_RULES: dict[str, tuple[str, Callable[[object], bool]]] = {
    "target": ("a model name (a non-empty string)", _is_name),
    "draft": ("a model name (a non-empty string)", _is_name),
    "drafter": _one_of(DRAFTERS),
    "description": ("a string", lambda value: isinstance(value, str)),
    "system": ("a string", lambda value: isinstance(value, str)),
    "dtype": _one_of(_DTYPE_NAMES),
    "device": ("auto, cpu, cuda, cuda:N or mps",
               lambda value: isinstance(value, str) and _DEVICE.fullmatch(value) is not None),
    "target_quantization": _one_of(_QUANTIZATION_NAMES),
    "draft_quantization": _one_of(_QUANTIZATION_NAMES),
    "target_auto_formats": ("a list of formats from none, int8, int4, q4, nf4, bnb8",
                            lambda value: isinstance(value, list) and bool(value)
                            and all(name in ("none", "int8", "int4", "q4", "nf4", "bnb8") for name in value)),
    "k": (f'"auto" or a whole number from 0 to {MAX_K}',
          lambda value: value == "auto" or (_is_integer(value) and 0 <= value <= MAX_K)),
    "temperature": ("a finite number >= 0 (0 = greedy)", lambda value: _is_number(value) and value >= 0),
    "top_p": ("a number above 0 and at most 1", lambda value: _is_number(value) and 0 < value <= 1),
    "top_k": ("a whole number >= 0 (0 = off)", lambda value: _is_integer(value) and value >= 0),
    "max_new_tokens": ("a whole number >= 1", lambda value: _is_integer(value) and value >= 1),
    "weights_gb": ("a number above 0", lambda value: _is_number(value) and value > 0),
}
assert set(_RULES) == _TOML_KEYS, "every Profile field read from TOML needs a rule"


def _check_keys(path: Path, data: dict) -> None:
    unknown = sorted(set(data) - _TOML_KEYS)
    if unknown:
        guesses = [f"{key}: did you mean {close[0]}?" for key in unknown
                   if (close := difflib.get_close_matches(key, _TOML_KEYS, 1))]
        meant = f" ({'; '.join(guesses)})" if guesses else ""
        raise _bad(path, f"unknown key(s) {', '.join(unknown)}{meant}; known: {', '.join(sorted(_TOML_KEYS))}")
    if "target" not in data:
        raise _bad(path, "`target` (a model name) is required")


def _check_values(path: Path, data: dict) -> None:
    """Each value's type and range, in file order: the first bad one is named with what it may be."""
    for key, value in data.items():
        allowed, check = _RULES[key]
        if not check(value):
            raise _bad(path, f"`{key}` must be {allowed}, not {value!r}")


def _check_drafter(path: Path, drafter: str, draft: str | None) -> None:
    if drafter != "ngram" and not draft:
        raise _bad(path, f'drafter "{drafter}" needs a `draft`, or set drafter = "ngram"')


def _parse(name: str, path: Path) -> Profile:
    data = _read_toml(path)
    _check_keys(path, data)
    _check_values(path, data)
    drafter = data.get("drafter") or ("model" if data.get("draft") else "ngram")
    _check_drafter(path, drafter, data.get("draft"))
    if drafter == "ngram":
        data = {**data, "draft": None, "draft_quantization": None}
    if "target_auto_formats" in data:
        data["target_auto_formats"] = tuple(data["target_auto_formats"])
    for key in ("target", "draft"):
        if data.get(key):
            data[key] = _beside(path, data[key])
    return Profile(name=name, path=path, **{**data, "drafter": drafter})


def _beside(path: Path, model: str) -> str:
    """A relative model path is the profile file's neighbour where one is there, as a config file's paths are in
    most tools: it named a path from wherever the command ran, so a profile worked in one folder and not in the
    next. Anything else (a hub id, a path from the current folder, demo:) is left as written."""
    given = Path(model)
    if given.is_absolute() or model.startswith("~") or ":" in model:
        return model
    beside = path.parent / given
    return str(beside.resolve()) if beside.exists() else model


# ---- public -----------------------------------------------------------------------------------


def scan_profiles() -> tuple[list[Profile], list[ProfileError]]:
    """Every profile that reads well, sorted by name, and what is wrong with each one that does not."""
    profiles: list[Profile] = []
    problems: list[ProfileError] = []
    for name, path in sorted(_profile_files().items()):
        try:
            profiles.append(_parse(name, path))
        except ProfileError as error:
            problems.append(error)
    return profiles, problems


def list_profiles() -> list[Profile]:
    """The profiles that read well, shipped and user, sorted by name (see `scan_profiles` for the rest)."""
    return scan_profiles()[0]


def load_profile(name: str) -> Profile:
    """The profile called `name`; ProfileError listing the known names if there is none."""
    files = _profile_files()
    if name not in files:
        known = ", ".join(sorted(files)) or "none"
        raise ProfileError(f"unknown profile {name!r}", f"known profiles: {known}; add one in {user_profiles_dir()}")
    return _parse(name, files[name])


# llama.cpp's names for files whose layers are mostly of the types specdec runs in place, each with the file's own
# weights (q4 keeps Q4_0, Q4_1 and Q4_K blocks; the levels matmul Q5_0, Q5_K, Q6_K and Q8_0): Q4_0, Q4_1, Q4_K_S/M/L,
# Q5_0, Q5_K_S/M, Q6_K, Q8_0. A file's name, or a hub tag, carries it (the demo pair's files too); IQ types, Q2_K,
# Q3_K and Q5_1 are not among them.
_IN_PLACE_GGUF = re.compile(r"(?:^|[^a-z0-9])(?:q4_(?:0|1|k(?:_[sml])?)|q5_(?:0|k(?:_[sm])?)|q6_k|q8_0)(?:\.gguf)?$",
                            re.IGNORECASE)
_TAGGED = re.compile(r"(?:^|[^a-z0-9])(?:i?q\d|f16|bf16|f32)", re.IGNORECASE)  # a name that says its type
IN_PLACE_TYPES = {"Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_K", "Q6_K", "Q8_0"}


def in_place_gguf(spec: str) -> bool:
    """Whether `spec` names a .gguf whose layers specdec runs in place, in the file's own types: by its quantisation
    tag (a local file's name, a hub repository's file by tag `org/name:Q4_K_M`, a demo model), or, for a local file
    whose name says no type, by the types of its 2-D tensors (most of them of `IN_PLACE_TYPES`)."""
    from specdec_cli.models.loading.demo import DEMO_MODELS, DEMO_PREFIX
    from specdec_cli.models.loading.hub import gguf_tag

    demo = DEMO_MODELS.get(spec.removeprefix(DEMO_PREFIX)) if spec.startswith(DEMO_PREFIX) else None
    tagged = gguf_tag(spec)
    name = demo.file_name if demo else tagged[2] if tagged else Path(spec).name if spec.lower().endswith(".gguf") else ""
    if _IN_PLACE_GGUF.search(name) is not None:
        return True
    if demo or tagged or not name or _TAGGED.search(Path(name).stem) is not None or not Path(spec).is_file():
        return False
    return _mostly_in_place(Path(spec))


def _mostly_in_place(path: Path) -> bool:
    """Whether most of a .gguf's 2-D tensors (its layers) are of a type specdec runs in place (the header only)."""
    try:
        from gguf import GGUFReader

        kinds = [tensor.tensor_type.name for tensor in GGUFReader(path).tensors if len(tensor.shape) == 2]
    except Exception:  # not a readable .gguf: the loader says what is wrong with it
        return False
    return bool(kinds) and sum(kind in IN_PLACE_TYPES for kind in kinds) * 2 > len(kinds)


def gguf_target_format(spec: str, device: str) -> str | None:
    """A target's format where nothing names one: q4 for a .gguf of quantised layers specdec runs in place on a CPU where
    q4 runs (`in_place_gguf`: the in-place read keeps the file's blocks, the weights the user chose), else None (any
    other model runs as it is given)."""
    if not in_place_gguf(spec):
        return None
    from specdec_cli.models.device import resolve_device
    from specdec_cli.models.formats.q4 import kernel_problem

    on_cpu = device == "cpu" or (device == "auto" and resolve_device("auto").type == "cpu")
    return "q4" if on_cpu and kernel_problem() is None else None
