"""How close the q4 demo target stays to the bfloat16 one, its Q4_K layers taken from the .gguf as they are
(gguf_q4.py) against all of them requantised from the bfloat16 conversion (what q4 did before).

    python scripts/gguf_q4_quality.py [--prompts 13] [--max-new-tokens 128] --json benchmarks/....json

For each Spec-Bench prompt (one per category) and each way, the q4 target's greedy output, then one bfloat16
forward and one q4 forward over prompt + output: the first output token where bfloat16's argmax differs is where
the two greedy outputs part (before it the contexts are the same), "identical" when it never does; over every
output position, how often the two argmaxes agree and the mean KL(bfloat16 ‖ q4). Also each layer's weight error
against the .gguf's own dequantised values (relative Frobenius), per tensor type in the file. `--output-layers`
adds ways with the file's values and the output layer (Q6_K in the file, so q4 requantises it) at int8 per output
channel (specdec's int8 matmul) or float32, and times a one-token forward with each head, alternating."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from specdec_cli.engine.cache_layers import new_cache
from specdec_cli.models import gguf_q4, load_model
from specdec_cli.models.calibrate import machine
from specdec_cli.models.int8 import PerTokenInt8Linear
from specdec_cli.session import encode_chat

QUESTIONS = Path(__file__).resolve().parents[1].parent / "shared/prompts/spec_bench_questions.jsonl"
TARGET = "demo:qwen2.5-coder-1.5b"


def one_per_category(count: int) -> list[str]:
    chosen: dict[str, str] = {}
    for line in QUESTIONS.read_text().splitlines():
        row = json.loads(line)
        chosen.setdefault(row["category"], row["turns"][0])
    return list(chosen.values())[:count]


@torch.inference_mode()
def greedy(model, prompt: list[int], tokens: int) -> list[int]:
    cache, ids = new_cache(model.config), list(prompt)
    logits = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1).logits
    for _ in range(tokens):
        ids.append(int(logits[0, -1].argmax()))
        logits = model(input_ids=torch.tensor([ids[-1:]]), cache=cache, use_cache=True).logits
    return ids[len(prompt):]


@torch.inference_mode()
def logits_over(model, ids: list[int], first: int) -> torch.Tensor:
    """(len(ids) - first, V) float32: the logits that predict ids[first:], one forward."""
    out = model(input_ids=torch.tensor([ids]), cache=new_cache(model.config), use_cache=True).logits[0]
    return out[first - 1:-1].float()


def compare_outputs(reference, model, prompt: list[int], output: list[int]) -> dict:
    ids = prompt + output
    expected, got = logits_over(reference, ids, len(prompt)), logits_over(model, ids, len(prompt))
    agree = expected.argmax(-1) == torch.tensor(output)
    parted = [i for i, same in enumerate(agree.tolist()) if not same]
    log_p, log_q = expected.log_softmax(-1), got.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return {"first_divergence": parted[0] if parted else None, "top1_agreement": float(agree.float().mean()),
            "mean_kl": float(kl.mean())}


def weight_errors(model, path: Path) -> dict:
    """Relative error of every decoder Linear's q4 weight against the .gguf's dequantised tensor, by file type."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors = {tensor.name: tensor for tensor in GGUFReader(str(path)).tensors}
    parts = {"self_attn.o_proj": "attn_output", "mlp.down_proj": "ffn_down"}
    errors: dict[str, list[float]] = {}
    for index, layer in enumerate(model.model.layers):
        for module, name in parts.items():
            tensor = tensors[f"blk.{index}.{name}.weight"]
            reference = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).astype(np.float32))
            ours = layer.get_submodule(module).dequantized_weight()
            error = float(torch.linalg.norm(ours - reference) / torch.linalg.norm(reference))
            errors.setdefault(f"{name} ({tensor.tensor_type.name})", []).append(error)
    return {kind: statistics.median(values) for kind, values in errors.items()}


def head_costs(model, heads: dict, repeats: int = 40) -> dict:
    """Median ms of the model's one-token forward over a 200-token cache with each output layer, in turn."""
    cache, times = new_cache(model.config), {name: [] for name in heads}
    with torch.inference_mode():
        model(input_ids=torch.arange(100, 300)[None], cache=cache, use_cache=True, logits_to_keep=1)
        for repeat in range(repeats):
            for name in (list(heads) if repeat % 2 else list(heads)[::-1]):
                model.lm_head = heads[name]
                started = time.perf_counter()
                model(input_ids=torch.tensor([[500]]), cache=cache, use_cache=True)
                times[name].append(time.perf_counter() - started)
                cache.crop(-1)
    return {name: 1000 * statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=13)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--output-layers", action="store_true")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    reference = load_model(TARGET, dtype="bfloat16", progress=False)
    tokenizer, path = reference.tokenizer, Path(reference.source)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": text}]) for text in one_per_category(args.prompts)]
    result = {"machine": machine(), "target": TARGET, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "ways": {}}
    take = gguf_q4.gguf_q4_source
    ways = ["requantised from bfloat16", "Q4_K blocks from the .gguf"]
    if args.output_layers:
        ways += ["Q4_K blocks, output layer int8", "Q4_K blocks, output layer float32"]
    heads = {}
    for way in ways:
        gguf_q4.gguf_q4_source = take if way.startswith("Q4_K") else (lambda *_: None)
        started = time.perf_counter()
        model = load_model(TARGET, dtype="bfloat16", quantization="q4", progress=False).model
        loaded = time.perf_counter() - started
        if way.endswith("int8") or way.endswith("float32"):
            heads.setdefault("q4", model.lm_head)
            full = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=False)
            full.weight.data = reference.model.lm_head.weight.data.float()
            heads[way.rpartition(" ")[2]] = model.lm_head = (PerTokenInt8Linear.from_linear(full)
                                                             if way.endswith("int8") else full)
        rows = [compare_outputs(reference.model, model, prompt, greedy(model, prompt, args.max_new_tokens))
                for prompt in prompts]
        parted = [row["first_divergence"] for row in rows if row["first_divergence"] is not None]
        summary = {
            "load_seconds": loaded, "from_gguf": list(getattr(model, "_specdec_q4_from_gguf", (0, 0))),
            "identical": len(rows) - len(parted), "median_first_divergence": statistics.median(parted) if parted else None,
            "top1_agreement": statistics.mean(row["top1_agreement"] for row in rows),
            "mean_kl": statistics.mean(row["mean_kl"] for row in rows), "weight_error": weight_errors(model, path),
            "per_prompt": rows,
        }
        result["ways"][way] = summary
        print(way, {key: value for key, value in summary.items() if key != "per_prompt"}, flush=True)
        if way.endswith("float32"):
            result["one_token_forward_ms_by_output_layer"] = costs = head_costs(model, heads)
            print("one-token forward by output layer", costs, flush=True)
        del model
    gguf_q4.gguf_q4_source = take
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
