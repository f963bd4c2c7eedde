"""The draft-length policy of a git revision against the working tree's, on whole generations, interleaved in one
process: the same models, the same drafters, only `engine/policy.py` differs.

    python scripts/policy_ab.py [--base HEAD] [--prompts 13] [--drafters cascade,tree] --json benchmarks/....json

The first question of each Spec-Bench category (as `compare` encodes it: the demo profile's chat template and system
prompt), 128 new tokens, greedy. Per prompt the target alone runs once, then for each drafter the two policies in
turn (the order alternating per prompt), a fresh decoder each time, prefill included as in `compare`. The tokens must
be the target's every way (a policy decides how far to draft, never what is kept). Prints tokens/s and speedup
over the target alone for each drafter and policy, overall and per category, and the steps each took."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kernel_ab import spec_bench_prompts
from specdec_cli.engine import SamplingParams
from specdec_cli.models.calibrate import machine
from specdec_cli.session import AUTO_MAX_K, build_decoder, draft_rule, verify_curve
from specdec_cli.settings import ModelOverrides, choose_models, load_choice

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ROOT.parent / "shared/prompts/spec_bench_questions.jsonl"


def base_policy_module(revision: str):
    """`specdec_cli/engine/policy.py` as it was at `revision`, imported under another name."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:specdec_cli/engine/policy.py"],
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "base_policy.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("base_policy", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["base_policy"] = module
    spec.loader.exec_module(module)
    return module


def categories(count: int) -> list[str]:
    seen: list[str] = []
    for line in QUESTIONS.read_text().splitlines():
        category = json.loads(line)["category"]
        if category not in seen:
            seen.append(category)
    return seen[:count]


def generation(decoder, prompt: list[int]) -> tuple[list[int], float, int]:
    """Greedy tokens (128 at most), seconds, steps."""
    start = time.perf_counter()
    events = list(decoder.stream(prompt, SamplingParams(), 128))
    return [token for event in events for token in event.tokens], time.perf_counter() - start, len(events)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="HEAD", help="the git revision whose policy is the baseline")
    parser.add_argument("--prompts", type=int, default=13)
    parser.add_argument("--drafters", default="cascade,tree")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    base = base_policy_module(args.base)
    choice = choose_models(ModelOverrides(profile="demo"))
    target, draft = load_choice(choice)
    curve = verify_curve(target)
    prompts = spec_bench_prompts(target.tokenizer, choice.profile.system, args.prompts)
    drafters = args.drafters.split(",")
    policies = {args.base: lambda: base.DraftOrNot(max_k=AUTO_MAX_K, rule=draft_rule("auto"), verify_curve=curve),
                "working tree": None}
    runs = []
    for index, (category, prompt) in enumerate(zip(categories(len(prompts)), prompts)):
        made, seconds, steps = generation(build_decoder(target, None, "none", 0), prompt)
        runs.append({"prompt": index, "category": category, "drafter": "none", "policy": None,
                     "tokens": len(made), "seconds": seconds, "steps": steps})
        for drafter in drafters:
            for which in list(policies)[:: 1 if index % 2 == 0 else -1]:
                decoder = build_decoder(target, draft, drafter, "auto")
                if policies[which] is not None:
                    decoder.set_drafting(decoder.drafter, policies[which]())
                output, seconds, steps = generation(decoder, prompt)
                if output != made:
                    raise SystemExit(f"prompt {index}: {drafter} with the {which} policy differs from the target alone")
                runs.append({"prompt": index, "category": category, "drafter": drafter, "policy": which,
                             "tokens": len(output), "seconds": seconds, "steps": steps})
        print(f"prompt {index + 1}/{len(prompts)} ({category}): {len(made)} tokens", flush=True)
    summary = summarise(runs, drafters, list(policies))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": machine(), "base": args.base,
            "base_commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", args.base], capture_output=True,
                                          text=True).stdout.strip(),
            "max_new_tokens": 128, "greedy": True, "runs": runs, "summary": summary}, indent=1) + "\n")


def summarise(runs: list[dict], drafters: list[str], policies: list[str]) -> dict:
    """Tokens/s and speedup over the target alone per drafter and policy, overall and per category; printed."""
    def rate(rows):
        return sum(row["tokens"] for row in rows) / sum(row["seconds"] for row in rows)

    alone = [row for row in runs if row["drafter"] == "none"]
    summary = {"target alone": {"tokens_per_second": rate(alone)}}
    print(f"target alone: {rate(alone):.1f} tok/s")
    for drafter in drafters:
        for policy in policies:
            rows = [row for row in runs if row["drafter"] == drafter and row["policy"] == policy]
            by_category = {row["category"]: row["tokens"] / row["seconds"] /
                           next(a["tokens"] / a["seconds"] for a in alone if a["prompt"] == row["prompt"])
                           for row in rows}
            entry = {"tokens_per_second": rate(rows), "speedup": rate(rows) / rate(alone),
                     "steps": sum(row["steps"] for row in rows), "speedup_by_category": by_category}
            summary[f"{drafter} ({policy})"] = entry
            print(f"{drafter} ({policy}): {entry['tokens_per_second']:.1f} tok/s x{entry['speedup']:.2f}, "
                  f"{entry['steps']} steps; worst {min(by_category.values()):.2f}; "
                  + " ".join(f"{name} {value:.2f}" for name, value in by_category.items()))
    return summary


if __name__ == "__main__":
    main()
