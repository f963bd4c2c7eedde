import pytest
import torch

from specdec_cli.errors import ModelLoadError
from specdec_cli.models import gguf, load_model


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
    assert len(entries) == 2 and any("-tf9.9.9-" in name for name in entries)
