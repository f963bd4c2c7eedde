"""specdec's own int8 matmul (int8_gemm.c): the same numbers as torch's oneDNN path bit for bit, on both
of its code paths, whatever the token count; a token's output independent of its neighbours; and the
fall-back to oneDNN, with the reason, where it cannot be built."""

import copy
import os
from pathlib import Path

import pytest
import torch

from specdec_cli.models.formats import int8 as int8_module
from specdec_cli.models.formats.int8 import PerTokenInt8Linear, matmul_name
from specdec_cli.models.native import binding
from specdec_cli.models.runtime.quantize import quantize_int8

# In CI these run even where the kernel does not build, and fail: CI's machine must build it.
needs_kernel = pytest.mark.skipif(binding.kernel_problem(7) is not None and not os.environ.get("CI"),
                                  reason=f"specdec's int8 kernel does not run here: {binding.kernel_problem(7)}")
# Odd shapes on purpose: rows not a multiple of 32 (one block half full), widths not a multiple of 4.
SHAPES = [(37, 18), (64, 100), (200, 131), (8, 7)]
TOKEN_COUNTS = [1, 2, 3, 5, 8, 9, 17]


def _pair(in_features: int, out_features: int, bits: int, bias: bool) -> tuple[PerTokenInt8Linear, PerTokenInt8Linear]:
    """(a layer on specdec's kernel, the same layer on oneDNN), from one float layer."""
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    own = PerTokenInt8Linear.from_linear(linear, bits)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(binding, "kernel_problem", lambda bits: "off for the reference")
        reference = PerTokenInt8Linear.from_linear(linear, bits)
    assert own.own_kernel and not reference.own_kernel
    return own, reference


@pytest.fixture(params=["vnni", "avx2"])
def code_path(request, monkeypatch):
    """Each ISA the CPU runs: the AVX2 code runs on an AVX512 CPU too, with 7-bit activations (as without VNNI)."""
    library, isa, _ = binding.library()
    if request.param == "vnni":
        if isa < 2:
            pytest.skip("this CPU has no AVX512-VNNI")
        return 8
    monkeypatch.setattr(binding, "library", lambda: (library, 1, None))
    return 7


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
def test_the_kernel_gives_onednns_numbers_bit_for_bit(code_path, in_features, out_features, bias):
    torch.manual_seed(in_features * out_features)
    own, reference = _pair(in_features, out_features, code_path, bias)
    for tokens in TOKEN_COUNTS:
        x = torch.randn(tokens, in_features) * torch.logspace(-2, 1, tokens)[:, None]  # rows of unlike scales
        assert torch.equal(own(x), reference(x)), (tokens, code_path)


@needs_kernel
def test_a_tokens_output_does_not_depend_on_the_others(code_path):
    torch.manual_seed(3)
    own, _ = _pair(131, 200, code_path, bias=True)
    x = torch.randn(17, 131)
    together = own(x)
    for i in range(17):
        assert torch.equal(own(x[i:i + 1])[0], together[i])


@needs_kernel
def test_the_kernel_takes_a_models_batch_and_dtype_shapes():
    torch.manual_seed(4)
    own, reference = _pair(64, 40, 8 if binding.library()[1] >= 2 else 7, bias=True)
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    assert own(x).shape == (2, 3, 40) and own(x).dtype == torch.bfloat16
    assert torch.equal(own(x), reference(x))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "width"), SHAPES + [(48, 1100)])
def test_the_c_quantiser_and_packer_give_torchs_bytes(rows, width, dtype):
    """Loading quantises and packs in C (a model loads ~3x faster); the numbers are torch's steps', bit for bit:
    rows of unlike scales, a zero row, a row below the 1e-12 floor, values near float16's largest."""
    torch.manual_seed(rows * width)
    weight = torch.randn(rows, width) * torch.logspace(-3, 0, rows)[:, None]
    weight[0], weight[1], weight[2, :3] = 0.0, 1e-14, 6e4
    weight = weight.to(dtype)
    expected = int8_module.quantize_weight(weight)
    for source in (weight, torch.cat([weight, weight[:, :5]], dim=1)[:, :width]):  # rows further apart than the width
        values, scales = int8_module.quantize_weight_fast(source)
        assert torch.equal(values, expected[0]) and torch.equal(scales, expected[1])
    for made, wanted in zip(binding.pack(expected[0]), binding.pack_in_torch(expected[0])):
        assert torch.equal(made, wanted)


@pytest.mark.parametrize(("rows", "width"), SHAPES)
def test_packing_keeps_every_weight(rows, width):
    weight = torch.randint(-127, 128, (rows, width), dtype=torch.int8)
    blocks, row_sums = binding.pack(weight)
    assert blocks.numel() == binding.packed_bytes(rows, width)
    assert torch.equal(binding.unpack(blocks, rows, width), weight)
    assert torch.equal(row_sums, weight.to(torch.int64).sum(dim=1).to(torch.int32))


@needs_kernel
def test_a_copied_layer_keeps_the_kernels_layout_and_numbers():
    own, _ = _pair(100, 64, 8 if binding.library()[1] >= 2 else 7, bias=False)
    copied = copy.deepcopy(own)
    x = torch.randn(3, 100)
    assert copied.own_kernel and torch.equal(copied(x), own(x))


def test_without_a_compiler_int8_runs_on_onednn_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails, in a fresh home: nothing cached to load
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    library, isa, problem = binding.load_library()
    assert library is None and isa == 0
    assert problem == "specdec's matmul kernels (int8, q4) did not build (false failed: no output)"
    assert not list((tmp_path / "home" / "kernels").iterdir())  # no half-built entry left behind


@needs_kernel
def test_a_library_cut_short_is_built_again_not_loaded(monkeypatch, tmp_path):
    """Loading a shared library a full disk or a copy cut short kills the process (SIGBUS), so the build leaves
    its sha256 beside it and a library that does not match is built again before anything loads it."""
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    library = binding._built()
    whole = library.read_bytes()
    library.write_bytes(whole[:10000])
    built = []
    real_compile = binding.compile_library
    monkeypatch.setattr(binding, "compile_library", lambda *args: (built.append(args), real_compile(*args)))
    assert binding._built() == library
    assert len(built) == 1 and library.stat().st_size == len(whole)
    assert binding._built() == library and len(built) == 1  # whole now: not built again
    library.with_name(library.name + ".sha256").unlink()
    assert binding._built() == library and len(built) == 2


def test_int8_falls_back_to_onednn_where_the_kernel_is_off(monkeypatch):
    monkeypatch.setattr(binding, "library", lambda: (None, 0, "SPECDEC_INT8_KERNEL=onednn"))
    layer = PerTokenInt8Linear.from_linear(torch.nn.Linear(16, 8))
    assert not layer.own_kernel and matmul_name() == "oneDNN"
    assert layer(torch.randn(2, 16)).shape == (2, 8)


@needs_kernel
def test_a_cpu_without_vnni_is_named_for_the_matmul_its_layers_run(monkeypatch):
    """Without VNNI activations are 7-bit and the AVX2 code runs them: the name calibrations and compare's
    JSON record must say so, not oneDNN."""
    library, _, _ = binding.library()
    monkeypatch.setattr(binding, "library", lambda: (library, 1, None))
    monkeypatch.setattr(int8_module, "activation_bits", lambda: 7)
    layer = PerTokenInt8Linear.from_linear(torch.nn.Linear(16, 8))
    assert layer.own_kernel and matmul_name() == "specdec AVX2"


def test_the_environment_forces_onednn(monkeypatch):
    monkeypatch.setenv("SPECDEC_INT8_KERNEL", "onednn")
    assert binding.load_library() == (None, 0, "SPECDEC_INT8_KERNEL=onednn")


@needs_kernel
def test_a_model_on_the_kernel_decodes_what_it_does_on_onednn(llama_target):
    """A whole tiny model: every Linear on the kernel gives the logits the oneDNN layers give."""
    on_kernel = quantize_int8(copy.deepcopy(llama_target))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(binding, "kernel_problem", lambda bits: "off for the reference")
        on_onednn = quantize_int8(copy.deepcopy(llama_target))
    ids = torch.tensor([[1, 5, 9, 14, 30, 2, 7]])
    assert torch.equal(on_kernel(ids).logits, on_onednn(ids).logits)



def test_a_kernel_another_process_built_meanwhile_is_used(monkeypatch, tmp_path):
    """Two processes building at once: the second one's rename finds the folder taken, and uses it."""
    import subprocess

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    real_run = subprocess.run

    def build_twice(command, **kwargs):
        output = command[command.index("-o") + 1]
        final = tmp_path / "home" / "kernels" / output.split("/")[-2].split(".")[1]
        final.mkdir(parents=True)
        real_run([*command[:command.index("-o") + 1], str(final / binding.LIBRARY_NAME), *command[command.index("-o") + 2:]],
                 **kwargs)  # the other process, done first
        return real_run(command, **kwargs)

    monkeypatch.setattr(binding.subprocess, "run", build_twice)
    library, isa, problem = binding.load_library()
    assert problem is None and library is not None and isa in (1, 2, 3)
    assert [path.name for path in (tmp_path / "home" / "kernels").iterdir()] == [Path(library._name).parent.name]


def test_a_compiler_without_amx_still_builds_the_kernels(monkeypatch, tmp_path):
    """gcc before 11 (or binutils before 2.36) cannot build q4_amx.c: the library is built again without it, and
    q4 runs on VNNI or AVX2, the same numbers."""
    import shutil
    import stat

    compiler = shutil.which("cc") or shutil.which("gcc")
    wrapper = tmp_path / "cc-without-amx"
    wrapper.write_text(f"#!/bin/sh\ncase \"$*\" in *-DSPECDEC_NO_AMX*) exec {compiler} \"$@\";; esac\n"
                       "echo 'q4_amx.c: error: no such instruction: tdpbsud' >&2\nexit 1\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CC", str(wrapper))
    library, isa, problem = binding.load_library()
    assert problem is None and isa in (1, 2) and library.specdec_amx_ready() == 0
    from specdec_cli.models.formats.q4 import Q4Linear

    layer = Q4Linear.from_linear(torch.nn.Linear(64, 40))
    x = torch.randn(12, 64)  # AMX's token counts where the CPU has it
    expected = layer(x)
    monkeypatch.setattr(binding, "library", lambda: (library, isa, None))
    assert torch.equal(layer(x), expected)


def test_a_full_disk_stops_the_build_in_one_line_instead_of_running_slower(monkeypatch, tmp_path):
    """With the home's disk full the compiler's last line was the linker's ("ld returned 1 exit status"), the kernels
    counted as not built, and `auto` ran int8 on oneDNN, ~4x slower than q4, without a word of why."""
    import stat

    from specdec_cli.errors import CacheWriteError

    compiler = tmp_path / "cc-on-a-full-disk"
    compiler.write_text("#!/bin/sh\necho '/usr/bin/ld: final link failed: No space left on device' >&2\n"
                        "echo 'collect2: error: ld returned 1 exit status' >&2\nexit 1\n")
    compiler.chmod(compiler.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CC", str(compiler))
    with pytest.raises(CacheWriteError) as raised:
        binding.load_library()
    assert raised.value.one_line().startswith("the disk is full: native-")
    assert raised.value.one_line().endswith(f"could not be written in {tmp_path / 'home' / 'kernels'} — free some "
                                            "space there, or set SPECDEC_HOME to a folder on a disk with room")
    assert not list((tmp_path / "home" / "kernels").iterdir())
