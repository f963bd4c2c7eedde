"""q4's weight blocks one or two at a time (q4_gemm.c): the same bits, a speed that depends on the CPU (two at a
time faster on an Intel Xeon, slower on an AMD EPYC), so `specdec calibrate` times both on the first q4 model it
loads (`measure_q4_pairs`), stores the choice with its calibration, and the kernel library takes it when it loads
(`calibrated_q4_pairs`). Nothing here prints."""

from __future__ import annotations

import torch

from specdec_cli.engine.kv import CachedModel
from specdec_cli.models.calibrate import CONTEXT_TOKENS, _interleaved_seconds, _token, cpu, load_calibration
from specdec_cli.models.loaded import LoadedModel

PAIR_SIZES = (1, 2, 4, 8)  # forwards q4's matmul may take blocks two at a time for (a tile of tokens: q4_gemm.c)
PAIR_GAIN = 0.97  # pairs are taken up to a size only where they are this much faster there and at every size below
PAIR_REPEATS = 15


class _Pairs:
    """A CachedModel whose forwards run q4's matmul with blocks two at a time up to `up_to` tokens (0: never)."""

    def __init__(self, runner: CachedModel, up_to: int):
        self.runner, self.up_to = runner, up_to

    def extend(self, ids: list[int], keep: int) -> None:
        from specdec_cli.models.int8_kernel import pair_q4_blocks

        pair_q4_blocks(self.up_to)
        self.runner.extend(ids, keep)


def measure_q4_pairs(loaded: LoadedModel, context_tokens: int = CONTEXT_TOKENS, repeats: int = PAIR_REPEATS,
                     clock: str = "wall") -> dict | None:
    """Whether q4's matmul should take its weight blocks two at a time on this machine (q4_gemm.c: the same bits,
    two streams of weights in flight; faster on an Intel Xeon, slower on an AMD EPYC): `loaded`'s forwards of
    PAIR_SIZES new tokens with pairs and without, in turn. Returns {"isa", "model", "up_to_tokens", "seconds":
    {"pairs": {"n": s}, "single": {"n": s}}} and leaves the library taking pairs up to "up_to_tokens" (the largest
    size where pairs are PAIR_GAIN as fast there and at every size below; 0: never); None where `loaded` has no q4
    layer or the kernel does not run."""
    from specdec_cli.models import int8_kernel, q4

    _, isa, problem = int8_kernel._library()
    if problem is not None or not any(isinstance(module, q4.Q4Linear) for module in loaded.model.modules()):
        return None
    vocab_size = loaded.vocab_size
    context = [_token(i, vocab_size) for i in range(context_tokens)]
    ways = {"pairs": PAIR_SIZES[-1], "single": 0}
    runners = {way: _Pairs(CachedModel(loaded.model), up_to) for way, up_to in ways.items()}
    before = int8_kernel.q4_pairs()
    try:
        timed = _interleaved_seconds(runners, context, PAIR_SIZES, repeats, vocab_size, clock)
    finally:
        int8_kernel.pair_q4_blocks(before)
    up_to = pairs_up_to(timed["pairs"], timed["single"])
    int8_kernel.pair_q4_blocks(up_to)
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
