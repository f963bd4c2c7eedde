"""The formats a model gets where no flag or profile names one (issue 60): a float target keeps its weights and says,
in one line, which format is faster here; a 4-bit .gguf target runs in q4, its own blocks; a draft runs in `auto`."""

import io

import pytest
from rich.console import Console

from specdec_cli import settings
from specdec_cli.models.native import binding
from specdec_cli.settings import ModelOverrides, choose_models, load_choice, resolve_formats


def choose(**flags):
    return choose_models(ModelOverrides(**flags))


def _kind_figure() -> str:
    """What the note says on this machine without a calibration (the kernels build on every test machine: CI)."""
    _, isa, problem = binding.library()
    assert problem is None, problem
    return {3: "×3.5 faster here (on this CPU kind)", 2: "×4 faster here (on this CPU kind)"}.get(isa, "several times faster here")


def _notes(console: Console) -> list[str]:
    return [line for line in console.export_text().splitlines() if line.startswith("note:")]


def test_a_bf16_folder_target_stays_bf16_with_one_note_and_its_draft_runs_quantised(tiny_pair, specdec_home):
    console = Console(record=True, width=400)
    choice = choose(target=tiny_pair.target, draft=tiny_pair.same, device="cpu", dtype="bfloat16")
    assert (choice.target_quantization, choice.draft_quantization) == (None, "auto")
    target, draft = load_choice(choice, console)
    uncalibrated_draft = "q4" if binding.library()[1] >= 2 else "int8"  # quant.UNCALIBRATED, by the CPU's kind
    assert (target.quantization, draft.quantization) == (None, uncalibrated_draft)
    faster = "q4" if binding.library()[1] >= 2 else "int8"
    assert [note for note in _notes(console) if note.startswith("note: the target")] == [
        f"note: the target runs in bfloat16; {faster} runs {_kind_figure()} — add --target-quant {faster} for that "
        "speed (its output may differ slightly from the bfloat16 weights')"]


def test_the_note_gives_the_calibrated_ratio_where_both_formats_were_timed(tiny_pair, specdec_home):
    from specdec_cli.models.formats.calibration import machine, save_calibration

    def timed(quantization, dtype, seconds):
        return {"model": tiny_pair.target, "quantization": quantization, "dtype": dtype,
                "seconds": {"1": seconds, "4": seconds, "8": seconds}}

    save_calibration({"machine": machine(), "entries": [timed("none", "bfloat16", 0.25), timed("q4", "float32", 0.05)]})
    console = Console(record=True, width=400)
    load_choice(choose(target=tiny_pair.target, device="cpu", dtype="bfloat16"), console)
    assert _notes(console) == [
        "note: the target runs in bfloat16; q4 runs ×5.0 faster here (calibrated) — add --target-quant q4 for that "
        "speed (its output may differ slightly from the bfloat16 weights')"]


def test_the_note_says_several_times_where_no_figure_exists_for_the_cpu_kind(tiny_pair, specdec_home, monkeypatch):
    choice = choose(target=tiny_pair.target, device="cpu", dtype="float32")
    target, _ = load_choice(choice, Console(file=io.StringIO()))
    library = binding.library()
    monkeypatch.setattr(binding, "library", lambda: (library[0], 1, None))  # an AVX2-only CPU: auto takes int8 there
    assert settings.float_target_note(choice, target) == (
        "note: the target runs in float32; int8 runs several times faster here — add --target-quant int8 for that "
        "speed (its output may differ slightly from the float32 weights')")


def test_a_float_target_asked_for_gets_no_note(tiny_pair, specdec_home):
    console = Console(record=True, width=400)
    load_choice(choose(target=tiny_pair.target, device="cpu", dtype="bfloat16", target_quant="none"), console)
    assert _notes(console) == []


@pytest.fixture(scope="module")
def q4_k_m_gguf(tmp_path_factory):
    """A tiny .gguf of Q4_K layers named as llama.cpp names a Q4_K_M file."""
    from tests.tiny import build_4bit_gguf

    path = tmp_path_factory.mktemp("tiny-q4-k-m") / "tiny-qwen2-Q4_K_M.gguf"
    build_4bit_gguf(path, arch="qwen2", kind="Q4_K")
    return path


def test_a_4bit_gguf_target_runs_in_q4_its_own_blocks(q4_k_m_gguf, specdec_home):
    choice = choose(target=str(q4_k_m_gguf), device="cpu", dtype="float32")
    assert choice.target_quantization == "q4"
    console = Console(record=True, width=400)
    target, _ = load_choice(choice, console)
    assert target.quantization == "q4"
    assert "layers kept as the .gguf's own blocks" in console.export_text()
    assert _notes(console) == []


@pytest.mark.parametrize(("target", "flags", "expected"), [
    ("org/model-GGUF:Q4_K_M", {}, "q4"),                   # a hub file by its tag
    ("org/model-GGUF@main:q4_0", {}, "q4"),
    ("demo:qwen2.5-coder-1.5b", {}, "q4"),                # the demo files are Q4_K_M
    ("models/model-Q4_K_S.gguf", {}, "q4"),
    ("org/model-GGUF:Q8_0", {}, "q4"),                    # in place too: the levels matmul keeps Q8_0, Q6_K, Q5_0/K
    ("org/model-GGUF:Q6_K", {}, "q4"),
    ("models/model-Q5_K_M.gguf", {}, "q4"),
    ("org/model-GGUF:IQ4_XS", {}, None),                  # types without a kernel: as it is (converted to the dtype)
    ("org/model-GGUF:Q3_K_M", {}, None),
    ("models/model-f16.gguf", {}, None),
    ("org/model", {}, None),                              # a hub id of float weights: the weights as given
    ("org/model-GGUF:Q4_K_M", {"device": "cuda"}, None),  # q4 runs on the CPU only
    ("org/model-GGUF:Q4_K_M", {"target_quant": "none"}, "none"),  # a flag wins
])
def test_what_a_target_runs_in_where_nothing_names_a_format(target, flags, expected):
    assert choose(target=target, **{"device": "cpu", **flags}).target_quantization == expected


def test_a_local_gguf_whose_name_says_no_type_runs_in_place_where_its_layers_are_of_types_with_kernels(tmp_path):
    """Read from the file's tensor table: most 2-D tensors Q4_K (or Q6_K) runs in place; F32 ones as they are."""
    from tests.tiny import build_4bit_gguf, build_tiny_gguf

    quantised, mixed, plain = tmp_path / "mine.gguf", tmp_path / "other.gguf", tmp_path / "plain.gguf"
    build_4bit_gguf(quantised, kind="Q4_K")
    build_4bit_gguf(mixed, kind="Q4_K", kinds={"ffn": "Q6_K", "attn": "Q8_0"})
    build_tiny_gguf(plain)
    assert [choose(target=str(path), device="cpu").target_quantization for path in (quantised, mixed, plain)] == [
        "q4", "q4", None]


def test_a_draft_without_a_format_is_auto_and_a_flag_or_profile_still_wins(specdec_home):
    choice = choose(target="org/big", draft="org/small", device="cpu")
    assert choice.draft_quantization == "auto"
    assert resolve_formats(choice).draft_quantization == ("q4" if binding.library()[1] >= 2 else "int8")
    assert choose(target="org/big", draft="org/small", draft_quant="none").draft_quantization == "none"
    assert choose(profile="qwen2.5-7b").draft_quantization == "auto"  # a shipped profile naming no draft format
    profiles = specdec_home / "profiles"
    profiles.mkdir(parents=True)
    (profiles / "float-draft.toml").write_text('target = "org/big"\ndraft = "org/small"\ndraft_quantization = "none"\n')
    assert choose(profile="float-draft").draft_quantization == "none"
