"""The KV cache: after any rollback, the next forward's logits equal a full-sequence forward."""

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
