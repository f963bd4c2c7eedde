"""The specdec home's building blocks: entries written whole, and made by one process at a time."""

import threading

import pytest

from specdec_cli.models import gguf, load_model
from specdec_cli.models.paths import atomic_folder, one_maker


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
    folder = gguf.converted_folder(path, gguf.torch.float32)
    second = {}

    with one_maker(folder):  # the first process, converting
        waiter = threading.Thread(target=lambda: second.update(
            model=load_model(str(path), device="cpu", dtype="float32", progress=False)))
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive() and conversions == []  # waiting, not converting
        with atomic_folder(folder) as staging:
            real_convert(path, gguf.torch.float32, staging)
    waiter.join(timeout=60)
    assert not waiter.is_alive()
    assert conversions == [] and second["model"].source == str(path.resolve())
