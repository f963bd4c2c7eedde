"""specdec on a CUDA GPU: what the CPU-only CI cannot show.

1. Greedy identity on the device: tiny random Llama and Qwen2 targets, each drafted by a noisy copy of itself,
   decoded by the target alone, by chains (k = 1, 4, auto), the cascade and trees (a fixed budget, and grown by
   value); float32 must match the target alone token for token; bfloat16 is reported (a GPU's kernels may round
   a k-token forward differently from a one-token one, so there a lossless rule can still change a token).
2. Sampling on the device: a seed gives the same tokens twice, and the first token's distribution under
   speculation (draft, accept with min(1, p/q), else the residual) against the target's own probabilities.
3. The CLI with --device cuda on tiny saved models (run, compare, chat; chain and tree), and mistakes
   (a GPU this machine lacks, a CPU-only format) answered in one line with exit 2.
4. Forward costs of a Qwen2.5-Coder-1.5B-shaped and a 0.5B-shaped random model in bfloat16 on a 200-token
   cache (n new tokens as a chain, and n tree nodes through the tree mask), and the target alone decoding
   128 tokens through specdec's engine against HF generate.

    python scripts/gpu_check.py [--device cuda] [--json PATH] [--skip-timings]

Runs on a CPU too (--device cpu), for trying the script before a GPU is at hand."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the tests' tiny models and tokenizer

from specdec_cli.drafters import CascadeDrafter, DraftModelDrafter
from specdec_cli.drafters.tree import TreeDrafter
from specdec_cli.engine import FixedK, SamplingParams, SpeculativeDecoder
from specdec_cli.engine.kv import CachedModel
from specdec_cli.session import draft_rule, make_policy
from tests.conftest import perturbed_copy, tiny_causal_lm
from tests.tiny import build_tiny_model, build_tokenizer

PROMPT = [1] + [(7 * i + 3) % 90 + 3 for i in range(60)]
NEW_TOKENS = 48
# Qwen2.5-Coder-1.5B / 0.5B as the demo pair's configs give them (the 1.5B's output layer untied, as in its GGUF).
QWEN_SHAPES = {
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, tie_word_embeddings=False),
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, tie_word_embeddings=True),
}


def tiny_pair(arch: str, seed: int, noise: float, draft_seed: int, device: torch.device,
              dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The tests' tiny random target (2 layers, 96 ids, a sharpened output layer) and its noisy copy as the draft
    (`perturbed_copy`), both made in float32 on the CPU, then moved to `device` at `dtype`."""
    target = tiny_causal_lm(arch, seed=seed, logit_scale=8.0)
    draft = perturbed_copy(target, noise, draft_seed)
    return target.to(device=device, dtype=dtype), draft.to(device=device, dtype=dtype)


def drafters(draft: torch.nn.Module) -> dict:
    """name → (drafter, policy): the configurations the identity check runs."""
    value_tree = CascadeDrafter(TreeDrafter(draft, budget=32, max_depth=20))
    value_tree.obey(draft_rule("auto"))
    chain_auto = DraftModelDrafter(draft)
    chain_auto.obey(draft_rule("auto"))
    return {
        "chain k=1": (DraftModelDrafter(draft), FixedK(1)),
        "chain k=4": (DraftModelDrafter(draft), FixedK(4)),
        "chain k=auto": (chain_auto, make_policy("auto")),
        "cascade k=4": (CascadeDrafter(DraftModelDrafter(draft)), FixedK(4)),
        "tree 8 nodes k=4": (TreeDrafter(draft, budget=8, max_depth=4), FixedK(4)),
        "tree by value k=auto": (value_tree, make_policy("auto")),
    }


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def greedy_identity(device: torch.device) -> list[dict]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for arch, seed in (("llama", 0), ("qwen2", 2)):
            target, draft = tiny_pair(arch, seed, 0.15, seed + 7, device, dtype)
            alone = SpeculativeDecoder(target).generate(PROMPT, SamplingParams(), NEW_TOKENS).tokens
            hf = target.generate(torch.tensor([PROMPT], device=device), do_sample=False, max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
            rows.append({"dtype": str(dtype).removeprefix("torch."), "arch": arch, "configuration": "HF generate",
                         "identical": hf == alone, "first_divergence": first_divergence(hf, alone)})
            for name, (drafter, policy) in drafters(draft).items():
                result = SpeculativeDecoder(target, drafter, policy).generate(PROMPT, SamplingParams(), NEW_TOKENS)
                stats = result.stats
                rows.append({"dtype": str(dtype).removeprefix("torch."), "arch": arch, "configuration": name,
                             "identical": result.tokens == alone, "first_divergence": first_divergence(result.tokens, alone),
                             "drafted": stats.drafted, "accepted": stats.accepted, "steps": stats.steps,
                             "tree_steps": stats.tree_steps})
    return rows


def sampling(device: torch.device, draws: int) -> dict:
    """The first token's distribution: speculative (chain k=4, a noisy draft) against the target's softmax."""
    target, draft = tiny_pair("llama", 0, 0.5, 3, device, torch.float32)
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, seed=11)
    decoder = SpeculativeDecoder(target, DraftModelDrafter(draft), FixedK(4))
    twice = [decoder.generate(PROMPT, params, 24).tokens for _ in range(2)]
    with torch.no_grad():
        probs = torch.softmax(target(torch.tensor([PROMPT], device=device)).logits[0, -1].float(), -1).cpu()
    counts = torch.zeros_like(probs)
    started = time.perf_counter()
    for draw in range(draws):
        token = decoder.generate(PROMPT, SamplingParams(temperature=1.0, top_p=1.0, top_k=0, seed=1000 + draw), 1).tokens[0]
        counts[token] += 1
    seconds = time.perf_counter() - started
    expected = probs * draws
    big = expected >= 5  # chi-square over the ids expected at least 5 times, the rest pooled
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    wanted = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = wanted > 0
    chi2 = float(((observed[keep] - wanted[keep]) ** 2 / wanted[keep]).sum())
    return {"seeded_twice_identical": twice[0] == twice[1], "draws": draws, "seconds": round(seconds, 1),
            "total_variation": round(float(0.5 * (counts / draws - probs).abs().sum()), 4),
            "chi_square": round(chi2, 1), "degrees_of_freedom": int(keep.sum()) - 1}


def cli(device: str) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        tokenizer = build_tokenizer()
        build_tiny_model(folder / "target", "qwen2", seed=0, tokenizer=tokenizer)
        build_tiny_model(folder / "draft", "qwen2", seed=0, tokenizer=tokenizer)  # the same weights: drafts accepted
        prompts = folder / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"id": str(i), "prompt": text}) + "\n"
                                   for i, text in enumerate(["def add(a, b):", "The quick brown fox", "for i in"])))
        pair = ["--target", str(folder / "target"), "--draft", str(folder / "draft"), "--device", device]
        commands = {
            "run chain": ["run", str(prompts), "-o", str(folder / "chain.jsonl"), *pair, "-n", "24", "-q"],
            "run tree": ["run", str(prompts), "-o", str(folder / "tree.jsonl"), *pair, "--drafter", "tree", "-n", "24",
                         "-q", "--batch-size", "1"],
            "compare": ["compare", "--prompts", str(prompts), *pair, "--drafter", "model,cascade,tree", "--k", "4,auto",
                        "-n", "24", "--json", str(folder / "compare.json")],
            "chat": ["chat", *pair, "--temperature", "0", "-n", "24"],
            "mistake: a GPU it lacks": ["run", str(prompts), "-o", str(folder / "x.jsonl"), *pair[:4], "--device",
                                        "cuda:7", "-q"],
            "mistake: q4 on the GPU": ["run", str(prompts), "-o", str(folder / "y.jsonl"), *pair, "--target-quant",
                                       "q4", "-q"],
        }
        for name, arguments in commands.items():
            completed = subprocess.run([sys.executable, "-m", "specdec_cli", *arguments], capture_output=True, text=True,
                                       input="def add(a, b):\n" if name == "chat" else None, timeout=600)
            row = {"command": name, "exit_code": completed.returncode,
                   "traceback": "Traceback" in completed.stderr + completed.stdout,
                   "stderr_tail": completed.stderr.strip().splitlines()[-3:]}
            if name.startswith("run") and completed.returncode == 0:
                records = [json.loads(line) for line in (folder / arguments[3]).read_text().splitlines()]
                row["records"] = len(records)
                row["stats"] = records[0].get("stats")
            if name == "compare" and completed.returncode == 0:
                report = json.loads((folder / "compare.json").read_text())
                row["identical"] = {s["configuration"]: s["identical"] for s in report["summary"]}
                row["environment_device"] = report["environment"]["device"]
            rows.append(row)
    return rows


def shaped(shape: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    config = Qwen2Config(vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         use_sliding_window=False, **QWEN_SHAPES[shape])
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    return model.eval()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_costs(model: torch.nn.Module, device: torch.device, repeats: int = 15) -> dict:
    """Median ms of n new tokens on a 200-token cache: as a chain (plain forward) and as n tree nodes (a binary
    tree through the tree mask)."""
    cached = CachedModel(model)
    context = [(17 * i) % 150000 + 10 for i in range(200)]
    cached.extend(context)
    chain, tree = {}, {}
    for n in (1, 2, 4, 8, 16, 32, 64):
        times = []
        for _ in range(repeats + 2):
            synchronize(device)
            started = time.perf_counter()
            cached.extend(context + list(range(100, 100 + n)), n_logits=n)
            synchronize(device)
            times.append(time.perf_counter() - started)
            cached.crop(200)
        chain[n] = round(1000 * statistics.median(times[2:]), 2)
        parents = [-1] + [(i - 1) // 2 for i in range(1, n)]
        times = []
        for _ in range(repeats + 2):
            synchronize(device)
            started = time.perf_counter()
            cached.extend_tree(context, list(range(300, 300 + n)), parents)
            synchronize(device)
            times.append(time.perf_counter() - started)
            cached.crop(200)
        tree[n] = round(1000 * statistics.median(times[2:]), 2)
    return {"chain_ms": chain, "tree_ms": tree}


def decode_speed(model: torch.nn.Module, device: torch.device, tokens: int = 128) -> dict:
    prompt = [(31 * i) % 150000 + 10 for i in range(64)]
    decoder = SpeculativeDecoder(model)
    decoder.generate(prompt, SamplingParams(), 16)  # warm-up
    decoder.reset()
    synchronize(device)
    started = time.perf_counter()
    ours = decoder.generate(prompt, SamplingParams(), tokens).tokens
    ours_seconds = time.perf_counter() - started
    ids = torch.tensor([prompt], device=device)
    model.generate(ids, do_sample=False, max_new_tokens=16, min_new_tokens=16, eos_token_id=None, pad_token_id=0)
    synchronize(device)
    started = time.perf_counter()
    theirs = model.generate(ids, do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens, eos_token_id=None,
                            pad_token_id=0)[0, len(prompt):].tolist()
    synchronize(device)
    hf_seconds = time.perf_counter() - started
    return {"tokens": tokens, "specdec_target_alone_tok_s": round(tokens / ours_seconds, 1),
            "hf_generate_tok_s": round(tokens / hf_seconds, 1), "same_tokens": ours == theirs,
            "first_divergence": first_divergence(ours, theirs)}


def timings(device: torch.device) -> dict:
    result = {}
    for shape in ("1.5B", "0.5B"):
        model = shaped(shape, device, torch.bfloat16)
        result[shape] = {"forward": forward_costs(model, device), "decode": decode_speed(model, device)}
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--draws", type=int, default=3000)
    parser.add_argument("--skip-timings", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    environment = {"device": args.device, "torch": torch.__version__, "transformers": transformers.__version__,
                   "python": platform.python_version(),
                   "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    print(json.dumps(environment), flush=True)
    report = {"schema": "specdec.gpu_check/1", "environment": environment}
    parts = [("greedy", lambda: greedy_identity(device)), ("sampling", lambda: sampling(device, args.draws)),
             ("cli", lambda: cli(args.device))]
    if not args.skip_timings:
        parts.append(("timings", lambda: timings(device)))
    for name, part in parts:
        started = time.perf_counter()
        try:
            report[name] = part()
        except Exception as error:  # a check that breaks is a finding: keep the others going
            import traceback
            report[name] = {"error": repr(error), "traceback": traceback.format_exc()[-3000:]}
        print(f"## {name} ({time.perf_counter() - started:.0f} s)\n{json.dumps(report[name], indent=1)}", flush=True)
        if args.json:
            args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
