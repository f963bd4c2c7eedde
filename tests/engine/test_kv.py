"""The KV cache: after any rollback, the next forward's logits equal a full-sequence forward."""

import pytest
import torch

from specdec_cli.engine.kv import CachedModel


def full_forward_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def test_extend_after_rollback_matches_full_forward(llama_target):
    runner = CachedModel(llama_target)
    prompt, rejected, accepted = [1, 5, 7, 9], [30, 31, 32, 33], [30, 44]
    runner.extend(prompt + rejected, 5)
    assert len(runner) == 8
    # The draft was accepted up to 30; 44 replaces 31. Only the shared prefix survives.
    logits = runner.extend(prompt + accepted, 2)
    assert runner.ids == prompt + accepted
    assert torch.allclose(logits, full_forward_logits(llama_target, prompt + accepted)[-2:], atol=1e-5)


def test_only_unseen_tokens_are_fed(llama_target):
    runner = CachedModel(llama_target)
    runner.extend([1, 2, 3, 4], 1)
    runner.extend([1, 2, 3, 4, 5, 6], 1)
    layer = runner.cache.layers[0]
    assert layer.keys.shape[-2] == 6 and runner.forwards == 2


def test_n_logits_larger_than_new_tokens_refeeds(llama_target):
    runner = CachedModel(llama_target)
    runner.extend([1, 2, 3, 4, 5], 1)
    logits = runner.extend([1, 2, 3, 4, 5], 3)
    assert torch.allclose(logits, full_forward_logits(llama_target, [1, 2, 3, 4, 5])[-3:], atol=1e-5)


def test_keep_selects_positions(qwen_target):
    runner = CachedModel(qwen_target)
    runner.extend([1, 5, 7, 9, 11, 13], 1)
    runner.keep([0, 1, 2, 3])
    assert runner.ids == [1, 5, 7, 9]
    logits = runner.extend([1, 5, 7, 9, 20], 1)
    assert torch.allclose(logits, full_forward_logits(qwen_target, [1, 5, 7, 9, 20])[-1:], atol=1e-5)


def test_interrupted_forward_leaves_a_consistent_cache(llama_target, monkeypatch):
    runner = CachedModel(llama_target)
    runner.extend([1, 2, 3], 1)
    layer_forward = llama_target.model.layers[1].forward

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(llama_target.model.layers[1], "forward", interrupted)
    try:
        runner.extend([1, 2, 3, 4, 5], 1)
    except KeyboardInterrupt:
        pass
    monkeypatch.setattr(llama_target.model.layers[1], "forward", layer_forward)
    assert runner.ids == [1, 2, 3]
    assert all(layer.keys.shape[-2] == 3 for layer in runner.cache.layers)
    logits = runner.extend([1, 2, 3, 4, 5], 1)
    assert torch.allclose(logits, full_forward_logits(llama_target, [1, 2, 3, 4, 5])[-1:], atol=1e-5)


def test_a_first_forward_interrupted_between_keys_and_values_rolls_back_cleanly(llama_target, monkeypatch):
    """A layer's first update replaces its empty 1-D keys, then its values: a signal landing between the two (a
    SIGTERM to `run` did, in the suite's SIGTERM test) left values 1-D, and the rollback's IndexError replaced
    the interrupt."""
    from specdec_cli.engine import cache_layers

    runner = CachedModel(llama_target)
    appended, calls = cache_layers._appended, []

    def interrupted_at_values(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # layer 0: keys done, values next
            raise KeyboardInterrupt
        return appended(*args, **kwargs)

    monkeypatch.setattr(cache_layers, "_appended", interrupted_at_values)
    with pytest.raises(KeyboardInterrupt):
        runner.extend([1, 2, 3], 1)
    monkeypatch.setattr(cache_layers, "_appended", appended)
    assert runner.ids == [] and not cache_layers.filled_layers(runner.cache)
    logits = runner.extend([1, 2, 3, 4, 5], 1)
    assert torch.allclose(logits, full_forward_logits(llama_target, [1, 2, 3, 4, 5])[-1:], atol=1e-5)


def test_a_long_prompt_is_fed_in_chunks_with_the_same_logits(llama_target):
    prompt = [(7 * i + 3) % 90 + 3 for i in range(150)]
    whole = CachedModel(llama_target, prefill_chunk=1000)
    chunked = CachedModel(llama_target, prefill_chunk=32)
    expected = whole.extend(prompt, 4)
    logits = chunked.extend(prompt, 4)
    assert (whole.forwards, chunked.forwards) == (1, 5)  # 32 + 32 + 32 + 32 + 22
    assert chunked.ids == prompt
    assert all(layer.keys.shape[-2] == 150 for layer in chunked.cache.layers)
    assert torch.equal(logits, expected)  # bit for bit: each chunk attends to the same keys as one forward would
    # and the cache the chunks built serves the next step like the whole-prompt one
    assert torch.equal(chunked.extend(prompt + [5, 6], 2), whole.extend(prompt + [5, 6], 2))


def test_the_last_chunk_always_holds_the_positions_asked_for(llama_target):
    prompt = [(5 * i + 1) % 90 + 3 for i in range(66)]
    runner = CachedModel(llama_target, prefill_chunk=32)
    logits = runner.extend(prompt, 5)  # 66 = 32 + 29 + 5: never a last chunk shorter than 5
    assert logits.shape[0] == 5
    assert torch.allclose(logits, full_forward_logits(llama_target, prompt)[-5:], atol=1e-5, rtol=0)


def test_ctrl_c_between_chunks_keeps_the_chunks_already_fed(llama_target, monkeypatch):
    prompt = [(3 * i + 2) % 90 + 3 for i in range(100)]
    runner = CachedModel(llama_target, prefill_chunk=32)
    forward = runner._forward
    calls = []

    def interrupted_third(new_ids, n_logits):
        calls.append(len(new_ids))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return forward(new_ids, n_logits)

    monkeypatch.setattr(runner, "_forward", interrupted_third)
    try:
        runner.extend(prompt, 1)
    except KeyboardInterrupt:
        pass
    assert calls == [32, 32, 32]
    assert runner.ids == prompt[:64]
    assert all(layer.keys.shape[-2] == 64 for layer in runner.cache.layers)
    monkeypatch.undo()
    logits = runner.extend(prompt, 1)
    assert torch.allclose(logits, full_forward_logits(llama_target, prompt)[-1:], atol=1e-5, rtol=0)


def test_the_draft_models_cache_equals_a_fresh_forward_after_rejections(llama_target, llama_near_draft):
    """Sampling with a draft that really is rejected, often mid-draft: after every proposal the draft
    model's cache holds exactly the keys and values a fresh forward over the same ids computes (nothing
    of a rejected draft left), and every draft row equals the fresh forward's distribution there."""
    from transformers import DynamicCache

    from specdec_cli.drafters import DraftModelDrafter
    from specdec_cli.engine import FixedK, SamplingParams, SpeculativeDecoder, logits_to_probs

    drafter = DraftModelDrafter(llama_near_draft)
    propose = drafter.propose
    proposals = []

    def checked_propose(ids, k, params, generator):
        draft = propose(ids, k, params, generator)
        sequence, runner = list(ids) + draft.ids, drafter.runner
        assert runner.ids == sequence[: len(runner.ids)] and len(runner.ids) >= len(ids)
        fresh = DynamicCache(config=llama_near_draft.config)
        with torch.no_grad():
            logits = llama_near_draft(input_ids=torch.tensor([sequence]), cache=fresh).logits[0]  # (T, V)
        for mine, theirs in zip(runner.cache.layers, fresh.layers, strict=True):
            torch.testing.assert_close(mine.keys, theirs.keys[..., : len(runner.ids), :], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(mine.values, theirs.values[..., : len(runner.ids), :], atol=1e-5, rtol=1e-4)
        rows = logits[len(ids) - 1 : len(ids) - 1 + len(draft)]  # (k, V): row i scores draft token i
        torch.testing.assert_close(draft.probs, logits_to_probs(rows, params), atol=1e-5, rtol=1e-4)
        proposals.append(len(draft))
        return draft

    drafter.propose = checked_propose
    decoder = SpeculativeDecoder(llama_target, drafter, FixedK(4))
    events = list(decoder.stream([1, 5, 7, 9, 11], SamplingParams(temperature=1.0, seed=3), 60))
    assert len(proposals) == len(events) > 10
    assert sum(1 for event in events if 0 < event.accepted < event.drafted) >= 3  # rejected mid-draft
    assert sum(1 for event in events if event.accepted == 0) >= 1 and any(e.accepted == e.drafted for e in events)


def test_a_forward_writes_its_entries_in_place_and_a_rollback_reuses_the_room(llama_target):
    """The cache's layers are views into buffers with room: one-token steps, a crop and the steps after it
    keep the same buffer (transformers' layer copies the whole cache each forward), and the logits are
    still those of a full forward."""
    runner = CachedModel(llama_target)
    runner.extend([1, 2, 3, 4, 5], 1)
    layer = runner.cache.layers[0]
    where = layer.keys.data_ptr(), layer.values.data_ptr()
    ids = [1, 2, 3, 4, 5]
    for token in (6, 7, 8):
        ids.append(token)
        runner.extend(ids, 1)
    assert (layer.keys.data_ptr(), layer.values.data_ptr()) == where
    assert layer.keys.shape[-2] == 8
    logits = runner.extend([1, 2, 3, 4, 5, 6, 20, 21], 2)  # rolled back past 7 and 8, then two new tokens
    assert (layer.keys.data_ptr(), layer.values.data_ptr()) == where
    assert torch.allclose(logits, full_forward_logits(llama_target, [1, 2, 3, 4, 5, 6, 20, 21])[-2:], atol=1e-5)


def test_growing_layer_holds_what_transformers_layer_holds_through_updates_crops_and_selects():
    """The same sequence of updates, crops (past and within a buffer), an index select and growth past the
    buffer's room: the same keys and values as transformers' concatenating layer, bit for bit."""
    from transformers.cache_utils import DynamicLayer

    from specdec_cli.engine.cache_layers import GrowingLayer

    generator = torch.Generator().manual_seed(0)
    ours, theirs = GrowingLayer(), DynamicLayer()

    def update(tokens: int) -> None:
        key, value = (torch.randn(1, 2, tokens, 4, generator=generator) for _ in range(2))
        got, expected = ours.update(key, value), theirs.update(key, value)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))

    update(5)
    update(1)
    for layer in (ours, theirs):
        layer.crop(-3)
    update(2)
    for layer in (ours, theirs):
        index = torch.tensor([0, 2, 3])
        layer.keys, layer.values = layer.keys.index_select(-2, index), layer.values.index_select(-2, index)
    update(1)
    update(400)  # past the buffer's room: a new buffer
    update(3)
    assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    ours.reset()
    update_after_reset = torch.randn(1, 2, 2, 4, generator=generator)
    keys, _ = ours.update(update_after_reset, update_after_reset)
    assert torch.equal(keys, update_after_reset)
