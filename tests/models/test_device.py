import pytest
import torch

from specdec_cli.errors import DeviceError
from specdec_cli.models import device as device_module, resolve_device, resolve_dtype

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def test_cpu_is_cpu():
    assert resolve_device("cpu") == torch.device("cpu")


@needs_no_cuda
def test_auto_falls_back_to_cpu_without_gpus(monkeypatch):
    monkeypatch.setattr(device_module, "_mps_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")


@needs_no_cuda
@pytest.mark.parametrize("asked", ["cuda", "cuda:1"])
def test_cuda_on_a_cpu_machine_is_a_device_error(asked):
    with pytest.raises(DeviceError) as raised:
        resolve_device(asked)
    assert "no CUDA GPU" in raised.value.one_line()
    assert "\n" not in raised.value.one_line()


def test_unknown_device_is_a_device_error():
    with pytest.raises(DeviceError, match="unknown device 'tpu0'"):
        resolve_device("tpu0")


@pytest.mark.parametrize(
    ("asked", "expected"),
    [("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("float16", torch.float16), ("float32", torch.float32)],
)
def test_explicit_dtypes(asked, expected):
    assert resolve_dtype(asked, torch.device("cpu")) == expected


def test_unknown_dtype_is_a_device_error():
    with pytest.raises(DeviceError, match="unknown dtype 'int3'"):
        resolve_dtype("int3", torch.device("cpu"))


def _cpuinfo(tmp_path, flags: str):
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nmodel name\t: test\nflags\t\t: fpu sse2 avx2 {flags}\n\nprocessor\t: 1\n")
    return path


def test_bf16_flags_are_read_from_cpuinfo(tmp_path):
    assert device_module.cpu_has_fast_bf16(_cpuinfo(tmp_path, "avx512f avx512_bf16"))
    assert device_module.cpu_has_fast_bf16(_cpuinfo(tmp_path, "amx_tile amx_bf16"))
    assert not device_module.cpu_has_fast_bf16(_cpuinfo(tmp_path, "avx512f"))
    assert not device_module.cpu_has_fast_bf16(tmp_path / "missing")


@pytest.mark.parametrize(("fast_bf16", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_on_cpu_follows_bf16_support(monkeypatch, fast_bf16, expected):
    monkeypatch.setattr(device_module, "cpu_has_fast_bf16", lambda: fast_bf16)
    assert resolve_dtype("auto", torch.device("cpu")) == expected


def test_auto_dtype_on_mps_is_float16():
    assert resolve_dtype("auto", torch.device("mps")) == torch.float16


def test_the_dtype_names_without_torch_are_the_dtypes_torch_maps():
    """models/names.py lists the dtype names for what reads them before torch (a profile's checks, --help)."""
    from specdec_cli.models.names import DTYPE_NAMES

    assert tuple(device_module.DTYPES) == DTYPE_NAMES


def test_others_cpu_use_sees_a_process_spinning_beside_it():
    """What calibrate's refusal stands on: a process spinning on one core reads as about one core (more on a machine
    busy with something else too: nothing here reads less)."""
    import subprocess
    import sys
    import time

    from specdec_cli.models.device import others_cpu_use

    if others_cpu_use(0.05) is None:
        pytest.skip("no /proc/stat here")
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 5\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.3)  # it has started
        assert others_cpu_use(0.5) >= 0.6
    finally:
        spinner.kill()
        spinner.wait(timeout=30)


def test_this_processs_own_cpu_time_is_not_counted_as_others():
    """Between two moments the machine was busy 3.0 s, 2.5 of them this process's own threads, over 1 s of wall
    time: others used 0.5 of a core. (Timed for real, a thread of ours spinning would show the same on an idle
    machine; a test machine need not be idle.)"""
    from specdec_cli.models.device import CpuUse

    earlier, later = CpuUse(busy=10.0, own=1.0, wall=100.0), CpuUse(busy=13.0, own=3.5, wall=101.0)
    assert later.others_since(earlier) == pytest.approx(0.5)
    assert CpuUse(busy=11.0, own=2.0, wall=101.0).others_since(earlier) == 0.0  # all of it ours


def test_others_cpu_use_is_none_without_a_proc_stat(tmp_path):
    from specdec_cli.models.device import others_cpu_use

    assert others_cpu_use(0.01, stat=tmp_path / "absent") is None
    (tmp_path / "stat").write_text("intr 1 2 3\n")
    assert others_cpu_use(0.01, stat=tmp_path / "stat") is None



@pytest.mark.parametrize(("cpus", "busy"), [(1, 0.5), (2, 0.5), (4, 1.0), (16, 4.0)])
def test_busy_is_a_quarter_of_the_cores_and_at_least_half_a_core(monkeypatch, cpus, busy):
    import os

    from specdec_cli.models.device import busy_cores

    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    assert busy_cores() == busy
