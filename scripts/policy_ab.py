"""The draft-length policy (or the drafters) of a git revision against the working tree's, on whole generations,
interleaved in one process: the same models, only `engine/policy.py` (or `drafters/model.py` and `drafters/tree.py`)
differs.

    python scripts/policy_ab.py [--base HEAD] [--what policy|drafters|run] [--temperature 0.7] [--prompts 13]
                                [--drafters cascade,tree] [--target-quant none --dtype bfloat16 --tolerate-ties]
                                --json benchmarks/....json

--what run times `run`'s one-request-at-a-time decoding (`build_decoder(..., clock_free=True)`: decisions that never
read the clock) in the working tree against what it did until 5 December whatever --base says: draft up to
AUTO_MAX_K tokens and stop on the draft's odds alone (`FixedK(AUTO_MAX_K)`).

The first question of each Spec-Bench category (as `compare` encodes it: the demo profile's chat template and system
prompt), 128 new tokens, greedy unless --temperature (then with the profile's top-p and top-k, seed 0). Per prompt
the target alone runs once, then for each drafter the two versions in turn (the order alternating per prompt), a
fresh decoder each time, prefill included as in `compare`. Greedy, the tokens must be the target's every way (a
policy or a stop rule decides how far to draft, never what is kept); sampled, the draws differ once the drafts do,
so only the rates compare. Prints tokens/s and speedup over the target alone for each drafter and version, overall
and per category, with the steps, drafted and accepted tokens."""

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
from levers import spec_bench  # scripts/levers.py: Spec-Bench questions, n per category, in the file's order
from specdec_cli.engine import FixedK, SamplingParams
from specdec_cli.models.calibrate import machine
from specdec_cli.session import AUTO_MAX_K, build_decoder, draft_rule, verify_curve
from specdec_cli.settings import ModelOverrides, choose_models, load_choice

ROOT = Path(__file__).resolve().parents[1]


def base_module(revision: str, path: str, name: str):
    """The module at `path` as it was at `revision`, imported as `name`."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:{path}"],
                            check=True, capture_output=True, text=True).stdout
    copy = Path(tempfile.mkdtemp()) / f"{name}.py"
    copy.write_text(source)
    spec = importlib.util.spec_from_file_location(name, copy)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def base_and_demo_pair(revision: str, path: str, name: str):
    """The module at `path` as it was at `revision` (imported as `name`), the demo profile's choice, and its loaded
    target and draft: what each A/B script here starts from."""
    base = base_module(revision, path, name)
    choice = choose_models(ModelOverrides(profile="demo"))
    target, draft = load_choice(choice)
    return base, choice, target, draft


def as_base(decoder, what: str, base: dict, curve) -> None:
    """Make `decoder` run the base revision's policy, or its drafters (the same object, the base's class)."""
    if what == "run":
        decoder.set_drafting(decoder.drafter, FixedK(AUTO_MAX_K, draft_rule("auto")))
        return
    if what == "policy":
        decoder.set_drafting(decoder.drafter, base["policy"].DraftOrNot(
            max_k=AUTO_MAX_K, rule=draft_rule("auto"), verify_curve=curve))
        return
    drafter = decoder.drafter.model_drafter  # the cascade's (tree or chain)
    drafter.__class__ = getattr(base["tree" if type(drafter).__name__ == "TreeDrafter" else "model"],
                                type(drafter).__name__)


def generation(decoder, prompt: list[int], params: SamplingParams) -> tuple[list[int], float, dict]:
    """Tokens (128 at most), seconds, and the steps, drafted and accepted tokens."""
    start = time.perf_counter()
    events = list(decoder.stream(prompt, params, 128))
    seconds = time.perf_counter() - start
    counts = {"steps": len(events), "drafted": sum(event.drafted for event in events),
              "accepted": sum(event.accepted for event in events)}
    return [token for event in events for token in event.tokens], seconds, counts


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="HEAD", help="the git revision whose policy or drafters are the baseline")
    parser.add_argument("--what", choices=("policy", "drafters", "run"), default="policy")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompts", type=int, default=13)
    parser.add_argument("--drafters", default="cascade,tree")
    parser.add_argument("--target-quant", default=None, help="the target's format (default: the demo profile's auto)")
    parser.add_argument("--dtype", default=None, help="with --target-quant none: bfloat16 or float32")
    parser.add_argument("--tolerate-ties", action="store_true",
                        help="bf16: a verify of several tokens rounds otherwise than one-token decoding and near-tied "
                             "argmaxes flip; count the outputs equal to the target alone's instead of stopping")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    base = ({"policy": base_module(args.base, "specdec_cli/engine/policy.py", "base_policy")} if args.what == "policy"
            else {} if args.what == "run"
            else {"model": base_module(args.base, "specdec_cli/drafters/model.py", "base_model"),
                  "tree": base_module(args.base, "specdec_cli/drafters/tree.py", "base_tree")})
    choice = choose_models(ModelOverrides(profile="demo", target_quant=args.target_quant, dtype=args.dtype))
    target, draft = load_choice(choice)
    curve = verify_curve(target)
    profile = choice.profile
    params = (SamplingParams(args.temperature, profile.top_k, profile.top_p, seed=0) if args.temperature
              else SamplingParams())
    prompts = spec_bench_prompts(target.tokenizer, profile.system, args.prompts)
    drafters = args.drafters.split(",")
    versions = ["odds alone" if args.what == "run" else args.base, "working tree"]
    runs = []
    categories = [category for category, _question in spec_bench(1)]  # the categories of spec_bench_prompts's
    for index, (category, prompt) in enumerate(zip(categories, prompts)):
        made, seconds, counts = generation(build_decoder(target, None, "none", 0), prompt, params)
        runs.append({"prompt": index, "category": category, "drafter": "none", "version": None,
                     "tokens": len(made), "seconds": seconds, **counts})
        for drafter in drafters:
            for which in versions[:: 1 if index % 2 == 0 else -1]:
                decoder = build_decoder(target, draft, drafter, "auto", clock_free=args.what == "run")
                if which != "working tree":
                    as_base(decoder, args.what, base, curve)
                output, seconds, counts = generation(decoder, prompt, params)
                if params.greedy and output != made and not args.tolerate_ties:
                    raise SystemExit(f"prompt {index}: {drafter} ({which}) differs from the target alone")
                runs.append({"prompt": index, "category": category, "drafter": drafter, "version": which,
                             "tokens": len(output), "seconds": seconds, "identical": output == made, **counts})
        print(f"prompt {index + 1}/{len(prompts)} ({category}): {len(made)} tokens", flush=True)
    summary = summarise(runs, drafters, versions)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": machine(), "target_quantization": target.quantization, "dtype": str(target.dtype),
            "draft_quantization": draft.quantization, "base": args.base, "what": args.what,
            "temperature": args.temperature,
            "top_p": params.top_p, "top_k": params.top_k,
            "base_commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", args.base], capture_output=True,
                                          text=True).stdout.strip(),
            "max_new_tokens": 128, "runs": runs, "summary": summary}, indent=1) + "\n")


def summarise(runs: list[dict], drafters: list[str], versions: list[str]) -> dict:
    """Tokens/s and speedup over the target alone per drafter and version, overall and per category; printed."""
    def rate(rows):
        return sum(row["tokens"] for row in rows) / sum(row["seconds"] for row in rows)

    alone = [row for row in runs if row["drafter"] == "none"]
    summary = {"target alone": {"tokens_per_second": rate(alone)}}
    print(f"target alone: {rate(alone):.1f} tok/s")
    for drafter in drafters:
        for version in versions:
            rows = [row for row in runs if row["drafter"] == drafter and row["version"] == version]
            by_category = {row["category"]: row["tokens"] / row["seconds"] /
                           next(a["tokens"] / a["seconds"] for a in alone if a["prompt"] == row["prompt"])
                           for row in rows}
            entry = {"tokens_per_second": rate(rows), "speedup": rate(rows) / rate(alone),
                     "identical": sum(row["identical"] for row in rows),
                     **{count: sum(row[count] for row in rows) for count in ("steps", "drafted", "accepted")},
                     "speedup_by_category": by_category}
            summary[f"{drafter} ({version})"] = entry
            print(f"{drafter} ({version}): {entry['tokens_per_second']:.1f} tok/s x{entry['speedup']:.2f}, "
                  f"{entry['steps']} steps, {entry['accepted']}/{entry['drafted']} accepted, "
                  f"{entry['identical']}/{len(rows)} identical; "
                  f"worst {min(by_category.values()):.2f}; "
                  + " ".join(f"{name} {value:.2f}" for name, value in by_category.items()))
    return summary


if __name__ == "__main__":
    main()
