"""Speculative sampling in the batched engine follows each row's own target distribution exactly, when the rows of a
batch differ: different prompts, temperatures, top-k and top-p, side by side in every step (what `run` does with a
file of mixed requests).

A tiny random Llama over 12 ids as target and another seed as draft (about half the draft tokens accepted); batches of
32 rows, k = 3, four kinds of request interleaved, 20,000 seeded requests of each kind. For each kind the 1st, 2nd and
3rd generated tokens must fit that kind's exact marginals (the target's one-token forwards over every path, under
that kind's settings; chi-square and TV, tests/stats.py). The check's power: a batched verify that builds a row's
target probabilities at its temperature alone (dropping its top-k and top-p) fails it."""

from dataclasses import dataclass

import pytest
import torch

import specdec_cli.engine.batched as batched
from specdec_cli.engine import SamplingParams, logits_to_probs
from specdec_cli.engine.acceptance import sampling_verdict
from specdec_cli.engine.batched import BatchedDecoder, RowRequest

from tests.conftest import tiny_causal_lm
from tests.stats import fit_failure

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(1800)]

VOCAB = 12
DRAWS = 20_000  # per kind
PLANTED_DRAWS = 5_000  # the planted bug moves whole tokens' mass: a quarter of the draws finds it, in a quarter the time
POSITIONS = 3


@dataclass(frozen=True)
class Kind:
    prompt: tuple[int, ...]
    temperature: float
    top_k: int = 0
    top_p: float = 1.0

    def params(self, seed: int | None = None) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, seed)


KINDS = [
    Kind((1, 4, 7, 4, 1), 1.0),
    Kind((2, 5, 3), 0.7, top_k=4),
    Kind((1, 4, 7, 4, 1), 1.0, top_p=0.7),
    Kind((6, 6, 9, 10, 3, 8, 1), 1.4),
]


@pytest.fixture(scope="module")
def pair():
    return (tiny_causal_lm("llama", vocab_size=VOCAB, seed=3, logit_scale=2.0),
            tiny_causal_lm("llama", vocab_size=VOCAB, seed=4, logit_scale=2.0))


@torch.no_grad()
def next_probs(model, ids: list[int], params: SamplingParams) -> torch.Tensor:
    """(V,) the target's distribution of the token after `ids` under `params`, from the last token's one-token
    forward on a cache of the others."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([ids[:-1]]), cache=cache)
    logits = model(input_ids=torch.tensor([ids[-1:]]), cache=cache).logits[0, -1]
    return logits_to_probs(logits, params).double()


def exact_marginals(model, kind: Kind) -> torch.Tensor:
    """(POSITIONS, V): P(the i-th generated token = v) under the target alone, for this kind."""
    prompt, params = list(kind.prompt), kind.params()
    first = next_probs(model, prompt, params)
    second = torch.zeros(VOCAB, dtype=torch.float64)
    third = torch.zeros(VOCAB, dtype=torch.float64)
    for a in range(VOCAB):
        after_a = next_probs(model, prompt + [a], params)
        second += first[a] * after_a
        for b in range(VOCAB):
            third += first[a] * after_a[b] * next_probs(model, prompt + [a, b], params)
    return torch.stack([first, second, third])


@pytest.fixture(scope="module")
def exact(pair):
    return [exact_marginals(pair[0], kind) for kind in KINDS]


def sample(pair, draws: int = DRAWS):
    """(kinds, draws, POSITIONS) tokens from `draws` requests of each kind, interleaved in one stream of batches of 32;
    and the acceptance rate."""
    target, draft = pair
    stop = lambda generated: len(generated) >= POSITIONS  # noqa: E731
    requests = [RowRequest(list(kind.prompt), kind.params(seed=draw * len(KINDS) + index), POSITIONS + 2, stop)
                for draw in range(draws) for index, kind in enumerate(KINDS)]
    decoder = BatchedDecoder(target, draft, "model", batch_size=32, k=3)
    tokens = torch.empty(len(KINDS), draws, POSITIONS, dtype=torch.long)
    drafted = accepted = 0
    for number, result in decoder.stream(requests):
        assert not isinstance(result, Exception), result
        tokens[number % len(KINDS), number // len(KINDS)] = torch.tensor(result.tokens[:POSITIONS])
        drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
    return tokens, accepted / drafted


def failures(tokens, exact) -> list[str]:
    found = []
    for index, kind in enumerate(KINDS):
        for position in range(POSITIONS):
            counts = torch.bincount(tokens[index, :, position], minlength=VOCAB).double()
            if failure := fit_failure(counts, exact[index][position]):
                found.append(f"{kind}, token {position + 1}: {failure}")
    return found


def test_each_row_of_a_mixed_batch_follows_its_own_target_distribution(pair, exact):
    tokens, acceptance = sample(pair)
    assert 0.2 < acceptance < 0.9  # rejections and acceptances both happen often
    assert failures(tokens, exact) == []


def test_the_check_rejects_a_verify_that_drops_a_rows_top_k_and_top_p(pair, exact, monkeypatch):
    def temperature_only(draft, target_logits, row):
        params = row.request.params
        if params.greedy:
            return batched.greedy_verdict(draft.ids, target_logits)
        probs = logits_to_probs(target_logits, SamplingParams(temperature=params.temperature))
        return sampling_verdict(draft.ids, draft.probs, probs, row.generator)

    monkeypatch.setattr(batched, "_verdict", temperature_only)
    tokens, _ = sample(pair, PLANTED_DRAWS)
    found = failures(tokens, exact)
    assert found and all("top_k=4" in line or "top_p=0.7" in line for line in found)
