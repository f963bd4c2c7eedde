"""A quantised target verifies k tokens exactly as k one-token forwards would: int8 scales activations per
token (exact integer sums), int4 quantises weights only, and attention runs row by row, so the logits
of a verify forward are bit-identical to one-token decoding and speculative decoding on a quantised
target reproduces that quantised target's own output. The per-tensor int8 of torch's `quantize_dynamic`
does not (the power check).

No sampling-distribution run here: the engine's (tests/engine/test_decode_sampling.py) holds for any
target whose verify rows equal its one-token forwards, which is what the row checks assert; a 20,000-draw
run through an int8 layer took ~13 minutes on the shared 2-core machine."""

import copy
import importlib.util
import warnings

import pytest
import torch
from transformers import DynamicCache

from specdec_cli.drafters import DraftModelDrafter
from specdec_cli.engine import FixedK, SamplingParams, SpeculativeDecoder
from specdec_cli.models.runtime.attention import _visible_keys, rowwise_attention_forward
from specdec_cli.models.runtime.quantize import quantize

from tests.conftest import hf_greedy, tiny_causal_lm

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs the quant extra (torchao)")
IDS = torch.tensor([[1] + [(7 * i + 2) % 90 + 3 for i in range(40)]])
VERIFIED = 8  # rows verified in one forward
MODELS = [("llama", 0), ("qwen2", 2)]


def per_tensor_int8(model: torch.nn.Module) -> torch.nn.Module:
    """What specdec's int8 used to be: torch's deprecated dynamic quantisation, one activation scale per forward."""
    from torch.ao import quantization as ao

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ao.quantize_dynamic(model.float(), {torch.nn.Linear: ao.per_channel_dynamic_qconfig}, dtype=torch.qint8)


@torch.no_grad()
def verify_and_decode(model: torch.nn.Module, ids: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of the last `rows` tokens of `ids` after a cached prefix: (from one forward over all of
    them, as verification runs; from one forward per token, as decoding runs), each (rows, V)."""
    prefix = ids[:, :-rows]
    together = DynamicCache(config=model.config)
    model(input_ids=prefix, cache=together)
    verified = model(input_ids=ids[:, -rows:], cache=together).logits[0]
    alone = DynamicCache(config=model.config)
    model(input_ids=prefix, cache=alone)
    decoded = [model(input_ids=ids[:, i : i + 1], cache=alone).logits[0, 0] for i in range(ids.shape[1] - rows, ids.shape[1])]
    return verified, torch.stack(decoded)


@pytest.mark.parametrize("quantization", ["int8", "q4"])
@pytest.mark.parametrize("arch, seed", MODELS)
def test_int8_and_q4_verify_rows_are_the_one_token_logits_bit_for_bit(arch, seed, quantization):
    model = quantize(tiny_causal_lm(arch, seed=seed, logit_scale=8.0, layers=4), quantization)
    assert sum(hasattr(module, "qkv_proj") for module in model.modules()) == 4  # the lean layers ran
    verified, decoded = verify_and_decode(model, IDS, VERIFIED)
    assert torch.equal(verified, decoded)


@pytest.mark.parametrize("quantization", ["int8", "q4"])
def test_the_lean_layers_give_transformers_layers_logits(quantization, monkeypatch):
    """Fused projections and one rotary pass (the torch path, as a batch of many rows or an additive mask
    takes it): with transformers' own RMSNorm, bit for bit the logits of transformers' layers on the same
    weights (the C RMSNorm is compared on its own, below)."""
    from specdec_cli.models.runtime import decoder_stack, lean_layers

    model = tiny_causal_lm("qwen2", seed=2, logit_scale=8.0, layers=4)  # qwen2: q/k/v with biases
    # transformers' RMSNorm for the layers' norms and the decoder's (whose forward `lean_norm` calls _rms_norm)
    monkeypatch.setattr(lean_layers, "_rms_norm", lambda norm, hidden: type(norm).forward(norm, hidden))
    monkeypatch.setattr(lean_layers, "_runs_in_c", lambda *args: False)
    lean = quantize(copy.deepcopy(model), quantization)
    monkeypatch.setattr(decoder_stack, "use_lean_layers", lambda model: model)
    plain = quantize(copy.deepcopy(model), quantization)
    with torch.no_grad():
        assert torch.equal(lean(IDS).logits, plain(IDS).logits)


def test_an_int8_model_on_onednn_runs_over_the_engines_cache(monkeypatch):
    """Without specdec's kernel (no C compiler, not x86-64, SPECDEC_INT8_KERNEL=onednn) int8 runs on oneDNN, whose
    prepacked weights have no address: the lean layers and the decoder stack must not ask for one (every forward
    raised RuntimeError) and give transformers' layers' logits, with speculation still the target alone."""
    from specdec_cli.engine.kv import CachedModel
    from specdec_cli.models.native import binding
    from specdec_cli.models.runtime import decoder_stack

    monkeypatch.setattr(binding, "library", lambda: (None, 0, "SPECDEC_INT8_KERNEL=onednn"))
    model = tiny_causal_lm("qwen2", seed=2, logit_scale=8.0, layers=4)
    lean = quantize(copy.deepcopy(model), "int8")
    assert not lean.model.layers[0].mlp.down_proj.own_kernel
    assert lean.model.forward.__func__ is decoder_stack.stack_forward
    monkeypatch.setattr(decoder_stack, "use_lean_layers", lambda model: model)
    plain = quantize(copy.deepcopy(model), "int8")
    ids = IDS[0].tolist()
    assert torch.equal(CachedModel(lean).extend(ids, 3), CachedModel(plain).extend(ids, 3))
    drafter = DraftModelDrafter(quantize(tiny_causal_lm("qwen2", seed=3, layers=2), "int8"))
    result = SpeculativeDecoder(lean, drafter, FixedK(3)).generate(ids, SamplingParams(), 12)
    assert result.tokens == hf_greedy(lean, ids, 12)


@pytest.mark.parametrize("quantization", ["int8", "q4"])
@pytest.mark.parametrize("arch, seed", MODELS)
def test_the_layers_in_c_give_transformers_layers_logits_up_to_rounding(arch, seed, quantization, monkeypatch):
    """A batch of one goes through layer_kernels.c (norm, q/k/v, rotary | attention | o, norm, gate/up, SiLU,
    down): the logits of transformers' layers on the same weights up to rounding (libm's expf, the norm's
    double sum, and int8 activations that turn a last-bit difference into a step now and then)."""
    from specdec_cli.models.runtime import decoder_stack

    model = tiny_causal_lm(arch, seed=seed, logit_scale=8.0, layers=4)
    lean = quantize(copy.deepcopy(model), quantization)
    monkeypatch.setattr(decoder_stack, "use_lean_layers", lambda model: model)
    plain = quantize(copy.deepcopy(model), quantization)
    with torch.no_grad():
        ours, theirs = lean(IDS).logits, plain(IDS).logits
    assert all(layer._c_projections[1] is not None for layer in lean.model.layers)  # the C path ran
    assert torch.allclose(ours, theirs, atol=0.05), (ours - theirs).abs().max()  # a step of ~0.006
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_the_rms_norm_in_c_is_transformers_rms_norm_up_to_rounding():
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    from specdec_cli.models.runtime.lean_layers import _rms_norm

    norm = Qwen2RMSNorm(96, eps=1e-6)
    norm.weight.data.uniform_(0.5, 1.5)
    hidden = torch.randn(1, 5, 96) * torch.logspace(-3, 2, 5)[None, :, None]  # rows of unlike scales
    with torch.no_grad():
        ours, theirs = _rms_norm(norm, hidden), norm(hidden)
        assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)
        assert torch.equal(_rms_norm(norm, hidden[:, 2:3]), ours[:, 2:3])  # a row on its own: the same bits


def _attention_inputs(rows: int, keys: int, generator: torch.Generator):
    query = torch.randn(1, 4, rows, 16, generator=generator)  # (1, heads, rows, dim): 2 heads per kv head
    key, value = (torch.randn(1, 2, keys, 16, generator=generator) for _ in range(2))
    return query, key, value


def test_attention_in_c_gives_each_row_what_it_gives_that_row_alone():
    """Causal: row r of a k-row call sees the keys a one-row call over the cache up to r sees, bit for bit."""
    query, key, value = _attention_inputs(6, 30, torch.Generator().manual_seed(1))
    module = torch.nn.Module()
    together, _ = rowwise_attention_forward(module, query, key, value, None, scaling=0.25)
    for row in range(6):
        keys = 30 - 6 + row + 1
        alone, _ = rowwise_attention_forward(module, query[:, :, row:row + 1], key[:, :, :keys].contiguous(),
                                             value[:, :, :keys].contiguous(), None, scaling=0.25)
        assert torch.equal(together[:, row], alone[:, 0]), row


def test_attention_in_c_over_a_tree_gives_each_node_its_paths_attention():
    """A tree mask: a node attends to the prefix and its ancestors, exactly as a one-row call over those keys
    laid side by side (what one-token decoding along its path holds in its cache)."""
    query, key, value = _attention_inputs(3, 8, torch.Generator().manual_seed(2))
    mask = torch.ones(1, 1, 3, 8, dtype=torch.bool)  # keys 0-4 the prefix; nodes 0, 1, 2 are keys 5, 6, 7
    mask[0, 0, 0, 6:] = False  # node 0: the prefix and itself
    mask[0, 0, 1, 7] = False  # node 1, a child of node 0: the prefix, node 0, itself
    mask[0, 0, 2, 6] = False  # node 2, node 1's sibling: the prefix, node 0, itself (not key 6: a branch)
    _assert_each_row_attends_as_alone(query, key, value, mask)


def test_attention_in_c_over_a_packed_batch_gives_each_row_its_own_keys():
    """A packed batch's mask: 4 rows own every 4th slot of 37 (so each block of 8 keys holds every row's), row 3 the
    fewest; each row bit for bit what a one-row call over its own keys side by side gives."""
    query, key, value = _attention_inputs(4, 37, torch.Generator().manual_seed(3))
    slots = torch.arange(37)
    mask = (slots[None, :] % 4 == torch.arange(4)[:, None])[None, None]
    mask[0, 0, 3, 20:] = False
    _assert_each_row_attends_as_alone(query, key, value, mask)


def _assert_each_row_attends_as_alone(query, key, value, mask) -> None:
    """Each row of one masked call, bit for bit what a one-row call over its visible keys side by side gives."""
    module = torch.nn.Module()
    together, _ = rowwise_attention_forward(module, query, key, value, mask, scaling=0.25)
    for row in range(query.shape[2]):
        own = mask[0, 0, row].nonzero().flatten()
        alone, _ = rowwise_attention_forward(module, query[:, :, row:row + 1], key[:, :, own].contiguous(),
                                             value[:, :, own].contiguous(), None, scaling=0.25)
        assert torch.equal(together[:, row], alone[:, 0]), row


@needs_torchao
@pytest.mark.parametrize("arch, seed", MODELS)
def test_int4_verify_rows_are_the_one_token_logits_bit_for_bit(arch, seed):
    model = quantize(tiny_causal_lm(arch, seed=seed, logit_scale=8.0, layers=4), "int4")  # bfloat16 activations
    verified, decoded = verify_and_decode(model, IDS, VERIFIED)
    assert torch.equal(verified, decoded)


@pytest.mark.parametrize("arch, seed", MODELS)
def test_per_tensor_int8_verify_rows_are_not_the_one_token_logits(arch, seed):
    model = per_tensor_int8(tiny_causal_lm(arch, seed=seed, logit_scale=8.0, layers=4))
    verified, decoded = verify_and_decode(model, IDS, VERIFIED)
    assert (verified - decoded).abs().max() > 1e-2  # an activation scale shared by the rows: whole steps apart


def test_rowwise_attention_reads_the_keys_each_row_may_see():
    assert _visible_keys(None, row=1, rows=3, keys=10) == slice(0, 9)  # causal: 7 cached + rows 0 and 1
    tree = torch.tensor([[True, True, False, True, False]])[None, None]  # (1, 1, 1, 5): a branch, not a prefix
    assert torch.equal(_visible_keys(tree, row=0, rows=1, keys=5), torch.tensor([0, 1, 3]))


def test_rowwise_attention_with_a_tree_mask_is_masked_attention():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 4, n, 8, generator=generator) for n in (3, 7, 7))  # (1, heads, n, dim)
    mask = torch.ones(1, 1, 3, 7, dtype=torch.bool)
    mask[0, 0, 1, 4] = mask[0, 0, 2, 5] = False  # rows 1 and 2 on different branches
    mask[0, 0, 0, 5:] = mask[0, 0, 1, 6] = False
    module = torch.nn.Module()
    ours, _ = rowwise_attention_forward(module, query, key, value, mask, scaling=8**-0.5)
    reference, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=8**-0.5)
    assert torch.allclose(ours, reference, atol=1e-6)


@pytest.fixture(scope="module")
def int8_draft(llama_near_draft):
    return quantize(copy.deepcopy(llama_near_draft), "int8")


@pytest.mark.parametrize("quantization", ["int8", "int4", "q4"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_speculative_greedy_on_a_quantised_target_is_that_target_alone(llama_target, int8_draft, quantization, k):
    if quantization == "int4" and importlib.util.find_spec("torchao") is None:
        pytest.skip("needs the quant extra (torchao)")
    target = quantize(copy.deepcopy(llama_target), quantization)
    prompt = [1] + [(7 * i + 2) % 60 + 3 for i in range(30)]
    result = SpeculativeDecoder(target, DraftModelDrafter(int8_draft), FixedK(k)).generate(prompt, SamplingParams(), 40)
    assert result.tokens == hf_greedy(target, prompt, 40)
    assert result.stats.accepted > 0  # verification of several tokens at once happened


@pytest.mark.parametrize("dim, keys", [(128, 37), (64, 200), (20, 9)])
def test_attention_in_c_is_attention_at_real_head_sizes(dim, keys):
    """Heads of 128 and 64 (the demo pair's), and 20 (a tail past the 8-wide steps); keys past a multiple of 8."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    generator = torch.Generator().manual_seed(dim)
    query = torch.randn(1, 6, 3, dim, generator=generator)
    key, value = (torch.randn(1, 2, keys, dim, generator=generator) for _ in range(2))
    module = torch.nn.Module()
    module.num_key_value_groups = 3
    ours, _ = rowwise_attention_forward(module, query, key, value, None, scaling=dim**-0.5)
    causal = torch.ones(3, keys, dtype=torch.bool).tril(keys - 3)[None, None]
    reference, _ = sdpa_attention_forward(module, query, key, value, causal, scaling=dim**-0.5)
    assert torch.allclose(ours, reference, atol=2e-6)


def test_attention_in_c_reads_a_cache_buffers_view_in_place():
    """A cache layer's keys are a view into a longer buffer (heads a buffer apart): the same bits as contiguous keys."""
    query, key, value = _attention_inputs(2, 11, torch.Generator().manual_seed(3))
    buffers = [torch.full((1, 2, 40, 16), float("nan")) for _ in range(2)]
    for buffer, states in zip(buffers, (key, value)):
        buffer[..., :11, :] = states
    module = torch.nn.Module()
    in_place, _ = rowwise_attention_forward(module, query, buffers[0][..., :11, :], buffers[1][..., :11, :], None,
                                            scaling=0.25)
    contiguous, _ = rowwise_attention_forward(module, query, key, value, None, scaling=0.25)
    assert torch.equal(in_place, contiguous)


@pytest.mark.parametrize("dim", [24, 128, 20])
def test_attention_in_c_gives_each_head_of_a_group_what_it_gives_that_head_alone(dim):
    """The query heads that share a kv head go through the C attention together (their scores a block of keys at a
    time, their weighted values up to 4 heads a pass): 7 heads per kv head (4 + 3), dims 24 (16 + a last 8), 128 and
    20 (a tail past the 8-wide steps), under a tree mask with a row that sees no key, each head bit for bit what it
    gives alone over its own kv head's keys, and what SDPA gives within rounding."""
    generator = torch.Generator().manual_seed(dim)
    query = torch.randn(1, 14, 4, dim, generator=generator)  # (1, heads, rows, dim): 2 kv heads of 7
    key, value = (torch.randn(1, 2, 13, dim, generator=generator) for _ in range(2))
    mask = torch.ones(1, 1, 4, 13, dtype=torch.bool).tril(9)
    mask[0, 0, 2, 10] = False  # a branch
    mask[0, 0, 3] = False  # a row with no visible key: zeros
    module = torch.nn.Module()
    module.num_key_value_groups = 7
    together, _ = rowwise_attention_forward(module, query, key, value, mask, scaling=dim**-0.5)
    alone_module = torch.nn.Module()
    alone_module.num_key_value_groups = 1
    for head in range(14):
        kv = head // 7
        alone, _ = rowwise_attention_forward(alone_module, query[:, head:head + 1], key[:, kv:kv + 1].contiguous(),
                                             value[:, kv:kv + 1].contiguous(), mask, scaling=dim**-0.5)
        assert torch.equal(together[:, :, head], alone[:, :, 0]), head
    assert not together[:, 3].any()
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    reference, _ = sdpa_attention_forward(module, query[:, :, :3], key, value, mask[:, :, :3], scaling=dim**-0.5)
    assert torch.allclose(together[:, :3], reference, atol=2e-6)  # and it is attention
