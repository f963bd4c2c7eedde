"""Draft-length policies replayed, without timing noise: the target's greedy output on Spec-Bench prompts is
recorded once, with the draft model's top token and its probability at every position of it (teacher-forced:
a chain draft that got tokens 1..i right sees exactly what it saw here, so token i + 1 of any chain is what
this records), and each policy then decodes that output again on paper: it picks how far to draft, the draft
stops where the policy's odds cut says, the leading matches are accepted, and every step costs what this
machine's calibrated curve (`specdec calibrate`) says a verify of n tokens costs, and a draft token what a
one-token forward of the draft (its subset head) measures here.

    python scripts/policy_replay.py [--per-category 3] [--max-new-tokens 128] [--json PATH]   (after specdec calibrate)

Prints the decoding speedup over the target alone (prefill left out) and tokens per step for: the shipped
policy (`session.make_policy("auto")`), the odds cut before it divided by the next token's acceptance, fixed
odds cuts, and the oracle that drafts exactly up to the first token the target rejects (the ceiling of any
stopping rule with this draft and these costs). Model drafts only: no lookups (the cascade's are extra).

--windows 32,64,128,256,all instead replays the shipped policy with the draft reading each window of the prompt
(`session.DRAFT_WINDOW`: the last N prompt tokens and everything after them; all: the whole prompt): the draft's
agreement with the target, the decoding speedup, and end to end with both prefills, each model's prefill of n
tokens timed here (the target's in both columns, the draft's of its window on the speculative side)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from specdec_cli.drafters.subset_head import draft_vocabulary, shared_subset_head
from specdec_cli.engine import SamplingParams
from specdec_cli.engine.kv import CachedModel
from specdec_cli.engine.policy import VerifyCost
from specdec_cli.models import load_model
from specdec_cli.models.formats.calibration import machine
from specdec_cli.session import (
    AUTO_MAX_K, DRAFT_WINDOW, build_decoder, encode_chat, forward_curve, make_policy,
)


STEP_OVERHEAD = 0.0017  # seconds of the engine's own work per speculative step (scripts/step_overhead.py)


QUESTIONS = Path(__file__).resolve().parents[1].parent / "shared/prompts/spec_bench_questions.jsonl"


def spec_bench(n_per_category: int) -> list[tuple[str, str]]:
    """(category, first turn) of the first `n_per_category` Spec-Bench questions of each category."""
    taken: dict[str, int] = {}
    prompts = []
    for line in QUESTIONS.read_text().splitlines():
        record = json.loads(line)
        if taken.get(record["category"], 0) < n_per_category:
            taken[record["category"]] = taken.get(record["category"], 0) + 1
            prompts.append((record["category"], record["turns"][0]))
    return prompts


def record(target, draft, questions, max_new_tokens: int) -> list[dict]:
    """Per prompt: the target's greedy output and, at each of its positions, the draft's top token and its
    probability, as the model drafter computes them (its subset head, its window)."""
    recorded = []
    for category, question in questions:
        prompt = encode_chat(target.tokenizer, [{"role": "user", "content": question}])
        output = build_decoder(target, None, "none", 0).generate(prompt, SamplingParams(), max_new_tokens).tokens
        recorded.append({"category": category, "prompt": prompt, "output": output})
        print(f"recorded {len(recorded)}/{len(questions)} ({category}, {len(output)} tokens)", flush=True)
    return drafted_over(recorded, draft, DRAFT_WINDOW)


def drafted_over(sequences: list[dict], draft, window: int | None) -> list[dict]:
    """The sequences with the draft's top token and its probability at each output position (teacher-forced),
    the draft reading the prompt's last `window` tokens (None: all of it) as the model drafter does."""
    subset = draft_vocabulary(draft.tokenizer, draft.vocab_size)
    head = shared_subset_head(draft.model, subset) if subset is not None else draft.model
    drafted = []
    for sequence in sequences:
        prompt, output = sequence["prompt"], sequence["output"]
        seen = prompt if window is None else prompt[-window:]
        with torch.inference_mode():
            logits = head(input_ids=torch.tensor([seen + output]), use_cache=False).logits[0]
        probs = logits[len(seen) - 1: len(seen) + len(output) - 1].float().softmax(-1)
        top, index = probs.max(-1)
        drafted.append(sequence | {"draft_top": (subset[index] if subset is not None else index).tolist(),
                                   "draft_p": top.tolist(), "seen": len(seen)})
    return drafted


def prefill_curve(model, head=None, sizes=(16, 64, 256, 768), repeats: int = 3) -> dict[int, float]:
    """Median seconds of a prefill of n tokens into an empty cache (the logits of the last one), per n."""
    curve = {}
    for size in sizes:
        ids, seconds = [100 + (31 * i) % 5000 for i in range(size)], []
        for _ in range(repeats):
            runner = CachedModel(head or model)
            started = time.perf_counter()
            runner.extend(ids, 1)
            seconds.append(time.perf_counter() - started)
        curve[size] = statistics.median(seconds)
    return curve


def at(curve: dict[int, float], n: int) -> float:
    """`curve` at n: linear between the measured sizes (from 0 at 0), proportional past the last."""
    sizes = sorted(curve)
    below = (0, 0.0)
    for size in sizes:
        if n <= size:
            return below[1] + (curve[size] - below[1]) * (n - below[0]) / (size - below[0])
        below = (size, curve[size])
    return curve[sizes[-1]] * n / sizes[-1]


def windows(sequences: list[dict], draft, target, sizes: list[int | None], make_policy_now, verify: VerifyCost,
            draft_seconds: float) -> dict:
    """The shipped policy replayed with the draft reading each window: agreement, decoding and end-to-end speedups
    (both prefills timed here; the target's is on both sides)."""
    subset = draft_vocabulary(draft.tokenizer, draft.vocab_size)
    head = shared_subset_head(draft.model, subset) if subset is not None else draft.model
    target_prefill, draft_prefill = prefill_curve(target.model), prefill_curve(draft.model, head)
    print("prefill seconds, target:", {n: round(s, 3) for n, s in target_prefill.items()},
          "draft:", {n: round(s, 3) for n, s in draft_prefill.items()})
    rows = {}
    for size in sizes:
        drafted = drafted_over(sequences, draft, size)
        agree = sum(sum(a == b for a, b in zip(s["draft_top"], s["output"])) for s in drafted)
        decoding = replay(drafted, PolicyChoice(make_policy_now), verify, draft_seconds)
        alone = spec = 0.0
        by_category = defaultdict(lambda: [0.0, 0.0])
        for sequence in drafted:
            one = replay([sequence], PolicyChoice(make_policy_now), verify, draft_seconds)
            decode_alone = len(sequence["output"]) * verify.at(1)
            prefill = at(target_prefill, len(sequence["prompt"]))
            pair = (prefill + decode_alone, prefill + decode_alone / one["speedup"] + at(draft_prefill, sequence["seen"]))
            alone, spec = alone + pair[0], spec + pair[1]
            by_category[sequence["category"]][0] += pair[0]
            by_category[sequence["category"]][1] += pair[1]
        end_to_end = {category: a / s for category, (a, s) in by_category.items()}
        name = "all" if size is None else str(size)
        rows[name] = {"agreement": agree / sum(len(s["output"]) for s in drafted), "decoding": decoding["speedup"],
                      "tokens_per_step": decoding["tokens_per_step"], "end_to_end": alone / spec,
                      "end_to_end_by_category": end_to_end}
        worst = sorted(end_to_end, key=end_to_end.get)[:3]
        print(f"window {name:>4}: agreement {rows[name]['agreement']:.3f}  decoding x{decoding['speedup']:.3f}  "
              f"{decoding['tokens_per_step']:.2f} tok/step  end to end x{alone / spec:.3f}  worst "
              + ", ".join(f"{category} x{end_to_end[category]:.2f}" for category in worst), flush=True)
    return {"target_prefill_seconds": target_prefill, "draft_prefill_seconds": draft_prefill, "windows": rows}


def draft_token_seconds(draft, context: int = 200, repeats: int = 21) -> float:
    """Median seconds of a one-token forward of the draft as the model drafter runs it (its subset head) over
    a `context`-token cache: what a draft token costs (the calibration times the full output layer)."""
    subset = draft_vocabulary(draft.tokenizer, draft.vocab_size)
    runner = CachedModel(shared_subset_head(draft.model, subset) if subset is not None else draft.model)
    ids = [100 + (31 * i) % 5000 for i in range(context)]
    runner.extend(ids, 1)
    seconds = []
    for repeat in range(repeats):
        started = time.perf_counter()
        runner.extend(ids + [200 + repeat], 1)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def replay(sequences: list[dict], choose, verify: VerifyCost, draft_seconds: float) -> dict:
    """Decode each recorded output again with `choose(sequence, position, policy)` -> tokens to draft; the
    policy (or None) learns from each step as the engine's would. Seconds: modelled, not measured."""
    alone = spec = 0.0
    steps = tokens = 0
    by_category = defaultdict(lambda: [0.0, 0.0])
    for sequence in sequences:
        output, policy = sequence["output"], choose.policy()
        position, seconds = 0, 0.0
        while position < len(output):
            drafted = choose(sequence, position, policy)
            accepted = 0
            while accepted < drafted and sequence["draft_top"][position + accepted] == output[position + accepted]:
                accepted += 1
            verify_seconds = verify.at(drafted + 1)
            seconds += verify_seconds + drafted * draft_seconds + (STEP_OVERHEAD if drafted else 0.0)
            if policy is not None:
                policy.update(drafted, accepted, drafted * draft_seconds if drafted else 0.0, verify_seconds)
            position += accepted + 1
            steps, tokens = steps + 1, tokens + accepted + 1
        plain = len(output) * verify.at(1)
        alone, spec = alone + plain, spec + seconds
        by_category[sequence["category"]][0] += plain
        by_category[sequence["category"]][1] += seconds
    return {"speedup": alone / spec, "tokens_per_step": tokens / steps,
            "by_category": {category: a / s for category, (a, s) in by_category.items()}}


class PolicyChoice:
    """Draft as the engine does: the policy's k, the draft stopping once its odds fall below the policy's cut."""

    def __init__(self, make):
        self.policy = make

    def __call__(self, sequence: dict, position: int, policy) -> int:
        k = min(policy.next_k(), len(sequence["output"]) - position)
        cut = policy.rule.min_survival if policy.rule is not None else 0.0
        drafted, survival = 0, 1.0
        while drafted < k:
            survival *= sequence["draft_p"][position + drafted]
            drafted += 1
            if survival < cut:
                break
        return drafted


class FixedCut(PolicyChoice):
    def __init__(self, cut: float):
        super().__init__(lambda: None)
        self.cut = cut

    def __call__(self, sequence: dict, position: int, policy) -> int:
        drafted, survival = 0, 1.0
        while drafted < AUTO_MAX_K and position + drafted < len(sequence["output"]):
            survival *= sequence["draft_p"][position + drafted]
            drafted += 1
            if survival < self.cut:
                break
        return drafted


class Oracle(PolicyChoice):
    def __init__(self):
        super().__init__(lambda: None)

    def __call__(self, sequence: dict, position: int, policy) -> int:
        right = 0
        while position + right < len(sequence["output"]) and \
                sequence["draft_top"][position + right] == sequence["output"][position + right]:
            right += 1
        return min(right + 1, len(sequence["output"]) - position, AUTO_MAX_K)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-quant", default="q4")
    parser.add_argument("--draft-quant", default="q4")
    parser.add_argument("--per-category", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--json", default="")
    parser.add_argument("--recorded", default="", help="keep the recording in this file, and replay it if it exists")
    parser.add_argument("--draft-ms", type=float, default=0.0, help="what-if: a draft token's cost (default: measured)")
    parser.add_argument("--verify-scale", type=float, default=1.0,
                        help="what-if: a verify of n tokens costs 1 + scale x (its calibrated cost / a one-token forward's - 1)")
    parser.add_argument("--windows", default="", help="draft windows to replay (prompt tokens, or all), e.g. 64,256,all")
    args = parser.parse_args()
    target = load_model("demo:qwen2.5-coder-1.5b", quantization=args.target_quant, progress=False)
    draft = load_model("demo:qwen2.5-coder-0.5b", quantization=args.draft_quant, progress=False, role="draft")
    target_curve = forward_curve(target)
    if not target_curve:
        raise SystemExit("no calibration for the target's format on this machine: run `specdec calibrate` first")
    if args.recorded and Path(args.recorded).exists():
        sequences = json.loads(Path(args.recorded).read_text())
    else:
        sequences = record(target, draft, spec_bench(args.per_category), args.max_new_tokens)
        if args.recorded:
            Path(args.recorded).write_text(json.dumps(sequences))
    one = min(target_curve.values())
    target_curve = {n: one * (1 + args.verify_scale * (seconds / one - 1)) for n, seconds in target_curve.items()}
    verify = VerifyCost(target_curve)
    draft_seconds = args.draft_ms / 1000 if args.draft_ms else draft_token_seconds(draft)
    if args.windows:
        sizes = [None if size == "all" else int(size) for size in args.windows.split(",")]
        result = windows(sequences, draft, target, sizes, lambda: make_policy("auto", verify_curve=target_curve),
                         verify, draft_seconds)
        if args.json:
            with open(args.json, "w") as file:
                json.dump({"machine": machine(), "target": target.precision, "draft": draft.precision,
                           "target_curve": target_curve, "draft_token_seconds": draft_seconds,
                           "per_category": args.per_category, "max_new_tokens": args.max_new_tokens,
                           "step_overhead": STEP_OVERHEAD} | result, file, indent=1)
        return
    choices = {"shipped (make_policy auto)": PolicyChoice(lambda: make_policy("auto", verify_curve=target_curve)),
               **{f"fixed odds cut {cut}": FixedCut(cut) for cut in (0.3, 0.5, 0.6, 0.7, 0.8, 0.9)},
               "oracle (drafts to the first rejection)": Oracle()}
    rows = {}
    print(f"\ndraft token {1000 * draft_seconds:.1f} ms, target forward {1000 * verify.at(1):.1f} ms "
          f"(c = {draft_seconds / verify.at(1):.2f}); decoding speedup over the target alone, prefill left out")
    for name, choose in choices.items():
        rows[name] = result = replay(sequences, choose, verify, draft_seconds)
        worst = min(result["by_category"], key=result["by_category"].get)
        print(f"{name:44} x{result['speedup']:.3f}  {result['tokens_per_step']:.2f} tok/step  "
              f"worst {worst} x{result['by_category'][worst]:.2f}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"machine": machine(), "target": target.precision, "draft": draft.precision,
                       "target_curve": target_curve, "verify_scale": args.verify_scale,
                       "draft_token_seconds": draft_seconds, "draft_token_seconds_given": bool(args.draft_ms),
                       "per_category": args.per_category,
                       "max_new_tokens": args.max_new_tokens, "step_overhead": STEP_OVERHEAD, "rows": rows},
                      file, indent=1)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
