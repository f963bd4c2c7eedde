"""q4's weight blocks one or two at a time (models/calibrate.py): calibrate times both on the first q4 model, stores
the choice for the code it timed and this machine, and the first q4 layer of a process takes it."""

import json

import pytest
import torch

from specdec_cli.models import load_model
from specdec_cli.models.calibrate import measure_forward_costs, pairs_up_to
from specdec_cli.models.formats.calibration import calibrated_q4_pairs, cpu, save_calibration


@pytest.fixture
def q4_kernel():
    """The kernel library (skipped where it does not run), its pairing as it was put back after the test."""
    from specdec_cli.models.native import binding

    library, isa, problem = binding.library()
    if problem is not None:
        pytest.skip(problem)
    before = binding.q4_pairs()
    yield library, isa
    binding.pair_q4_blocks(before)


def _this_machine() -> dict:
    return {**cpu(), "threads": torch.get_num_threads()}


def test_pairs_are_taken_up_to_the_largest_size_where_they_win_there_and_below():
    single = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}
    assert pairs_up_to({1: 0.9, 2: 0.9, 4: 0.95, 8: 1.1}, single) == 4
    assert pairs_up_to({n: 0.5 for n in single}, single) == 8
    assert pairs_up_to({1: 0.9, 2: 1.2, 4: 0.8, 8: 0.8}, single) == 1  # not past a size where they lose
    assert pairs_up_to({1: 0.99, 2: 0.8, 4: 0.8, 8: 0.8}, single) == 0  # a tie at one token is no win


def test_the_first_q4_model_times_both_ways_and_the_library_keeps_the_faster(llama_folder, q4_kernel, monkeypatch):
    from specdec_cli.models import calibrate
    from specdec_cli.models.native import binding

    result = measure_forward_costs({"target": str(llama_folder)}, {"target": ["int8", "q4"]}, dtype="float32",
                                   token_counts=(1,), context_tokens=8, repeats=1)
    pairs = result["q4_pairs"]
    assert (pairs["isa"], pairs["model"]) == (q4_kernel[1], str(llama_folder))
    assert {way: list(row) for way, row in pairs["seconds"].items()} == {"pairs": ["1", "2", "4", "8"],
                                                                         "single": ["1", "2", "4", "8"]}
    assert binding.q4_pairs() == pairs["up_to_tokens"] == pairs_up_to(
        *({int(n): s for n, s in pairs["seconds"][way].items()} for way in ("pairs", "single")))
    json.dumps(result)
    # Timings where pairs win to 2 tokens: the library takes them to 2, and what is timed after runs so.
    made_up = {"pairs": {1: 0.5, 2: 0.5, 4: 2.0, 8: 2.0}, "single": {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}}
    monkeypatch.setattr(calibrate, "_interleaved_seconds", lambda runners, *args: made_up)
    loaded = load_model(str(llama_folder), dtype="float32", quantization="q4", progress=False)
    assert calibrate.measure_q4_pairs(loaded)["up_to_tokens"] == binding.q4_pairs() == 2
    unquantised = load_model(str(llama_folder), dtype="float32", progress=False)
    assert calibrate.measure_q4_pairs(unquantised) is None and binding.q4_pairs() == 2  # no q4 layer: untouched


def test_without_a_q4_format_nothing_is_said_of_pairs(llama_folder):
    result = measure_forward_costs({"target": str(llama_folder)}, {"target": ["int8"]}, dtype="float32",
                                   token_counts=(1,), context_tokens=8, repeats=1)
    assert "q4_pairs" not in result


def test_a_stored_pairing_counts_for_the_code_it_was_timed_on_and_on_this_machine_only(specdec_home):
    stored = {"machine": _this_machine(), "q4_pairs": {"isa": 2, "up_to_tokens": 4}}
    assert calibrated_q4_pairs(2, stored) == 4
    assert calibrated_q4_pairs(1, stored) == 0  # the AVX2 code (SPECDEC_INT8_KERNEL=avx2) was not timed
    for machine in ({**_this_machine(), "cpu": "elsewhere"}, {**_this_machine(), "threads": 99}, {}):
        assert calibrated_q4_pairs(2, {**stored, "machine": machine}) == 0
    for odd in ("4", None, [], {"isa": 2}, {"isa": 2, "up_to_tokens": "8"}, {"isa": 2, "up_to_tokens": -3}):
        assert calibrated_q4_pairs(2, {**stored, "q4_pairs": odd}) == 0
    assert calibrated_q4_pairs(2) == 0  # nothing stored
    save_calibration(stored)
    assert calibrated_q4_pairs(2) == 4


def test_the_first_q4_layer_takes_the_pairing_stored_for_this_machine(specdec_home, q4_kernel):
    from specdec_cli.models.formats import q4
    from specdec_cli.models.native import binding

    _, isa = q4_kernel
    save_calibration({"machine": _this_machine(), "q4_pairs": {"isa": isa, "up_to_tokens": 4}})
    binding.pair_q4_blocks(0)
    q4.take_calibrated_pairs.cache_clear()
    q4.Q4Linear.from_linear(torch.nn.Linear(64, 32))
    assert binding.q4_pairs() == 4
    save_calibration({"machine": {**_this_machine(), "cpu": "elsewhere"}, "q4_pairs": {"isa": isa, "up_to_tokens": 4}})
    q4.take_calibrated_pairs.cache_clear()
    q4.Q4Linear.from_linear(torch.nn.Linear(64, 32))
    assert binding.q4_pairs() == 0
    binding.pair_q4_blocks(4)  # taken once a process: a later layer leaves what was set since as it is
    q4.Q4Linear.from_linear(torch.nn.Linear(64, 32))
    assert binding.q4_pairs() == 4


def test_a_calibration_without_q4_keeps_the_pairing_measured_before():
    from specdec_cli.models.formats.calibration import merged_with

    now = {"machine": {"cpu": "here"}, "context_tokens": 200, "clock": "wall", "entries": [], "prompt_reads": []}
    pairs = {"isa": 2, "model": "m", "up_to_tokens": 4}
    assert merged_with({**now, "q4_pairs": pairs}, now)[0]["q4_pairs"] == pairs
    newer = {**pairs, "up_to_tokens": 0}
    assert merged_with({**now, "q4_pairs": pairs}, {**now, "q4_pairs": newer})[0]["q4_pairs"] == newer
    assert "q4_pairs" not in merged_with({**now, "machine": {"cpu": "elsewhere"}, "q4_pairs": pairs}, now)[0]


def test_compares_json_says_how_q4_took_its_blocks(llama_folder, q4_kernel):
    from specdec_cli.bench.probes import environment
    from specdec_cli.models.native import binding

    q4_target = load_model(str(llama_folder), dtype="float32", quantization="q4", progress=False)
    binding.pair_q4_blocks(4)
    assert environment(q4_target, None)["q4_pairs_up_to"] == 4
    binding.pair_q4_blocks(0)
    assert environment(q4_target, None)["q4_pairs_up_to"] == 0
    unquantised = load_model(str(llama_folder), dtype="float32", progress=False)
    assert "q4_pairs_up_to" not in environment(unquantised, None)
