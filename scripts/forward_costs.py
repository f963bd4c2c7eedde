"""Forward-pass cost of the target and the draft per quantisation format, for 1..16 new tokens on a warm cache.

Speculation pays only while verifying k tokens costs about as much as one: this prints, per model and
format, the median milliseconds of a forward of n new tokens and its ratio to n=1, as a Markdown table.
The measuring is `specdec_cli.models.calibrate` (what `specdec calibrate` will run).

    python scripts/forward_costs.py [--profile demo] [--target-formats none,int8,int4] [--draft-formats int8,int4]
                                    [--dtype auto] [--repeats 5] [--context 200] [--threads N] [--clock wall|cpu]
                                    [--save | --json PATH]

Loads the models one at a time; run it under the shared lock on a shared machine."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from specdec_cli.models.calibrate import TOKEN_COUNTS, measure_forward_costs
from specdec_cli.models.formats.calibration import machine, save_calibration
from specdec_cli.profiles import load_profile


def _names(value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()]


def _row(entry: dict) -> str:
    seconds = entry["seconds"]
    one = seconds["1"]
    cells = [f"{1000 * s:.0f} ms" + ("" if n == "1" else f" (x{s / one:.2f})") for n, s in seconds.items()]
    return f"| {entry['role']} {entry['model']} | {entry['precision']} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="demo")
    parser.add_argument("--target-formats", default="none,int8,int4")
    parser.add_argument("--draft-formats", default="int8,int4")
    parser.add_argument("--dtype", default="auto", help="the dtype weights load at (int8 then runs float32, int4 bfloat16)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this process's CPU time, for a busy machine (use with --threads 1)")
    parser.add_argument("--save", action="store_true", help="store the result under the specdec home")
    parser.add_argument("--json", type=Path, help="store the result in this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    profile = load_profile(args.profile)
    models = {"target": profile.target, **({"draft": profile.draft} if profile.draft else {})}
    formats = {"target": _names(args.target_formats), "draft": _names(args.draft_formats)}
    facts = machine()
    print(f"{facts['cpu']} · flags {' '.join(facts['cpu_flags'])} · {facts['threads']} threads · "
          f"torch {facts['torch']} · {args.context}-token cache, median of {args.repeats}, {args.clock} clock")
    print("| model | precision | " + " | ".join(f"n={n}" for n in TOKEN_COUNTS) + " |")
    print("|---|---|" + "---|" * len(TOKEN_COUNTS))
    result = measure_forward_costs(
        models, formats, dtype=args.dtype, context_tokens=args.context, repeats=args.repeats, clock=args.clock,
        on_result=lambda entry: print(_row(entry), flush=True), progress=True,
    )
    if args.save or args.json:
        path = save_calibration(result, args.json)
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
