"""The demo pair's q4 target reading its prompts itself, with its bfloat16 copy, and (on a CPU with AMX-BF16) with its
own weights on AMX in bfloat16 (`--prefill`, models/prefill.py), alternated in one process on whole generations.

    python scripts/prefill_ab.py [--prompts 13] [--per-category 1] [--drafter cascade] --json benchmarks/....json

The pair is loaded once as `auto` picks it and the copy loaded once (explicitly: `attach` gives a q4 target on AMX
the AMX path instead); per prompt (the first question of each Spec-Bench category, as `compare` encodes them, 128 new
tokens, greedy) the target alone and the drafter run each way, the order rotating per prompt, a fresh decoder each
time. In the AMX way the q4 draft reads its window on AMX too, as `_read_prompts` gives it; in the others it reads
it itself. Within a way the drafter's tokens must be the target alone's; between ways they may differ (the prompt's
entries differ), so the comparison is tokens/s and the first step's seconds (the prompt's read)."""

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

WAYS = ("q4 reads", "bf16 copy reads", "bf16 on AMX reads")


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
    paths = {WAYS[1]: (prefill.load_copy(target, progress=False), None)}
    prefill.warm(paths[WAYS[1]][0], target.model.config)
    attach_seconds = time.perf_counter() - started
    ways = WAYS[:2]
    if prefill.amx_reads(target) and prefill.amx_reads(draft):
        paths[WAYS[2]] = (prefill.AmxPromptPath(target.model), prefill.AmxPromptPath(draft.model))
        ways = WAYS
    prompts = spec_bench_prompts(target.tokenizer, choice.profile.system, args.prompts, args.per_category)
    described = {"target": target.describe("target"), "draft": draft.describe("draft")}  # as loaded: q4 reads
    rows = _alternated(target, draft, args.drafter, prompts, paths, ways)
    result = {"machine": machine(), **described, "drafter": args.drafter, "max_new_tokens": 128, "copy_load_seconds": attach_seconds,
              "min_tokens": {way: path.min_tokens for way, (path, _) in paths.items()}, "prompts": rows,
              "totals": _totals(rows, args.drafter, ways)}
    for way in ways:
        print(f"{way:18}", " ".join(f"{key}: {value}" for key, value in result["totals"][way].items()))
    print("same output as q4's own read:", {way: result["totals"][f"same output as {WAYS[0]}"][way] for way in ways[1:]},
          "of", len(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


@torch.inference_mode()
def _alternated(target, draft, drafter: str, prompts: list[list[int]], paths: dict, ways: tuple[str, ...]) -> list[dict]:
    from specdec_cli.session import build_decoder

    rows = []
    for index, prompt in enumerate(prompts):
        row = {"prompt_tokens": len(prompt)}
        for way in ways[index % len(ways):] + ways[:index % len(ways)]:
            for model, path in zip((target.model, draft.model), paths.get(way, (None, None))):
                if path is None:
                    model.__dict__.pop(PREFILL_PATH, None)
                else:
                    model.__dict__[PREFILL_PATH] = path
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
        print(f"prompt {index + 1}/{len(prompts)} ({len(prompt)} tokens):",
              " ".join(f"{key} {value['seconds']:.2f}s" for key, value in row.items() if isinstance(value, dict)
                       and "seconds" in value), flush=True)
        rows.append(row)
    return rows


def _totals(rows: list[dict], drafter: str, ways: tuple[str, ...]) -> dict:
    totals = {}
    for way in ways:
        runs = {name: [row[f"{way} {name}"] for row in rows] for name in ("none", drafter)}
        rates = {name: sum(run["tokens"] for run in made) / sum(run["seconds"] for run in made)
                 for name, made in runs.items()}
        totals[way] = {"alone tok/s": round(rates["none"], 2), f"{drafter} tok/s": round(rates[drafter], 2),
                       "speedup": round(rates[drafter] / rates["none"], 3),
                       "first step s (alone)": round(sum(run["first_step"] for run in runs["none"]) / len(rows), 3),
                       f"first step s ({drafter})": round(sum(run["first_step"] for run in runs[drafter]) / len(rows),
                                                          3)}
    totals[f"same output as {WAYS[0]}"] = {way: sum(row[f"{way} output"] == row[f"{WAYS[0]} output"] for row in rows)
                                           for way in ways[1:]}
    return totals


if __name__ == "__main__":
    main()
