"""The logits -> probabilities transform shared by draft and target."""

import math
import os

import pytest
import torch

from specdec_cli.engine import sampling
from specdec_cli.engine.sampling import (SamplingParams, argmax_ids, logits_to_probs, make_generator, nonzero_ids, sample,
                                         top_k)
from specdec_cli.models.native import binding
from specdec_cli.models.native.rows import CRowKernels

LOGITS = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))


def c_row_kernels() -> CRowKernels:
    library, _, problem = binding.library()
    if library is None and not os.environ.get("CI"):
        pytest.skip(f"specdec's kernel library does not load here: {problem}")
    assert library is not None, problem
    return CRowKernels(library)


@pytest.fixture(params=["torch", "C"])
def row_kernels(request):
    """Each test that takes it runs on sampling's torch code and on the C row kernels that a loaded kernel
    library installs (the process-wide choice is put back after)."""
    before = sampling._row_kernels
    sampling.use_row_kernels(c_row_kernels() if request.param == "C" else None)
    yield request.param
    sampling.use_row_kernels(before)


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


@pytest.mark.parametrize("temperature", [5e-324, 1e-40, 1e-30, 9.9e-6])
@pytest.mark.parametrize("top_k", [0, 3])
def test_a_temperature_below_greedy_below_is_greedy_not_nan(temperature, top_k):
    """Logits over 5e-324 (a subnormal) are inf and every probability NaN: sampling raised, and in a batch it failed
    the step's other rows too. Below 1e-5 (vLLM's cut) a temperature decodes greedily; at 1e-5 it samples."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=0.9)
    assert params.greedy
    probs = logits_to_probs(torch.stack([LOGITS, LOGITS.flip(0)]), params)
    assert probs.argmax(-1).tolist() == [0, 4] and probs.sum(-1).tolist() == [1.0, 1.0]
    assert not SamplingParams(temperature=sampling.GREEDY_BELOW).greedy


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-1), dict(top_k=-1), dict(top_p=0), dict(top_p=1.5),
    dict(temperature=math.nan), dict(temperature=math.inf), dict(temperature=-math.inf),
    dict(top_p=math.nan), dict(top_p=math.inf), dict(seed=-1), dict(seed=sampling.MAX_SEED + 1),
])
def test_invalid_params_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_every_seed_in_range_seeds_a_generator_and_run_lines_take_the_same_range():
    from specdec_cli.batch import MAX_SEED  # repeated there: that module loads no torch

    assert MAX_SEED == sampling.MAX_SEED
    for seed in (0, sampling.MAX_SEED):
        make_generator(SamplingParams(seed=seed).seed)


def test_same_seed_same_draws():
    probs = torch.full((50,), 1 / 50)
    first = [sample(probs, g) for g in [make_generator(3)] for _ in range(20)]
    second = [sample(probs, g) for g in [make_generator(3)] for _ in range(20)]
    assert first == second and not math.isclose(len(set(first)), 1)


@pytest.mark.parametrize("width", [151_936, 65_536, 100_003])
def test_top_k_on_a_large_vocabulary_finds_what_torch_topk_finds(width, row_kernels):
    """top_k reads block maxima first: the same k best values and ids, rows alone and in a batch, with a row's
    best scattered over far blocks, a row of mostly -inf, and a width that is no multiple of the block."""
    generator = torch.Generator().manual_seed(width)
    rows = torch.randn(4, width, generator=generator) * 3
    rows[1, torch.randint(0, width, (30,), generator=generator)] = 20.0 + torch.rand(30, generator=generator)
    rows[2, :] = float("-inf")
    rows[2, torch.randint(0, width, (40,), generator=generator)] = torch.randn(40, generator=generator)
    for k in (1, 21, 41):
        expected = torch.topk(rows, k, dim=-1)
        values, indices = top_k(rows, k)
        assert torch.equal(values, expected.values)
        assert torch.equal(rows.gather(-1, indices), expected.values)  # ids holding those values
        assert all(len(set(row.tolist())) == k for row in indices)
        assert torch.equal(top_k(rows[3], k)[0], expected.values[3])


def test_top_k_probs_on_a_large_vocabulary_equal_the_masked_softmax(row_kernels):
    """The top-k path's candidates-only arithmetic against the whole-vocabulary definition (mask outside the k
    best, then top-p, softmax), also where the k-th and the next score tie (then every tied id stays)."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 151_936, generator=generator) * 4
    best = torch.topk(logits[2], 21).indices
    logits[2, best[20]] = logits[2, best[19]]  # the 20th and 21st best tie
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.8)
    scores = logits / 0.7
    kth = torch.topk(scores, 20, dim=-1).values[:, -1:]
    masked = scores.masked_fill(scores < kth, float("-inf"))
    sorted_scores, order = torch.sort(masked, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_scores, dim=-1)
    drop = torch.zeros_like(sorted_probs, dtype=torch.bool).scatter(
        -1, order, torch.cumsum(sorted_probs, -1) - sorted_probs >= 0.8)
    expected = torch.softmax(masked.masked_fill(drop, float("-inf")), dim=-1)
    probs = logits_to_probs(logits, params)
    assert torch.allclose(probs, expected, atol=1e-6)
    assert int((probs[2] > 0).sum()) == int((expected[2] > 0).sum())


@pytest.mark.parametrize("width", [37, 1000, 65_536, 151_936])
def test_c_top_k_gives_torch_topks_values_and_ids(width):
    """The C pass against torch.topk: the same values best first, ids holding them, on widths that are and are
    not multiples of its 32 floats a comparison, with the best ids in the last partial stretch too."""
    kernels = c_row_kernels()
    generator = torch.Generator().manual_seed(width)
    rows = torch.randn(3, width, generator=generator) * 3
    rows[1, -3:] = 50.0 + torch.arange(3.0)  # the best three at the very end
    for k in (1, 2, 21, 33):
        values, ids = kernels.top_k(rows, k)
        expected = torch.topk(rows, k, dim=-1)
        assert torch.equal(values, expected.values)
        assert torch.equal(rows.gather(-1, ids), values)
        assert all(len(set(row.tolist())) == k for row in ids)
    assert kernels.top_k(rows, 129) is None  # more candidates than its sorted slots: torch decides


def test_c_top_k_declines_nan_and_rows_short_of_k_finite_scores(row_kernels):
    """A NaN (torch.topk puts it first) or fewer than k scores above -inf (torch.topk fills with -inf ids of its
    choosing): the kernel declines and top_k still returns torch.topk's values."""
    kernels = c_row_kernels()
    short = torch.full((2, 5000), float("-inf"))
    short[0, 7], short[1, 9], short[1, 4000] = 1.0, 2.0, 3.0
    with_nan = torch.randn(1, 5000)
    with_nan[0, 4990] = float("nan")
    for rows in (short, with_nan):
        assert kernels.top_k(rows, 3) is None
        values, _ = top_k(rows, 3)
        assert torch.equal(values.nan_to_num(7.0), torch.topk(rows, 3).values.nan_to_num(7.0))


def test_c_support_is_torch_nonzero():
    kernels = c_row_kernels()
    generator = torch.Generator().manual_seed(1)
    for width in (5, 32, 100_003, 151_936):
        probs = torch.zeros(width)
        probs[torch.randint(0, width, (min(width, 20),), generator=generator)] = 0.05
        probs[-1] = 0.5
        if width > 40:
            probs[33] = float("nan")  # torch.nonzero counts a NaN
            probs[34] = -0.0  # and not a negative zero
        assert torch.equal(kernels.support(probs), probs.nonzero().flatten())
    assert kernels.support(torch.zeros(64)).numel() == 0
    assert kernels.support(torch.zeros(64, dtype=torch.float64)) is None


def test_sampled_probabilities_and_draws_are_the_same_with_the_c_row_kernels():
    """What the kernels change is speed only: logits_to_probs gives the same floats (also with a tie at the k-th
    score and at temperatures whose division could round two scores together) and sample the same draws."""
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 151_936, generator=generator) * 4
    best = torch.topk(logits[3], 21).indices
    logits[3, best[20]] = logits[3, best[19]]
    before = sampling._row_kernels
    try:
        results = []
        for kernels in (None, c_row_kernels()):
            sampling.use_row_kernels(kernels)
            probs = [logits_to_probs(logits, SamplingParams(t, 20, p)) for t in (0.7, 1.0, 0.3) for p in (0.8, 1.0)]
            draws = [sample(row, make_generator(5)) for batch in probs for row in batch]
            results.append((probs, draws, nonzero_ids(probs[0][0])))
    finally:
        sampling.use_row_kernels(before)
    (torch_probs, torch_draws, torch_ids), (c_probs, c_draws, c_ids) = results
    assert all(torch.equal(a, b) for a, b in zip(torch_probs, c_probs))
    assert torch_draws == c_draws and torch.equal(torch_ids, c_ids)


def test_argmax_ids_is_torch_argmax_also_on_ties(row_kernels):
    """Greedy decoding's argmax, on either path: the first of equal maxima, as torch.argmax gives it; a NaN or a row
    of -inf goes to torch.argmax itself."""
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 151_936, generator=generator)
    logits[1, 90_000] = logits[1, 7] = 9.0  # a tie: the first one counts
    logits[2, -1] = 9.0  # the best at the very end
    logits[3] = float("-inf")
    logits[4, 5] = float("nan")
    assert argmax_ids(logits) == logits.argmax(dim=-1).tolist() == [argmax_ids(row)[0] for row in logits]
    assert argmax_ids(logits)[1] == 7


def test_loading_the_kernel_library_changes_no_global_and_offers_the_row_kernels():
    """A q4 or int8 model's first use loads the library; the engine is handed its C passes by the settings that
    loaded the model (below), not by the load."""
    before = sampling._row_kernels
    try:
        sampling.use_row_kernels(None)
        library, _, problem = binding.library()
        if library is None and not os.environ.get("CI"):
            pytest.skip(f"specdec's kernel library does not load here: {problem}")
        assert sampling._row_kernels is None
        assert isinstance(binding.row_kernels(), CRowKernels)
    finally:
        sampling.use_row_kernels(before)


def test_loading_a_q4_model_through_the_settings_hands_the_engine_the_row_kernels(tmp_path):
    from specdec_cli.settings import ModelOverrides, choose_models, load_choice
    from tests.tiny import build_tiny_model

    if binding.library()[0] is None and not os.environ.get("CI"):
        pytest.skip(f"specdec's kernel library does not load here: {binding.library()[2]}")
    build_tiny_model(tmp_path / "tiny")
    before = sampling._row_kernels
    try:
        sampling.use_row_kernels(None)
        load_choice(choose_models(ModelOverrides(target=str(tmp_path / "tiny"), device="cpu", dtype="float32",
                                                 target_quant="q4")), _Quiet())
        assert isinstance(sampling._row_kernels, CRowKernels)
    finally:
        sampling.use_row_kernels(before)


class _Quiet:
    quiet = True

    def print(self, text: str, *, markup: bool = False) -> None:
        pass
