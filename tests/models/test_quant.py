"""nf4 and bnb8 (bitsandbytes 4-bit and 8-bit; old names 4bit, 8bit) loading, for real, on the CPU."""

import sys

import pytest
import torch

from specdec_cli.errors import MissingExtraError
from specdec_cli.models import load_model

bitsandbytes = pytest.importorskip("bitsandbytes")


def test_4bit_load_quantises_the_linear_layers_and_runs(llama_folder):
    loaded = load_model(str(llama_folder), device="cpu", dtype="bfloat16", quantization="4bit", progress=False)
    quantised = [name for name, module in loaded.model.named_modules() if isinstance(module, bitsandbytes.nn.Linear4bit)]
    assert len(quantised) == 2 * 7  # q, k, v, o, gate, up, down in each of the 2 layers
    assert loaded.quantization == "nf4"  # the old name "4bit" is an alias
    assert loaded.vocab_size == 300  # the output layer is not quantised
    with torch.no_grad():
        logits = loaded.model(torch.tensor([[1, 2, 3, 4]])).logits  # (B, T, V)
    assert logits.shape == (1, 4, 300)
    assert torch.isfinite(logits).all()
    assert loaded.describe("draft").endswith("· nf4 weights (bitsandbytes), bfloat16 compute")


def test_missing_bitsandbytes_names_the_extra(llama_folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes importlib.util.find_spec return None
    with pytest.raises(MissingExtraError) as raised:
        load_model(str(llama_folder), quantization="4bit", progress=False)
    assert raised.value.hint == "pip install 'specdec[4bit]'"


def test_a_bitsandbytes_that_does_not_import_is_one_line_not_a_traceback(llama_folder, tmp_path, monkeypatch):
    """Installed but broken (its native library built for another CUDA, say): find_spec finds it, its import fails."""
    import importlib

    from specdec_cli.errors import ModelLoadError

    (tmp_path / "bitsandbytes.py").write_text("raise OSError('libbitsandbytes_cuda130.so: cannot open shared object file')\n")
    monkeypatch.delitem(sys.modules, "bitsandbytes", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    with pytest.raises(ModelLoadError) as raised:
        load_model(str(llama_folder), quantization="nf4", progress=False)
    assert str(raised.value).startswith("bitsandbytes is installed but does not load (libbitsandbytes_cuda130.so")
    assert "--force-reinstall bitsandbytes" in raised.value.hint


def test_third_party_loaders_that_log_noise_at_every_load_show_errors_only():
    """bitsandbytes' CPU backend warns on every nf4/bnb8 load that a hub kernel repository could not be loaded
    (untrusted, and unreachable offline); torchao warns about GPU libraries. specdec shows their errors only."""
    import logging

    import specdec_cli.models  # noqa: F401  (sets the levels)

    for name in ("torchao", "torch.utils._pytree", "bitsandbytes.backends.cpu.ops"):
        assert logging.getLogger(name).getEffectiveLevel() == logging.ERROR, name
