"""Autouse fixtures that point SPECDEC_HOME at a temporary folder, so no test writes the real cache: one per
test, and one per module for what a module's own fixtures write before any test starts. Import both into a
conftest.py (or a test module) to apply them there."""

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


@pytest.fixture(autouse=True, scope="module")
def module_specdec_home(tmp_path_factory, request):
    """A SPECDEC_HOME for the module's own fixtures (a model loaded once per module), except in modules marked
    `real`. `specdec_home` starts only with each test: before, such a fixture that loaded a tiny model as int8
    stored its layers in the user's real cache, a new entry every run."""
    if request.node.get_closest_marker("real"):
        yield None
        return
    with pytest.MonkeyPatch.context() as environment:
        environment.setenv("SPECDEC_HOME", str(tmp_path_factory.mktemp("module-specdec-home")))
        environment.delenv("XDG_CACHE_HOME", raising=False)
        yield
