"""Where speculation stops paying as the batch grows (issue 17): the batched engine at batch sizes 1, 2, 4, 8
(and 16 with enough prompts), the target alone against speculation (cascade with k = auto, the batch policy
choosing each row's k from the forward-cost curves; the draft model at a fixed k), on the same held chat
prompts (the first N of each MT-bench category of Spec-Bench), greedy. Configurations are interleaved per
batch size in one process; every row says its tokens per second, its ratio to the target alone at that batch
size, the draft tokens it verified per row and step, its acceptance, and whether its outputs equal the target
alone's.

    python scripts/batch_crossover.py [--per-category 1] [--max-new-tokens 64] [--sizes 1,2,4,8] [--whole-draft] [--json PATH]

--whole-draft adds the cascade as the batched engine drafted before it read a window and scored a subset of the
vocabulary (the draft model reading every prompt token, scoring all its ids), against the default.

Run on an idle machine (no other process on the cores)."""

from __future__ import annotations

import argparse
import json
import time

import torch

from specdec_cli.drafters import NgramDrafter
from specdec_cli.engine import SamplingParams
from specdec_cli.engine.batched import BatchedDecoder, RowRequest
from specdec_cli.models import load_model
from specdec_cli.models.formats.calibration import machine
from specdec_cli.session import build_batched_decoder, encode_chat, eos_token_ids, forward_curve

SPEC_BENCH = "../shared/prompts/spec_bench_questions.jsonl"
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
CONFIGURATIONS = (("target alone", "none", 0), ("cascade k=auto", "cascade", "auto"), ("model k=3", "model", 3))


def held_prompts(path: str, per_category: int) -> list[str]:
    taken: dict[str, list[str]] = {category: [] for category in MT_BENCH}
    with open(path, encoding="utf-8") as file:
        for line in file:
            record = json.loads(line)
            chosen = taken.get(record["category"])
            if chosen is not None and len(chosen) < per_category:
                chosen.append(record["turns"][0])
    return [question for category in MT_BENCH for question in taken[category]]


WHOLE_DRAFT = ("cascade k=auto, whole prompt and vocabulary", "cascade", "auto")


def whole_draft_decoder(target, draft, size, curves) -> BatchedDecoder:
    """The cascade's batched engine without the draft's window and subset head."""
    return BatchedDecoder(target.model, draft.model, "cascade", size, "auto", eos_token_ids(target),
                          verify_curve=curves[0], draft_curve=curves[1],
                          lookup_factory=lambda: NgramDrafter(max_n=4, min_n=2))


def one_pass(target, draft, name, drafter, k, size, prompts, max_new_tokens, curves) -> dict:
    if name == WHOLE_DRAFT[0]:
        decoder = whole_draft_decoder(target, draft, size, curves)
    else:
        decoder = build_batched_decoder(target, draft, drafter, k, size, *curves)
    started = time.perf_counter()
    results = decoder.generate_many([RowRequest(ids, SamplingParams(), max_new_tokens) for ids in prompts])
    seconds = time.perf_counter() - started
    steps = sum(result.stats.steps for result in results)
    return {
        "tokens": [result.tokens for result in results], "seconds": seconds,
        "new_tokens": sum(len(result.tokens) for result in results), "row_steps": steps,
        "drafted": sum(result.stats.drafted for result in results),
        "accepted": sum(result.stats.accepted for result in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--sizes", default="1,2,4,8")
    parser.add_argument("--target-quant", default="int8")
    parser.add_argument("--draft-quant", default="int4")
    parser.add_argument("--whole-draft", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    configurations = CONFIGURATIONS + ((WHOLE_DRAFT,) if args.whole_draft else ())
    torch.set_num_threads(2)
    target = load_model("demo:qwen2.5-coder-1.5b", dtype="bfloat16", quantization=args.target_quant, role="target", progress=False)
    draft = load_model("demo:qwen2.5-coder-0.5b", dtype="bfloat16", quantization=args.draft_quant, role="draft", progress=False)
    prompts = [encode_chat(target.tokenizer, [{"role": "user", "content": q}]) for q in held_prompts(SPEC_BENCH, args.per_category)]
    curves = (forward_curve(target), forward_curve(draft))
    build_batched_decoder(target, draft, "model", 2, 1, *curves).generate_many(  # warm-up
        [RowRequest(prompts[0], SamplingParams(), 8)])
    rows = []
    for size in map(int, args.sizes.split(",")):
        measured_by_name = {}
        shift = len(rows) // len(configurations)  # each batch size starts with another configuration (drift)
        for name, drafter, k in configurations[shift % len(configurations):] + configurations[:shift % len(configurations)]:
            measured_by_name[name] = one_pass(target, draft, name, drafter, k, size, prompts, args.max_new_tokens, curves)
        baseline = measured_by_name[configurations[0][0]]
        for name, _, _ in configurations:
            measured = measured_by_name[name]
            row = {"batch_size": size, "configuration": name, **{key: measured[key] for key in measured if key != "tokens"},
                   "tok_per_s": measured["new_tokens"] / measured["seconds"],
                   "vs_target_alone": baseline["seconds"] / measured["seconds"] * measured["new_tokens"] / baseline["new_tokens"],
                   "drafted_per_row_step": measured["drafted"] / measured["row_steps"],
                   "acceptance": measured["accepted"] / measured["drafted"] if measured["drafted"] else None,
                   "identical": sum(a == b for a, b in zip(measured["tokens"], baseline["tokens"]))}
            rows.append(row)
            acceptance = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
            print(f"B={size:>2} {name:<15} {row['tok_per_s']:6.2f} tok/s  x{row['vs_target_alone']:.2f}  "
                  f"drafts/row-step {row['drafted_per_row_step']:.2f}  accept {acceptance}  "
                  f"identical {row['identical']}/{len(prompts)}", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump({"machine": machine(), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                       "target": f"qwen2.5-coder-1.5b {args.target_quant}", "draft": f"qwen2.5-coder-0.5b {args.draft_quant}",
                       "curves": {"target": curves[0], "draft": curves[1]}, "rows": rows}, file, indent=1)


if __name__ == "__main__":
    main()
