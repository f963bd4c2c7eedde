"""Calibration: forward costs per model and format as plain data, stored as JSON under the specdec home."""

import json

from specdec_cli.models.calibrate import (
    calibration_path, load_calibration, measure_forward_costs, save_calibration,
)


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
