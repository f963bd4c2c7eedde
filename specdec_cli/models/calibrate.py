"""Forward costs per model and format on this machine: how long a forward of n new tokens takes on a
warm cache. Speculation pays only while verifying k tokens costs about what one does, and which format
is fastest depends on the CPU, so `specdec calibrate` measures this and `auto` will read it.

`measure_forward_costs` is pure measurement and returns plain data, which formats/calibration.py keeps as JSON
under the specdec home; `measure_q4_pairs` times q4's two ways of taking its weight blocks (native/q4_gemm.c: the
same bits, a speed that depends on the CPU). Nothing here prints."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timezone

import torch

from specdec_cli.engine.context import context_length
from specdec_cli.engine.kv import CachedModel
from specdec_cli.errors import InputError, InsufficientMemoryError
from specdec_cli.models.device import dtype_name
from specdec_cli.models.formats import q4
from specdec_cli.models.formats.calibration import auto_score, machine
from specdec_cli.models.loading import prefill
from specdec_cli.models.loading.loaded import LoadedModel, load_model
from specdec_cli.models.loading.preflight import available_memory_bytes, held_weight_bytes
from specdec_cli.models.native import binding

TOKEN_COUNTS = (1, 2, 4, 8, 16)
CONTEXT_TOKENS = 200
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
    round): a machine whose speed drifts (a shared VM's does within minutes) then slows all n alike, where n
    after n would tilt the curve (a 2-token forward could time faster than a 1-token one) — and all runners alike,
    where one after the other would favour whichever ran in the faster minutes."""
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
    prompt read from an empty cache by the loaded target and by its prefill path (loading/prefill.py, attached to it
    here: a q4 target's own weights on AMX where the CPU has AMX-BF16, else its bfloat16 copy; "copy_seconds" for
    either, the name calibration files have), in turn; None where the path cannot read its prompts (a float target
    among them) or the copy does not fit in memory beside it."""
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


CONTENDERS = 1.3  # formats whose score is within this factor of the best one's are timed again, together


def _retime_contenders(spec: str, role: str, measured: list[tuple[dict, dict]], weights: list[int],
                       token_counts: tuple[int, ...], context_tokens: int, repeats: int, clock: str) -> None:
    """Time the formats that `auto` could pick between (`auto_score` within CONTENDERS of the best) again, all
    loaded at once and every forward of every one in turn, and keep those figures (each such entry says which
    formats it was timed with: "timed_with"). Timed one after another, formats take whatever speed the machine
    had in their minutes, which can rank two close formats the wrong way round (docs/models-and-formats.md,
    "Calibration"). Skipped where the contenders' weights would not fit in half of the free memory together."""
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


PAIR_SIZES = (1, 2, 4, 8)  # forwards q4's matmul may take blocks two at a time for (a tile of tokens: native/q4_gemm.c)
PAIR_GAIN = 0.97  # pairs are taken up to a size only where they are this much faster there and at every size below
PAIR_REPEATS = 15


class _Pairs:
    """A CachedModel whose forwards run q4's matmul with blocks two at a time up to `up_to` tokens (0: never)."""

    def __init__(self, runner: CachedModel, up_to: int):
        self.runner, self.up_to = runner, up_to

    def extend(self, ids: list[int], keep: int) -> None:
        binding.pair_q4_blocks(self.up_to)
        self.runner.extend(ids, keep)


def measure_q4_pairs(loaded: LoadedModel, context_tokens: int = CONTEXT_TOKENS, repeats: int = PAIR_REPEATS,
                     clock: str = "wall") -> dict | None:
    """Whether q4's matmul should take its weight blocks two at a time on this machine (native/q4_gemm.c: the same
    bits, two streams of weights in flight; faster on some CPUs, slower on others): `loaded`'s forwards of
    PAIR_SIZES new tokens with pairs and without, in turn. Returns {"isa", "model", "up_to_tokens", "seconds":
    {"pairs": {"n": s}, "single": {"n": s}}} and leaves the library taking pairs up to "up_to_tokens" (the largest
    size where pairs are PAIR_GAIN as fast there and at every size below; 0: never); None where `loaded` has no q4
    layer or the kernel does not run."""
    _, isa, problem = binding.library()
    if problem is not None or not any(isinstance(module, q4.Q4Linear) for module in loaded.model.modules()):
        return None
    vocab_size = loaded.vocab_size
    context = [_token(i, vocab_size) for i in range(context_tokens)]
    ways = {"pairs": PAIR_SIZES[-1], "single": 0}
    runners = {way: _Pairs(CachedModel(loaded.model), up_to) for way, up_to in ways.items()}
    before = binding.q4_pairs()
    try:
        timed = _interleaved_seconds(runners, context, PAIR_SIZES, repeats, vocab_size, clock)
    finally:
        binding.pair_q4_blocks(before)
    up_to = pairs_up_to(timed["pairs"], timed["single"])
    binding.pair_q4_blocks(up_to)
    return {"isa": isa, "model": loaded.name, "up_to_tokens": up_to,
            "seconds": {way: {str(n): value for n, value in row.items()} for way, row in timed.items()}}


def pairs_up_to(pairs: dict[int, float], single: dict[int, float]) -> int:
    """The largest forward size (of `single`'s, in order) up to which pairs take at most PAIR_GAIN of the time without
    them at every size; 0 where they do not at the first. A noisy tie is not a win."""
    up_to = 0
    for n, alone in single.items():
        if pairs[n] > PAIR_GAIN * alone:
            break
        up_to = n
    return up_to


