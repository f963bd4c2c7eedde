"""int8 (per-channel weights, per-token activations, oneDNN): loaded for real, CPU only, and lossless as a draft."""

import copy

import pytest
import torch

from specdec_cli.drafters import DraftModelDrafter
from specdec_cli.engine import FixedK, SamplingParams, SpeculativeDecoder
from specdec_cli.errors import ModelLoadError
from specdec_cli.models import load_model
from specdec_cli.models.formats.quant import check_quantization
from specdec_cli.models.loading.preflight import estimate_weight_bytes
from specdec_cli.models.runtime.quantize import quantize_int8_dynamic

from tests.conftest import hf_greedy

from specdec_cli.models.formats.int8 import PerTokenInt8Linear


def test_int8_load_quantises_every_linear_layer_and_runs(llama_folder):
    loaded = load_model(str(llama_folder), device="cpu", dtype="bfloat16", quantization="int8", progress=False)
    quantised = [name for name, module in loaded.model.named_modules() if isinstance(module, PerTokenInt8Linear)]
    # in each of the 2 layers q/k/v fused, o, gate/up fused, down (lean_layers.py); and the output layer
    assert len(quantised) == 2 * 4 + 1
    assert not any(isinstance(module, torch.nn.Linear) for module in loaded.model.modules())
    assert (loaded.quantization, loaded.dtype, loaded.vocab_size) == ("int8", torch.float32, 300)
    with torch.no_grad():
        logits = loaded.model(torch.tensor([[1, 2, 3, 4]])).logits  # (B, T, V)
    assert logits.shape == (1, 4, 300) and torch.isfinite(logits).all()
    assert loaded.describe("draft").endswith("· float32 · int8 weights, per-token int8 activations")


def test_int8_is_refused_off_the_cpu_with_what_to_do():
    with pytest.raises(ModelLoadError) as raised:
        check_quantization("int8", torch.device("cuda"))
    assert "CPU only" in str(raised.value) and "nf4 or bnb8" in raised.value.hint
    check_quantization("int8", torch.device("cpu"))  # no error


@pytest.mark.parametrize("tied", [True, False])
def test_int8_memory_estimate_is_what_the_quantised_model_holds(tmp_path, tied):
    from transformers import AutoConfig

    from tests.tiny import build_tiny_model

    build_tiny_model(tmp_path, arch="llama")
    config = AutoConfig.from_pretrained(tmp_path)
    config.tie_word_embeddings = tied
    config.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32", quantization="int8", progress=False)
    int8_layers = [module for module in loaded.model.modules() if isinstance(module, PerTokenInt8Linear)]
    tensors = [*loaded.model.parameters(), *(buffer for layer in int8_layers for buffer in layer.buffers())]
    held = sum(tensor.numel() * tensor.element_size() for tensor in tensors)  # int8 weights, fp32 scales and the rest
    assert estimate_weight_bytes(config, torch.bfloat16, "int8") == held  # no biases in llama


@pytest.mark.parametrize("k", [1, 3, 6])
def test_an_int8_draft_is_lossless(llama_target, llama_near_draft, k):
    prompt = [1] + [(7 * i + 2) % 60 + 3 for i in range(30)]
    draft = quantize_int8_dynamic(copy.deepcopy(llama_near_draft))
    result = SpeculativeDecoder(llama_target, DraftModelDrafter(draft), FixedK(k)).generate(prompt, SamplingParams(), 40)
    assert result.tokens == hf_greedy(llama_target, prompt, 40)
    assert result.stats.accepted > 0  # the quantised near-copy still agrees with the target often


def test_the_benchmark_counts_an_int8_models_packed_weights(llama_folder):
    from specdec_cli.models.loading.preflight import held_weight_bytes

    loaded = load_model(str(llama_folder), device="cpu", dtype="float32", quantization="int8", progress=False)
    linear = sum(module.in_features * module.out_features for module in loaded.model.modules()
                 if isinstance(module, PerTokenInt8Linear))
    parameters = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    assert linear > 0
    assert held_weight_bytes(loaded.model) >= parameters + linear  # one byte per int8 weight on top of the fp32 rest


def test_a_subset_head_over_an_int8_model_scores_the_same_rows(llama_near_draft):
    from transformers import DynamicCache

    from specdec_cli.drafters.subset_head import SubsetHeadLM

    int8 = quantize_int8_dynamic(copy.deepcopy(llama_near_draft))
    subset = torch.tensor([0, 3, 5, 40, 95])
    head = SubsetHeadLM(int8, subset)
    assert isinstance(head.head, PerTokenInt8Linear)
    ids = torch.tensor([[1, 2, 3]])
    logits = head(ids, cache=DynamicCache(config=int8.config), logits_to_keep=1).logits
    with torch.no_grad():
        full = int8(ids, logits_to_keep=1).logits
    assert torch.equal(logits, full[..., subset])  # the same int8 rows and scales: the same scores


@pytest.mark.parametrize("k", [2, 5])
def test_an_int8_draft_with_a_subset_head_is_lossless(llama_target, llama_near_draft, k):
    prompt = [1] + [(7 * i + 2) % 60 + 3 for i in range(30)]
    int8 = quantize_int8_dynamic(copy.deepcopy(llama_near_draft))
    drafter = DraftModelDrafter(int8, token_ids=torch.arange(0, 96, 2))
    result = SpeculativeDecoder(llama_target, drafter, FixedK(k)).generate(prompt, SamplingParams(), 40)
    assert result.tokens == hf_greedy(llama_target, prompt, 40)
    assert result.stats.accepted > 0
