"""The batched engine: B rows per forward give each row what batch size 1 gives it.

Greedy output equals `SpeculativeDecoder`'s token for token (float32, tiny Llama and Qwen2; bit for bit
logits under an int8 target's row-wise attention), across drafters and k, with rows of ragged acceptance,
rows that finish mid-step, refills, per-row EOS, stop callbacks, budgets and seeds."""

import pytest
import torch

from specdec_cli.drafters import DraftModelDrafter, NgramDrafter
from specdec_cli.engine import FixedK, SamplingParams, SpeculativeDecoder
from specdec_cli.engine.batched import BatchedDecoder, RowRequest
from specdec_cli.engine.kv import CachedModel
from specdec_cli.engine.packed import PackedCache
from specdec_cli.models.runtime.quantize import quantize

from tests.conftest import perturbed_copy, tiny_causal_lm

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def prompts(count: int, seed: int = 0, longest: int = 30) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest, (count,), generator=generator).tolist()
    return [torch.randint(3, 90, (length,), generator=generator).tolist() for length in lengths]


def alone(target, prompt, max_new_tokens, params=SamplingParams(), eos=(), stop=None) -> list[int]:
    """Batch size 1: the target alone through the one-sequence decoder."""
    return SpeculativeDecoder(target, None, FixedK(0), eos).generate(prompt, params, max_new_tokens, stop).tokens


class LateDisagreeing(torch.nn.Module):
    """A draft that is the target before position `late` and its opposite from there on (negated logits: its
    argmax is never the target's), so a row with a short prompt accepts every draft and one past `late`
    none — one draft model, ragged acceptance across the rows of a batch."""

    def __init__(self, target: torch.nn.Module, late: int) -> None:
        super().__init__()
        self.target, self.late, self.config = target, late, target.config

    def forward(self, input_ids, position_ids=None, logits_to_keep=0, **kwargs):
        output = self.target(input_ids=input_ids, position_ids=position_ids, logits_to_keep=logits_to_keep, **kwargs)
        if position_ids is not None and isinstance(logits_to_keep, torch.Tensor):
            late = position_ids[0, logits_to_keep] >= self.late  # (kept,)
            output.logits[0, late] = -output.logits[0, late]
        return output


# Forward-cost curves ({tokens: seconds}) on which drafting pays: a verify of 40 tokens costs little more than one,
# a draft forward a thirtieth of a verify. k=auto then drafts, so its cases compare a batch that drafted with
# batch size 1, not the target with itself.
FLAT_VERIFY = {1: 0.030, 4: 0.031, 16: 0.033, 64: 0.040}
CHEAP_DRAFT = {1: 0.001, 4: 0.0011, 16: 0.0012, 64: 0.0015}


@pytest.mark.parametrize("drafter, k", [("none", 0), ("model", 3), ("model", "auto"), ("ngram", 4), ("cascade", "auto")])
@pytest.mark.parametrize("arch, seed", [("llama", 0), ("qwen2", 2)])
def test_batch_greedy_equals_batch_one_greedy_in_float32(arch, seed, drafter, k):
    model = tiny_causal_lm(arch, seed=seed, logit_scale=8.0)
    draft = perturbed_copy(model, noise=0.15, seed=7)
    requests = prompts(7, seed=seed)
    decoder = BatchedDecoder(model, draft, drafter, batch_size=3, k=k, lookup_factory=NgramDrafter,
                             verify_curve=FLAT_VERIFY, draft_curve=CHEAP_DRAFT)
    results = decoder.generate_many([RowRequest(prompt, SamplingParams(), 40) for prompt in requests])
    assert [result.tokens for result in results] == [alone(model, prompt, 40) for prompt in requests]
    drafted = sum(result.stats.drafted for result in results)
    assert drafted == 0 if drafter == "none" else drafted > 0


def test_rows_accept_raggedly_one_everything_one_nothing(target):
    draft = LateDisagreeing(target, late=100)
    short, long = [5, 6, 7], prompts(1, seed=3, longest=2)[0] * 0 + list(range(3, 90)) + list(range(3, 23))
    decoder = BatchedDecoder(target, draft, "model", batch_size=2, k=4)
    everything, nothing = decoder.generate_many([RowRequest(short, max_new_tokens=30), RowRequest(long, max_new_tokens=30)])
    assert everything.stats.drafted > 0 and everything.stats.accepted == everything.stats.drafted
    assert nothing.stats.drafted > 0 and nothing.stats.accepted == 0
    assert everything.tokens == alone(target, short, 30) and nothing.tokens == alone(target, long, 30)


def test_a_row_that_finishes_mid_step_leaves_and_the_next_request_takes_its_place(target, near_draft, monkeypatch):
    """Budgets of 3 and 40 tokens with k = 4: the short row ends inside a step (its accepted draft cut at the
    budget) while the long one goes on, and the third request joins the long one before it finishes."""
    together = []
    extend = PackedCache.extend

    def recording(self, sequences, n_logits):
        if self.model is target:
            together.append(sorted(sequences))
        return extend(self, sequences, n_logits)

    monkeypatch.setattr(PackedCache, "extend", recording)
    requests = prompts(3, seed=5)
    budgets = [3, 40, 12]
    decoder = BatchedDecoder(target, near_draft, "model", batch_size=2, k=4)
    finished = [index for index, _ in decoder.stream([RowRequest(p, max_new_tokens=b) for p, b in zip(requests, budgets)])]
    results = decoder.generate_many([RowRequest(p, max_new_tokens=b) for p, b in zip(requests, budgets)])
    assert [len(result.tokens) for result in results] == budgets
    assert [result.finish_reason for result in results] == ["length"] * 3
    assert [result.tokens for result in results] == [alone(target, p, b) for p, b in zip(requests, budgets)]
    assert max(map(len, together)) == 2  # never more rows than the batch
    assert [0, 1] in together and [1, 2] in together  # the third request joined while the second went on
    assert finished.index(0) < finished.index(2)


def test_eos_and_stop_conditions_end_each_row_on_its_own(target, near_draft):
    requests = prompts(3, seed=11)
    free_running = [alone(target, prompt, 20) for prompt in requests]
    eos = free_running[0][6]  # the first row emits it as its 7th token
    stop_after = free_running[1][:4]
    stop = lambda generated: generated[-4:] == stop_after if len(generated) >= 4 else False  # noqa: E731
    decoder = BatchedDecoder(target, near_draft, "model", batch_size=3, k=3, eos_token_ids=[eos])
    first, second, third = decoder.generate_many([
        RowRequest(requests[0], max_new_tokens=20), RowRequest(requests[1], max_new_tokens=20, stop=stop),
        RowRequest(requests[2], max_new_tokens=20)])
    assert (first.tokens, first.finish_reason) == (alone(target, requests[0], 20, eos=[eos]), "stop")
    assert first.tokens[-1] == eos and len(first.tokens) <= 7
    assert (second.tokens, second.finish_reason) == (free_running[1][:4], "stop")
    assert third.tokens == alone(target, requests[2], 20, eos=[eos])


def test_each_row_samples_from_its_own_seed(target, near_draft):
    prompt = prompts(1, seed=2)[0]
    sampled = lambda seed: RowRequest(prompt, SamplingParams(temperature=1.0, seed=seed), 24)  # noqa: E731
    batched = BatchedDecoder(target, near_draft, "model", batch_size=4, k=3)
    same, again, other, greedy = batched.generate_many([sampled(1), sampled(1), sampled(2), RowRequest(prompt, max_new_tokens=24)])
    assert same.tokens == again.tokens  # same seed, same draws, whatever row it sits in
    assert same.tokens != other.tokens
    assert greedy.tokens == alone(target, prompt, 24)
    one_at_a_time = BatchedDecoder(target, near_draft, "model", batch_size=1, k=3)
    assert one_at_a_time.generate_many([sampled(1)])[0].tokens == same.tokens  # a fixed k: the batch changes no draw


def test_an_int8_target_gives_the_lone_sequence_logits_bit_for_bit():
    model = quantize(tiny_causal_lm("qwen2", seed=2, logit_scale=8.0, layers=3), "int8")
    packed = PackedCache(model)
    sequences = {0: list(range(3, 30)), 1: [40, 41], 2: list(range(50, 62))}
    for row, ids in sequences.items():
        packed.admit(row, ids[:-3])
    wanted = {0: 4, 1: 2, 2: 3}
    logits = packed.extend(sequences, wanted)
    for row, ids in sequences.items():
        lone = CachedModel(model)
        expected = torch.stack([lone.extend(ids[: len(ids) - wanted[row] + i + 1], 1)[-1] for i in range(wanted[row])])
        assert torch.equal(logits[row], expected)


def test_rollback_release_and_compaction_keep_each_rows_logits(target):
    packed = PackedCache(target)
    rows = {row: prompts(1, seed=row, longest=20)[0] + [row + 3] for row in range(3)}
    for row, ids in rows.items():
        packed.admit(row, ids[:-1])
    for step in range(40):  # grow each row by 3, roll 2 back: holes pile up until the cache compacts
        grown = {row: ids + [(step * 7 + row) % 90 + 3] * 3 for row, ids in rows.items()}
        packed.extend(grown, dict.fromkeys(grown, 3))
        rows = {row: ids[:-2] for row, ids in grown.items()}
        if step == 20:
            packed.release(1)
            rows.pop(1)
    assert len(packed.owner) < 40 * 3 * 3  # compacted on the way
    final = packed.extend(rows, dict.fromkeys(rows, 2))
    for row, ids in rows.items():
        expected = CachedModel(target).extend(ids, 2)
        torch.testing.assert_close(final[row], expected, rtol=1e-4, atol=1e-4)


def test_a_failing_step_decodes_its_rows_again_alone_and_the_batch_goes_on(target, monkeypatch):
    """A step that failed once (a kernel refusing, out of memory) failed every row it held: each is decoded again
    from its start, alone, and gets what it gets alone."""
    requests = prompts(4, seed=8)
    extend, calls = PackedCache.extend, []

    def failing_third(self, sequences, n_logits):
        calls.append(sorted(sequences))
        if len(calls) == 3:
            raise RuntimeError("a kernel refused this input")
        return extend(self, sequences, n_logits)

    monkeypatch.setattr(PackedCache, "extend", failing_third)
    outcomes = dict(BatchedDecoder(target, batch_size=2).stream([RowRequest(p, max_new_tokens=5) for p in requests]))
    assert [outcomes[index].tokens for index in range(4)] == [alone(target, request, 5) for request in requests]
    assert calls[2] == [0, 1] and calls[3] == [0]  # the failed step's rows, then row 0 alone
    retried = [rows for rows in calls[3:] if {0, 1} & set(rows)]
    assert retried and all(len(rows) == 1 for rows in retried)  # row 1 too, the later requests waiting for it


@pytest.mark.parametrize("drafter, k", [("none", 0), ("model", 3)])
def test_a_request_that_fails_every_step_it_is_in_fails_alone(target, near_draft, drafter, k, monkeypatch):
    """One request that breaks any step holding it (its sampling meets a NaN, say) failed its batch mates with it:
    only it gets the error now; the others get what they get alone, and the batch goes on."""
    import specdec_cli.engine.batched as batched

    requests = prompts(5, seed=3)
    poisoned = SamplingParams(temperature=0.5, seed=13)
    real = batched.logits_to_probs

    raised = []

    def nan_for_the_poisoned(logits, params):
        if params == poisoned:
            raised.append(1)
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return real(logits, params)

    monkeypatch.setattr(batched, "logits_to_probs", nan_for_the_poisoned)
    # the poisoned request last in its batch: retried last, and still alone while later requests wait
    params = [SamplingParams(), SamplingParams(temperature=0.5, seed=2), poisoned, SamplingParams(), SamplingParams()]
    decoder = BatchedDecoder(target, near_draft if drafter == "model" else None, drafter, batch_size=3, k=k)
    outcomes = dict(decoder.stream([RowRequest(p, q, max_new_tokens=6) for p, q in zip(requests, params)]))
    assert isinstance(outcomes[2], RuntimeError) and "nan" in str(outcomes[2])
    assert len(raised) == 2  # in its batch, then alone: never again beside later requests
    for index in (0, 1, 3, 4):
        lone = BatchedDecoder(target, near_draft if drafter == "model" else None, drafter, batch_size=1, k=k)
        assert outcomes[index].tokens == lone.generate_many([RowRequest(requests[index], params[index], 6)])[0].tokens


def test_a_prompt_past_the_context_fails_alone(target):
    too_long = list(range(3, 90)) * 6  # 522 tokens, past the tiny model's 512
    outcomes = dict(BatchedDecoder(target, batch_size=2).stream(
        [RowRequest([5, 6], max_new_tokens=4), RowRequest(too_long), RowRequest([])]))
    assert outcomes[0].tokens == alone(target, [5, 6], 4)
    assert "512" in str(outcomes[1]) and isinstance(outcomes[2], ValueError)


def test_the_draft_model_is_used_for_the_batch_drafts(target, near_draft):
    """A draft model drafter in a batch drafts as `DraftModelDrafter` would for the row alone (greedy, k fixed)."""
    prompt = prompts(1, seed=4)[0]
    result = BatchedDecoder(target, near_draft, "model", batch_size=2, k=3).generate_many(
        [RowRequest(prompt, max_new_tokens=30), RowRequest(prompt[:3], max_new_tokens=30)])[0]
    single = SpeculativeDecoder(target, DraftModelDrafter(near_draft), FixedK(3)).generate(prompt, SamplingParams(), 30)
    assert (result.tokens, result.stats.drafted, result.stats.accepted) == (
        single.tokens, single.stats.drafted, single.stats.accepted)


def test_with_k_auto_a_sampled_row_draws_the_same_in_any_batch(target, near_draft):
    """A row's k never depends on its batch mates: the same seeded request gives the same tokens alone, in a
    batch of 4, and among other requests after a refill (as after `run --resume`)."""
    requests = prompts(5, seed=9)
    sampled = [RowRequest(prompt, SamplingParams(temperature=0.9, top_k=20, seed=index), 24)
               for index, prompt in enumerate(requests)]
    batched = BatchedDecoder(target, near_draft, "model", batch_size=4, k="auto").generate_many(sampled)
    one_by_one = [BatchedDecoder(target, near_draft, "model", batch_size=4, k="auto").generate_many([request])[0]
                  for request in sampled]
    reordered = BatchedDecoder(target, near_draft, "model", batch_size=4, k="auto").generate_many(sampled[::-1])[::-1]
    assert [r.tokens for r in batched] == [r.tokens for r in one_by_one] == [r.tokens for r in reordered]
    assert sum(r.stats.drafted for r in batched) > 0


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, seed=5)], ids=["greedy", "sampled"])
def test_a_subset_head_and_a_window_draft_in_a_batch_as_the_drafter_alone(target, near_draft, params):
    """The draft scoring a subset of the vocabulary and reading the last tokens of the prompt (run's defaults,
    as the one-sequence drafter's): each row drafts, accepts and draws what `DraftModelDrafter` with the same
    subset and window does for it alone — the subset's indices mapped back to ids, its probabilities scattered
    back onto the vocabulary, the window kept as the row grows."""
    from specdec_cli.drafters.subset_head import SubsetHeadLM

    subset = torch.cat([torch.arange(0, 60), torch.tensor([70, 95])])  # ids 60-94 but 70 are never drafted
    head = SubsetHeadLM(near_draft, subset)
    long, short = prompts(1, seed=4)[0] + list(range(3, 30)), [5, 6, 7]
    decoder = BatchedDecoder(target, head, "model", batch_size=2, k=3, draft_ids=subset, draft_window=12)
    results = decoder.generate_many([RowRequest(long, params, 30), RowRequest(short, params, 30)])
    for prompt, result in zip((long, short), results):
        drafter = DraftModelDrafter(near_draft, token_ids=subset, window=12)
        single = SpeculativeDecoder(target, drafter, FixedK(3)).generate(prompt, params, 30)
        assert (result.tokens, result.stats.drafted, result.stats.accepted) == (
            single.tokens, single.stats.drafted, single.stats.accepted)
        assert result.stats.accepted > 0


@pytest.mark.parametrize("threshold", [0.3, 0.6])
def test_a_sampled_rows_survival_reads_the_drafts_odds_before_top_k_and_top_p(target, near_draft, threshold):
    """As the one-sequence drafter: a row's draft stops where the product of the draft's own odds (its softmax at
    the sampling temperature, before top-k and top-p) falls below the cut, while the acceptance rule still gets
    the nucleus's probabilities. A top-p that leaves one token gives it probability 1: cut on those, the row
    drafted all 12."""
    params = SamplingParams(temperature=0.7, top_p=0.05, top_k=5, seed=0)
    decoder = BatchedDecoder(target, near_draft, "model", batch_size=2, k=12)
    decoder.min_survival = threshold  # as k = auto sets it, with the length fixed at 12
    prompt = prompts(1, seed=3)[0]
    row = decoder._admit(0, RowRequest(prompt, params, 40))
    draft = decoder._draft_with_model({0: 12}, {0: row})[0]
    with torch.no_grad():
        logits = near_draft(torch.tensor([prompt + draft.ids])).logits[0, len(prompt) - 1:]
    assert draft.ids == logits[: len(draft)].argmax(-1).tolist()  # a nucleus of one: its best token
    assert draft.probs.max(-1).values.tolist() == [1.0] * len(draft)
    survival = torch.cumprod(torch.softmax(logits.float() / 0.7, -1).max(-1).values[: len(draft)], 0)
    assert bool((survival[:-1] >= threshold).all())
    assert len(draft) < 12 and float(survival[-1]) < threshold
