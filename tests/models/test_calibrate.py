"""Calibration: forward costs per model and format as plain data, stored as JSON under the specdec home."""

import json

import pytest

from specdec_cli.models.calibrate import measure_forward_costs
from specdec_cli.models.formats.calibration import calibration_path, load_calibration, save_calibration


def test_measures_each_format_and_token_count(llama_folder):
    seen = []
    result = measure_forward_costs(
        {"target": str(llama_folder)}, {"target": ["none", "int8"], "draft": ["int4"]},  # no draft model: skipped
        dtype="float32", token_counts=(1, 3), context_tokens=8, repeats=1, on_result=seen.append,
    )
    entries = result["entries"]
    assert seen == entries
    assert [(e["role"], e["quantization"], e["dtype"]) for e in entries] == [
        ("target", "none", "float32"), ("target", "int8", "float32")]
    assert entries[1]["precision"] == "int8 weights, per-token int8 activations"
    assert all(list(e["seconds"]) == ["1", "3"] and min(e["seconds"].values()) > 0 for e in entries)
    assert (result["context_tokens"], result["clock"]) == (8, "wall") and result["machine"]["threads"] >= 1
    json.dumps(result)  # plain data


def test_a_calibration_is_stored_under_the_specdec_home_and_read_back(specdec_home):
    result = {"machine": {"cpu": "test"}, "entries": []}
    path = save_calibration(result)
    assert path == calibration_path() == specdec_home / "calibration.json"
    assert load_calibration() == result


def test_no_or_a_broken_calibration_reads_as_none(specdec_home):
    assert load_calibration() is None
    calibration_path().parent.mkdir(parents=True, exist_ok=True)
    calibration_path().write_text("{not json")
    assert load_calibration() is None


def test_a_calibration_of_another_shape_reads_as_none_and_its_odd_entries_are_left_out(specdec_home):
    """JSON that is not a calibration (a list; a machine that is not an object) was an AttributeError traceback in
    every command that reads the costs; entries that are not objects, too."""
    from specdec_cli.models.formats.calibration import calibrated_prompt_read, calibrated_seconds, machine

    calibration_path().parent.mkdir(parents=True, exist_ok=True)
    for text in ("[1, 2]", '"calibrated"', '{"machine": [1]}', '{"entries": []}'):
        calibration_path().write_text(text)
        assert load_calibration() is None, text
        assert calibrated_seconds("m", "q4") is None and calibrated_prompt_read("m", "q4") is None
    entry = {"model": "m", "quantization": "q4", "seconds": {"1": 0.04}}
    calibration_path().write_text(json.dumps({"machine": machine(), "entries": [3, None, entry], "prompt_reads": 7}))
    assert load_calibration()["entries"] == [entry] and load_calibration()["prompt_reads"] == []
    assert calibrated_seconds("m", "q4") == {1: 0.04}


def test_each_repeat_times_every_token_count_in_turn(llama_folder, monkeypatch):
    """A machine that slows down halfway must slow every token count alike, not the ones measured last."""
    from specdec_cli.engine.kv import CachedModel

    fed = []
    extend = CachedModel.extend

    def counted(self, ids, n_logits=1):
        fed.append(n_logits)
        return extend(self, ids, n_logits)

    monkeypatch.setattr(CachedModel, "extend", counted)
    measure_forward_costs({"target": str(llama_folder)}, {"target": ["none"]}, dtype="float32",
                          token_counts=(1, 2, 4), context_tokens=8, repeats=2)
    assert fed == [1] + [1, 2, 4] * 3  # the context, then a warm-up round and two timed rounds


def _drifting_machine(monkeypatch, drift: float) -> None:
    """Forwards that cost n new tokens × a speed that worsens with every forward (a VM slowing down), on a
    clock of their own: a format timed after another looks slower by the drift alone."""
    from specdec_cli.engine.kv import CachedModel
    from specdec_cli.models import calibrate

    state = {"now": 0.0, "forwards": 0}
    extend = CachedModel.extend

    def drifting(self, ids, n_logits=1):
        state["now"] += n_logits * (1 + drift * state["forwards"])
        state["forwards"] += 1
        return extend(self, ids, n_logits)

    monkeypatch.setattr(CachedModel, "extend", drifting)
    monkeypatch.setitem(calibrate.CLOCKS, "wall", lambda: state["now"])


def _calibrate_two_formats(llama_folder) -> dict:
    result = measure_forward_costs({"target": str(llama_folder)}, {"target": ["none", "int8"]}, dtype="float32",
                                   token_counts=(1, 2), context_tokens=8, repeats=2)
    return {entry["quantization"]: entry for entry in result["entries"]}


def test_formats_close_enough_to_rank_are_timed_again_together(llama_folder, monkeypatch):
    """Timed one after the other, int8 looks 24% slower on the drifting machine though both cost the same;
    timed again in turn, forward by forward, they come out within the drift of one forward."""
    _drifting_machine(monkeypatch, drift=0.04)
    entries = _calibrate_two_formats(llama_folder)
    assert entries["none"]["timed_with"] == entries["int8"]["timed_with"] == ["none", "int8"]
    for n in ("1", "2"):
        assert entries["int8"]["seconds"][n] / entries["none"]["seconds"][n] < 1.05


def test_formats_far_apart_keep_their_own_timings(llama_folder, monkeypatch):
    _drifting_machine(monkeypatch, drift=0.2)  # int8 looks 1.8x slower: no ranking to settle
    entries = _calibrate_two_formats(llama_folder)
    assert "timed_with" not in entries["none"] and "timed_with" not in entries["int8"]
    assert entries["int8"]["seconds"]["1"] / entries["none"]["seconds"]["1"] > 1.5


def test_formats_that_would_not_fit_in_memory_together_keep_their_own_timings(llama_folder, monkeypatch):
    from specdec_cli.models import calibrate

    monkeypatch.setattr(calibrate, "available_memory_bytes", lambda device: 0)
    _drifting_machine(monkeypatch, drift=0.04)
    entries = _calibrate_two_formats(llama_folder)
    assert "timed_with" not in entries["int8"]
    assert entries["int8"]["seconds"]["1"] / entries["none"]["seconds"]["1"] > 1.2


def test_sizes_without_a_one_token_forward_are_measured_but_not_ranked(llama_folder):
    result = measure_forward_costs({"target": str(llama_folder)}, {"target": ["none", "int8"]}, dtype="float32",
                                   token_counts=(2, 4), context_tokens=8, repeats=1)
    assert [list(entry["seconds"]) for entry in result["entries"]] == [["2", "4"], ["2", "4"]]
    assert not any("timed_with" in entry for entry in result["entries"])


def test_a_quantised_targets_prompt_read_is_timed_by_itself_and_by_its_bfloat16_copy(llama_folder):
    result = measure_forward_costs({"target": str(llama_folder)}, {"target": ["none", "int8"]}, dtype="float32",
                                   token_counts=(1,), context_tokens=8, repeats=1)
    (read,) = result["prompt_reads"]  # int8 only: a float target reads its prompts itself
    assert (read["model"], read["quantization"], read["tokens"]) == (str(llama_folder), "int8", 256)
    assert read["model_seconds"] > 0 and read["copy_seconds"] > 0


def test_another_machines_or_another_cache_lengths_calibration_is_replaced_whole():
    from specdec_cli.models.formats.calibration import merged_with

    entry = {"role": "target", "model": "m", "quantization": "int8", "dtype": "float32", "seconds": {"1": 0.1}}
    now = {"machine": {"cpu": "here"}, "context_tokens": 200, "clock": "wall", "entries": [], "prompt_reads": []}
    for earlier_machine, context in (({"cpu": "elsewhere"}, 200), ({"cpu": "here"}, 64)):
        earlier = {**now, "machine": earlier_machine, "context_tokens": context, "entries": [entry]}
        assert merged_with(earlier, now) == (now, [])
    stored, kept = merged_with({**now, "entries": [entry], "measured_at": "then"}, now)
    assert kept == stored["entries"] == [{**entry, "measured_at": "then"}]


def test_a_cache_past_the_models_context_is_refused_before_any_forward(llama_folder, monkeypatch):
    """`calibrate --context 100000` on a 32k model ran for hours on positions the model never runs at."""
    import pytest

    from specdec_cli.engine.context import context_length
    from specdec_cli.errors import InputError
    from specdec_cli.models import calibrate, load_model

    loaded = load_model(str(llama_folder), device="cpu", dtype="float32", progress=False)
    limit = context_length(loaded.model)
    forwards = []
    monkeypatch.setattr(calibrate, "_interleaved_seconds", lambda *args: forwards.append(args) or {0: {1: 1.0}})
    with pytest.raises(InputError) as raised:
        calibrate.forward_costs(loaded, (1, 4), context_tokens=limit - 3)
    assert raised.value.one_line() == (f"--context {limit - 3} and the 4 new tokens of the largest forward need "
                                       f"{limit + 1} positions; {llama_folder} takes {limit} — give --context "
                                       f"{limit - 4} or less")
    assert forwards == []
    calibrate.forward_costs(loaded, (1, 4), context_tokens=limit - 4)  # exactly full: timed
    assert len(forwards) == 1


def test_a_full_disk_keeps_the_calibration_before_and_leaves_no_partial_file(specdec_home):
    """It raised OSError (a traceback after minutes of timing) and left `.calibration.json.tmp` beside the file."""
    import errno
    from pathlib import Path

    from specdec_cli.errors import CacheWriteError

    before = {"machine": {"cpu": "test"}, "entries": []}
    save_calibration(before)
    written = Path.write_text

    def cut_short(self, text, *args, **kwargs):  # the disk fills halfway through
        written(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.MonkeyPatch.context() as patch, pytest.raises(CacheWriteError) as raised:
        patch.setattr(Path, "write_text", cut_short)
        save_calibration({"machine": {"cpu": "test"}, "entries": [{"role": "target"}] * 50})
    assert raised.value.one_line() == (f"the disk is full: calibration.json could not be written in {specdec_home} — "
                                       "free some space there, or set SPECDEC_HOME to a folder on a disk with room")
    assert load_calibration() == before
    assert sorted(path.name for path in specdec_home.iterdir()) == ["calibration.json"]
