"""The batched engine on a q4 target (the format `auto` picks for the demo pair on an AVX512 CPU) and a q4 draft:
each row gets what batch size 1 gives it, token for token — greedy rows what the q4 target alone gives, sampled rows
what the same request gives decoded alone — with k = auto and a fixed k, the model drafter and the cascade, and
requests of different prompt lengths, budgets and sampling settings finishing at different steps and refilled.

A planted bug (a row's rejected drafts left visible to its attention: the cache trim skipped) fails it."""

import pytest
import torch

from specdec_cli.drafters import NgramDrafter
from specdec_cli.engine import FixedK, SamplingParams, SpeculativeDecoder
from specdec_cli.engine.batched import BatchedDecoder, RowRequest
from specdec_cli.engine.packed import PackedCache
from specdec_cli.models.runtime.quantize import quantize

from tests.conftest import perturbed_copy, tiny_causal_lm
from tests.engine.test_batched import CHEAP_DRAFT, FLAT_VERIFY

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BUDGETS = [40, 7, 25, 1, 33, 18, 40]
SAMPLED = {2: SamplingParams(temperature=0.8, seed=3), 4: SamplingParams(temperature=1.0, top_k=10, seed=9),
           5: SamplingParams(temperature=0.6, top_p=0.9, seed=1)}


@pytest.fixture(scope="module")
def q4_pair():
    float_target = tiny_causal_lm("qwen2", seed=2, logit_scale=8.0, layers=3)
    return quantize(float_target, "q4"), quantize(perturbed_copy(float_target, noise=0.15, seed=7), "q4")


def requests() -> list[RowRequest]:
    """Seven requests: prompts of 1 to 60 tokens (one repeating itself, so the cascade's lookup matches), budgets of
    1 to 40, greedy and sampled rows."""
    generator = torch.Generator().manual_seed(4)
    lengths = [12, 1, 60, 5, 30, 17, 2]
    prompts = [torch.randint(3, 90, (length,), generator=generator).tolist() for length in lengths]
    prompts[4] = prompts[4][:10] * 3
    return [RowRequest(prompt, SAMPLED.get(index, SamplingParams()), budget)
            for index, (prompt, budget) in enumerate(zip(prompts, BUDGETS))]


def batch_of(target, draft, drafter: str, k, batch_size: int) -> BatchedDecoder:
    return BatchedDecoder(target, draft, drafter, batch_size=batch_size, k=k, lookup_factory=NgramDrafter,
                          verify_curve=FLAT_VERIFY, draft_curve=CHEAP_DRAFT)


def alone(target, request: RowRequest) -> list[int]:
    return SpeculativeDecoder(target, None, FixedK(0)).generate(request.prompt_ids, SamplingParams(),
                                                                request.max_new_tokens).tokens


@pytest.mark.parametrize("drafter, k", [("model", 3), ("model", "auto"), ("cascade", 4), ("cascade", "auto")])
def test_a_q4_batch_gives_each_row_what_batch_one_gives_it(q4_pair, drafter, k):
    target, draft = q4_pair
    wanted = requests()
    batched = batch_of(target, draft, drafter, k, batch_size=3).generate_many(wanted)
    # one row at a time (k = auto prices a row's k by the batch size, so a sampled row's draws are the same alone in a
    # decoder of that batch size; greedy rows are compared with the target alone below as well)
    one_by_one = [batch_of(target, draft, drafter, k, batch_size=3).generate_many([request])[0] for request in wanted]
    assert [len(result.tokens) for result in batched] == BUDGETS  # no EOS: every row runs to its own budget
    assert [result.tokens for result in batched] == [result.tokens for result in one_by_one]
    greedy = [index for index in range(len(wanted)) if index not in SAMPLED]
    assert [batched[index].tokens for index in greedy] == [alone(target, wanted[index]) for index in greedy]
    assert sum(result.stats.accepted for result in batched) > 0
    assert sum(result.stats.drafted - result.stats.accepted for result in batched) > 0  # rejections to trim
    assert len({tuple(result.tokens) for result in batched}) == len(wanted)


def test_the_check_fails_when_a_row_keeps_its_rejected_drafts(q4_pair, monkeypatch):
    """Planted: row 0's rollback drops its rejected entries from its own ids but leaves them in the attention's
    view (their slots keep their owner), so its later tokens attend to drafts the target rejected."""
    crop = PackedCache._crop_row

    def skipping_the_trim(self, row, length):
        if row != 0 or self.model is not q4_pair[0]:
            return crop(self, row, length)
        state = self.rows[row]
        del state.ids[length:], state.slots[length:]

    monkeypatch.setattr(PackedCache, "_crop_row", skipping_the_trim)
    with pytest.raises(AssertionError):
        test_a_q4_batch_gives_each_row_what_batch_one_gives_it(q4_pair, "model", 3)
