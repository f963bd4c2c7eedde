"""The engine tests' shared tiny pair: a Llama target and a draft near it (its weights perturbed)."""

import pytest

from tests.conftest import perturbed_copy, tiny_causal_lm


@pytest.fixture(scope="module")
def target():
    return tiny_causal_lm("llama", seed=0, logit_scale=8.0)


@pytest.fixture(scope="module")
def near_draft(target):
    return perturbed_copy(target, noise=0.15, seed=7)
