"""The C kernels of a git revision against the working tree's, on the demo pair, interleaved in one process.

    python scripts/kernel_ab.py --base HEAD --format q4 [--avx2] --json benchmarks/....json

--generate N instead times whole generations, what a user sees: the first question of each Spec-Bench category (N
of them) through the demo profile as `compare` runs it (its chat template and system prompt), 128 new tokens,
greedy, the target alone and the profile's drafter, each library in turn (the order alternating per prompt), a
fresh decoder each time (prefill included, as in `compare`); the tokens must be the same every way.

--batched B instead times `run --batch-size B` (the batched engine, the target alone, greedy, 128 new tokens) over
--prompts Spec-Bench questions (round-robin over the categories, as `compare` encodes them), each library in turn
(the order alternating per repeat); the tokens must be the same every way. --batched-drafter cascade makes it
speculative (the profile's draft, k = auto).

--amx times the working tree's library on AMX (isa 3: the q4 matmul of several tokens, q4_amx.c) against its own
VNNI code (isa 2), instead of a base revision's.

--pairs times the working tree's library taking q4's weight blocks two at a time (forwards of up to 8 tokens)
against one at a time (q4_gemm.c: the same bits; `specdec calibrate` picks one per machine), instead of a base
revision's.

--avx2 runs the code an AVX2-only CPU runs (the AVX2 kernels, and 7-bit activations for int8, as such a CPU gets
them) on a CPU that has AVX512-VNNI too.

Both libraries are built from their sources (int8_gemm.c, q4_gemm.c, layer_kernels.c) with the flags specdec uses,
and each model's forwards of 1 / 2 / 4 / 8 new tokens (--sizes) over a 200-token cache alternate between them: the same
weights, the same caches, only the compiled code differs. Timed apart: the decoder (the stack of layers, one call
into C) and the output head over the new tokens' rows (the full vocabulary; the demo's drafter scores a 64k-row
subset of the draft's). Where the change does not touch the arithmetic the logits must agree bit for bit; the
script checks that on every forward and stops if they do not."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from specdec_cli.engine.cache_layers import new_cache
from specdec_cli.models import int8, int8_kernel, load_model
from specdec_cli.models.calibrate import machine

MODELS = {"draft": "demo:qwen2.5-coder-0.5b", "target": "demo:qwen2.5-coder-1.5b"}
SIZES = (1, 2, 4, 8)
ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="HEAD", help="the git revision whose kernels are the baseline")
    parser.add_argument("--format", default="q4")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--avx2", action="store_true", help="the code an AVX2-only CPU runs")
    parser.add_argument("--amx", action="store_true",
                        help="the working tree's library with AMX (isa 3) against its VNNI code, instead of --base")
    parser.add_argument("--pairs", action="store_true",
                        help="the working tree's library taking q4's blocks two at a time (up to 8 tokens) against one "
                             "at a time, instead of --base")
    parser.add_argument("--sizes", default="1,2,4,8", help="new tokens per timed forward, comma-separated")
    parser.add_argument("--generate", type=int, default=0, help="time generations of N prompts instead")
    parser.add_argument("--batched", type=int, default=0, help="time the batched engine at batch size B instead")
    parser.add_argument("--prompts", type=int, default=16, help="with --batched: how many requests")
    parser.add_argument("--batched-drafter", default="none",
                        help="with --batched: the drafter (none: the target alone; cascade: speculative, k = auto)")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    if args.avx2:
        os.environ["SPECDEC_INT8_KERNEL"] = "avx2"
        int8.activation_bits = lambda: 7
    tree = int8_kernel._library()
    if args.amx and tree[1] != 3:
        raise SystemExit("--amx: this CPU (or this process) cannot use AMX")
    libraries = ({"VNNI": (tree[0], 2, None), "AMX": tree} if args.amx
                 else {"single blocks": (*tree, 0), "paired blocks": (*tree, 8)} if args.pairs
                 else {args.base: _base_library(args.base, tree[1]), "working tree": tree})
    result = {"machine": machine(), "python": platform.python_version(), "format": args.format, "avx2_code": args.avx2,
              "base": "VNNI (isa 2)" if args.amx else "single blocks" if args.pairs else args.base,
              "base_commit": _git("rev-parse", args.base).strip(), "context_tokens": args.context,
              "repeats": args.repeats, "milliseconds": {}}
    if args.generate or args.batched:
        result["generations"] = (_batched(libraries, args.batched, args.prompts, args.repeats, args.batched_drafter)
                                 if args.batched
                                 else _generations(libraries, args.generate))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return
    for role, name in MODELS.items():
        model = load_model(name, dtype="bfloat16", quantization=args.format, progress=False, role=role).model
        sizes = tuple(int(n) for n in args.sizes.split(","))
        result["milliseconds"][role] = rows = _interleaved(model, libraries, args.context, args.repeats, sizes)
        for which, parts in rows.items():
            for part, row in parts.items():
                timings = " ".join(f"{n}: {ms:.1f} ms" for n, ms in row.items())
                print(f"{role:6} {which:12} {part:7}", timings, flush=True)
        del model
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def _git(*words: str) -> str:
    return subprocess.run(["git", *words], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def _base_library(revision: str, isa: int) -> tuple[ctypes.CDLL, int, None]:
    folder = Path(tempfile.mkdtemp(prefix="specdec-kernels-"))
    sources = []
    for path in (*int8_kernel.SOURCES, *int8_kernel.HEADERS):
        source = folder / path.name
        try:
            source.write_text(_git("show", f"{revision}:{path.relative_to(ROOT)}"))
        except subprocess.CalledProcessError:  # newer than the revision (sampling_kernels.c, q4_amx.c): this tree's
            source.write_text(path.read_text())
        if path in int8_kernel.SOURCES:
            sources.append(source)
    if "int specdec_q4_linear(int isa, int layout," not in (folder / "q4_gemm.c").read_text():
        raise SystemExit(f"{revision}'s q4 kernel predates its layout argument (2026-12-05): its calls would take "
                         "other arguments than this tree passes; compare revisions from e024405 on")
    if not any("specdec_amx_bf16_ready(void) {" in source.read_text() for source in sources):
        # A revision before the AMX prompt read (b13da7a): this tree's _declare asks for its readiness; say not ready.
        sources.append(folder / "amx_bf16_absent.c")
        sources[-1].write_text("int specdec_amx_bf16_ready(void) { return 0; }\n")
    built = folder / "libbase.so"
    int8_kernel.compile_library(sources, built, int8_kernel.c_compiler())
    library = ctypes.CDLL(str(built))
    int8_kernel._declare(library)
    return library, min(isa, library.specdec_isa()), None  # a revision before AMX (isa 3) runs its VNNI code


QUESTIONS = ROOT.parent / "shared/prompts/spec_bench_questions.jsonl"


def spec_bench_prompts(tokenizer, system: str | None, count: int, per_category: int = 1) -> list[list[int]]:
    """The first Spec-Bench question of each of the first `count` categories, as `compare` encodes them: the chat
    template, with the profile's system prompt where it has one. per_category > 1: the first questions of every
    category round-robin (each category's first, then each one's second, ...), `count` of them."""
    from specdec_cli.session import encode_chat

    by_category: dict[str, list[str]] = {}
    for line in QUESTIONS.read_text().splitlines():
        question = json.loads(line)
        by_category.setdefault(question["category"], []).append(question["turns"][0])
    texts = [questions[i] for i in range(per_category) for questions in by_category.values() if i < len(questions)]
    system_turn = [{"role": "system", "content": system}] if system else []
    return [encode_chat(tokenizer, [*system_turn, {"role": "user", "content": text}]) for text in texts[:count]]


@contextlib.contextmanager
def _kernels(library: tuple):
    """Every kernel call inside runs `library` (a `int8_kernel._library()` tuple; a fourth item, where there is one:
    up to how many tokens q4 takes its blocks in pairs); the process's own after."""
    original, pairs = int8_kernel._library, library[3] if len(library) > 3 else None
    int8_kernel._library = lambda: library[:3]
    before = int8_kernel.q4_pairs() if pairs is not None else None
    if pairs is not None:
        int8_kernel.pair_q4_blocks(pairs)
    try:
        yield
    finally:
        int8_kernel._library = original
        if before is not None:
            int8_kernel.pair_q4_blocks(before)


@torch.inference_mode()
def _generations(libraries: dict, count: int) -> dict:
    from specdec_cli.session import build_decoder
    from specdec_cli.settings import ModelOverrides, choose_models, load_choice

    choice = choose_models(ModelOverrides(profile="demo"))
    target, draft = load_choice(choice)
    prompts = spec_bench_prompts(target.tokenizer, choice.profile.system, count)
    drafters = ("none", choice.drafter)
    seconds = {which: {drafter: 0.0 for drafter in drafters} for which in libraries}
    tokens = {which: {drafter: 0 for drafter in drafters} for which in libraries}
    for index, prompt in enumerate(prompts):
        outputs = []
        for which in list(libraries)[:: 1 if index % 2 == 0 else -1]:
            for drafter in drafters:
                decoder = build_decoder(target, draft, drafter, "auto")
                with _kernels(libraries[which]):
                    made, spent = timed_generation(decoder, prompt)
                seconds[which][drafter] += spent
                tokens[which][drafter] += len(made)
                outputs.append(made)
        if any(made != outputs[0] for made in outputs[1:]):
            raise SystemExit(f"prompt {index}: the outputs differ between libraries or drafters")
        print(f"prompt {index + 1}/{len(prompts)}: {len(outputs[0])} tokens", flush=True)
    return generation_rates(seconds, tokens, choice.drafter, len(prompts))


@torch.inference_mode()
def _batched(libraries: dict, batch_size: int, count: int, repeats: int, drafter: str = "none") -> dict:
    from specdec_cli.engine import SamplingParams
    from specdec_cli.engine.batched import RowRequest
    from specdec_cli.session import build_batched_decoder
    from specdec_cli.settings import ModelOverrides, choose_models, load_choice

    choice = choose_models(ModelOverrides(profile="demo"))
    target, draft = load_choice(choice)  # the profile's pair: the draft runs with --batched-drafter
    prompts = spec_bench_prompts(target.tokenizer, choice.profile.system, count, per_category=count)
    requests = [RowRequest(prompt, SamplingParams(), 128) for prompt in prompts]
    seconds = {which: {drafter: 0.0} for which in libraries}
    tokens = {which: {drafter: 0} for which in libraries}
    outputs = {}
    for repeat in range(repeats):
        for which in list(libraries)[:: 1 if repeat % 2 == 0 else -1]:
            decoder = (build_batched_decoder(target, None, "none", 0, batch_size) if drafter == "none"
                       else build_batched_decoder(target, draft, drafter, "auto", batch_size))
            with _kernels(libraries[which]):
                start = time.perf_counter()
                results = decoder.generate_many(requests)
                seconds[which][drafter] += time.perf_counter() - start
            made = [result.tokens for result in results]
            tokens[which][drafter] += sum(map(len, made))
            if outputs.setdefault(repeat, made) != made:
                raise SystemExit(f"repeat {repeat}: the outputs differ between libraries")
        print(f"repeat {repeat + 1}/{repeats}:", " ".join(
            f"{which} {tokens[which][drafter] / seconds[which][drafter]:.1f} tok/s" for which in libraries), flush=True)
    return {"batch_size": batch_size, "drafter": drafter, "prompts": len(prompts), "max_new_tokens": 128,
            "seconds": seconds, "tokens": tokens,
            "tokens_per_second": {which: tokens[which][drafter] / seconds[which][drafter] for which in libraries}}


def timed_generation(decoder, prompt: list[int]) -> tuple[list[int], float]:
    """The decoder's greedy tokens for `prompt` (128 at most) and the seconds they took."""
    from specdec_cli.engine import SamplingParams

    start = time.perf_counter()
    made = [token for event in decoder.stream(prompt, SamplingParams(), 128) for token in event.tokens]
    return made, time.perf_counter() - start


def generation_rates(seconds: dict, tokens: dict, drafter: str, prompts: int) -> dict:
    """Tokens/s of each way (`seconds[way][drafter]`, the target alone as "none"), printed a line a way, and the
    record of them."""
    rates = {which: {name: tokens[which][name] / seconds[which][name] for name in row} for which, row in seconds.items()}
    for which, row in rates.items():
        print(f"{which:12}", " ".join(f"{name}: {rate:.1f} tok/s" for name, rate in row.items()),
              f"(x{row[drafter] / row['none']:.2f})")
    return {"prompts": prompts, "max_new_tokens": 128, "drafter": drafter, "seconds": seconds, "tokens": tokens,
            "tokens_per_second": rates}


@torch.inference_mode()
def _interleaved(model, libraries: dict, context: int, repeats: int, sizes: tuple[int, ...] = SIZES) -> dict:
    caches = {which: new_cache(model.config) for which in libraries}
    times = {which: {part: {n: [] for n in sizes} for part in ("decoder", "head")} for which in libraries}
    generator = torch.Generator().manual_seed(0)
    for which, cache in caches.items():
        with _kernels(libraries[which]):
            model(input_ids=torch.arange(100, 100 + context)[None], cache=cache, use_cache=True, logits_to_keep=1)
    for _ in range(repeats):
        for n in sizes:
            ids = torch.randint(100, 1000, (1, n), generator=generator)
            logits = []
            for which, cache in caches.items():
                with _kernels(libraries[which]):
                    start = time.perf_counter()
                    hidden = model.model(input_ids=ids, cache=cache, use_cache=True).last_hidden_state
                    middle = time.perf_counter()
                    logits.append(model.lm_head(hidden))
                    end = time.perf_counter()
                times[which]["decoder"][n].append(middle - start)
                times[which]["head"][n].append(end - middle)
                cache.crop(context - cache.get_seq_length())  # 5.24: a negative count of positions to drop
            if not all(torch.equal(logits[0], other) for other in logits[1:]):
                raise SystemExit(f"the libraries' logits differ for {n} tokens")
    return {which: {part: {n: 1000 * statistics.median(values) for n, values in rows.items()}
                    for part, rows in parts.items()} for which, parts in times.items()}


if __name__ == "__main__":
    main()
