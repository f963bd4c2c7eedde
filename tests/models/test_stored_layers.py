"""A model's quantised layers (q4, int8) stored under the specdec home and read back on the next load
(models/stored_layers.py): the same layers and logits bit for bit, the .gguf's note kept, a new entry when a model file changes, and a load that goes
on as before where the entry is damaged, does not fit, or cannot be written."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from specdec_cli.models import load_model
from specdec_cli.models.formats import int8, stored_layers
from specdec_cli.models.formats.int8 import PerTokenInt8Linear
from specdec_cli.models.formats.q4 import Q4KLinear, Q4Linear
from tests.models.test_q4_kernel import needs_kernel
from tests.tiny import build_4bit_gguf

pytestmark = needs_kernel


@pytest.fixture(scope="module")
def q4k_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-q4k-cache") / "tiny-qwen2-q4k.gguf"
    build_4bit_gguf(path, arch="qwen2", kind="Q4_K")
    return path


def _entries(home) -> list:
    folder = home / stored_layers.KIND
    return sorted(folder.glob("*.safetensors")) if folder.is_dir() else []


def _layers(model) -> dict:
    return {name: module for name, module in model.named_modules() if isinstance(module, (Q4Linear, PerTokenInt8Linear))}


def _made_again(monkeypatch) -> list:
    """Counts the loads that make the layers (instead of reading them)."""
    made = []
    replacing = stored_layers.replace_linears_stored

    def counted(model, store, make):
        def counted_make(whole):
            made.append(1)
            return make(whole)

        return replacing(model, store, counted_make)

    monkeypatch.setattr(stored_layers, "replace_linears_stored", counted)
    return made


def _same_layers(first, second) -> None:
    ours, theirs = _layers(first), _layers(second)
    assert ours.keys() == theirs.keys() and ours
    for name, layer in ours.items():
        other = theirs[name]
        assert type(layer) is type(other) and torch.equal(layer.packed_weight, other.packed_weight), name
        for part in ("row_sums", "weight_scales"):
            assert torch.equal(getattr(layer, part, torch.zeros(0)), getattr(other, part, torch.zeros(0))), name
        assert (layer.bias is None) == (other.bias is None) and (layer.bias is None or torch.equal(layer.bias, other.bias))


def _logits(model) -> torch.Tensor:
    return model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits


def test_a_gguf_models_layers_are_read_back_the_same_with_its_note(q4k_gguf, specdec_home, monkeypatch):
    made = _made_again(monkeypatch)
    first = load_model(str(q4k_gguf), quantization="q4", progress=False)
    assert len(made) == 1 and len(_entries(specdec_home)) == 1
    second = load_model(str(q4k_gguf), quantization="q4", progress=False)
    assert len(made) == 1  # read, not made
    _same_layers(first.model, second.model)
    assert any(type(layer) is Q4KLinear for layer in _layers(second.model).values())
    assert second.model._specdec_q4_from_gguf == first.model._specdec_q4_from_gguf == (15, 15)
    assert second.describe("target") == first.describe("target")
    assert torch.equal(_logits(first.model), _logits(second.model))


@pytest.mark.parametrize("quantization", ["q4", "int8"])
def test_a_folder_models_layers_are_read_back_the_same(tiny_pair, specdec_home, monkeypatch, quantization):
    made = _made_again(monkeypatch)
    first = load_model(tiny_pair.target, quantization=quantization, dtype="float32", progress=False)
    second = load_model(tiny_pair.target, quantization=quantization, dtype="float32", progress=False)
    assert len(made) == 1 and len(_entries(specdec_home)) == 1
    _same_layers(first.model, second.model)
    assert torch.equal(_logits(first.model), _logits(second.model))


def test_each_format_keeps_its_own_entry(tiny_pair, specdec_home, monkeypatch):
    for quantization in ("q4", "int8", "q4"):
        load_model(tiny_pair.target, quantization=quantization, dtype="float32", progress=False)
    made = _made_again(monkeypatch)
    load_model(tiny_pair.target, quantization="int8", dtype="float32", progress=False)
    assert len(_entries(specdec_home)) == 2 and made == []


def test_int8_layers_on_another_activation_width_are_made_again(tiny_pair, specdec_home, monkeypatch):
    """An AVX2-only CPU's int8 takes 7-bit activations: layers stored for 8 bits are not its."""
    load_model(tiny_pair.target, quantization="int8", dtype="float32", progress=False)
    monkeypatch.setattr(int8, "activation_bits", lambda: 7)
    made = _made_again(monkeypatch)
    loaded = load_model(tiny_pair.target, quantization="int8", dtype="float32", progress=False)
    assert made and {layer.bits for layer in _layers(loaded.model).values()} == {7}


def test_a_changed_model_file_makes_a_new_entry_in_place_of_the_old(q4k_gguf, tmp_path, specdec_home, monkeypatch):
    path = tmp_path / q4k_gguf.name
    shutil.copy(q4k_gguf, path)
    made = _made_again(monkeypatch)
    load_model(str(path), quantization="q4", progress=False)
    before = _entries(specdec_home)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the same name, touched: another file
    load_model(str(path), quantization="q4", progress=False)
    after = _entries(specdec_home)
    assert len(made) == 2 and len(before) == len(after) == 1 and before != after


def test_a_damaged_entry_is_made_again(q4k_gguf, specdec_home, monkeypatch):
    first = load_model(str(q4k_gguf), quantization="q4", progress=False)
    (entry,) = _entries(specdec_home)
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])  # cut short, as a crash of another writer might
    made = _made_again(monkeypatch)
    second = load_model(str(q4k_gguf), quantization="q4", progress=False)
    assert len(made) == 1
    _same_layers(first.model, second.model)


def test_an_entry_that_does_not_fit_the_modules_is_not_used(q4k_gguf, specdec_home, monkeypatch):
    load_model(str(q4k_gguf), quantization="q4", progress=False)
    reading = stored_layers.read

    def other_modules(key, label, linears):  # the same entry asked for a model whose first layer is wider
        name = next(iter(linears))
        wider = torch.nn.Linear(linears[name].in_features + 256, linears[name].out_features, bias=False)
        return reading(key, label, {**linears, name: wider})

    monkeypatch.setattr(stored_layers, "read", other_modules)
    made = _made_again(monkeypatch)
    load_model(str(q4k_gguf), quantization="q4", progress=False)
    assert len(made) == 1


def test_a_short_disk_only_means_no_entry(q4k_gguf, specdec_home, monkeypatch):
    def short_in_layers(path):  # the conversion beside it has room
        return shutil._ntuple_diskusage(10**9, 10**9, 1000 if stored_layers.KIND in str(path) else 10**9)

    monkeypatch.setattr(stored_layers.shutil, "disk_usage", short_in_layers)
    loaded = load_model(str(q4k_gguf), quantization="q4", progress=False)
    assert _entries(specdec_home) == [] and torch.isfinite(_logits(loaded.model)).all()


def test_a_failed_write_leaves_no_partial_entry(q4k_gguf, specdec_home, monkeypatch):
    import safetensors.torch

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as handle:
            handle.write(b"\0" * 100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    loaded = load_model(str(q4k_gguf), quantization="q4", progress=False)
    assert list((specdec_home / stored_layers.KIND).iterdir()) == [] and torch.isfinite(_logits(loaded.model)).all()


def test_other_formats_and_onednn_int8_layers_store_nothing(tiny_pair, specdec_home, monkeypatch):
    load_model(tiny_pair.target, quantization="int4", dtype="float32", progress=False)
    load_model(tiny_pair.target, dtype="float32", progress=False)
    monkeypatch.setattr(int8.binding, "kernel_problem", lambda bits: "no kernel here")  # torch's oneDNN matmul
    loaded = load_model(tiny_pair.target, quantization="int8", dtype="float32", progress=False)
    assert not any(layer.own_kernel for layer in _layers(loaded.model).values())
    assert _entries(specdec_home) == []
