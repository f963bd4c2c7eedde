"""The demo pair's part packages, imitated with small fake packages on sys.path."""

import hashlib
import importlib
import json
import os
import shutil

import pytest

from specdec_cli.errors import CacheWriteError, MissingExtraError, ModelLoadError, ModelNotFoundError
from specdec_cli.models.loading import demo

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


def test_a_disk_without_room_is_refused_before_joining(fake_demo, specdec_home, monkeypatch):
    from specdec_cli.models import paths

    model, chunks, _, site = fake_demo
    _install_fake_parts(site, model.package_prefix, chunks)
    monkeypatch.setattr(paths.shutil, "disk_usage", lambda folder: shutil._ntuple_diskusage(10**9, 10**9, 2**20))
    with pytest.raises(CacheWriteError, match=r"joining demo:fake needs 0 MB free in .*; its disk has 1 MB"):
        demo.ensure_joined(model, progress=False)
    assert list((specdec_home / "demo").iterdir()) == []


def test_unknown_demo_name_lists_the_known_ones():
    with pytest.raises(ModelNotFoundError) as raised:
        demo.demo_model("demo:gpt-5")
    assert "demo:qwen2.5-coder-1.5b" in raised.value.hint and "demo:qwen2.5-coder-0.5b" in raised.value.hint


def test_a_joined_file_is_hashed_once_and_trusted_while_its_stamp_matches(fake_demo, monkeypatch):
    model, chunks, joined, site = fake_demo
    _install_fake_parts(site, model.package_prefix, chunks)
    path = demo.ensure_joined(model, progress=False)
    stamp = json.loads(demo.stamp_path(path).read_text())
    assert stamp == {"sha256": model.sha256, "size": len(joined), "mtime_ns": path.stat().st_mtime_ns}

    def must_not_hash(path):
        raise AssertionError("a stamped file must not be hashed again")

    monkeypatch.setattr(demo, "file_sha256", must_not_hash)
    assert demo.ensure_joined(model, progress=False) == path


def test_a_changed_file_is_hashed_again_and_rejoined_when_corrupt(fake_demo):
    """Same size, other bytes, a new mtime: the stamp no longer vouches for it; the hash fails; the
    parts are joined again."""
    model, chunks, joined, site = fake_demo
    _install_fake_parts(site, model.package_prefix, chunks)
    path = demo.ensure_joined(model, progress=False)
    path.write_bytes(b"\0" * len(joined))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert demo.ensure_joined(model, progress=False) == path
    assert path.read_bytes() == joined
    assert json.loads(demo.stamp_path(path).read_text())["mtime_ns"] == path.stat().st_mtime_ns


def test_a_good_file_with_a_stale_stamp_is_verified_and_restamped_without_rejoining(fake_demo, monkeypatch):
    model, chunks, joined, site = fake_demo
    _install_fake_parts(site, model.package_prefix, chunks)
    path = demo.ensure_joined(model, progress=False)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # touched, not changed
    hashed = []
    real_hash = demo.file_sha256
    monkeypatch.setattr(demo, "file_sha256", lambda file: hashed.append(file) or real_hash(file))
    monkeypatch.setattr(demo, "_join", lambda *args: pytest.fail("a good file must not be joined again"))
    assert demo.ensure_joined(model, progress=False) == path
    assert hashed == [path]
    assert json.loads(demo.stamp_path(path).read_text())["mtime_ns"] == path.stat().st_mtime_ns


def test_a_file_without_a_stamp_is_hashed_before_it_is_trusted(fake_demo):
    """A file left by an older version (size right, no stamp) is not trusted on its size."""
    model, chunks, joined, site = fake_demo
    _install_fake_parts(site, model.package_prefix, chunks)
    path = demo.joined_path(model)
    path.write_bytes(joined[::-1])  # the right size, the wrong bytes
    assert demo.ensure_joined(model, progress=False) == path
    assert path.read_bytes() == joined
