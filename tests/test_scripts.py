"""The maintainer scripts (scripts/, named in docs/development.md) start, and reach specdec through public names only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))


def private_uses(source: str) -> list[str]:
    """Private names of specdec_cli that `source` imports or reads off an imported specdec_cli module."""
    tree = ast.parse(source)
    modules, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specdec_cli"):
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{node.module}.{alias.name}")
                modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules.update(alias.asname or alias.name for alias in node.names if alias.name.startswith("specdec_cli"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_every_script_is_named_in_the_docs():
    documented = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")  # its table names each one
    assert SCRIPTS and [path.name for path in SCRIPTS if f"`{path.name}`" not in documented] == []


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_a_script_reaches_specdec_through_public_names_only(script):
    assert private_uses(script.read_text(encoding="utf-8")) == []


def test_a_private_use_is_found():
    source = ("from specdec_cli.models.native import binding\nfrom specdec_cli.settings import _read_prompts\n"
              "binding._declare(None)\nbinding.library()\n")
    assert private_uses(source) == ["specdec_cli.settings._read_prompts", "binding._declare"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_a_script_starts_and_prints_its_usage(script):
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=300,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage: " + script.name)
