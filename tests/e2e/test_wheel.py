"""The wheel users install: built from this tree, installed into a fresh virtual environment, and run from
there: the console script starts and the shipped profiles are inside (in the source tree `profiles/` is a
symlink, which only a built wheel proves was followed).

Offline: the wheel is built with the setuptools already installed (--no-build-isolation), and the fresh
environment borrows this one's packages (torch, transformers, ...) through a .pth file instead of
downloading them again; its own site-packages, holding only specdec, comes first."""

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import specdec_cli

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the first test builds the wheel and a venv (600 s a step)


def _run(*command, **kwargs) -> subprocess.CompletedProcess:
    process = subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=600, **kwargs)
    assert process.returncode == 0, process.stderr[-3000:]
    return process


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of this tree's packaged files (building writes build/ and egg-info)."""
    source, dist = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("dist")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "profiles", source / "profiles")
    shutil.copytree(ROOT / "specdec_cli", source / "specdec_cli", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", dist, source)
    (built,) = dist.glob("specdec-*.whl")
    return built


def test_the_wheel_holds_the_package_the_profiles_and_the_console_script(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = sorted(path.name for path in (ROOT / "profiles").glob("*.toml"))
    assert shipped and {f"specdec_cli/profiles/{name}" for name in shipped} <= names
    assert {"specdec_cli/__init__.py", "specdec_cli/cli/app.py", "specdec_cli/engine/__init__.py"} <= names
    entry_points = next(name for name in names if name.endswith(".dist-info/entry_points.txt"))
    assert "specdec = specdec_cli.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment with the wheel installed; returns its bin folder."""
    venv = tmp_path_factory.mktemp("venv")
    _run(sys.executable, "-m", "venv", venv)
    bin_folder = venv / ("Scripts" if os.name == "nt" else "bin")
    purelib = _run(bin_folder / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    borrowed = [path for path in site.getsitepackages() if Path(path).is_dir()]
    (Path(purelib) / "_borrowed_packages.pth").write_text("".join(f"{path}\n" for path in borrowed))
    _run(bin_folder / "python", "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel)
    return bin_folder


def _from_the_venv(bin_folder: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "SPECDEC_HOME", "VIRTUAL_ENV")}
    env.update(SPECDEC_HOME=str(cwd / "home"), COLUMNS="250", PATH=f"{bin_folder}{os.pathsep}{env.get('PATH', '')}")
    return _run(*args, cwd=cwd, env=env)


def test_the_installed_console_script_runs_from_the_wheel(installed, tmp_path):
    where = _from_the_venv(installed, installed / "python", "-c", "import specdec_cli; print(specdec_cli.__file__)", cwd=tmp_path)
    assert Path(where.stdout.strip()).is_relative_to(installed.parent)  # the wheel's copy, not this tree
    version = _from_the_venv(installed, installed / "specdec", "--version", cwd=tmp_path)
    assert version.stdout == f"specdec {specdec_cli.__version__}\n"


def test_the_installed_wheel_lists_the_shipped_profiles(installed, tmp_path):
    listing = _from_the_venv(installed, installed / "specdec", "profiles", "list", cwd=tmp_path)
    names = {line.split("│")[1].strip() for line in listing.stdout.splitlines() if line.startswith("│")}
    shipped = {path.stem for path in (ROOT / "profiles").glob("*.toml")}
    assert names == (shipped - {"demo"}) | {"demo (default)"}
    shown = _from_the_venv(installed, installed / "specdec", "profiles", "show", "demo", cwd=tmp_path)
    assert "demo:qwen2.5-coder-1.5b" in shown.stdout


def test_the_installed_wheel_builds_specdecs_int8_matmul(installed, tmp_path):
    """The kernel's C source ships inside the wheel and builds from there, as it does in this tree."""
    from specdec_cli.models.formats.int8 import matmul_name

    expected = matmul_name()
    built = _from_the_venv(installed, installed / "python", "-c",
                           "from specdec_cli.models.formats.int8 import matmul_name; print(matmul_name())", cwd=tmp_path)
    assert built.stdout.strip() == expected
    if expected != "oneDNN":
        assert list((tmp_path / "home" / "kernels").glob("native-*/libspecdec_kernels.so"))
