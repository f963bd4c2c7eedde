"""The logits -> probabilities transform shared by draft and target."""

import math

import pytest
import torch

from specdec_cli.engine.sampling import SamplingParams, logits_to_probs, make_generator, sample

LOGITS = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))


def test_temperature_one_is_softmax():
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=1.0))
    assert torch.allclose(probs, torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))


def test_temperature_sharpens():
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=0.5))
    expected = torch.tensor([0.25, 0.04, 0.0225, 0.01, 0.0025])
    assert torch.allclose(probs, expected / expected.sum())


def test_top_k_keeps_k_most_likely():
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(probs, torch.tensor([5 / 7, 2 / 7, 0, 0, 0]))


def test_top_p_keeps_smallest_set_reaching_p():
    # 0.5 + 0.2 = 0.7 < 0.8, so 0.15 is needed too.
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(probs, torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)


def test_top_p_always_keeps_the_best_token():
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.01))
    assert torch.allclose(probs, torch.tensor([1.0, 0, 0, 0, 0]))


def test_greedy_is_a_point_mass_on_argmax():
    probs = logits_to_probs(torch.stack([LOGITS, LOGITS.flip(0)]), SamplingParams())
    assert probs.argmax(-1).tolist() == [0, 4] and probs.sum(-1).tolist() == [1.0, 1.0]


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-1), dict(top_k=-1), dict(top_p=0), dict(top_p=1.5),
    dict(temperature=math.nan), dict(temperature=math.inf), dict(temperature=-math.inf),
    dict(top_p=math.nan), dict(top_p=math.inf),
])
def test_invalid_params_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_same_seed_same_draws():
    probs = torch.full((50,), 1 / 50)
    first = [sample(probs, g) for g in [make_generator(3)] for _ in range(20)]
    second = [sample(probs, g) for g in [make_generator(3)] for _ in range(20)]
    assert first == second and not math.isclose(len(set(first)), 1)
