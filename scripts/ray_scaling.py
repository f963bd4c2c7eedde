"""Measure `specdec run --engine ray` against `--engine local` on one machine: the same held prompts through
2 workers × 1 thread, 1 worker × 2 threads and the local engine, each as the `specdec run` command a user
types (Ray's start and every worker's model load included), one after the other.

    python scripts/ray_scaling.py --json benchmarks/ray-scaling.json [--prompts FILE] [--n 16]
        [--max-new-tokens 64] [-- extra `specdec run` options, e.g. --profile demo or --target X --draft Y]

Prints one row per configuration: wall seconds, tokens per second over the wall time, the seconds the
workers spent generating (the records' own seconds, summed), what the rest went on (Ray's start, loading
the pair once per worker), and whether its texts are those of --engine local. The JSON keeps all of it and
every record. Greedy (-t 0). Nothing here is a test: timings belong in benchmarks, never in assertions."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ROOT.parent / "shared/prompts/spec_bench_questions.jsonl"
CONFIGURATIONS = {
    "local": ["--engine", "local"],
    "ray 2 workers x 1 thread": ["--engine", "ray", "--workers", "2", "--cpus-per-worker", "1"],
    "ray 1 worker x 2 threads": ["--engine", "ray", "--workers", "1", "--cpus-per-worker", "2"],
}


def held_prompts(path: Path, count: int) -> list[dict]:
    """The first `count` Spec-Bench questions (first turn), as `run` request lines."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:count]
    return [{"id": f"q{record.get('question_id', number)}", "messages": [{"role": "user", "content": record["turns"][0]}]}
            for number, record in enumerate(lines)]


def run_once(name: str, flags: list[str], source: Path, folder: Path, extra: list[str], tokens: int) -> dict:
    output = folder / f"{name.replace(' ', '-')}.jsonl"
    command = [sys.executable, "-m", "specdec_cli", "run", str(source), "-o", str(output), "--overwrite", "-q",
               "-t", "0", "--max-new-tokens", str(tokens), *flags, *extra]
    started = time.perf_counter()
    finished = subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE,
                              text=True)
    wall = time.perf_counter() - started
    if finished.returncode != 0:
        raise SystemExit(f"{name}: specdec run exited {finished.returncode}: {finished.stderr[-2000:]}")
    records = [json.loads(line) for line in output.read_text().splitlines()]
    workers = int(flags[flags.index("--workers") + 1]) if "--workers" in flags else 1
    busy = sum(record["stats"]["seconds"] for record in records)
    tokens_made = sum(record["completion_tokens"] for record in records)
    return {"name": name, "flags": flags, "wall_seconds": wall, "completion_tokens": tokens_made,
            "tokens_per_second": tokens_made / wall, "generating_seconds": busy,
            "other_seconds": wall - busy / workers, "records": records}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, default=QUESTIONS, help="Spec-Bench JSONL ({'turns': [...]})")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    arguments, extra = parser.parse_known_args()
    extra = [flag for flag in extra if flag != "--"]
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "prompts.jsonl"
        source.write_text("".join(json.dumps(line) + "\n" for line in held_prompts(arguments.prompts, arguments.n)))
        results = [run_once(name, flags, source, Path(folder), extra, arguments.max_new_tokens)
                   for name, flags in CONFIGURATIONS.items()]
    local_texts = [_text(record) for record in results[0]["records"]]
    print(f"{'configuration':<28} {'wall s':>8} {'tok/s':>7} {'generating s':>13} {'other s':>8} {'vs local':>9}  same texts")
    for result in results:
        result["identical_to_local"] = [_text(record) for record in result["records"]] == local_texts
        print(f"{result['name']:<28} {result['wall_seconds']:8.1f} {result['tokens_per_second']:7.2f} "
              f"{result['generating_seconds']:13.1f} {result['other_seconds']:8.1f} "
              f"{results[0]['wall_seconds'] / result['wall_seconds']:8.2f}x  {result['identical_to_local']}")
    arguments.json.write_text(json.dumps({
        "prompts": str(arguments.prompts), "n": arguments.n, "max_new_tokens": arguments.max_new_tokens,
        "extra": extra, "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "results": results,
    }, indent=1))


def _text(record: dict) -> str | None:
    return record.get("text")


if __name__ == "__main__":
    main()
