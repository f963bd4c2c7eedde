"""The demo pair's q4 target reading its prompts itself against reading them with its bfloat16 copy (`--prefill`),
alternated in one process on whole generations.

    python scripts/prefill_ab.py [--prompts 13] [--per-category 1] [--drafter cascade] --json benchmarks/....json

The pair is loaded once as `auto` picks it and the copy attached once; per prompt (the first question of each
Spec-Bench category, as `compare` encodes them, 128 new tokens, greedy) the target alone and the drafter run with
the copy and without it, the order alternating per prompt, a fresh decoder each time. Within a way the drafter's
tokens must be the target alone's; between ways they may differ (the prompt's entries differ), so the comparison
is tokens/s and the first step's seconds (the prompt's read)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kernel_ab import spec_bench_prompts
from specdec_cli.engine import SamplingParams
from specdec_cli.engine.kv import PREFILL_PATH, prefill_path
from specdec_cli.models.calibrate import machine

WAYS = ("q4 reads", "bf16 copy reads")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=13)
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--drafter", default="cascade")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    from specdec_cli.models import prefill
    from specdec_cli.settings import ModelOverrides, choose_models, load_choice

    choice = choose_models(ModelOverrides(profile="demo", prefill="none"))
    target, draft = load_choice(choice)
    started = time.perf_counter()
    prefill.attach(target)
    attach_seconds = time.perf_counter() - started
    path = prefill_path(target.model)
    prompts = spec_bench_prompts(target.tokenizer, choice.profile.system, args.prompts, args.per_category)
    rows = _alternated(target, draft, args.drafter, prompts, path)
    result = {"machine": machine(), "target": target.describe("target"), "draft": draft.describe("draft"),
              "drafter": args.drafter, "max_new_tokens": 128, "copy_load_seconds": attach_seconds,
              "min_tokens": path.min_tokens, "prompts": rows, "totals": _totals(rows, args.drafter)}
    for way in WAYS:
        print(f"{way:16}", " ".join(f"{key}: {value}" for key, value in result["totals"][way].items()))
    print("same output both ways:", result["totals"]["same output both ways"], "of", len(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


@torch.inference_mode()
def _alternated(target, draft, drafter: str, prompts: list[list[int]], path) -> list[dict]:
    from specdec_cli.session import build_decoder

    rows = []
    for index, prompt in enumerate(prompts):
        row = {"prompt_tokens": len(prompt)}
        for way in WAYS[:: 1 if index % 2 == 0 else -1]:
            if way == WAYS[1]:
                target.model.__dict__[PREFILL_PATH] = path
            else:
                target.model.__dict__.pop(PREFILL_PATH, None)
            outputs = []
            for name in ("none", drafter):
                decoder = build_decoder(target, draft, name, "auto")
                started, first, tokens = time.perf_counter(), None, []
                for event in decoder.stream(prompt, SamplingParams(), 128):
                    first = first if first is not None else time.perf_counter() - started
                    tokens.extend(event.tokens)
                row[f"{way} {name}"] = {"seconds": time.perf_counter() - started, "first_step": first,
                                        "tokens": len(tokens)}
                outputs.append(tokens)
            if outputs[0] != outputs[1]:
                raise SystemExit(f"prompt {index}, {way}: the drafter's output is not the target's")
            row[f"{way} output"] = outputs[0]
        row["same output both ways"] = row[f"{WAYS[0]} output"] == row[f"{WAYS[1]} output"]
        print(f"prompt {index + 1}/{len(prompts)} ({len(prompt)} tokens):",
              " ".join(f"{key} {value['seconds']:.2f}s" for key, value in row.items() if isinstance(value, dict)
                       and "seconds" in value), flush=True)
        rows.append(row)
    return rows


def _totals(rows: list[dict], drafter: str) -> dict:
    totals = {}
    for way in WAYS:
        runs = {name: [row[f"{way} {name}"] for row in rows] for name in ("none", drafter)}
        rates = {name: sum(run["tokens"] for run in made) / sum(run["seconds"] for run in made)
                 for name, made in runs.items()}
        totals[way] = {"alone tok/s": round(rates["none"], 2), f"{drafter} tok/s": round(rates[drafter], 2),
                       "speedup": round(rates[drafter] / rates["none"], 3),
                       "first step s (alone)": round(sum(run["first_step"] for run in runs["none"]) / len(rows), 3)}
    totals["same output both ways"] = sum(row["same output both ways"] for row in rows)
    return totals


if __name__ == "__main__":
    main()
