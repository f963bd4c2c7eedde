"""The decoder stack in one C call (decoder_stack.stack_forward, layer_kernels.c's specdec_decoder_forward) computes
what the lean layers compute one call at a time, bit for bit, through everything the engine's cache does:
prefill in chunks, a cache that outgrows its buffer, verification, rollback, kept positions, token trees and
their commit. Forwards it does not take (transformers' own cache, a batch of two) go the old way."""

import copy

import pytest
import torch
from transformers import DynamicCache

from specdec_cli.engine.kv import CachedModel
from specdec_cli.models.runtime import decoder_stack, lean_layers
from specdec_cli.models.runtime.quantize import quantize

from tests.conftest import tiny_causal_lm

MODELS = [("llama", 0), ("qwen2", 2)]
IDS = [1] + [(7 * i + 2) % 90 + 3 for i in range(299)]  # 300 tokens: past the first 256-entry buffer


def _pair(arch: str, seed: int, quantization: str):
    """(the model with the stack, the same model whose decoder runs its layers one by one)."""
    stacked = quantize(tiny_causal_lm(arch, seed=seed, logit_scale=8.0, layers=4), quantization)
    layered = quantize(tiny_causal_lm(arch, seed=seed, logit_scale=8.0, layers=4), quantization)
    assert stacked.model.forward.__func__ is decoder_stack.stack_forward
    del layered.model.forward  # back to transformers' forward, the lean layers one by one
    return stacked, layered


@pytest.fixture
def layer_calls(monkeypatch):
    """How many layers ran one by one in C (lean_layers._forward_in_c) so far."""
    calls = [0]
    one_layer = lean_layers._forward_in_c

    def counted(*args, **kwargs):
        calls[0] += 1
        return one_layer(*args, **kwargs)

    monkeypatch.setattr(lean_layers, "_forward_in_c", counted)
    return calls


def _same(stacked: CachedModel, layered: CachedModel, layer_calls, step) -> torch.Tensor:
    """step(model) on both; asserts the stack ran no layer one by one, the other did, and the logits are equal."""
    before = layer_calls[0]
    ours = step(stacked)
    assert layer_calls[0] == before, "the stack ran its layers one by one"
    theirs = step(layered)
    assert layer_calls[0] > before, "the layered model did not run its layers in C"
    assert torch.equal(ours, theirs), (ours - theirs).abs().max()
    return ours


@pytest.mark.parametrize("quantization", ["int8", "q4"])
@pytest.mark.parametrize("arch, seed", MODELS)
def test_the_stack_gives_the_layers_one_by_one_bit_for_bit(arch, seed, quantization, layer_calls):
    stacked, layered = (CachedModel(model, prefill_chunk=128) for model in _pair(arch, seed, quantization))
    steps = [
        lambda model: model.extend(IDS[:250], 1),  # prefill in two chunks
        lambda model: model.extend(IDS[:251], 1),  # decode one
        lambda model: model.extend(IDS[:259], 8),  # verify 8, outgrowing the 256-entry buffer
        lambda model: model.extend(IDS[:254] + [5, 6], 3),  # rollback, then a rejected draft's correction
        lambda model: model.extend_tree(IDS[:260], [5, 6, 7, 8, 9], [-1, 0, 0, 1, 2], sequence_logits=True),
        lambda model: (model.keep_path([0, 2]), model.extend(list(model.ids) + [11], 1))[1],  # commit, go on
        lambda model: (model.keep(list(range(100)) + list(range(150, 200))), model.extend(list(model.ids) + [4], 2))[1],
    ]
    for step in steps:
        _same(stacked, layered, layer_calls, step)
    assert stacked.ids == layered.ids
    for ours, theirs in zip(stacked.cache.layers, layered.cache.layers):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def test_forwards_the_stack_does_not_take_go_the_layered_way(layer_calls):
    stacked, layered = _pair("qwen2", 2, "q4")
    ids = torch.tensor([IDS[:40], IDS[40:80]])
    with torch.no_grad():
        # transformers' own cache: its layers have no room to write into, so the layers run one by one in C
        ours = stacked(input_ids=ids[:1], cache=DynamicCache(config=stacked.config)).logits
        assert layer_calls[0] == 4
        assert torch.equal(ours, layered(input_ids=ids[:1], cache=DynamicCache(config=layered.config)).logits)
        both = stacked(input_ids=ids).logits  # a batch of two: transformers' layers (the torch path), no crash
        assert layer_calls[0] == 8
        assert torch.equal(both, layered(input_ids=ids).logits)


def test_a_model_copied_after_a_forward_computes_the_same_on_its_own_weights():
    """The C descriptors cached on the model point into its own tensors: a deep copy drops them and makes its own."""
    model = quantize(tiny_causal_lm("qwen2", seed=2, logit_scale=8.0, layers=4), "q4")
    first = CachedModel(model).extend(IDS[:40], 2)
    twin = copy.deepcopy(model)
    assert twin.model._c_stack is None and twin.model.layers[0]._c_projections is None
    assert torch.equal(CachedModel(twin).extend(IDS[:40], 2), first)
    assert twin.model._c_stack[1] is not model.model._c_stack[1]


def test_the_stack_follows_weights_that_moved_and_an_attention_that_changed(layer_calls):
    """The stack's descriptors are made once and checked every forward against the weights' addresses: a
    projection given new weights after a forward is read from its new tensor, and an attention set to one the
    C does not compute sends the forward the layered way."""
    stacked, layered = _pair("qwen2", 2, "q4")
    before = CachedModel(stacked).extend(IDS[:40], 2)
    for model in (stacked, layered):
        down = model.model.layers[2].mlp.down_proj
        down.packed_weight = down.packed_weight.flip(0).contiguous()  # new values at a new address
    ours = _same(CachedModel(stacked), CachedModel(layered), layer_calls, lambda model: model.extend(IDS[:40], 2))
    assert not torch.equal(ours, before)
    stacked.config._attn_implementation = "eager"
    calls = layer_calls[0]
    with torch.no_grad():
        eager = CachedModel(stacked).extend(IDS[:40], 2)
    assert layer_calls[0] == calls  # neither the stack nor the layers in C: transformers' eager attention
    assert torch.allclose(eager, ours, atol=1e-4)


@pytest.mark.parametrize("arch, seed", MODELS)
def test_the_rotary_table_holds_the_rotary_modules_own_numbers(arch, seed):
    """Rows of the decoder's rotary table (positions in order) equal what the rotary module computes for those
    positions in a call of their own, bit for bit, past the table's first size (it grows)."""
    decoder = tiny_causal_lm(arch, seed=seed, layers=1).model
    hidden = torch.zeros(1, 1, decoder.config.hidden_size)
    first = 0
    for tokens in [1, 2, 3, 7, 16, 1] * 60 + [700, 5]:
        states = hidden.expand(1, tokens, -1)
        positions = torch.arange(first, first + tokens).unsqueeze(0)
        table = decoder_stack._rotary_rows(decoder, states, positions, first)
        own = decoder.rotary_emb(states, positions)
        assert all(torch.equal(row, part) for row, part in zip(table, own)), (first, tokens)
        first += tokens
    assert first > decoder_stack.ROTARY_ROWS and decoder._rotary_table[1][0].shape[1] >= first


def test_an_id_outside_the_embedding_is_an_index_error_on_both_ways():
    """The C gathers the embedding rows itself: an id past the vocabulary (or negative) raises IndexError before
    anything is computed, as torch's embedding does on the layered way, and leaves the cache as it was."""
    stacked, layered = _pair("qwen2", 2, "q4")
    rows = stacked.model.embed_tokens.weight.shape[0]
    runner = CachedModel(stacked)
    first = runner.extend(IDS[:20], 1)
    for bad in (rows, rows + 1000, -1):
        with pytest.raises(IndexError, match="embedding"):
            runner.extend(IDS[:20] + [bad], 1)
        with pytest.raises(IndexError):
            CachedModel(layered).extend(IDS[:20] + [bad], 1)
    assert runner.cache.get_seq_length() == 20 and torch.equal(runner.extend(IDS[:20] + [5], 1),
                                                                CachedModel(stacked).extend(IDS[:20] + [5], 1))
    assert torch.equal(first, CachedModel(stacked).extend(IDS[:20], 1))


@pytest.mark.parametrize("quantization", ["int8", "q4"])
def test_torchs_default_dtype_changes_nothing(quantization, layer_calls):
    """A model loading in another thread sets torch's default dtype to bfloat16 for a while (transformers does, and
    chat loads --prefill's copy in a thread): the C code's float32 scratch must not follow it (a bfloat16 buffer of
    half the bytes was overrun: a segfault). Both ways, the stack and the layers one by one."""
    stacked, layered = _pair("qwen2", 2, quantization)
    expected = [CachedModel(model).extend(IDS[:40], 4) for model in (stacked, layered)]
    torch.set_default_dtype(torch.bfloat16)
    try:
        got = [CachedModel(model).extend(IDS[:40], 4) for model in (stacked, layered)]
    finally:
        torch.set_default_dtype(torch.float32)
    for ours, theirs in zip(got, expected):
        assert ours.dtype == torch.float32 and torch.equal(ours, theirs)
