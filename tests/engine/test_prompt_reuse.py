"""A target that computes each row alone (row-wise attention: int8/int4/q4) keeps a prompt's cache entries for
the next prompt: the prefix they share (a system prompt, few-shot examples) is computed once, and the entries
after it are bit for bit those of computing the whole prompt — in the one-sequence decoder across `reset`
(run's records, chat's /reset) and in the batched engine across admissions. A float target (SDPA, whose sums
round by how a prompt is split) and a draft quantised without exact rows start over, as before."""

import os
from types import SimpleNamespace

import pytest
import torch

from specdec_cli.drafters import DraftModelDrafter
from specdec_cli.drafters.tree import TreeDrafter
from specdec_cli.engine import FixedK, SamplingParams, SpeculativeDecoder
from specdec_cli.engine.batched import BatchedDecoder, RowRequest
from specdec_cli.engine.cache_layers import filled_layers
from specdec_cli.engine.kv import CachedModel
from specdec_cli.engine.packed import PackedCache
from specdec_cli.models.runtime.quantize import computes_rows_alone, quantize
from specdec_cli.session import build_batched_decoder, build_decoder

from tests.conftest import perturbed_copy, tiny_causal_lm
from tests.tiny import tokenless_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHARED = list(range(3, 40))  # a system prompt's worth of ids
PROMPTS = [SHARED + [50, 51, 52], SHARED + [60, 61], SHARED[:20] + [70, 71, 72, 73], SHARED + [50, 51, 52]]
# Each prompt shares this much with the one before it (and diverges before that one's end).
SHARED_WITH_PREVIOUS = [0] + [len(os.path.commonprefix([before, after])) for before, after in zip(PROMPTS, PROMPTS[1:])]


@pytest.fixture(scope="module")
def float_target():
    return tiny_causal_lm("qwen2", seed=2, logit_scale=8.0, layers=3)


@pytest.fixture(scope="module")
def row_wise(float_target):
    return quantize(perturbed_copy(float_target, noise=0.0), "int8")


@pytest.fixture(scope="module")
def draft(float_target):
    return perturbed_copy(float_target, noise=0.1, seed=3)


class FedTokens:
    """The positions each forward of `model` computes, in order."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.counts: list[int] = []
        self._handle = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs) -> None:
        self.counts.append(kwargs["input_ids"].shape[1])

    def take(self) -> list[int]:
        counts, self.counts = self.counts, []
        return counts

    def close(self) -> None:
        self._handle.remove()


@pytest.fixture
def fed(row_wise):
    counter = FedTokens(row_wise)
    yield counter
    counter.close()


def same_entries(one: CachedModel, other: CachedModel) -> bool:
    pairs = list(zip(filled_layers(one.cache), filled_layers(other.cache), strict=True))
    return one.ids == other.ids and all(
        torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) for a, b in pairs)


def read_alone(model: torch.nn.Module, prompt: list[int]) -> CachedModel:
    """A fresh cache holding `prompt` as the decoder reads it: all but its last token through the model's prefill
    path (where it has one and the prompt is long enough), then the last."""
    alone = CachedModel(model)
    alone.prefill(prompt[:-1])
    alone.extend(prompt)
    return alone


def test_only_a_model_quantised_with_exact_rows_computes_rows_alone(float_target, row_wise):
    assert computes_rows_alone(row_wise)
    assert not computes_rows_alone(float_target)
    assert not computes_rows_alone(quantize(perturbed_copy(float_target, noise=0.0), "int8", exact_rows=False))


DRAFTERS = {"chain": DraftModelDrafter, "tree": lambda model: TreeDrafter(model, budget=6)}


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, seed=5)], ids=["greedy", "sampled"])
def test_after_reset_the_next_prompt_computes_only_what_it_does_not_share(row_wise, draft, fed, params, drafter):
    """A tree's uncommitted nodes go at reset; the committed path stays with the rest of the entries."""
    reused = SpeculativeDecoder(row_wise, DRAFTERS[drafter](draft), FixedK(3), reuse_prompts=True)
    for prompt, shared in zip(PROMPTS, SHARED_WITH_PREVIOUS):
        reused.reset()
        result = reused.generate(prompt, params, 12)
        reused_counts = fed.take()
        fresh = SpeculativeDecoder(row_wise, DRAFTERS[drafter](draft), FixedK(3))
        expected = fresh.generate(prompt, params, 12)
        fresh_counts = fed.take()
        assert result.tokens == expected.tokens and result.provenance == expected.provenance
        assert same_entries(reused.target, fresh.target)  # bit for bit, not only the same argmax
        assert reused_counts == [fresh_counts[0] - shared] + fresh_counts[1:]


def test_a_float_target_starts_over_after_reset(float_target):
    decoder = SpeculativeDecoder(float_target, None, FixedK(0))
    decoder.generate(PROMPTS[0], SamplingParams(), 4)
    decoder.reset()
    assert len(decoder.target) == 0


def test_packed_admission_computes_a_shared_prefix_once_and_the_rows_get_their_own_logits(row_wise, fed):
    packed = PackedCache(row_wise, reuse_prompts=True)
    for row, (prompt, shared) in enumerate(zip(PROMPTS, SHARED_WITH_PREVIOUS)):
        packed.admit(row, prompt[:-1])
        assert fed.take() == [len(prompt) - 1 - shared]
    wanted = {row: 2 for row in range(len(PROMPTS))}
    sequences = {row: prompt + [80 + row] for row, prompt in enumerate(PROMPTS)}
    logits = packed.extend(sequences, wanted)
    for row, ids in sequences.items():
        lone = CachedModel(row_wise)
        expected = torch.stack([lone.extend(ids[: len(ids) - 2 + i + 1], 1)[-1] for i in range(2)])
        assert torch.equal(logits[row], expected)


def test_the_batched_engine_reuses_prompts_for_the_roles_given(row_wise, draft, fed):
    requests = [RowRequest(prompt, SamplingParams(), 10) for prompt in PROMPTS]
    alone = [SpeculativeDecoder(row_wise, None, FixedK(0)).generate(prompt, SamplingParams(), 10).tokens
             for prompt in PROMPTS]
    fed.take()
    decoder = BatchedDecoder(row_wise, draft, "model", batch_size=2, k=3, reuse_prompts=("target",))
    assert decoder.target.reuse_prompts and not decoder.draft.reuse_prompts
    assert [result.tokens for result in decoder.generate_many(requests)] == alone
    reused = sum(fed.take())
    starting_over = BatchedDecoder(row_wise, draft, "model", batch_size=2, k=3)
    assert [result.tokens for result in starting_over.generate_many(requests)] == alone
    assert reused == sum(fed.take()) - sum(SHARED_WITH_PREVIOUS)


def test_run_chat_and_compare_reuse_prompts_exactly_where_the_target_computes_rows_alone(float_target, row_wise, draft):
    def loaded(model, name):
        return SimpleNamespace(model=model, name=name, quantization=None, dtype=torch.float32, eos_token_ids=(2,),
                               tokenizer=tokenless_tokenizer(), vocab_size=model.config.vocab_size,
                               vocabulary_overlap=None)

    small = loaded(draft, "org/small")
    assert build_decoder(loaded(row_wise, "org/big"), small, "model", 3).reuse_prompts
    assert not build_decoder(loaded(float_target, "org/big"), small, "model", 3).reuse_prompts
    batched = build_batched_decoder(loaded(row_wise, "org/big"), small, "model", 3, 2)
    assert batched.target.reuse_prompts and not batched.draft.reuse_prompts
    assert not build_batched_decoder(loaded(float_target, "org/big"), small, "model", 3, 2).target.reuse_prompts


class MarkedPath:
    """A row-exact prefill path, as models/prefill.py's AMX path is (that one needs AMX; tests/models/test_amx_prompt.py
    runs it): here the model's own forward with each new key then moved by +1, so the entries it makes are not the
    ones the model's own read makes, and each row's are the same however a prompt is split."""

    row_exact = True
    reader = "marked"
    decoder = None

    def __init__(self, model: torch.nn.Module, min_tokens: int) -> None:
        self.model, self.min_tokens, self.read = model, min_tokens, []

    def __call__(self, cache, new_ids: list[int]) -> None:
        for token in new_ids:  # one at a time: every row sees moved keys before it, however the prompt is split
            self.model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True, logits_to_keep=1)
            for layer in filled_layers(cache):
                layer.keys[..., -1:, :] += 1.0
        self.read.append(len(new_ids))


@pytest.fixture
def with_path(row_wise):
    """(the row-wise target with a MarkedPath for prompts of 10 tokens or more, the path)"""
    import copy

    from specdec_cli.engine.kv import PREFILL_PATH

    model = copy.deepcopy(row_wise)
    path = model.__dict__[PREFILL_PATH] = MarkedPath(model, min_tokens=10)
    return model, path


LONG = list(range(3, 43))  # 40 tokens
# (prompt, tokens the path reads, tokens the model's own forward feeds) after the prompt before it, the cache kept
PATH_PROMPTS = [
    (LONG, 39, 1),                              # read by the path but its last token
    (LONG[:30] + [60, 61, 62, 63], 3, 1),        # 30 shared path entries kept: the path reads the 3 after, not q4
    (LONG[:30] + [60, 61, 62, 70], 0, 1),        # all but the last token kept
    (LONG[:6] + [80, 81], 0, 8),                 # short (its own forward when read alone): the path's entries go
    (LONG[:6] + [90], 0, 1),                     # short after short: the 6 own entries stay
    (LONG[:6] + [91] * 10, 15, 1),               # long after short: nothing the path made is cached, it reads all
]


def test_a_row_exact_paths_entries_are_kept_only_where_reading_the_prompt_alone_makes_them(with_path):
    """kv.py's `prefill(fresh=True)`: the entries after each prompt are those of reading it into an empty cache, bit for
    bit, and only what they do not share with the cache is computed, by whichever of path and model reads it alone."""
    model, path = with_path
    counter = FedTokens(model)
    try:
        runner = CachedModel(model)
        for prompt, by_path, by_model in PATH_PROMPTS:
            path.read.clear()
            counter.take()
            runner.prefill(prompt[:-1], fresh=True)
            runner.extend(prompt)
            assert (sum(path.read), sum(counter.take()) - sum(path.read)) == (by_path, by_model), prompt
            alone = read_alone(model, prompt)
            counter.take()
            assert same_entries(runner, alone), prompt
    finally:
        counter.close()


def test_with_a_row_exact_path_reset_keeps_the_prompt_and_the_tokens_stay_those_of_a_fresh_decoder(with_path, draft):
    model, path = with_path
    assert computes_rows_alone(model)
    decoder = SpeculativeDecoder(model, DraftModelDrafter(draft), FixedK(3), reuse_prompts=computes_rows_alone(model))
    for prompt, by_path, _ in PATH_PROMPTS:
        decoder.reset()
        path.read.clear()
        result = decoder.generate(prompt, SamplingParams(), 8)
        assert sum(path.read) == by_path
        fresh = SpeculativeDecoder(model, DraftModelDrafter(draft), FixedK(3))
        assert result.tokens == fresh.generate(prompt, SamplingParams(), 8).tokens
        assert same_entries(decoder.target, fresh.target)


def test_packed_admission_with_a_row_exact_path_gives_each_row_what_reading_it_alone_gives(with_path):
    """The batched engine admits a row's prompt but its last token (its first step feeds that one), and each of
    those entries is the one-sequence decoder's: the path reads what it reads (the table's counts), no more."""
    model, path = with_path
    packed = PackedCache(model, reuse_prompts=True)
    for row, (prompt, by_path, _) in enumerate(PATH_PROMPTS):
        path.read.clear()
        packed.admit(row, prompt[:-1])
        assert sum(path.read) == by_path, prompt
        alone = read_alone(model, prompt)
        alone.crop(len(prompt) - 1)
        assert same_entries(packed.single, alone), prompt


def test_a_batch_with_a_prefill_path_gives_each_row_the_one_sequence_decoders_tokens(with_path, draft):
    """As `run` decodes the prompts (a q4 target whose prompts the AMX path reads): batched, with and without
    drafting, each row's greedy tokens are those of the one-sequence decoder over the same prompts in order."""
    model, _ = with_path
    prompts = [prompt for prompt, _, _ in PATH_PROMPTS]
    single = SpeculativeDecoder(model, None, FixedK(0), reuse_prompts=True)
    expected = []
    for prompt in prompts:
        single.reset()
        expected.append(single.generate(prompt, SamplingParams(), 10).tokens)
    for drafter, k in (("none", 0), ("model", 3)):
        batched = BatchedDecoder(model, draft if k else None, drafter, batch_size=3, k=k, reuse_prompts=["target"])
        results = batched.generate_many([RowRequest(prompt, SamplingParams(), 10) for prompt in prompts])
        assert [result.tokens for result in results] == expected, drafter


def test_a_copy_that_rounds_rows_by_their_forward_is_read_anew(with_path):
    model, path = with_path
    path.row_exact = False
    assert not computes_rows_alone(model)
    runner = CachedModel(model)
    runner.prefill(LONG[:-1], fresh=True)
    path.read.clear()
    runner.prefill(LONG[:30] + [60, 61], fresh=True)
    assert path.read == [32]
