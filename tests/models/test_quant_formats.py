"""The quantisation names (none, int8, int4, q4, nf4, bnb8, auto and the old aliases), int4 loaded for real,
and the one-line errors: a missing package, a CPU-only format off the CPU, a CPU without the kernel."""

import importlib.util
import sys

import pytest
import torch

from specdec_cli.errors import MissingExtraError, ModelLoadError
from specdec_cli.models import load_model, load_pair
from specdec_cli.models.formats import int4 as int4_module, int8 as int8_module
from specdec_cli.models.formats.quant import canonical, check_quantization, resolve_auto
from specdec_cli.models.loading.preflight import estimate_weight_bytes
from specdec_cli.profiles import load_profile

CPU = torch.device("cpu")
needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs the quant extra (torchao)")


@pytest.mark.parametrize(("name", "meaning"), [
    ("none", None), (None, None), ("int8", "int8"), ("int4", "int4"), ("q4", "q4"), ("nf4", "nf4"), ("bnb8", "bnb8"),
    ("auto", "auto"), ("4bit", "nf4"), ("8bit", "bnb8"),
])
def test_each_name_and_alias_means_one_format(name, meaning):
    assert canonical(name) == meaning


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ModelLoadError) as raised:
        canonical("int3")
    assert raised.value.one_line() == (
        "unknown quantization 'int3' — use one of none, int8, int4, q4, nf4, bnb8, auto (or the old 4bit, 8bit)"
    )


@pytest.mark.parametrize("name", ["int8", "int4", "q4"])
def test_a_cpu_only_format_off_the_cpu_names_what_to_use(name):
    with pytest.raises(ModelLoadError) as raised:
        check_quantization(name, torch.device("cuda"))
    assert raised.value.one_line() == (
        f"{name} runs on the CPU only, not on cuda — on a GPU use nf4 or bnb8 (bitsandbytes), or pass --device cpu"
    )


def test_a_cpu_without_the_int8_kernel_names_another_format(monkeypatch):
    monkeypatch.setattr(int8_module, "int8_kernel_problem", lambda: "this torch build has no oneDNN")
    with pytest.raises(ModelLoadError) as raised:
        check_quantization("int8", CPU)
    assert raised.value.one_line() == (
        "int8 cannot run on this machine: this torch build has no oneDNN — use int4, nf4 or none instead"
    )


@needs_torchao
def test_a_cpu_without_the_int4_kernel_names_another_format(monkeypatch):
    monkeypatch.setattr(int4_module, "_probe", lambda: "this torch build has no CPU int4 matmul")
    with pytest.raises(ModelLoadError) as raised:
        check_quantization("int4", CPU)
    assert raised.value.hint == "use int8, q4, nf4 or none instead"


def test_int4_without_torchao_says_what_to_install(llama_folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # the import fails as if it were not installed
    with pytest.raises(MissingExtraError) as raised:
        load_model(str(llama_folder), device="cpu", quantization="int4", progress=False)
    assert raised.value.one_line() == "int4 needs torchao, which is not installed — pip install 'specdec[quant]'"


def test_int8_needs_no_extra(llama_folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    loaded = load_model(str(llama_folder), device="cpu", quantization="int8", progress=False)
    assert loaded.quantization == "int8"


def _kernels_as(monkeypatch, isa: int, problem: str | None = None) -> None:
    """This process's matmul kernels as a CPU of this kind would have them (1 AVX2, 2 AVX512-VNNI, 3 with AMX)."""
    from specdec_cli.models.native import binding

    library = binding.library()[0]
    monkeypatch.setattr(binding, "library", lambda: (None, 0, problem) if problem else (library, isa, None))


def test_auto_without_calibration_is_q4_on_a_vnni_cpu_and_int8_on_an_avx2_one(specdec_home, monkeypatch):
    _kernels_as(monkeypatch, 2)  # AVX512-VNNI: q4 where allowed (a draft; a target whose profile lists it)
    assert resolve_auto("draft", CPU) == "q4" and resolve_auto("target", CPU) == "int8"
    assert resolve_auto("target", CPU, allowed=("none", "int8", "q4")) == "q4"
    assert resolve_auto("target", CPU, allowed=("none", "int8")) == "int8"
    assert resolve_auto("target", CPU, allowed=("none",)) is None  # a profile that allows no quantisation
    assert resolve_auto("draft", torch.device("cuda")) is None
    _kernels_as(monkeypatch, 3)  # AMX too: as AVX512-VNNI
    assert resolve_auto("draft", CPU) == "q4" and resolve_auto("target", CPU, allowed=("none", "int8", "q4")) == "q4"
    _kernels_as(monkeypatch, 1)  # AVX2 only: int8, whatever else is allowed
    assert resolve_auto("draft", CPU) == "int8"
    assert resolve_auto("target", CPU, allowed=("none", "int8", "q4")) == "int8"
    assert resolve_auto("target", CPU, allowed=("none", "q4")) is None  # q4 waits for a calibration there
    _kernels_as(monkeypatch, 0, "no compiler")  # no kernels: int8 on torch's oneDNN, q4 cannot run
    assert resolve_auto("draft", CPU) == "int8"
    assert resolve_auto("target", CPU, allowed=("none", "int8", "q4")) == "int8"


def test_auto_in_a_pair_loads_the_cpus_default_and_a_profile_can_keep_the_target_float(llama_folder,
                                                                                          specdec_home):
    from specdec_cli.models.native import binding

    draft_default = "q4" if binding.library()[1] >= 2 else "int8"  # this CPU's kind (the test above)
    target, draft = load_pair(str(llama_folder), str(llama_folder), device="cpu", dtype="float32",
                              target_quantization="auto", draft_quantization="auto", progress=False)
    assert (target.quantization, draft.quantization) == ("int8", draft_default)
    target, draft = load_pair(str(llama_folder), str(llama_folder), device="cpu", dtype="float32",
                              target_quantization="auto", draft_quantization="auto", progress=False,
                              target_auto_formats=("none",))
    assert (target.quantization, draft.quantization) == (None, draft_default)
    assert target.describe("target").endswith("· cpu · float32")


def _calibrate(spec: str, seconds: dict[str, dict[str, float]], role: str = "target") -> None:
    from specdec_cli.models.formats.calibration import machine, save_calibration

    entries = [{"role": role, "model": spec, "quantization": name, "dtype": "float32", "seconds": curve}
               for name, curve in seconds.items()]
    save_calibration({"machine": machine(), "entries": entries})


def test_auto_picks_the_fastest_calibrated_format_it_is_allowed(specdec_home):
    _calibrate("m", {"none": {"1": 0.30, "4": 0.60, "8": 0.80}, "int8": {"1": 0.10, "4": 0.10, "8": 0.15},
                     "int4": {"1": 0.07, "4": 0.20, "8": 0.40}})
    assert resolve_auto("target", CPU, "m", torch.float32) == "int8"  # int4 not allowed by default
    assert resolve_auto("target", CPU, "m", torch.float32, allowed=("none",)) is None
    assert resolve_auto("target", CPU, "other", torch.float32) == "int8"  # not measured: the fallback


@needs_torchao
def test_auto_picks_a_draft_by_its_catch_up_forwards_too(specdec_home):
    # int4 is faster for one token, int8 once the step's first forward takes in the accepted tokens
    # (this machine's calibration with specdec's int8 matmul, in ms: int8 31/32/36, int4 30/34/46)
    _calibrate("d", {"int8": {"1": 0.031, "2": 0.032, "4": 0.036}, "int4": {"1": 0.030, "2": 0.034, "4": 0.046}},
               role="draft")
    assert resolve_auto("draft", CPU, "d", torch.float32) == "int8"
    _calibrate("d", {"int8": {"1": 0.031, "2": 0.032, "4": 0.036}, "int4": {"1": 0.020, "2": 0.022, "4": 0.030}},
               role="draft")
    assert resolve_auto("draft", CPU, "d", torch.float32) == "int4"


def test_auto_trusts_a_calibration_of_this_machine_only(specdec_home):
    from specdec_cli.models.formats.calibration import machine, save_calibration

    elsewhere = machine() | {"cpu": "some other CPU"}
    save_calibration({"machine": elsewhere, "entries": [
        {"role": "target", "model": "m", "quantization": "none", "dtype": "float32", "seconds": {"1": 0.01}}]})
    assert resolve_auto("target", CPU, "m", torch.float32) == "int8"
    _calibrate("m", {"none": {"1": 0.01, "4": 0.01, "8": 0.01}, "int8": {"1": 0.1, "4": 0.1, "8": 0.1}})
    assert resolve_auto("target", CPU, "m", torch.float32) is None  # here float measured fastest


@needs_torchao
def test_int4_load_quantises_the_linear_layers_and_runs(llama_folder):
    loaded = load_model(str(llama_folder), device="cpu", dtype="float32", quantization="int4", progress=False)
    int4_layers = [name for name, parameter in loaded.model.named_parameters() if hasattr(parameter, "qdata")]
    assert len(int4_layers) == 2 * 7  # the 300-row output layer stays bfloat16: the kernel needs rows in 16s
    assert (loaded.quantization, loaded.dtype, loaded.vocab_size) == ("int4", torch.bfloat16, 300)
    with torch.no_grad():
        logits = loaded.model(torch.tensor([[1, 2, 3, 4]])).logits  # (B, T, V)
    assert logits.shape == (1, 4, 300) and torch.isfinite(logits).all()
    assert loaded.describe("target").endswith(
        "· cpu · bfloat16 · int4 weights (groups of up to 128), bfloat16 activations")
    assert loaded.precision == "int4 weights (groups of up to 128), bfloat16 activations"


def _held_bytes(model: torch.nn.Module) -> int:
    """Parameter bytes, counting an int4 weight by its packed values and its scales and zeros."""
    total = 0
    for parameter in model.parameters():
        inner = [parameter.qdata, parameter.scale_and_zero] if hasattr(parameter, "qdata") else [parameter]
        total += sum(tensor.numel() * tensor.element_size() for tensor in inner)
    return total


@needs_torchao
@pytest.mark.parametrize("tied", [True, False])
def test_int4_memory_estimate_is_what_the_quantised_model_holds(tmp_path, tied):
    from transformers import AutoConfig

    from tests.tiny import build_tiny_model

    build_tiny_model(tmp_path, arch="llama", vocab_size=320)  # 320 rows: the output layer is int4 too
    config = AutoConfig.from_pretrained(tmp_path)
    config.tie_word_embeddings = tied
    config.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32", quantization="int4", progress=False)
    assert hasattr(loaded.model.get_output_embeddings().weight, "qdata")
    assert estimate_weight_bytes(config, torch.float32, "int4") == _held_bytes(loaded.model)


def test_profiles_take_the_new_names_and_none(specdec_home):
    folder = specdec_home / "profiles"
    folder.mkdir(parents=True)
    (folder / "cpu.toml").write_text('target = "org/big"\ndraft = "org/small"\n'
                                     'target_quantization = "int4"\ndraft_quantization = "none"\n')
    profile = load_profile("cpu")
    assert (profile.target_quantization, profile.draft_quantization) == ("int4", "none")


@needs_torchao
def test_an_int4_draft_gets_a_subset_head_of_its_own_rows(llama_folder):
    from specdec_cli.drafters.subset_head import SubsetHeadLM

    loaded = load_model(str(llama_folder), device="cpu", dtype="float32", quantization="int4", progress=False)
    model = loaded.model
    full = model.lm_head
    model.lm_head = torch.nn.Linear(full.in_features, 304, bias=False)  # rows in 16s: the int4 kernel takes it
    model.lm_head.weight = torch.nn.Parameter(torch.randn(304, full.in_features, dtype=torch.bfloat16) * 0.1)
    from specdec_cli.models.formats.int4 import quantize_int4

    quantize_int4(torch.nn.Sequential(model.lm_head))  # the new head to int4 as well
    assert hasattr(model.lm_head.weight, "qdata")  # int4 now, as in an int4 draft
    ids = torch.arange(0, 304, 3)[:32]  # 32 rows
    head = SubsetHeadLM(model, ids)
    tokens = torch.tensor([[1, 5, 9, 14]])
    subset_logits = head(tokens).logits[0, -1].float()  # (32,)
    full_logits = model(tokens).logits[0, -1].float()[ids]
    assert head.full_vocab_size == 304 and subset_logits.shape == (32,) and hasattr(head.head.weight, "qdata")
    assert torch.allclose(subset_logits, full_logits, atol=0.05, rtol=0.05)  # the same rows, re-quantised
