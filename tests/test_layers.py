"""The floor plan holds: no module of specdec_cli imports one from a higher layer, and no modules import each other
round a circle.

Top to bottom: cli; chat, batch, bench (and render); session, settings; drafters, models, profiles,
prompts; engine. `errors`, `lazy` (a package's imports on first use) and the package root (`__version__`) may
be imported by every layer. For the layers every import counts: at the top of a module, under `if TYPE_CHECKING:`,
and inside functions. For circles every import that runs counts (inside functions too); one under
`if TYPE_CHECKING:` does not."""

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
    sources = [*modules(), *PACKAGE.rglob("*.c"), *PACKAGE.rglob("*.h")]
    lengths = {str(path.relative_to(PACKAGE)): len(path.read_text(encoding="utf-8").splitlines()) for path in sources}
    assert {name: length for name, length in lengths.items() if length > MAX_LINES} == {}


def _without_type_checking(source: str) -> str:
    """`source` with the bodies of its `if TYPE_CHECKING:` blocks emptied (their imports never run)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            node.body = [ast.Pass()]
    return ast.unparse(tree)


def import_graph(sources: dict[Path, str]) -> dict[str, set[str]]:
    """Module -> the specdec_cli modules it imports when it runs (TYPE_CHECKING imports left out)."""
    graph = {}
    for path, source in sources.items():
        importer = module_name(path)
        graph[importer] = {name for _, name in imported_modules(_without_type_checking(source), importer,
                                                                  path.name == "__init__.py")} - {importer}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other round a circle (strongly connected, more than one module)."""
    order, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.get(module, ()):
            if imported not in order:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], order[imported])
        if low[module] == order[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return found


def _sources() -> dict[Path, str]:
    return {path: path.read_text(encoding="utf-8") for path in modules()}


def test_no_modules_import_each_other_round_a_circle():
    assert circles(import_graph(_sources())) == []


@pytest.mark.parametrize(
    ("where", "source"),
    [
        ("models/native/binding.py", "def f():\n    from specdec_cli.models.loading import loaded\n"),
        ("engine/stats.py", "from specdec_cli.engine import decode\n"),
        ("models/formats/int8.py", "import specdec_cli.models.formats.stored_layers\n"),
    ],
)
def test_a_planted_circle_is_found(where, source):
    sources = _sources()
    path = PACKAGE / where
    sources[path] = sources[path] + "\n" + source
    assert len(circles(import_graph(sources))) == 1


def test_an_import_for_type_checking_alone_makes_no_circle():
    sources = _sources()
    path = PACKAGE / "models/native/binding.py"
    sources[path] += "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from specdec_cli.models.loading import loaded\n"
    assert circles(import_graph(sources)) == []


def test_the_models_packages_import_one_way():
    """models/: native <- formats <- runtime <- loading, each package importing only those before it (and the
    leaf modules beside them: paths, names, device, progress); calibrate.py times loaded models, above them all."""
    rank = {"native": 1, "formats": 2, "runtime": 3, "loading": 4, "calibrate": 5}
    leaves = {"paths", "names", "device", "progress"}

    def package(module: str) -> str | None:
        parts = module.split(".")
        return parts[2] if len(parts) > 2 and parts[1] == "models" else None

    wrong = sorted(f"{importer} imports {imported}" for importer, imports in import_graph(_sources()).items()
                   for imported in imports
                   if package(importer) in rank and package(imported) in rank | dict.fromkeys(leaves)
                   and package(imported) not in leaves and rank[package(imported)] > rank[package(importer)])
    leaf_imports = sorted(f"{importer} imports {imported}" for importer, imports in import_graph(_sources()).items()
                          for imported in imports if package(importer) in leaves and package(imported) in rank)
    assert (wrong, leaf_imports) == ([], [])


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
