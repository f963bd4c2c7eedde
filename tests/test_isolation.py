"""The suite's own isolation: no fixture or test writes the user's real specdec cache."""

import pytest

from specdec_cli.models.paths import specdec_home


@pytest.fixture(scope="module")
def home_of_a_module_fixture(tmp_path_factory):
    """What a module-scoped fixture (a model loaded once per module) writes to: until module_specdec_home it ran
    before the per-test home and wrote the real cache (test_batched_peers' int8 tiny target did, every run)."""
    return specdec_home()


def test_a_module_fixture_writes_a_temporary_home(home_of_a_module_fixture, tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    assert home_of_a_module_fixture.is_relative_to(base), home_of_a_module_fixture
    assert specdec_home().is_relative_to(base) and specdec_home() != home_of_a_module_fixture  # the test's own

