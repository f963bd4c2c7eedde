"""In CI (CI set) a skipped `real` test fails the run; elsewhere it stays a skip. Checked on an inner pytest
session that uses this suite's hook."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INNER_TESTS = """
import pytest

@pytest.mark.real
@pytest.mark.skipif(True, reason="the demo pair is not installed")
def test_real_but_skipped():
    pass

@pytest.mark.real
def test_real_and_run():
    pass

@pytest.mark.skip(reason="not a real-pair test")
def test_other_skip():
    pass
"""


def inner_session(tmp_path: Path, ci: bool) -> subprocess.CompletedProcess:
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    real: real pair\n")
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_runtest_makereport  # noqa: F401\n")
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER_TESTS))
    env = {key: value for key, value in os.environ.items() if key != "CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)


@pytest.mark.parametrize("ci", [True, False], ids=["CI", "not CI"])
def test_a_skipped_real_test_fails_only_in_ci(tmp_path, ci):
    session = inner_session(tmp_path, ci)
    summary = session.stdout.strip().splitlines()[-1]
    if ci:
        assert session.returncode == 1
        assert summary.startswith("1 passed, 1 skipped, 1 error"), session.stdout  # a skip in setup: an error
        assert ("ERROR test_inner.py::test_real_but_skipped - a real-pair test skipped in CI "
                "(Skipped: the demo pair is not installed)") in session.stdout
    else:
        assert session.returncode == 0
        assert summary.startswith("1 passed, 2 skipped"), session.stdout
