"""A cheaper draft by fewer bits a weight: how much of the draft's agreement with the target a 3-bit (or 2-bit) draft
keeps, without timing noise and without a kernel for it.

    python scripts/draft_bits.py [--per-category 1] [--max-new-tokens 128] --json benchmarks/....json

The q4 target's greedy output on Spec-Bench prompts (the first question of each category, the chat template) is
recorded once (policy_replay.record); then the q4 draft, as the model drafter runs it (its 64k subset head, the
last DRAFT_WINDOW prompt tokens; policy_replay.drafted_over), is teacher-forced over each output with its decoder
layers' weights requantised from the values it holds: b-bit levels 0..2^b - 1 with a float16 step and minimum per
group of 32, which q4's own layout holds exactly (levels below 16), so the draft still runs through specdec's q4
matmul with its int8 activations — the numbers a b-bit kernel of that layout would give. Its top token is
compared with the target's at every position: the agreement a chain's next token has. "searched" picks each
group's range among 25 shrinkings of its min and max by the least squared error. 4 bits requantised is the
control (the same values as the draft's but rounding). The output head stays as loaded."""

from __future__ import annotations

import argparse

import torch

from draft_layers import top_agreement, write_record  # the same measure and record as for skipped layers
from levers import spec_bench  # scripts/levers.py: Spec-Bench questions, n per category
from policy_replay import record  # the same recording and teacher-forcing as the policy replays
from specdec_cli.models import load_model
from specdec_cli.models.q4 import GROUP, Q4KLinear, Q4Linear

SHRINKS = (0.0, 0.05, 0.1, 0.15, 0.2)  # of a group's range, from below and from above, when searched
WAYS = {"4-bit requantised": (4, False), "3-bit": (3, False), "3-bit searched": (3, True),
        "2-bit searched": (2, True)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    target = load_model("demo:qwen2.5-coder-1.5b", quantization="q4", progress=False)
    draft = load_model("demo:qwen2.5-coder-0.5b", quantization="q4", role="draft", progress=False)
    recorded = record(target, draft, spec_bench(args.per_category), args.max_new_tokens)
    layers = {name: module for name, module in draft.model.named_modules()
              if name != "lm_head" and isinstance(module, (Q4Linear, Q4KLinear))}
    agreement = {"as loaded": top_agreement(draft, recorded)}
    print(f"as loaded: agreement {agreement['as loaded']:.4f}", flush=True)
    for way, (bits, searched) in WAYS.items():
        for name, layer in layers.items():
            _replace(draft.model, name, _requantised(layer, bits, searched))
        agreement[way] = top_agreement(draft, recorded)
        print(f"{way}: agreement {agreement[way]:.4f}", flush=True)
        for name, layer in layers.items():
            _replace(draft.model, name, layer)
    if args.json:
        write_record(args.json, target, draft, recorded, layers_requantised=len(layers), agreement=agreement)


def _requantised(layer: Q4Linear, bits: int, searched: bool) -> Q4Linear:
    """The layer's weight at `bits` bits a weight (levels 0..2^bits - 1, a float16 step and minimum per 32)."""
    weight = layer.dequantized_weight().float()
    rows, width = weight.shape
    padded = torch.zeros(rows, -(-width // GROUP) * GROUP)
    padded[:, :width] = weight
    grouped = padded.view(rows, -1, GROUP)
    low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    top = 2 ** bits - 1
    best = None
    for below in SHRINKS if searched else (0.0,):
        for above in SHRINKS if searched else (0.0,):
            step = ((high - low) * (1 - below - above) / top).half()
            base = (low + below * (high - low)).half()
            levels = torch.where(step.float() > 0, ((grouped - base.float()) / step.float().clamp_min(1e-30)).round(),
                                 torch.zeros_like(grouped)).clamp(0, top)
            error = ((levels * step.float() + base.float() - grouped) ** 2).sum(-1, keepdim=True)
            if best is None:
                best = [levels, step, base, error]
            else:
                better = error < best[3]
                best = [torch.where(better, new, old) for new, old in zip((levels, step, base, error), best)]
    levels, step, base, _ = best
    return Q4Linear.from_parts(levels.to(torch.uint8).view(rows, -1), step.squeeze(-1), base.squeeze(-1),
                               layer.bias, width)


def _replace(model: torch.nn.Module, name: str, layer: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, layer)


if __name__ == "__main__":
    main()
