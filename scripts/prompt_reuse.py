"""What keeping a row-wise target's cache entries from one prompt to the next saves `run` (engine/packed.py,
`SpeculativeDecoder.reset`): the same records with the reuse on and off, as `run` decodes them — one at a time
(`--batch-size 1`) and batched (the batch size `run` picks from this machine's calibration) — on the demo pair
with the cascade, k = auto, greedy. Two shapes of job: the chat template's own system prompt (what a job of
bare questions shares: 24 tokens) and a job whose every record carries the same instruction block (335 tokens
shared). Passes go on, off, off, on for each (the VM's speed drifts); every row says its tokens per second, the
ratio of the passes' mean seconds, and whether every record's tokens were the same both ways.

    python scripts/prompt_reuse.py [--per-category 2] [--max-new-tokens 64] [--json PATH]

Run on an idle machine (no other process on the cores)."""

from __future__ import annotations

import argparse
import json
import time

import torch

from batch_crossover import SPEC_BENCH, held_prompts  # the same held chat prompts (this folder is on sys.path)

from specdec_cli.engine import SamplingParams
from specdec_cli.engine.batched import RowRequest
from specdec_cli.bench.probes import prompt_reader
from specdec_cli.models import load_model, prefill
from specdec_cli.models.calibrate import machine
from specdec_cli.session import batch_size_for, build_batched_decoder, build_decoder, encode_chat, forward_curve

INSTRUCTIONS = """You are the writing assistant of an engineering team. Every answer you give is read by busy
engineers, so follow these rules without exception.

1. Start with the answer itself: no greeting, no restating of the question, no "Sure" or "Certainly".
2. Prefer short paragraphs and plain words. Use a list only when the content is a list of parallel items.
3. When you give code, give complete, runnable code in one fenced block, with the language named, and say
   in one sentence before it what it does. Do not explain line by line unless asked.
4. When a question is ambiguous, pick the most likely reading, say in one sentence which reading you took,
   and answer it. Do not ask a question back.
5. Numbers keep their units. Dates are written as 2026-12-03. Money keeps its currency.
6. If you do not know something, say so in one sentence and say how the reader could find out.
7. Never invent references, file names, functions or command-line options. If you are not sure a function
   exists, say so.
8. Keep answers under 300 words unless the question asks for more, and end without a summary of what you
   just said.
9. For writing tasks (emails, posts, stories), match the tone the question asks for, and keep names and
   facts from the question exactly as given.
10. For math, show the steps that matter, one per line, and give the final result on its own line."""
SYSTEMS = {"template": None, "instructions": INSTRUCTIONS}


def one_pass(target, draft, mode: str, size: int, reuse: bool, prompts, max_new_tokens: int, curves) -> dict:
    """The records as `run` decodes them (a decoder built for the job, reset before each one-at-a-time record)."""
    started = time.perf_counter()
    if mode == "one at a time":
        decoder = build_decoder(target, draft, "cascade", "auto", clock_free=True)
        decoder.reuse_prompts = reuse
        tokens = []
        for prompt in prompts:
            decoder.reset()
            tokens.append(decoder.generate(prompt, SamplingParams(), max_new_tokens).tokens)
    else:
        decoder = build_batched_decoder(target, draft, "cascade", "auto", size, *curves)
        decoder.target.reuse_prompts = reuse
        requests = [RowRequest(prompt, SamplingParams(), max_new_tokens) for prompt in prompts]
        tokens = [result.tokens for result in decoder.generate_many(requests)]
    return {"seconds": time.perf_counter() - started, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--target-quant", default="q4")
    parser.add_argument("--draft-quant", default="q4")
    parser.add_argument("--prefill", choices=("auto", "none"), default="auto",
                        help="who reads the prompts, as run's --prefill (auto: the AMX path on a CPU with AMX-BF16)")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    target = load_model("demo:qwen2.5-coder-1.5b", dtype="bfloat16", quantization=args.target_quant, role="target", progress=False)
    draft = load_model("demo:qwen2.5-coder-0.5b", dtype="bfloat16", quantization=args.draft_quant, role="draft", progress=False)
    if prefill.wanted(args.prefill, target):  # as settings._read_prompts gives run its paths
        prefill.attach(target, progress=False)
        if prefill.amx_reads(draft):
            prefill.attach(draft)
    reader = prompt_reader(target)
    print(f"prompts read by: {reader}", flush=True)
    curves = (forward_curve(target), forward_curve(draft))
    size = batch_size_for(curves[0])
    questions = held_prompts(SPEC_BENCH, args.per_category)
    build_decoder(target, draft, "cascade", "auto", clock_free=True).generate(  # warm-up
        encode_chat(target.tokenizer, [{"role": "user", "content": questions[0]}]), SamplingParams(), 8)
    rows = []
    for system_name, system in SYSTEMS.items():
        head = [{"role": "system", "content": system}] if system else []
        prompts = [encode_chat(target.tokenizer, head + [{"role": "user", "content": q}]) for q in questions]
        for mode in ("one at a time", f"batched, B={size}"):
            passes = {True: [], False: []}
            for reuse in (True, False, False, True):
                passes[reuse].append(one_pass(target, draft, mode, size, reuse, prompts, args.max_new_tokens, curves))
            new_tokens = sum(map(len, passes[True][0]["tokens"]))
            seconds = {reuse: sum(p["seconds"] for p in runs) / len(runs) for reuse, runs in passes.items()}
            identical = all(p["tokens"] == passes[False][0]["tokens"] for runs in passes.values() for p in runs)
            row = {"system": system_name, "mode": mode, "records": len(prompts),
                   "prompt_tokens": sum(map(len, prompts)), "new_tokens": new_tokens,
                   "seconds_reuse": [p["seconds"] for p in passes[True]],
                   "seconds_no_reuse": [p["seconds"] for p in passes[False]],
                   "tok_per_s_reuse": new_tokens / seconds[True], "tok_per_s_no_reuse": new_tokens / seconds[False],
                   "speedup": seconds[False] / seconds[True], "identical": identical}
            rows.append(row)
            print(f"{system_name:<13} {mode:<14} {row['prompt_tokens']:>6} prompt tokens  "
                  f"{row['tok_per_s_no_reuse']:6.2f} -> {row['tok_per_s_reuse']:6.2f} tok/s  x{row['speedup']:.2f}  "
                  f"identical {identical}", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump({"machine": machine(), "max_new_tokens": args.max_new_tokens,
                       "target": f"qwen2.5-coder-1.5b {args.target_quant}", "draft": f"qwen2.5-coder-0.5b {args.draft_quant}",
                       "prompt_reader": reader,
                       "curves": {"target": curves[0], "draft": curves[1]}, "rows": rows}, file, indent=1)


if __name__ == "__main__":
    main()
