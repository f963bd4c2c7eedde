"""llama.cpp beside specdec on the same machine, in one run: the demo pair's own .gguf files, each target alone and
with its 0.5B draft, prompt by prompt.

    python scripts/llama_cpp_peer.py --llama-bin PATH/llama.cpp/build/bin [--prompts 13] --json benchmarks/....json

Per prompt (the first question of each Spec-Bench category, as `compare` encodes them: the chat template with the
demo profile's system prompt; llama.cpp gets that text, special tokens parsed), 128 new tokens at most, greedy, 2
threads, the four runs in an order that rotates per prompt:
- llama.cpp alone: `llama-completion -n 128 --temp 0 -no-cnv`; its own timings, prompt eval + eval;
- llama.cpp speculative: `llama-speculative-simple --spec-type draft-simple` with the draft, its default draft
  settings (up to 3 tokens a step; --spec-args adds others, e.g. "--spec-draft-n-max 8");
  its own timings, "encoded" (both models read the prompt) + "decoded" (it may run a few tokens past 128);
- specdec alone and specdec's default drafter (cascade, k=auto), the pair as `auto` picks it here (after
  `specdec calibrate`; the target's prompts read by its bfloat16 copy where --prefill auto takes it).
Each time runs from the prompt's read to the last token; loading the models is left out (llama.cpp loads them
per process, from the page cache after the warm-up). The engines' outputs differ (llama.cpp's Q4_K arithmetic is
not specdec's), so each stops at its own EOS or the budget, and tok/s is its own tokens over its own seconds."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time
from pathlib import Path

import torch

from specdec_cli.engine import SamplingParams
from specdec_cli.models.formats.calibration import machine
from specdec_cli.session import encode_chat

ENGINES = ("llama.cpp alone", "llama.cpp speculative", "specdec alone", "specdec cascade")
NEW_TOKENS = 128


QUESTIONS = Path(__file__).resolve().parents[1].parent / "shared/prompts/spec_bench_questions.jsonl"


def spec_bench_prompts(tokenizer, system: str | None, count: int, per_category: int = 1) -> list[list[int]]:
    """The first Spec-Bench question of each of the first `count` categories, as `compare` encodes them: the chat
    template, with the profile's system prompt where it has one. per_category > 1: the first questions of every
    category round-robin (each category's first, then each one's second, ...), `count` of them."""
    by_category: dict[str, list[str]] = {}
    for line in QUESTIONS.read_text().splitlines():
        question = json.loads(line)
        by_category.setdefault(question["category"], []).append(question["turns"][0])
    texts = [questions[i] for i in range(per_category) for questions in by_category.values() if i < len(questions)]
    system_turn = [{"role": "system", "content": system}] if system else []
    return [encode_chat(tokenizer, [*system_turn, {"role": "user", "content": text}]) for text in texts[:count]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama-bin", required=True, help="the folder holding llama-completion and"
                        " llama-speculative-simple")
    parser.add_argument("--prompts", type=int, default=13)
    parser.add_argument("--spec-args", default="", help="more arguments for llama-speculative-simple")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    from specdec_cli.settings import ModelOverrides, choose_models, load_choice

    choice = choose_models(ModelOverrides(profile="demo"))
    target, draft = load_choice(choice)
    files = _gguf_files()
    llama = Llama(Path(args.llama_bin), files, args.spec_args.split())
    prompts = spec_bench_prompts(target.tokenizer, choice.profile.system, args.prompts)
    texts = [target.tokenizer.decode(prompt, skip_special_tokens=False) for prompt in prompts]
    warm = spec_bench_prompts(target.tokenizer, choice.profile.system, 1)[0][:40]
    _one_of_each(llama, target, draft, warm, target.tokenizer.decode(warm, skip_special_tokens=False))
    rows = []
    for index, (prompt, text) in enumerate(zip(prompts, texts)):
        row = {"prompt_tokens": len(prompt)}
        order = ENGINES[index % 4:] + ENGINES[:index % 4]
        for engine in order:
            row[engine] = _run(engine, llama, target, draft, prompt, text)
        print(f"prompt {index + 1}/{len(prompts)} ({len(prompt)} tokens):",
              "  ".join(f"{engine} {row[engine]['tokens']} tok {row[engine]['seconds']:.2f}s" for engine in ENGINES),
              flush=True)
        rows.append(row)
    totals = {engine: _rate(rows, engine) for engine in ENGINES}
    for engine, total in totals.items():
        print(f"{engine:22} {total['tok/s']:6.2f} tok/s  first step {total['first step s']:.3f} s")
    result = {"machine": machine(), "llama.cpp": llama.version(), "llama.cpp build": build_flags(llama.folder),
              "spec_args": args.spec_args,
              "target": target.describe("target"), "draft": draft.describe("draft"), "max_new_tokens": NEW_TOKENS,
              "files": {role: str(path) for role, path in files.items()}, "prompts": rows, "totals": totals}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def _gguf_files() -> dict[str, Path]:
    from specdec_cli.models.paths import specdec_home

    folder = specdec_home() / "demo"
    return {"target": folder / "qwen2.5-coder-1.5b-q4_k_m.gguf", "draft": folder / "qwen2.5-coder-0.5b-q4_k_m.gguf"}


def build_flags(folder: Path) -> dict[str, str]:
    """The x86 CPU settings of the build whose bin/ `folder` is (GGML_NATIVE, the AVX / AMX flags, repacking,
    OpenMP, the build type), from its CMakeCache.txt."""
    cache = folder.parent / "CMakeCache.txt"
    wanted = ("GGML_NATIVE", "GGML_AVX", "GGML_AMX", "GGML_FMA", "GGML_F16C", "GGML_BMI2", "GGML_CPU_REPACK",
              "GGML_LLAMAFILE", "GGML_OPENMP", "CMAKE_BUILD_TYPE")
    flags = {}
    for line in cache.read_text().splitlines() if cache.exists() else []:
        name, _, value = line.partition("=")
        name = name.split(":")[0]
        if name.startswith(wanted) and not name.endswith("-STRINGS"):
            flags[name] = value
    return flags


class Llama:
    """llama.cpp's two tools, run as processes, their own timings read from what they print."""

    def __init__(self, folder: Path, files: dict[str, Path], spec_args: list[str]) -> None:
        self.folder, self.files, self.spec_args = folder, files, spec_args
        self.env = {**os.environ, "LD_LIBRARY_PATH": str(folder)}

    def version(self) -> str:
        return self._call(["llama-completion", "--version"]).strip().splitlines()[0]

    def alone(self, text: str) -> dict:
        out = self._call(["llama-completion", "-m", str(self.files["target"]), "-t", "2", "-n", str(NEW_TOKENS),
                          "--temp", "0", "-no-cnv", "--no-warmup", "-p", text])
        prompt = re.search(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", out)
        decoded = re.search(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs", out)
        if not prompt or not decoded:
            raise SystemExit(f"llama-completion printed no timings:\n{out[-2000:]}")
        first = float(prompt.group(1)) / 1e3
        # `runs` counts the decode calls after the prompt's: one token each, the first token coming from the prompt's
        return {"seconds": first + float(decoded.group(1)) / 1e3, "first_step": first,
                "tokens": int(decoded.group(2)) + 1, "prompt_tokens": int(prompt.group(2))}

    def speculative(self, text: str) -> dict:
        out = self._call(["llama-speculative-simple", "-m", str(self.files["target"]), "-md", str(self.files["draft"]),
                          "--spec-type", "draft-simple", "-t", "2", "-td", "2", "-n", str(NEW_TOKENS), "--temp", "0",
                          *self.spec_args, "-p", text])
        encoded = re.search(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", out)
        decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", out)
        drafted = re.search(r"n_drafted = (\d+)", out)
        accepted = re.search(r"n_accept  = (\d+)", out)
        if not encoded or not decoded:
            raise SystemExit(f"llama-speculative-simple printed no timings:\n{out[-2000:]}")
        first = float(encoded.group(2))
        return {"seconds": first + float(decoded.group(2)), "first_step": first, "tokens": int(decoded.group(1)),
                "prompt_tokens": int(encoded.group(1)), "drafted": int(drafted.group(1)) if drafted else None,
                "accepted": int(accepted.group(1)) if accepted else None}

    def _call(self, command: list[str]) -> str:
        done = subprocess.run([str(self.folder / command[0]), *command[1:]], env=self.env, capture_output=True,
                              text=True, errors="replace", timeout=600)
        if done.returncode != 0:
            raise SystemExit(f"{command[0]} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-2000:]}")
        return done.stdout + done.stderr


@torch.inference_mode()
def _specdec(target, draft, drafter: str, prompt: list[int]) -> dict:
    from specdec_cli.session import build_decoder

    decoder = build_decoder(target, draft, drafter, "auto")
    started, first, tokens = time.perf_counter(), None, []
    for event in decoder.stream(prompt, SamplingParams(), NEW_TOKENS):
        first = first if first is not None else time.perf_counter() - started
        tokens.extend(event.tokens)
    return {"seconds": time.perf_counter() - started, "first_step": first, "tokens": len(tokens), "output": tokens}


def _run(engine: str, llama: Llama, target, draft, prompt: list[int], text: str) -> dict:
    if engine == "llama.cpp alone":
        return llama.alone(text)
    if engine == "llama.cpp speculative":
        return llama.speculative(text)
    return _specdec(target, draft, "none" if engine == "specdec alone" else "cascade", prompt)


def _one_of_each(llama: Llama, target, draft, prompt: list[int], text: str) -> None:
    for engine in ENGINES:
        _run(engine, llama, target, draft, prompt, text)


def _rate(rows: list[dict], engine: str) -> dict:
    runs = [row[engine] for row in rows]
    return {"tok/s": sum(run["tokens"] for run in runs) / sum(run["seconds"] for run in runs),
            "tokens": sum(run["tokens"] for run in runs), "seconds": sum(run["seconds"] for run in runs),
            "first step s": sum(run["first_step"] for run in runs) / len(runs)}


if __name__ == "__main__":
    main()
