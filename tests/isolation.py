"""An autouse fixture that points SPECDEC_HOME at a temporary folder, so no test writes the real cache.
Import it into a conftest.py (or a test module) to apply it there."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def specdec_home(tmp_path, monkeypatch, request):
    """A fresh SPECDEC_HOME per test, except for tests marked `real`, which use the user's cache."""
    if request.node.get_closest_marker("real"):
        yield None
        return
    home = tmp_path / "specdec-home"
    monkeypatch.setenv("SPECDEC_HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    yield home
