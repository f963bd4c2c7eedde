"""Forward costs per model and format on this machine: how long a forward of n new tokens takes on a
warm cache. Speculation pays only while verifying k tokens costs about what one does, and which format
is fastest depends on the CPU, so `specdec calibrate` measures this and `auto` will read it.

`measure_forward_costs` is pure measurement and returns plain data; `save_calibration` /
`load_calibration` keep it as JSON under the specdec home. Nothing here prints."""

from __future__ import annotations

import gc
import json
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path

import torch

from specdec_cli.engine.context import context_length
from specdec_cli.engine.kv import CachedModel
from specdec_cli.errors import InputError
from specdec_cli.models.device import cpu_flags, dtype_name
from specdec_cli.models.loaded import LoadedModel, load_model
from specdec_cli.models.paths import atomic_file, specdec_home
from specdec_cli.models.preflight import available_memory_bytes, held_weight_bytes

TOKEN_COUNTS = (1, 2, 4, 8, 16)
CONTEXT_TOKENS = 200
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
CALIBRATION_FILE = "calibration.json"
# "wall" is what a user waits. "cpu" (this process's CPU time) is for a busy machine: with one thread it
# approximates an idle core's wall time, where wall time would mostly measure the other processes.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _token(i: int, vocab_size: int) -> int:
    """An ordinary id (past the first few, which are often special) that varies with i."""
    return 3 + (31 * i) % min(vocab_size - 3, 5000)


def forward_costs(loaded: LoadedModel, token_counts: Iterable[int] = TOKEN_COUNTS,
                  context_tokens: int = CONTEXT_TOKENS, repeats: int = 5, clock: str = "wall") -> dict[str, float]:
    """{"n": seconds} for a forward of n new tokens on a `context_tokens`-token cache."""
    return forward_costs_together({0: loaded}, token_counts, context_tokens, repeats, clock)[0]


def forward_costs_together(models: dict, token_counts: Iterable[int] = TOKEN_COUNTS,
                           context_tokens: int = CONTEXT_TOKENS, repeats: int = 5,
                           clock: str = "wall") -> dict[object, dict[str, float]]:
    """{key: {"n": seconds}} for several loaded models (`models`: key → LoadedModel), every forward size of every
    model timed in turn, so that a drifting machine slows them alike."""
    vocab_size = min(loaded.vocab_size for loaded in models.values())
    token_counts = tuple(token_counts)
    _check_room(models.values(), context_tokens + max(token_counts, default=0), context_tokens)
    context = [_token(i, vocab_size) for i in range(context_tokens)]
    runners = {key: CachedModel(loaded.model) for key, loaded in models.items()}
    seconds = _interleaved_seconds(runners, context, tuple(token_counts), repeats, vocab_size, clock)
    return {key: {str(n): value for n, value in row.items()} for key, row in seconds.items()}


def _check_room(models: Iterable[LoadedModel], positions: int, context_tokens: int) -> None:
    """A cache past the model's context would time positions it never runs at (and a 100,000-token one ran for hours
    before any figure): refused in one line."""
    for loaded in models:
        limit = context_length(loaded.model)
        if limit is not None and positions > limit:
            added = positions - context_tokens
            raise InputError(f"--context {context_tokens} and the {added} new tokens of the largest forward need "
                             f"{positions} positions; {loaded.name} takes {limit}",
                             f"give --context {max(limit - added, 1)} or less")


def _interleaved_seconds(runners: dict, context: list[int], token_counts: tuple[int, ...], repeats: int,
                         vocab_size: int, clock: str) -> dict[object, dict[int, float]]:
    """{key: {n: median seconds}}, each repeat timing every n of every runner in turn (after one warm-up
    round): a machine whose speed drifts (a shared VM: ±25% within minutes) then slows all n alike, where n
    after n would tilt the curve (one such run measured a 1-token forward of the q4 demo target at 37 ms, 2
    tokens at 30) — and all runners alike, where one after the other would favour whichever ran in the faster
    minutes."""
    now = CLOCKS[clock]
    for runner in runners.values():
        runner.extend(context, 1)
    times = {key: {n: [] for n in token_counts} for key in runners}
    for repeat in range(repeats + 1):
        for n in token_counts:
            # another first id each repeat, so none of the new tokens is already cached
            extra = [_token(len(context) + 1000 * repeat + 7 * i + 1, vocab_size) for i in range(n)]
            for key, runner in runners.items():
                started = now()
                runner.extend(context + extra, n)  # crops back to `context`, then runs the new tokens
                if repeat:
                    times[key][n].append(now() - started)
    return {key: {n: statistics.median(values) for n, values in rows.items()} for key, rows in times.items()}


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

    from specdec_cli.models.int8 import matmul_name

    return {
        **cpu(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers": transformers.__version__, "platform": platform.platform(), "int8_kernel": matmul_name(),
    }


def measure_forward_costs(
    models: dict[str, str],
    formats: dict[str, Iterable[str]],
    *,
    device: str = "cpu",
    dtype: str = "auto",
    token_counts: Iterable[int] = TOKEN_COUNTS,
    context_tokens: int = CONTEXT_TOKENS,
    repeats: int = 5,
    clock: str = "wall",
    on_result: Callable[[dict], None] | None = None,
    progress: bool = False,
) -> dict:
    """Load each role's model (`models`: role → spec) once per format (`formats`: role → names such as
    "none", "int8", "int4", "q4"), one at a time, and time its forwards; then the formats `auto` could pick
    between again, together (`_retime_contenders`). `on_result` sees each entry as it is first measured (the
    returned entries hold the final figures). `clock`: "wall" or "cpu" (see CLOCKS). Returns {"machine",
    "context_tokens", "clock", "measured_at", "entries": [...]}, each entry
    {"role", "model", "quantization", "precision", "dtype", "seconds": {"n": s}}, and "prompt_reads": a q4 or int8
    target's prompt read by itself and by its prefill path (`time_prompt_read`), where it has one; "q4_pairs": how q4's
    matmul takes its blocks here (`measure_q4_pairs`, on the first q4 model: what the timings after it ran with)."""
    token_counts = tuple(token_counts)
    entries, reads, pairs = [], [], None
    for role, spec in models.items():
        measured, weights = [], []
        for quantization in formats.get(role, ()):
            load = dict(device=device, dtype=dtype, quantization=quantization, progress=progress, role=role)
            loaded = load_model(spec, **load)
            if pairs is None and quantization == "q4":  # the first q4 model (the target's) decides for the library
                from specdec_cli.models.q4_pairs import PAIR_REPEATS, measure_q4_pairs  # it times with this module's

                pairs = measure_q4_pairs(loaded, context_tokens, max(repeats, PAIR_REPEATS), clock)
            entry = {
                "role": role, "model": spec, "quantization": loaded.quantization or "none",
                "precision": loaded.precision, "dtype": dtype_name(loaded.dtype),
                "seconds": forward_costs(loaded, token_counts, context_tokens, repeats, clock),
            }
            weights.append(held_weight_bytes(loaded.model))  # before a prompt-reading copy joins it
            if role == "target" and (read := time_prompt_read(loaded, clock=clock)) is not None:
                reads.append(read)
            del loaded
            gc.collect()  # one model in memory at a time
            measured.append((entry, load))
            if on_result:
                on_result(entry)
        _retime_contenders(spec, role, measured, weights, token_counts, context_tokens, repeats, clock)
        entries.extend(entry for entry, _load in measured)
    return {
        "machine": machine(), "context_tokens": context_tokens, "clock": clock,
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "entries": entries,
        "prompt_reads": reads, **({"q4_pairs": pairs} if pairs else {}),
    }


PROMPT_TOKENS = 256  # the prompt `time_prompt_read` times: Spec-Bench's long prompts run 192-700 tokens


def time_prompt_read(loaded: LoadedModel, tokens: int = PROMPT_TOKENS, repeats: int = 3,
                     clock: str = "wall") -> dict | None:
    """{"model", "quantization", "tokens", "model_seconds", "copy_seconds"}: median seconds of a `tokens`-token
    prompt read from an empty cache by the loaded target and by its prefill path (models/prefill.py, attached to it
    here: a q4 target's own weights on AMX where the CPU has AMX-BF16, else its bfloat16 copy; "copy_seconds" for
    either, the name calibration files have), in turn; None where the path cannot read its prompts (a float target
    among them) or the copy does not fit in memory beside it."""
    from specdec_cli.errors import InsufficientMemoryError
    from specdec_cli.models import prefill

    if prefill.why_not(loaded) is not None:
        return None
    try:
        prefill.attach(loaded, progress=False)
    except InsufficientMemoryError:
        return None
    ids = [_token(i, loaded.vocab_size) for i in range(tokens)]
    timings: dict[str, list[float]] = {"model_seconds": [], "copy_seconds": []}
    read = {"model_seconds": lambda runner: runner.extend(ids), "copy_seconds": lambda runner: runner.prefill(ids)}
    for _ in range(repeats):
        for way, timing in timings.items():
            runner = CachedModel(loaded.model, prefill_chunk=tokens)
            started = CLOCKS[clock]()
            read[way](runner)
            timing.append(CLOCKS[clock]() - started)
    return {"model": loaded.name, "quantization": loaded.quantization, "tokens": tokens,
            **{way: statistics.median(timing) for way, timing in timings.items()}}


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


CONTENDERS = 1.3  # formats whose score is within this factor of the best one's are timed again, together


def _retime_contenders(spec: str, role: str, measured: list[tuple[dict, dict]], weights: list[int],
                       token_counts: tuple[int, ...], context_tokens: int, repeats: int, clock: str) -> None:
    """Time the formats that `auto` could pick between (`auto_score` within CONTENDERS of the best) again, all
    loaded at once and every forward of every one in turn, and keep those figures (each such entry says which
    formats it was timed with: "timed_with"). Timed one after another, formats take whatever speed the machine
    had in their minutes: on this project's VM a fresh calibration once ranked the demo target's int8 ahead of
    q4 (142 against 144 ms), where interleaved forwards gave q4 by 19% and whole generations by 15% (scripts/
    format_ab.py). Skipped where the contenders' weights would not fit in half of the free memory together."""
    if len(measured) < 2 or not all("1" in entry["seconds"] for entry, _load in measured):
        return  # nothing to rank, or no 1-token forward to score by
    scores = [auto_score(role, {int(n): s for n, s in entry["seconds"].items()}) for entry, _load in measured]
    best = min(scores)
    close = [i for i, score in enumerate(scores) if score <= CONTENDERS * best]
    if len(close) < 2 or sum(weights[i] for i in close) > available_memory_bytes(torch.device("cpu")) // 2:
        return
    loaded = {i: load_model(spec, **measured[i][1]) for i in close}
    timed = forward_costs_together(loaded, token_counts, context_tokens, repeats, clock)
    del loaded
    gc.collect()
    names = [measured[i][0]["quantization"] for i in close]
    for i in close:
        measured[i][0]["seconds"] = timed[i]
        measured[i][0]["timed_with"] = names


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
