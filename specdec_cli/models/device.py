"""Choosing the device and the compute dtype."""

from __future__ import annotations

from pathlib import Path

import torch

from specdec_cli.errors import DeviceError

DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}

# CPU flags that make bf16 matmuls faster than fp32; without them bf16 is emulated and slower.
_BF16_CPU_FLAGS = {"avx512_bf16", "amx_bf16", "amx_tile"}


def _mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()


def _auto_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if _mps_available():
        return torch.device("mps")
    return torch.device("cpu")


def _check_cuda(device: torch.device, asked: str) -> None:
    if not torch.cuda.is_available():
        raise DeviceError(f"device {asked!r} asked for, but this machine has no CUDA GPU", "use --device cpu or auto")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise DeviceError(f"device {asked!r} does not exist: this machine has {count} CUDA GPU(s)", "use --device cuda:0")


def resolve_device(device: str = "auto") -> torch.device:
    """auto → cuda, then mps, then cpu. An explicit device this machine lacks raises DeviceError."""
    asked = (device or "auto").strip().lower()
    if asked == "auto":
        return _auto_device()
    try:
        chosen = torch.device(asked)
    except RuntimeError:
        raise DeviceError(f"unknown device {device!r}", "use auto, cpu, cuda, cuda:N or mps") from None
    if chosen.type == "cuda":
        _check_cuda(chosen, device)
    elif chosen.type == "mps" and not _mps_available():
        raise DeviceError(f"device {device!r} asked for, but MPS is not available here", "use --device cpu or auto")
    elif chosen.type not in ("cpu", "cuda", "mps"):
        raise DeviceError(f"unsupported device {device!r}", "use auto, cpu, cuda, cuda:N or mps")
    return chosen


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU feature flags from /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def busy_cores() -> float:
    """Cores' worth of other processes' CPU use at which a timing is refused (calibrate) or flagged (compare): a
    quarter of the machine, at least half a core. A single-threaded job beside specdec on a 2-core machine takes a
    core its forwards need; a browser's half core on a 16-core desktop is the normal state of that machine."""
    import os

    return max(0.5, 0.25 * (os.cpu_count() or 1))


class CpuUse:
    """The machine's busy CPU time (/proc/stat: user, nice, system, irq, softirq; not a hypervisor's steal) and this
    process's own, at one moment; `others_since(earlier)` is how many cores' worth other processes used in between.
    `at()` is None where there is no /proc/stat (macOS, Windows)."""

    def __init__(self, busy: float, own: float, wall: float) -> None:
        self.busy, self.own, self.wall = busy, own, wall

    @classmethod
    def at(cls, stat: Path = Path("/proc/stat")) -> "CpuUse | None":
        import os
        import time

        try:
            fields = stat.read_text().splitlines()[0].split()
        except (OSError, IndexError):
            return None
        if fields[:1] != ["cpu"] or len(fields) < 8:
            return None
        user, nice, system, _idle, _iowait, irq, softirq = (int(value) for value in fields[1:8])
        times = os.times()
        return cls((user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK"), times.user + times.system,
                   time.monotonic())

    def others_since(self, earlier: "CpuUse") -> float:
        return max(0.0, (self.busy - earlier.busy) - (self.own - earlier.own)) / max(self.wall - earlier.wall, 1e-9)


class BackgroundLoad:
    """How many cores' worth of CPU other processes used since `begin()` (`CpuUse`), rounded to 0.01: what a timing
    taken meanwhile includes. `cores()` is None before `begin()`, and where there is no /proc/stat."""

    def __init__(self, stat: Path = Path("/proc/stat")) -> None:
        self.stat = stat
        self.start: CpuUse | None = None

    def begin(self) -> "BackgroundLoad":
        self.start = CpuUse.at(self.stat)
        return self

    def cores(self) -> float | None:
        now = CpuUse.at(self.stat) if self.start is not None else None
        return None if now is None else round(now.others_since(self.start), 2)


def others_cpu_use(seconds: float = 0.5, stat: Path = Path("/proc/stat")) -> float | None:
    """How many cores' worth of CPU time other processes use over the next `seconds` (this process waits, and what
    it uses is taken out anyway); None where there is no /proc/stat."""
    import time

    load = BackgroundLoad(stat).begin()
    if load.start is None:
        return None
    time.sleep(seconds)
    return load.cores()


def cpu_has_fast_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    return bool(cpu_flags(cpuinfo) & _BF16_CPU_FLAGS)


def _auto_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto → bf16 on bf16-capable CUDA and on CPUs with AVX512-BF16/AMX, fp16 on older GPUs and mps, else fp32."""
    asked = (dtype or "auto").strip().lower()
    if asked == "auto":
        return _auto_dtype(device)
    if asked not in DTYPES:
        raise DeviceError(f"unknown dtype {dtype!r}", "use auto, bfloat16, float16 or float32")
    return DTYPES[asked]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


GIB = 1024**3


def available_memory_bytes(device: torch.device) -> int:
    """Free VRAM on a CUDA device, else free RAM (mps shares system memory)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def format_gib(size: int) -> str:
    return f"{size / GIB:.1f} GiB"
