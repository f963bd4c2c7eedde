"""Two limits of a 2-core CPU that bound what speculation can add there, measured.

    python scripts/core_limits.py [--seconds 8] [--runs 3] --json benchmarks/....json

- **The int8 dot-product peak.** A loop of independent 512-bit `vpdpbusd` (AVX512-VNNI), compiled with the system C
  compiler, timed by its thread's CPU time so that another process's load does not count: instructions a CPU-second
  on one core. Against it, what one token of the demo target's verify needs: its decoder's linear layers' weights
  / 64 (one `vpdpbusd` multiplies 64 byte pairs), on both cores: the multiply-adds alone, the least any int8 or q4
  kernel spends a token on this CPU once the arithmetic no longer hides under the weights' read (the target's
  forwards of 1, 4 and 8 tokens below show where that is). Beside it, q4's matmul alone on layers of the target's
  MLP shape (8960 × 1536, synthetic weights) for 1 / 2 / 4 / 8 tokens: two layers that stay in L3 (17 MB), called in
  turn, against forty streamed from memory (344 MB), nanoseconds a weight. Where the two agree, the matmul is bound
  by its own arithmetic, not by the weights' read.
- **The draft beside the target, one core each** (drafting the next tokens while the target verifies, as PEARL
  does on GPUs). The q4 demo target's and draft's decoders alone (no output layer) over a 200-token cache, in
  processes of their own: each alone on 2 threads and on 1, then both at once on 1 thread each (--runs times),
  forwards back to back for --seconds; medians. What the two lose to each other is what a pipeline would give up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = {"target": "demo:qwen2.5-coder-1.5b", "draft": "demo:qwen2.5-coder-0.5b"}
CONTEXT = 200

PEAK_LOOP = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double cpu_seconds(void) { struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
#define STEP(c) c = _mm512_dpbusd_epi32(c, a, b)
int main(void) {  /* 12 chains in registers, so each instruction's latency is hidden behind the others */
    __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5), c0 = _mm512_setzero_si512(), c1 = c0, c2 = c0,
            c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0, c9 = c0, c10 = c0, c11 = c0;
    long rounds = 300000000;
    double start = cpu_seconds();
    for (long i = 0; i < rounds; i++) {
        STEP(c0); STEP(c1); STEP(c2); STEP(c3); STEP(c4); STEP(c5); STEP(c6); STEP(c7); STEP(c8); STEP(c9);
        STEP(c10); STEP(c11);
        __asm__ volatile("" : "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3), "+v"(c4), "+v"(c5), "+v"(c6), "+v"(c7),
                              "+v"(c8), "+v"(c9), "+v"(c10), "+v"(c11));
    }
    double seconds = cpu_seconds() - start;
    __m512i sum = _mm512_add_epi32(_mm512_add_epi32(c0, c6), c11);
    printf("%.6e %d\n", 12.0 * rounds / seconds, _mm512_reduce_add_epi32(sum));
    return 0;
}
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--runs", type=int, default=3, help="times both models run at once")
    parser.add_argument("--json", default="")
    parser.add_argument("--forwards", nargs=4, metavar=("ROLE", "THREADS", "TOKENS", "START"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.forwards:  # one timed process (below)
        role, threads, tokens, start = args.forwards
        print(json.dumps(_forwards(role, int(threads), int(tokens), args.seconds, float(start))))
        return
    from specdec_cli.models.calibrate import machine

    result = {"machine": machine(), "context_tokens": CONTEXT, "seconds_per_measure": args.seconds,
              "vnni_peak": _vnni_peak(), "q4_matmul_ns_per_weight": _resident_vs_streamed(), "alone": [],
              "side_by_side": []}
    print(json.dumps(result["vnni_peak"]), flush=True)
    print(json.dumps(result["q4_matmul_ns_per_weight"]), flush=True)
    for role, threads, tokens in (("target", 2, 1), ("target", 1, 1), ("target", 2, 4), ("target", 1, 4),
                                  ("target", 2, 8), ("draft", 2, 1), ("draft", 1, 1)):
        row = _together([(role, threads, tokens)], args.seconds)[0]
        result["alone"].append(row)
        print(json.dumps(row), flush=True)
    for run in range(args.runs):
        for tokens in (1, 4):
            rows = _together([("target", 1, tokens), ("draft", 1, 1)], args.seconds)
            result["side_by_side"].append({"run": run, "rows": rows})
            print(json.dumps(rows), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def _vnni_peak() -> dict:
    """`vpdpbusd` a CPU-second on one core, and the demo target's verify token at that rate on 2 cores."""
    from transformers import AutoConfig

    from specdec_cli.models.resolve import local_config_folder

    with tempfile.TemporaryDirectory() as folder:
        source, binary = Path(folder) / "peak.c", Path(folder) / "peak"
        source.write_text(PEAK_LOOP)
        subprocess.run(["cc", "-O2", "-mavx512f", "-mavx512bw", "-mavx512vnni", str(source), "-o", str(binary)],
                       check=True)
        rates = [float(subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout.split()[0])
                 for _ in range(2)]
    folder = local_config_folder(MODELS["target"])
    if folder is None:
        raise SystemExit("the demo target is not on this machine yet: run `specdec run` once first")
    config = AutoConfig.from_pretrained(folder)
    hidden, inner = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (getattr(config, "head_dim", None) or hidden // config.num_attention_heads)
    weights = config.num_hidden_layers * (2 * hidden * hidden + 2 * kv * hidden + 3 * inner * hidden)
    rate = max(rates)
    return {"vpdpbusd_per_cpu_second": rates, "target_linear_weights": weights,
            "target_verify_ms_per_token_at_peak_2_cores": 1000 * weights / 64 / (2 * rate)}


def _resident_vs_streamed() -> dict:
    """q4's matmul, ns a weight, for 1 / 2 / 4 / 8 tokens: weights in L3 against weights streamed from memory."""
    import torch

    from specdec_cli.models.q4 import Q4Linear

    torch.manual_seed(0)

    def layers(count: int) -> list:
        return [Q4Linear.from_linear(torch.nn.Linear(1536, 8960, bias=False)) for _ in range(count)]

    def ns_per_weight(chosen: list, tokens: int, calls: int) -> float:
        x = torch.randn(1, tokens, 1536)
        for layer in chosen:  # one call each first: the kernels built, the caches as they will be
            layer(x)
        rounds = []
        for _ in range(5):
            began = time.perf_counter()
            for call in range(calls):
                chosen[call % len(chosen)](x)
            rounds.append((time.perf_counter() - began) / calls)
        return 1e9 * statistics.median(rounds) / (1536 * 8960)

    resident, streamed = layers(2), layers(40)
    with torch.inference_mode():
        return {tokens: {"in_l3": ns_per_weight(resident, tokens, 400), "streamed": ns_per_weight(streamed, tokens, 80)}
                for tokens in (1, 2, 4, 8)}


def _together(jobs: list[tuple[str, int, int]], seconds: float) -> list[dict]:
    """Each (role, threads, new tokens) in a process of its own, their timed loops starting at the same moment."""
    start = time.time() + 25  # after every process has loaded its model
    processes = [subprocess.Popen([sys.executable, __file__, "--seconds", str(seconds), "--forwards", role,
                                   str(threads), str(tokens), str(start)], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True)
                 for role, threads, tokens in jobs]
    rows = []
    for process in processes:
        output, _ = process.communicate()
        if process.returncode:
            raise SystemExit(f"a timed process failed (exit {process.returncode})")
        rows.append(json.loads(output.strip().splitlines()[-1]))
    return rows


def _forwards(role: str, threads: int, tokens: int, seconds: float, start: float) -> dict:
    import torch

    from specdec_cli.engine.cache_layers import new_cache
    from specdec_cli.models import load_model

    torch.set_num_threads(threads)
    model = load_model(MODELS[role], dtype="bfloat16", quantization="q4", progress=False, role=role).model
    cache = new_cache(model.config)
    ids = torch.randint(100, 1000, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(input_ids=torch.arange(100, 100 + CONTEXT)[None], cache=cache, use_cache=True, logits_to_keep=1)
        for _ in range(5):
            model.model(input_ids=ids, cache=cache, use_cache=True)
            cache.crop(CONTEXT - cache.get_seq_length())
        if time.time() > start:
            raise SystemExit("loading took longer than the time set for the start")
        time.sleep(start - time.time())
        timings, end = [], time.time() + seconds
        while time.time() < end:
            began = time.perf_counter()
            model.model(input_ids=ids, cache=cache, use_cache=True)
            timings.append(time.perf_counter() - began)
            cache.crop(CONTEXT - cache.get_seq_length())  # 5.24: a negative count of positions to drop
    return {"role": role, "threads": threads, "new_tokens": tokens, "median_ms": 1000 * statistics.median(timings),
            "forwards": len(timings)}


if __name__ == "__main__":
    main()
