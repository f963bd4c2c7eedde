"""The specdec home's building blocks: entries written whole, and made by one process at a time."""

import errno
import shutil
import threading

import pytest
import torch

from specdec_cli.errors import CacheWriteError
from specdec_cli.models import load_model, paths
from specdec_cli.models.loading import gguf
from specdec_cli.models.paths import atomic_file, atomic_folder, one_maker
from tests.cli_result import assert_exited


def test_a_folder_another_process_put_in_place_first_is_kept(tmp_path):
    final = tmp_path / "entry"
    with atomic_folder(final) as staging:
        (staging / "weights").write_text("ours")
        final.mkdir()  # another process finished the same entry meanwhile
        (final / "weights").write_text("theirs")
    assert (final / "weights").read_text() == "theirs"
    assert [path.name for path in tmp_path.iterdir()] == ["entry"]


def test_a_failed_rename_with_nothing_in_place_is_still_an_error(tmp_path):
    final = tmp_path / "entry"
    with pytest.raises(OSError), atomic_folder(final) as staging:
        (staging / "weights").write_text("ours")
        final.write_text("a file, not an entry")
    assert final.read_text() == "a file, not an entry"


def test_a_second_process_waits_for_the_first_to_convert_a_gguf(tiny_gguf, specdec_home, monkeypatch):
    """Two loads of one new .gguf at once (two chats, Ray workers on one machine): the second waits for the
    first's conversion and uses it, instead of converting beside it (twice the memory) and failing to rename."""
    path, _ = tiny_gguf
    conversions = []
    real_convert = gguf._convert
    monkeypatch.setattr(gguf, "_convert", lambda *args: (conversions.append(args[0]), real_convert(*args)))
    folder = gguf.converted_folder(path, torch.float32)
    second = {}

    with one_maker(folder):  # the first process, converting
        waiter = threading.Thread(target=lambda: second.update(
            model=load_model(str(path), device="cpu", dtype="float32", progress=False)))
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive() and conversions == []  # waiting, not converting
        with atomic_folder(folder) as staging:
            real_convert(path, torch.float32, staging)
    waiter.join(timeout=60)
    assert not waiter.is_alive()
    assert conversions == [] and second["model"].source == str(path.resolve())


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"),
                                     RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                                                  "message: \"No space left on device\" })")])
def test_a_full_disk_while_writing_is_one_error_and_leaves_nothing(tmp_path, failure):
    """safetensors wraps the OS's error in its own: both are a full disk."""
    with pytest.raises(CacheWriteError, match="the disk is full: entry could not be written") as raised:
        with atomic_folder(tmp_path / "entry") as staging:
            (staging / "weights").write_bytes(b"\0" * 100)
            raise failure
    assert "SPECDEC_HOME" in raised.value.one_line()
    with pytest.raises(CacheWriteError), atomic_file(tmp_path / "file") as staging:
        staging.write_bytes(b"\0" * 100)
        raise failure
    assert list(tmp_path.iterdir()) == []


def test_another_failure_while_writing_is_left_as_it_is(tmp_path):
    with pytest.raises(ValueError), atomic_folder(tmp_path / "entry"):
        raise ValueError("a bug")


def test_a_disk_without_room_for_a_conversion_is_refused_before_it_starts(tiny_gguf, specdec_home, monkeypatch):
    path, _ = tiny_gguf
    conversions = []
    monkeypatch.setattr(gguf, "_convert", lambda *args: conversions.append(args))
    needed = gguf.element_count(path) * 4 + 64 * 2**20
    monkeypatch.setattr(paths.shutil, "disk_usage", lambda folder: shutil._ntuple_diskusage(10**12, 10**12, needed - 1))
    with pytest.raises(CacheWriteError, match=r"converting tiny-llama.gguf to safetensors needs \d+ MB free in "):
        gguf.ensure_converted(path, torch.float32, progress=False)
    assert conversions == [] and gguf.existing_conversions(path) == []
    monkeypatch.setattr(paths.shutil, "disk_usage", lambda folder: shutil._ntuple_diskusage(10**12, 10**12, needed))
    gguf.ensure_converted(path, torch.float32, progress=False)
    assert len(conversions) == 1


def test_a_full_home_in_chat_is_one_line_and_exit_2(tiny_gguf, specdec_home, monkeypatch):
    from typer.testing import CliRunner

    from specdec_cli.cli.app import app

    path, _ = tiny_gguf
    monkeypatch.setattr(paths.shutil, "disk_usage", lambda folder: shutil._ntuple_diskusage(10**12, 10**12, 0))
    result = CliRunner().invoke(app, ["chat", "--target", str(path), "--dtype", "float32"], input="Hello\n")
    assert_exited(result, 2)
    assert result.stderr.startswith("error: converting tiny-llama.gguf to safetensors needs ")
    assert len(result.stderr.strip().splitlines()) == 1 and result.stdout == ""


def test_a_read_only_home_is_one_error_naming_the_folder(tmp_path, monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(paths.tempfile, "mkstemp", read_only)
    monkeypatch.setattr(paths.tempfile, "mkdtemp", read_only)
    for atomic in (atomic_file, atomic_folder):
        with pytest.raises(CacheWriteError, match="cannot write entry in .*: Read-only file system") as raised:
            with atomic(tmp_path / "entry"):
                pass
        assert raised.value.hint == "set SPECDEC_HOME to a folder you can write"


def test_what_a_killed_maker_left_is_removed_under_the_lock(tmp_path, specdec_home):
    """atomic_folder's `finally` does not run after a kill -9 or the out-of-memory killer: its staging folder (a
    half conversion, GBs) stayed for ever. The next maker of the same entry removes it; other entries' stay."""
    final = tmp_path / "entry"
    left_folder = tmp_path / ".entry.k3j2h1ab"
    left_folder.mkdir()
    (left_folder / "model.safetensors").write_bytes(b"\0" * 100)
    left_file = tmp_path / ".entry.9xq7w2er"
    left_file.write_bytes(b"\0" * 100)
    others = [tmp_path / ".entry-other.k3j2h1ab", tmp_path / "entry.lock-not-ours"]
    for other in others:
        other.mkdir()
    with one_maker(final):
        assert not left_folder.exists() and not left_file.exists()
    assert all(other.exists() for other in others)
