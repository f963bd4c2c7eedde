"""The floor plan holds: no module of specdec_cli imports one from a higher layer.

Top to bottom: cli; chat, batch, bench (and render); session, settings; drafters, models, profiles,
prompts; engine. `errors`, `lazy` (a package's imports on first use) and the package root (`__version__`) may
be imported by every layer. Every import counts: at the top of a module, under `if TYPE_CHECKING:`, and inside
functions."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "specdec_cli"
MAX_LINES = 400

LAYERS = {
    "cli": 4, "__main__": 4,
    "chat": 3, "batch": 3, "bench": 3, "render": 3,
    "session": 2, "settings": 2,
    "drafters": 1, "models": 1, "profiles": 1, "prompts": 1,
    "engine": 0,
    "errors": -1, "lazy": -1, "": -1,  # "": the package root (specdec_cli/__init__.py)
}


def room_of(dotted: str) -> str:
    """`specdec_cli.batch.loop` → "batch"; `specdec_cli` → ""."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else ""


def module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(relative.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, importer: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted name) of every specdec_cli module that `source` imports, wherever the import stands."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, importer, is_package)
            # `from specdec_cli import batch` imports the module specdec_cli.batch
            found += [(node.lineno, f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}") else base)
                      for alias in node.names]
    return [(line, name) for line, name in found if name == "specdec_cli" or name.startswith("specdec_cli.")]


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    anchor = importer.split(".")
    anchor = anchor if is_package else anchor[:-1]
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def _is_module(dotted: str) -> bool:
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def upward_imports(path: Path, source: str) -> list[str]:
    importer = module_name(path)
    own = LAYERS[room_of(importer)]
    return [
        f"{path.relative_to(PACKAGE.parent)}:{line} ({room_of(importer) or 'specdec_cli'}, layer {own}) imports "
        f"{name} ({room_of(name)}, layer {LAYERS[room_of(name)]})"
        for line, name in imported_modules(source, importer, path.name == "__init__.py")
        if LAYERS[room_of(name)] > own
    ]


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer():
    assert {room_of(module_name(path)) for path in modules()} <= set(LAYERS)


def test_no_module_imports_a_higher_layer():
    problems = [problem for path in modules() for problem in upward_imports(path, path.read_text(encoding="utf-8"))]
    assert problems == []


@pytest.mark.parametrize(
    ("where", "source"),
    [
        ("engine/decode.py", "from specdec_cli.drafters import NgramDrafter\n"),
        ("drafters/model.py", "def f():\n    from specdec_cli import session\n"),
        ("session.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from specdec_cli.cli.options import X\n"),
        ("batch/loop.py", "import specdec_cli.cli.app\n"),
        ("engine/__init__.py", "from .. import settings\n"),
    ],
)
def test_a_planted_upward_import_is_found(where, source):
    assert len(upward_imports(PACKAGE / where, source)) == 1


def test_imports_down_and_sideways_are_allowed():
    source = "from specdec_cli.engine import FixedK\nfrom specdec_cli.errors import InputError\nfrom . import settings\n"
    assert upward_imports(PACKAGE / "session.py", source) == []


def test_no_module_is_over_the_size_limit():
    lengths = {str(path.relative_to(PACKAGE)): len(path.read_text(encoding="utf-8").splitlines()) for path in modules()}
    assert {name: length for name, length in lengths.items() if length > MAX_LINES} == {}


def test_reading_and_writing_run_records_loads_no_torch_and_no_rich():
    probe = "import sys, specdec_cli.batch; print(sorted({'torch', 'rich'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                            cwd=PACKAGE.parent, timeout=120)
    assert result.stdout.strip() == "[]"


def test_help_and_a_usage_mistake_load_no_torch():
    """`specdec --help`, each command's help and a mistake found before any model is chosen answer without
    importing torch (~2.5 s of imports before it): each in a fresh process, its exit code and whether torch came."""
    probe = (
        "import sys; from typer.testing import CliRunner; from specdec_cli.cli import app\n"
        "result = CliRunner().invoke(app, sys.argv[1:])\n"
        "print(result.exit_code, 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    asked = [["--help"], *([command, "--help"] for command in ("chat", "run", "compare", "calibrate", "profiles")),
             ["run", "in.jsonl"], ["run", "in.jsonl", "-o", "out.jsonl", "--batch-size", "0"]]
    for arguments in asked:
        result = subprocess.run([sys.executable, "-c", probe, *arguments], capture_output=True, text=True, check=True,
                                cwd=PACKAGE.parent, timeout=120)
        assert result.stdout.split() == ["0" if "--help" in arguments else "2", "False", "False"], arguments
