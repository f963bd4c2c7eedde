from pathlib import Path

import pytest
import torch

from specdec_cli.errors import ModelLoadError
from specdec_cli.models import load_model
from specdec_cli.models.loading import gguf


def _cache_entries(home):
    folder = home / "gguf"
    return sorted(path.name for path in folder.iterdir()) if folder.exists() else []


def test_gguf_loads_with_the_same_logits_as_its_source_model(tiny_gguf):
    path, source_model = tiny_gguf
    loaded = load_model(str(path), device="cpu", dtype="float32", progress=False)
    input_ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(input_ids).logits, source_model(input_ids).logits)
    assert loaded.tokenizer.eos_token == "<|im_end|>"
    assert loaded.eos_token_ids == (loaded.tokenizer.eos_token_id,)
    assert loaded.source == str(path.resolve())


def test_gguf_is_converted_once_then_read_from_the_cache(tiny_gguf, specdec_home, monkeypatch):
    path, _ = tiny_gguf
    load_model(str(path), device="cpu", dtype="bfloat16", progress=False)
    entries = _cache_entries(specdec_home)
    assert len(entries) == 1 and entries[0].startswith("tiny-llama-") and entries[0].endswith("-bfloat16")
    assert (specdec_home / "gguf" / entries[0] / "model.safetensors").is_file()

    def converter_must_not_run(*args):
        raise AssertionError("the cached conversion should have been used")

    monkeypatch.setattr(gguf, "_convert", converter_must_not_run)
    loaded = load_model(str(path), device="cpu", dtype="bfloat16", progress=False)
    assert loaded.dtype == torch.bfloat16
    assert _cache_entries(specdec_home) == entries


def test_a_failed_conversion_leaves_no_cache_entry(tiny_gguf, specdec_home, monkeypatch):
    path, _ = tiny_gguf

    def crash_halfway(source, dtype, destination):
        (destination / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf, "_convert", crash_halfway)
    with pytest.raises(KeyboardInterrupt):
        load_model(str(path), device="cpu", progress=False)
    assert _cache_entries(specdec_home) == []


def test_a_changed_file_gets_a_new_cache_key(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"one")
    first = gguf.file_identity(path)
    path.write_bytes(b"three")
    assert gguf.file_identity(path) != first


def test_a_corrupt_gguf_is_a_one_line_load_error(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError) as raised:
        load_model(str(path), device="cpu", progress=False)
    assert "broken.gguf" in raised.value.one_line()
    assert "\n" not in raised.value.one_line()


@pytest.mark.parametrize("kept", [40, 300, 0.5, 0.99])  # bytes inside the header, or a share of the file
def test_a_gguf_cut_short_is_a_one_line_load_error_saying_to_download_it_again(tiny_gguf, specdec_home, tmp_path, kept):
    """A download cut off mid-header made the gguf reader's struct.error a traceback (exit 1); later cuts a
    ValueError. Either way: one line naming the file, and what to do."""
    data = Path(tiny_gguf[0]).read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: kept if isinstance(kept, int) else int(len(data) * kept)])
    with pytest.raises(ModelLoadError) as raised:
        load_model(str(path), device="cpu", progress=False)
    line = raised.value.one_line()
    assert "cut.gguf" in line and "download the .gguf again" in line and "\n" not in line


def test_the_conversion_cache_key_names_the_converters_versions(tiny_gguf, specdec_home, monkeypatch):
    """A conversion made by other transformers or gguf versions is not read back: it is made again."""
    from importlib.metadata import version

    path, _ = tiny_gguf
    load_model(str(path), device="cpu", dtype="float32", progress=False)
    (entry,) = _cache_entries(specdec_home)
    assert f"-tf{version('transformers')}-gguf{version('gguf')}-float32" in entry

    real_version = gguf._version
    monkeypatch.setattr(gguf, "_version", lambda package: "9.9.9" if package == "transformers" else real_version(package))
    assert gguf.existing_conversions(path) == []
    load_model(str(path), device="cpu", dtype="float32", progress=False)
    entries = _cache_entries(specdec_home)
    assert sorted(entries) == sorted([entry, entry.replace(f"-tf{version('transformers')}-", "-tf9.9.9-")])


def test_a_first_load_reads_the_gguf_once_and_gives_the_reader_back(tiny_gguf, specdec_home, monkeypatch):
    """A first load reads a .gguf for the memory pre-flight's config and the tokenizer, and transformers reads
    it for the conversion's config, weights and tokenizer; each read parsed the whole vocabulary again (~7 s
    for a demo file). The load shares one reader per file, and puts gguf's own back when it is done."""
    import gguf as gguf_package

    path, source_model = tiny_gguf
    opened = []

    class CountingReader(gguf_package.GGUFReader):
        def __init__(self, file, *args, **kwargs):
            opened.append(Path(file).resolve())
            super().__init__(file, *args, **kwargs)

    monkeypatch.setattr(gguf_package, "GGUFReader", CountingReader)
    loaded = load_model(str(path), device="cpu", dtype="float32", progress=False)
    assert opened == [path.resolve()]
    assert gguf_package.GGUFReader is CountingReader
    input_ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(input_ids).logits, source_model(input_ids).logits)

    with pytest.raises(KeyboardInterrupt), gguf.shared_readers():
        raise KeyboardInterrupt
    assert gguf_package.GGUFReader is CountingReader


def test_shared_readers_share_per_file(tiny_gguf, tmp_path):
    import gguf as gguf_package

    path, _ = tiny_gguf
    other = tmp_path / "other.gguf"
    other.write_bytes(path.read_bytes())
    with gguf.shared_readers():
        first = gguf_package.GGUFReader(str(path))
        assert gguf_package.GGUFReader(path) is first
        assert gguf_package.GGUFReader(other) is not first
        with gguf.shared_readers():
            assert gguf_package.GGUFReader(str(path)) is first
        (tmp_path / "converted").mkdir()
        gguf._convert(path, torch.float32, tmp_path / "converted")  # its last read: the reader is let go
        assert gguf_package.GGUFReader(path) is not first


@pytest.mark.parametrize("damage", ["cut", "gone", "no config"])
def test_a_damaged_conversion_is_made_again(tiny_gguf, specdec_home, damage):
    """A cached conversion whose weights file was cut short (a full disk or a crash outside specdec's own writes,
    a copied cache) or deleted loaded with a traceback or 'has no weights — check the folder or hub id', which a
    user cannot fix: it is converted again."""
    path, source_model = tiny_gguf
    load_model(str(path), device="cpu", dtype="float32", progress=False)
    (entry,) = gguf.existing_conversions(path)
    weights = entry / "model.safetensors"
    if damage == "cut":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif damage == "gone":
        weights.unlink()
    else:
        (entry / "config.json").unlink()
    assert gguf.conversion_problem(entry) == {"cut": "model.safetensors cut short", "gone": "no weights",
                                              "no config": "no config.json"}[damage]
    loaded = load_model(str(path), device="cpu", dtype="float32", progress=False)
    assert gguf.existing_conversions(path) == [entry] and gguf.conversion_problem(entry) is None
    input_ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(input_ids).logits, source_model(input_ids).logits)


def test_a_whole_conversion_is_not_made_again(tiny_gguf, specdec_home, monkeypatch):
    path, _ = tiny_gguf
    load_model(str(path), device="cpu", dtype="float32", progress=False)
    (entry,) = gguf.existing_conversions(path)
    assert gguf.conversion_problem(entry) is None
    monkeypatch.setattr(gguf, "_convert", lambda *args: pytest.fail("converted again"))
    load_model(str(path), device="cpu", dtype="float32", progress=False)


def test_a_cut_weights_file_in_a_folder_is_one_line(llama_folder, tmp_path):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(llama_folder, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match="cannot load .*: Error while deserializing header") as raised:
        load_model(str(folder), device="cpu", dtype="float32", progress=False)
    assert "\n" not in raised.value.one_line()


def test_a_gguf_without_the_gguf_package_is_one_line_naming_the_extra(tiny_gguf, specdec_home, monkeypatch):
    """Without gguf installed, the memory pre-flight's config read (transformers, before any conversion) raised
    an ImportError traceback."""
    import importlib.util

    from specdec_cli.errors import MissingExtraError

    path, _ = tiny_gguf
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "gguf" else real_find_spec(name, *args))
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)  # an import of it fails as if not installed
    with pytest.raises(MissingExtraError) as raised:
        load_model(str(path), device="cpu", dtype="float32", progress=False)
    assert raised.value.one_line() == "loading .gguf files needs the gguf package — pip install 'specdec[gguf]'"


def test_a_conversion_that_would_not_fit_in_memory_is_refused_before_it_starts(tiny_gguf, specdec_home, monkeypatch):
    """The demo target's conversion peaks at ~5.4 GB: on a machine with less free, the kernel killed the process
    half-way with no message."""
    from specdec_cli.errors import InsufficientMemoryError

    path, _ = tiny_gguf
    needed = int(gguf.CONVERSION_MEMORY * gguf.element_count(path) * 4)
    monkeypatch.setattr(gguf, "available_memory_bytes", lambda device: needed - 1)
    with pytest.raises(InsufficientMemoryError, match=r"converting tiny-llama.gguf to safetensors \(once\) needs ~"):
        load_model(str(path), device="cpu", dtype="float32", progress=False)
    assert gguf.existing_conversions(path) == []
    monkeypatch.setattr(gguf, "available_memory_bytes", lambda device: needed)
    load_model(str(path), device="cpu", dtype="float32", progress=False)
    assert len(gguf.existing_conversions(path)) == 1


def test_a_gguf_of_an_architecture_transformers_cannot_read_is_named_as_such(specdec_home, tmp_path):
    """An mmproj file (llama.cpp's vision projector, architecture 'clip') beside a model's .gguf was told to download
    itself again, as if it were damaged."""
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "mmproj-model-f16.gguf"
    writer = GGUFWriter(str(path), "clip")
    writer.add_tensor("v.patch_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError) as raised:
        load_model(str(path), device="cpu", progress=False)
    line = raised.value.one_line()
    assert line.startswith(f"{path} holds a 'clip' model, which transformers cannot read from a .gguf")
    assert "download" not in line and "mmproj" in line


def test_a_load_removes_the_conversions_it_supersedes_once_they_go_unread(tiny_gguf, specdec_home, monkeypatch,
                                                                           tmp_path):
    """Every transformers upgrade converted the demo pair again beside the old conversion (4.6 GB each time), and a
    .gguf downloaded again did the same: the disk filled with entries nothing could read. A load removes those of the
    same file and dtype by other converter versions, and those of what the same path held before, once unread for
    KEEP_UNUSED_SECONDS: another install sharing the home (another transformers) still reads its own, and removing it
    at once made the two convert in turn at every start. Another dtype's conversion and other files' stay."""
    import os
    import shutil
    import time

    def age(folder):  # as if no load had read it for longer than kept
        then = time.time() - gguf.KEEP_UNUSED_SECONDS - 60
        os.utime(folder, (then, then))

    def float32_conversions():
        return [entry for entry in gguf.existing_conversions(path) if entry.name.endswith("-float32")]

    path = tmp_path / "mine" / tiny_gguf[0].name  # its own copy: this test changes the file's mtime
    path.parent.mkdir()
    shutil.copy(tiny_gguf[0], path)
    load_model(str(path), device="cpu", dtype="float32", progress=False)
    load_model(str(path), device="cpu", dtype="bfloat16", progress=False)
    (as_bfloat16,) = [entry for entry in gguf.existing_conversions(path) if entry.name.endswith("bfloat16")]
    other_file = tmp_path / "other" / path.name  # the same name in another folder: another file
    other_file.parent.mkdir()
    shutil.copy(path, other_file)
    load_model(str(other_file), device="cpu", dtype="float32", progress=False)
    (other,) = gguf.existing_conversions(other_file)
    for folder in (as_bfloat16, other):
        age(folder)

    today = gguf.converter_versions()
    monkeypatch.setattr(gguf, "converter_versions", lambda: "tf99.0.0-gguf9.9.9")  # an upgrade
    (before,) = gguf.superseded_conversions(path, torch.float32)
    assert before.name.endswith("float32") and before != other
    load_model(str(path), device="cpu", dtype="float32", progress=False)
    (upgraded,) = float32_conversions()
    assert "tf99.0.0-gguf9.9.9" in upgraded.name and before.is_dir()  # read a moment ago: another install's, maybe
    age(before)
    with monkeypatch.context() as other_install:  # the install beside it, with the old versions, reads its own
        other_install.setattr(gguf, "converter_versions", lambda: today)
        load_model(str(path), device="cpu", dtype="float32", progress=False)
    load_model(str(path), device="cpu", dtype="float32", progress=False)
    assert before.is_dir()  # made long ago, but read just now
    age(before)
    load_model(str(path), device="cpu", dtype="float32", progress=False)  # read from the cache this time
    assert not before.exists() and as_bfloat16.is_dir() and other.is_dir()

    os.utime(path, ns=(0, 0))  # the file changed in place (downloaded again): a new identity
    age(upgraded)
    load_model(str(path), device="cpu", dtype="float32", progress=False)
    (changed,) = float32_conversions()
    assert changed != upgraded and not upgraded.exists() and gguf.conversion_problem(changed) is None
    assert sorted(entry.name for entry in (specdec_home / "gguf").iterdir() if not entry.name.startswith(".")) == \
        sorted([changed.name, as_bfloat16.name, other.name])
