"""The levers of issue 13 on a quantised target, each against that target alone, interleaved prompt by
prompt in one process (13 Spec-Bench prompts, one per category, greedy):

- the draft's format (int8, int4) and the subset head (the draft scores the 32k most frequent ids only);
- the draft's window (it reads only the last 256, 128, 64, 32 or 16 tokens of the prompt);
- lookups priced by the verify-cost curve (the policy's lookup length) against lookups at a fixed length;
- the verify curve from this machine's calibration against the one the run learns;
- the odds cut as it was before it divided by the next token's expected acceptance.

    python scripts/draft_levers.py [--target-quant int8] [--max-new-tokens 128] [--per-category 1] [--only a,b] [--json PATH]

Prints one row per configuration (speedup = baseline seconds / seconds over all prompts, tok/s, accepted,
tokens per step, identical to the baseline) and a per-category speedup line. Run on an idle machine."""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

from specdec_cli.drafters import CascadeDrafter, DraftModelDrafter, NgramDrafter
from specdec_cli.drafters.subset_head import frequent_token_ids
from specdec_cli.engine import DraftOrNot, FixedK, GenerationStats, SamplingParams, SpeculativeDecoder
from specdec_cli.models import load_model
from specdec_cli.models.calibrate import machine
from specdec_cli.session import AUTO_MAX_K, draft_rule, encode_chat, eos_token_ids, verify_curve

from levers import spec_bench  # scripts/levers.py: one Spec-Bench question per category


class CutOnOdds(DraftOrNot):
    """The odds cut before it took the next token's acceptance into account: (draft + slope) · rate."""

    def next_acceptance(self) -> float:
        return 1.0


class UnpricedLookups(DraftOrNot):
    """The policy before lookups were priced: a lookup is always proposed at the rule's length."""

    def _choose_lookup(self) -> int:
        return self.base_rule.lookup_k


def configurations(target, drafts: dict, curve):
    auto = lambda policy=DraftOrNot, curve=curve: policy(max_k=AUTO_MAX_K, rule=draft_rule("auto"), verify_curve=curve)  # noqa: E731

    def cascade(name: str, subset: bool | int = False, window: int | None = None):
        loaded = drafts[name]
        size = subset if isinstance(subset, int) and subset > 1 else 32768
        ids = frequent_token_ids(loaded.tokenizer, size, loaded.vocab_size) if subset else None
        drafter = CascadeDrafter(DraftModelDrafter(loaded.model, token_ids=ids, share_head=True, window=window))
        drafter.obey(draft_rule("auto"))
        return drafter

    fixed_cut = lambda: auto(lambda **kw: DraftOrNot(cost_cut=False, **kw))  # noqa: E731
    return {
        "target": lambda: (None, FixedK(0)),
        "cascade int8 draft": lambda: (cascade("int8"), auto()),
        "cascade int4 draft": lambda: (cascade("int4"), auto()),
        "cascade int4 draft +fr32k": lambda: (cascade("int4", True), auto()),
        "cascade int8 draft +fr32k": lambda: (cascade("int8", True), auto()),
        "cascade int4 (lookups unpriced)": lambda: (cascade("int4"), auto(UnpricedLookups)),
        "cascade int4 (curve learned)": lambda: (cascade("int4"), auto(curve=None)),
        "cascade q4 draft": lambda: (cascade("q4"), auto()),
        "cascade q4 draft (fixed odds cut)": lambda: (cascade("q4"), fixed_cut()),
        "cascade q4 draft +fr32k": lambda: (cascade("q4", True), auto()),
        "cascade q4 draft +fr64k": lambda: (cascade("q4", 65536), auto()),
        "cascade q4 draft +fr64k +window256": lambda: (cascade("q4", 65536, 256), auto()),
        "cascade q4 draft +fr64k +window128": lambda: (cascade("q4", 65536, 128), auto()),
        "cascade q4 draft +fr64k +window64": lambda: (cascade("q4", 65536, 64), auto()),
        "cascade q4 draft +fr64k +window32": lambda: (cascade("q4", 65536, 32), auto()),
        "cascade q4 draft +fr64k +window16": lambda: (cascade("q4", 65536, 16), auto()),
        "cascade q4 draft +fr64k +window256 (cut on odds)": lambda: (cascade("q4", 65536, 256), auto(CutOnOdds)),
        "ngram": lambda: (NgramDrafter(), auto()),
        "ngram (lookups unpriced)": lambda: (NgramDrafter(), auto(UnpricedLookups)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target-quant", default="int8")
    parser.add_argument("--draft-quants", default="int8,int4", help="draft formats to load (the configurations use them)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--per-category", type=int, default=1, help="Spec-Bench prompts per category")
    parser.add_argument("--only", default="")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    target = load_model("demo:qwen2.5-coder-1.5b", dtype="bfloat16", quantization=args.target_quant, progress=False)
    drafts = {name: load_model("demo:qwen2.5-coder-0.5b", dtype="bfloat16", quantization=name, progress=False, role="draft")
              for name in args.draft_quants.split(",")}
    curve = verify_curve(target)
    configs = configurations(target, drafts, curve)
    if args.only:
        configs = {name: make for name, make in configs.items() if name == "target" or name in args.only.split(",")}
    configs = {name: make for name, make in configs.items() if not name.startswith("cascade ")
               or name.split()[1] in drafts}
    eos = eos_token_ids(target)
    questions = spec_bench(args.per_category)
    prompts = [encode_chat(target.tokenizer, [{"role": "user", "content": q}]) for _, q in questions]
    for make in configs.values():  # warm-up
        drafter, policy = make()
        SpeculativeDecoder(target.model, drafter, policy, eos).generate(prompts[0], SamplingParams(), 8)
    seconds = defaultdict(lambda: defaultdict(float))
    stats, identical = defaultdict(GenerationStats), defaultdict(int)
    for number, ((category, _), prompt) in enumerate(zip(questions, prompts)):
        baseline = None
        order = list(configs.items())
        order = order[number % len(order):] + order[: number % len(order)]  # no configuration always first
        results = {}
        for name, make in order:
            drafter, policy = make()
            started = time.perf_counter()
            results[name] = SpeculativeDecoder(target.model, drafter, policy, eos).generate(
                prompt, SamplingParams(), args.max_new_tokens)
            seconds[name][category] += time.perf_counter() - started
        baseline = results["target"].tokens
        for name, result in results.items():
            stats[name].merge(result.stats)
            identical[name] += result.tokens == baseline
        print(f"prompt {number + 1}/{len(prompts)} ({category}) done", flush=True)
    base = sum(seconds["target"].values())
    rows = []
    print(f"\n{'configuration':32} {'speedup':>8} {'tok/s':>7} {'accept':>7} {'tok/step':>8} {'identical':>9}  worst category")
    for name in configs:
        s, total = stats[name], sum(seconds[name].values())
        by_category = {c: seconds["target"][c] / seconds[name][c] for c in seconds[name]}
        worst = min(by_category, key=by_category.get)
        rows.append({"configuration": name, "speedup": base / total, "tokens_per_second": s.new_tokens / total,
                     "acceptance": s.acceptance_rate, "tokens_per_step": s.tokens_per_step,
                     "identical": identical[name], "prompts": len(prompts), "by_category": by_category,
                     "stats": s.as_dict()})
        print(f"{name:32} {base / total:8.2f} {s.new_tokens / total:7.2f} {s.acceptance_rate or 0:7.2f} "
              f"{s.tokens_per_step:8.2f} {identical[name]:4}/{len(prompts)}  {worst} x{by_category[worst]:.2f}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"machine": machine(), "target": target.precision, "verify_curve": curve,
                       "max_new_tokens": args.max_new_tokens, "per_category": args.per_category, "rows": rows},
                      file, indent=1)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
