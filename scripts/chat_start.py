"""How long `specdec chat` keeps a user waiting, with and without --prefill's bfloat16 copy (loaded in the background
while the first message is typed).

    python scripts/chat_start.py [--repeats 2] [--typing 4] --json benchmarks/....json

Each run starts `specdec chat --prefill MODE --max-new-tokens 8` on the default profile, takes "ready" when the
models line for the draft is printed, waits --typing seconds (a user typing), sends "Hi", and takes the time from
sending to the process's end (the reply, its stats, the exit). The modes alternate, `none` first, after one untimed
run of each (the files into the page cache)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from specdec_cli.models.calibrate import machine

SPECDEC = Path(sys.executable).with_name("specdec")


def one_chat(mode: str, typing: float) -> dict:
    started = time.perf_counter()
    process = subprocess.Popen([str(SPECDEC), "chat", "--prefill", mode, "--max-new-tokens", "8", "--no-color"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in process.stderr:
        lines.append(line.rstrip("\n"))
        if line.startswith("draft:"):
            break
    ready = time.perf_counter() - started
    time.sleep(typing)
    sent = time.perf_counter()
    process.stdin.write("Hi\n")
    process.stdin.close()
    process.stdout.read()
    process.stderr.read()
    process.wait()
    return {"mode": mode, "ready_seconds": ready, "reply_and_exit_seconds": time.perf_counter() - sent,
            "returncode": process.returncode, "models": lines[-2:]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--typing", type=float, default=4.0)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    for mode in ("none", "auto"):
        one_chat(mode, args.typing)  # warm-up: the model files into the page cache
    runs = []
    for _ in range(args.repeats):
        for mode in ("none", "auto"):
            runs.append(one_chat(mode, args.typing))
            run = runs[-1]
            print(f"--prefill {mode}: ready {run['ready_seconds']:.2f} s, reply and exit "
                  f"{run['reply_and_exit_seconds']:.2f} s after sending, rc {run['returncode']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "typing_seconds": args.typing, "runs": runs},
                                              indent=1))


if __name__ == "__main__":
    main()
