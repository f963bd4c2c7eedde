"""The stored calibration: what `specdec calibrate` measured on this machine (forward costs per model and format,
prompt reads, q4's block pairing), kept as JSON under the specdec home, and the lookups `auto`, `--prefill` and the
q4 kernel make in it. Reading and writing only: the timing is models/calibrate.py. Nothing here prints."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch

from specdec_cli.models.device import cpu_flags
from specdec_cli.models.formats.int8 import matmul_name
from specdec_cli.models.paths import atomic_file, specdec_home

CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


CALIBRATION_FILE = "calibration.json"


def auto_score(role: str, seconds: dict[int, float]) -> float:
    """What `auto` ranks a format by (lower is faster): a target by its 1-, 4- and 8-token forwards, where
    verification lives; a draft by its 1-, 2- and 4-token forwards (a step's first draft forward also takes
    in the tokens the last step accepted). Sizes not measured count as the 1-token forward."""
    sizes = (1, 4, 8) if role == "target" else (1, 2, 4)
    return sum(seconds.get(n, seconds[1]) for n in sizes)


def cpu() -> dict:
    """The CPU's model and those of its flags that pick kernels (CPU_FLAGS)."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
                break
    except OSError:  # no /proc/cpuinfo (macOS)
        pass
    flags = cpu_flags()
    return {"cpu": name, "cpu_flags": sorted(flag for flag in CPU_FLAGS if flag in flags)}


def machine() -> dict:
    """What decides the costs: CPU model and the flags that pick kernels, threads, library versions."""
    import transformers

    return {
        **cpu(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers": transformers.__version__, "platform": platform.platform(), "int8_kernel": matmul_name(),
    }


def calibrated_prompt_read(model: str, quantization: str | None, calibration: dict | None = None) -> dict | None:
    """`time_prompt_read`'s result for `model` in `quantization` as `specdec calibrate` stored it on this machine;
    None where it was not measured here."""
    calibration = calibration if calibration is not None else load_calibration()
    if not calibration or not same_machine(calibration.get("machine", {})):
        return None
    for read in calibration.get("prompt_reads", ()):
        if isinstance(read, dict) and read.get("model") == model and read.get("quantization") == quantization:
            if all(isinstance(read.get(way), (int, float)) for way in ("model_seconds", "copy_seconds")):
                return read
    return None


def calibration_path() -> Path:
    return specdec_home() / CALIBRATION_FILE


def save_calibration(result: dict, path: Path | None = None) -> Path:
    """Write `result` as JSON (atomically: a reader never sees half a file, and a full disk leaves the one before
    and no partial file, with a CacheWriteError saying so); returns the path."""
    path = path or calibration_path()
    with atomic_file(path) as staging:
        staging.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return path


def merged_with(earlier: dict | None, result: dict) -> tuple[dict, list[dict]]:
    """(what to store, the earlier entries it keeps): `result` plus the entries and prompt reads of `earlier` that it
    did not measure again (same role, model, format and dtype; same model and format; its q4_pairs), where `earlier`
    was taken on a machine like this one with the same cache length and clock. A calibration of a few formats then
    adds to one of all (it replaced it: `auto` and the cost curves lost the formats not timed again); another
    machine's is replaced whole."""
    if (not earlier or not same_machine(earlier["machine"], result["machine"])
            or (earlier.get("context_tokens"), earlier.get("clock")) != (result["context_tokens"], result["clock"])):
        return result, []

    def entry_key(entry: dict) -> tuple:
        return tuple(entry.get(key) for key in ("role", "model", "quantization", "dtype"))

    def read_key(read: dict) -> tuple:
        return read.get("model"), read.get("quantization")

    measured = {entry_key(entry) for entry in result["entries"]}
    when = earlier.get("measured_at")
    kept = [{**entry, "measured_at": entry.get("measured_at", when)} for entry in earlier.get("entries", ())
            if entry_key(entry) not in measured]
    read_now = {read_key(read) for read in result["prompt_reads"]}
    reads = [read for read in earlier.get("prompt_reads", ()) if read_key(read) not in read_now]
    pairs = {"q4_pairs": earlier["q4_pairs"]} if "q4_pairs" in earlier and "q4_pairs" not in result else {}
    merged = {**result, **pairs, "entries": kept + result["entries"], "prompt_reads": reads + result["prompt_reads"]}
    return merged, kept


def load_calibration(path: Path | None = None) -> dict | None:
    """The stored measurement, or None when there is none (or it is unreadable: measure again). A file of another shape
    (hand-edited, another tool's) counts as none; its entries that are not objects are left out."""
    path = path or calibration_path()
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(found, dict) or not isinstance(found.get("machine"), dict):
        return None
    for key in ("entries", "prompt_reads"):
        if key in found:
            listed = found[key]
            found[key] = [item for item in listed if isinstance(item, dict)] if isinstance(listed, list) else []
    return found


def same_machine(measured: dict, here: dict | None = None) -> bool:
    """Whether a stored measurement was taken on a machine like this one: same CPU, kernel flags, threads and
    int8 matmul (a measurement from before specdec had its own holds none: its int8 costs are not today's)."""
    here = here or machine()
    return all(measured.get(key) == here.get(key) for key in ("cpu", "cpu_flags", "threads", "int8_kernel"))


def calibrated_seconds(model: str, quantization: str | None, dtype: str | None = None,
                       calibration: dict | None = None) -> dict[int, float] | None:
    """{n: seconds} of a forward of n new tokens for `model` in `quantization` ("none" or None: float at
    `dtype`; a quantised format: whatever dtype it computes in), as stored by `specdec calibrate` on this
    machine; None when it was not measured here."""
    calibration = calibration if calibration is not None else load_calibration()
    if not calibration or not same_machine(calibration.get("machine", {})):
        return None
    quantization = quantization or "none"
    for entry in calibration.get("entries", ()):
        if entry.get("model") != model or entry.get("quantization") != quantization:
            continue
        if quantization == "none" and dtype is not None and entry.get("dtype") != dtype:
            continue
        try:
            return {int(n): float(seconds) for n, seconds in entry["seconds"].items()}
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
    return None


def calibrated_q4_pairs(isa: int, calibration: dict | None = None) -> int:
    """Up to how many tokens q4's matmul takes blocks two at a time here, as `specdec calibrate` measured it for the
    code `isa` runs (`measure_q4_pairs`) on a machine like this one; 0 (never) where it was not measured. It asks
    cpu() and the threads, not machine(): this runs while the kernel library loads, which machine() asks about."""
    calibration = calibration if calibration is not None else load_calibration()
    measured, here = (calibration or {}).get("machine", {}), {**cpu(), "threads": torch.get_num_threads()}
    pairs = (calibration or {}).get("q4_pairs")
    if any(measured.get(key) != value for key, value in here.items()) or not isinstance(pairs, dict):
        return 0
    up_to = pairs.get("up_to_tokens")
    return up_to if pairs.get("isa") == isa and isinstance(up_to, int) and up_to > 0 else 0
