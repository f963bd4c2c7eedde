"""A cheaper draft by skipping its layers (self-speculative style, no training): how much of the draft's agreement
with the target each skipped layer costs, without timing noise.

    python scripts/draft_layers.py [--per-category 1] [--max-new-tokens 128] --json benchmarks/....json

The q4 target's greedy output on Spec-Bench prompts (the first question of each category, the chat template) is
recorded once (policy_replay.record); then the q4 draft, as the model drafter runs it (its 64k subset head, the
last DRAFT_WINDOW prompt tokens; policy_replay.drafted_over), is teacher-forced over each output with all its
layers and with each one layer left out (and the pairs of the --pairs best single ones), and its top token compared
with the target's at every position: the agreement a chain's next token has. A layer left out saves about 1/L of
the draft decoder's weight reads; the agreement it costs compounds over a chain's positions."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from levers import spec_bench  # scripts/levers.py: Spec-Bench questions, n per category
from policy_replay import drafted_over, record  # the same recording and teacher-forcing as the policy replays
from specdec_cli.models import load_model
from specdec_cli.models.calibrate import machine
from specdec_cli.session import DRAFT_WINDOW


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=4, help="pairs of the N least harmful single layers")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    target = load_model("demo:qwen2.5-coder-1.5b", quantization="q4", progress=False)
    draft = load_model("demo:qwen2.5-coder-0.5b", quantization="q4", role="draft", progress=False)
    recorded = record(target, draft, spec_bench(args.per_category), args.max_new_tokens)
    layers = list(draft.model.model.layers)
    agreement = {"none": _agreement(draft, layers, recorded, ())}
    print(f"all {len(layers)} layers: agreement {agreement['none']:.4f}", flush=True)
    for index in range(len(layers)):
        agreement[str(index)] = _agreement(draft, layers, recorded, (index,))
        print(f"without layer {index}: {agreement[str(index)]:.4f}", flush=True)
    best = sorted(range(len(layers)), key=lambda index: -agreement[str(index)])[: args.pairs]
    for pair in itertools.combinations(sorted(best), 2):
        key = ",".join(map(str, pair))
        agreement[key] = _agreement(draft, layers, recorded, pair)
        print(f"without layers {key}: {agreement[key]:.4f}", flush=True)
    if args.json:
        write_record(args.json, target, draft, recorded, layers=len(layers), agreement_without=agreement)


def write_record(path: str, target, draft, recorded: list[dict], **measured) -> None:
    """The JSON of a teacher-forced draft measurement: the machine, both models, the prompts and positions, and
    `measured`."""
    result = {"machine": machine(), "target": target.describe("target"), "draft": draft.describe("draft"),
              "draft_window": DRAFT_WINDOW, "prompts": len(recorded),
              "positions": sum(len(r["output"]) for r in recorded), **measured}
    Path(path).write_text(json.dumps(result, indent=1))


@torch.inference_mode()
def _agreement(draft, layers: list, recorded: list[dict], skipped: tuple[int, ...]) -> float:
    """The share of output positions where the draft without `skipped` layers has the target's token on top."""
    decoder = draft.model.model
    kept = [layer for index, layer in enumerate(layers) if index not in skipped]
    decoder.layers, decoder.config.num_hidden_layers = torch.nn.ModuleList(kept), len(kept)
    try:
        return top_agreement(draft, recorded)
    finally:
        decoder.layers, decoder.config.num_hidden_layers = torch.nn.ModuleList(layers), len(layers)


@torch.inference_mode()
def top_agreement(draft, recorded: list[dict]) -> float:
    """The share of the recorded output positions where the draft, as the model drafter runs it, has the target's
    token on top."""
    drafted = drafted_over(recorded, draft, DRAFT_WINDOW)
    agree = sum(sum(top == token for top, token in zip(s["draft_top"], s["output"])) for s in drafted)
    return agree / sum(len(s["output"]) for s in drafted)


if __name__ == "__main__":
    main()
