"""The demo pair's part packages, imitated with small fake packages on sys.path."""

import hashlib
import importlib

import pytest

from specdec_cli.errors import MissingExtraError, ModelLoadError, ModelNotFoundError
from specdec_cli.models import demo

PARTS = 11  # more than 9, so that joining in string order ("part10" < "part2") would be caught


def _install_fake_parts(root, prefix, chunks, skip=()):
    for number, chunk in enumerate(chunks, start=1):
        if number in skip:
            continue
        data = root / f"{prefix}{number}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("raise RuntimeError('part packages must not be imported')\n")
        (data / f"part{number:02d}.bin").write_bytes(chunk)
    importlib.invalidate_caches()


@pytest.fixture
def fake_demo(tmp_path, monkeypatch):
    """A registered demo model `demo:fake` whose 11 parts are installed, and its expected joined bytes."""
    chunks = [bytes([number]) * (100 + number) for number in range(1, PARTS + 1)]
    joined = b"".join(chunks)
    prefix = f"fake_demo_{tmp_path.name.replace('-', '_')}_part"
    model = demo.DemoModel("fake", prefix, PARTS, len(joined), hashlib.sha256(joined).hexdigest())
    monkeypatch.setitem(demo.DEMO_MODELS, "fake", model)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return model, chunks, joined, tmp_path / "site"


def test_parts_are_joined_in_numeric_order_and_verified(fake_demo, specdec_home):
    model, chunks, joined, site = fake_demo
    _install_fake_parts(site, model.package_prefix, chunks)
    path = demo.ensure_joined(model, progress=False)
    assert path == specdec_home / "demo" / "fake-q4_k_m.gguf"
    assert path.read_bytes() == joined


def test_a_joined_file_is_reused(fake_demo):
    model, chunks, _, site = fake_demo
    _install_fake_parts(site, model.package_prefix, chunks)
    path = demo.ensure_joined(model, progress=False)
    mtime = path.stat().st_mtime_ns
    assert demo.ensure_joined(model, progress=False) == path
    assert path.stat().st_mtime_ns == mtime


def test_missing_parts_name_the_install_command(fake_demo, specdec_home):
    model, chunks, _, site = fake_demo
    _install_fake_parts(site, model.package_prefix, chunks, skip={3, 7})
    with pytest.raises(MissingExtraError, match=r"demo:fake is not installed \(2 of 11 parts missing\)") as raised:
        demo.ensure_joined(model, progress=False)
    assert raised.value.hint == "pip install 'specdec[demo]'"
    assert not (specdec_home / "demo" / "fake-q4_k_m.gguf").exists()


def test_a_corrupt_part_is_refused_and_not_cached(fake_demo, specdec_home):
    model, chunks, _, site = fake_demo
    chunks[4] = b"x" * len(chunks[4])
    _install_fake_parts(site, model.package_prefix, chunks)
    with pytest.raises(ModelLoadError, match="is corrupt"):
        demo.ensure_joined(model, progress=False)
    assert list((specdec_home / "demo").iterdir()) == []


def test_unknown_demo_name_lists_the_known_ones():
    with pytest.raises(ModelNotFoundError) as raised:
        demo.demo_model("demo:gpt-5")
    assert "demo:qwen2.5-coder-1.5b" in raised.value.hint and "demo:qwen2.5-coder-0.5b" in raised.value.hint
