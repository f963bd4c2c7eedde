"""Write a `.gguf` at the real shape of a 7B-class model, as llama.cpp's Q4_K_M makes it, with random valid blocks and
the demo target's tokenizer; optionally time specdec on it (load, peak memory, prompt read, decoding of the target
alone). Speed and memory do not depend on the weights' values; acceptance does (take it from the demo pair).

    python scripts/gguf_shapes.py --shape qwen2.5-7b --out /tmp/qwen7b-q4_k_m.gguf [--measure --json FILE]

Q4_K_M's mix, as llama.cpp's quantiser picks it: Q6_K for the output layer and for attn_v and ffn_down in the
layers `use_more_bits` names (the first and last eighth, and every third between), Q4_K for every other matrix
(the embedding too), F32 for norms and biases."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

SHAPES = {  # architecture, hidden, intermediate, layers, heads, kv heads, vocabulary rows, rope theta, qkv bias
    "qwen2.5-7b": ("qwen2", 3584, 18944, 28, 28, 4, 152064, 1e6, True),
    "llama-3.1-8b": ("llama", 4096, 14336, 32, 32, 8, 128256, 5e5, False),
}
BLOCK = {"Q4_K": (256, 144, 0), "Q6_K": (256, 210, 208)}  # channels, bytes, offset of d (float16)


def use_more_bits(layer: int, layers: int) -> bool:
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def random_blocks(kind: str, rows: int, width: int, rng: np.random.Generator) -> np.ndarray:
    channels, size, d_at = BLOCK[kind]
    blocks = rng.integers(0, 256, size=(rows * width // channels, size), dtype=np.uint8)
    small = rng.uniform(1e-5, 5e-5, (len(blocks), 2 if kind == "Q4_K" else 1)).astype(np.float16).view(np.uint8)
    blocks[:, d_at:d_at + small.shape[1]] = small  # d (and dmin): weights of a sane scale
    return blocks.reshape(rows, -1)


def demo_tokenizer() -> dict:
    """The demo target's tokenizer fields, read from its .gguf (installed by the demo extra)."""
    from gguf import GGUFReader

    from specdec_cli.models.loading.demo import DEMO_MODELS, ensure_joined

    reader = GGUFReader(str(ensure_joined(DEMO_MODELS["qwen2.5-coder-1.5b"])))
    fields = {}
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            fields[name] = field.contents()
    return fields


def fitted_tokenizer(fields: dict, vocab: int) -> dict:
    """The demo tokenizer's `fields` for a vocabulary of `vocab` rows: padded with unused tokens where it is larger
    (as llama.cpp's converter pads), else its first ordinary tokens, then its special ones (control and user-defined:
    <|endoftext|>, <|im_start|>, ...) with the bos/eos/pad ids moved with them, and only the merges of tokens kept.
    Cut at the first `vocab` tokens, Llama-3.1-8B's 128,256 rows lost every special token its ids name, and
    transformers refused the config (a pad id outside the embedding)."""
    import gguf

    tokens, types = list(fields["tokenizer.ggml.tokens"]), list(fields["tokenizer.ggml.token_type"])
    fitted = dict(fields)
    if vocab >= len(tokens):
        fitted["tokenizer.ggml.tokens"] = tokens + [f"[PAD{index}]" for index in range(len(tokens), vocab)]
        fitted["tokenizer.ggml.token_type"] = types + [gguf.TokenType.UNUSED] * (vocab - len(types))
        return fitted
    special = [index for index, kind in enumerate(types)
               if kind in (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED)]
    chosen = set(special)
    order = [index for index in range(len(tokens)) if index not in chosen][:vocab - len(special)] + special
    moved = {old: new for new, old in enumerate(order)}
    fitted["tokenizer.ggml.tokens"] = [tokens[index] for index in order]
    fitted["tokenizer.ggml.token_type"] = [types[index] for index in order]
    kept = set(fitted["tokenizer.ggml.tokens"])
    fitted["tokenizer.ggml.merges"] = [
        merge for merge in fields["tokenizer.ggml.merges"]
        if all(part in kept for part in (*merge.split(" ", 1), merge.replace(" ", "", 1)))]
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.padding_token_id"):
        if key in fields:
            fitted[key] = moved[int(fields[key])]
    return fitted


def write(shape: str, out: Path, seed: int = 0) -> None:
    import gguf

    arch, hidden, inter, layers, heads, kv_heads, vocab, theta, bias = SHAPES[shape]
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_context_length(32768)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(1e-6)
    tokenizer = fitted_tokenizer(demo_tokenizer(), vocab)
    writer.add_tokenizer_model(tokenizer["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(tokenizer.get("tokenizer.ggml.pre", "qwen2"))
    writer.add_token_list(tokenizer["tokenizer.ggml.tokens"])
    writer.add_token_types(tokenizer["tokenizer.ggml.token_type"])
    writer.add_token_merges(tokenizer["tokenizer.ggml.merges"])
    for key, add in (("tokenizer.ggml.eos_token_id", writer.add_eos_token_id),
                     ("tokenizer.ggml.bos_token_id", writer.add_bos_token_id),
                     ("tokenizer.ggml.padding_token_id", writer.add_pad_token_id),
                     ("tokenizer.chat_template", writer.add_chat_template)):
        if key in tokenizer:
            add(tokenizer[key])
    rng = np.random.default_rng(seed)

    def matrix(name: str, kind: str, rows: int, width: int) -> None:
        writer.add_tensor(name, random_blocks(kind, rows, width, rng), raw_dtype=gguf.GGMLQuantizationType[kind])

    def vector(name: str, length: int, value: float = 1.0) -> None:
        writer.add_tensor(name, np.full(length, value, dtype=np.float32))

    matrix("token_embd.weight", "Q4_K", vocab, hidden)
    for layer in range(layers):
        more = "Q6_K" if use_more_bits(layer, layers) else "Q4_K"
        block = f"blk.{layer}"
        vector(f"{block}.attn_norm.weight", hidden)
        vector(f"{block}.ffn_norm.weight", hidden)
        matrix(f"{block}.attn_q.weight", "Q4_K", heads * head_dim, hidden)
        matrix(f"{block}.attn_k.weight", "Q4_K", kv_heads * head_dim, hidden)
        matrix(f"{block}.attn_v.weight", more, kv_heads * head_dim, hidden)
        if bias:
            vector(f"{block}.attn_q.bias", heads * head_dim, 0.0)
            vector(f"{block}.attn_k.bias", kv_heads * head_dim, 0.0)
            vector(f"{block}.attn_v.bias", kv_heads * head_dim, 0.0)
        matrix(f"{block}.attn_output.weight", "Q4_K", hidden, heads * head_dim)
        matrix(f"{block}.ffn_gate.weight", "Q4_K", inter, hidden)
        matrix(f"{block}.ffn_up.weight", "Q4_K", inter, hidden)
        matrix(f"{block}.ffn_down.weight", more, hidden, inter)
    vector("output_norm.weight", hidden)
    matrix("output.weight", "Q6_K", vocab, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def peak_gib() -> float:
    return int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0]) / 2**20


def measure(path: Path, prompt_tokens: int = 64, new_tokens: int = 64) -> dict:
    """specdec's q4 target alone on the file: load seconds, peak memory, prompt read and decoding in tokens/s."""
    import torch

    from specdec_cli.engine.kv import CachedModel
    from specdec_cli.models import load_model
    from specdec_cli.models.formats.calibration import machine

    started = time.perf_counter()
    loaded = load_model(str(path), quantization="q4", progress=False)
    load_seconds = time.perf_counter() - started
    after_load = peak_gib()
    ids = [(17 * index + 101) % 50000 + 200 for index in range(prompt_tokens)]
    runner = CachedModel(loaded.model)
    started = time.perf_counter()
    logits = runner.extend(ids, 1)
    prompt_seconds = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(new_tokens):
        logits = runner.extend([int(torch.argmax(logits[-1]))], 1)
    decode_seconds = time.perf_counter() - started
    return {"machine": machine(), "file": str(path), "file_gib": path.stat().st_size / 2**30,
            "described": loaded.describe("target"), "load_seconds": load_seconds, "peak_gib_after_load": after_load,
            "peak_gib": peak_gib(), "prompt_tokens": prompt_tokens,
            "prompt_tokens_per_second": prompt_tokens / prompt_seconds, "new_tokens": new_tokens,
            "decode_tokens_per_second": new_tokens / decode_seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-7b")
    parser.add_argument("--out", type=Path, required=True, help="the .gguf to write (kept if it exists)")
    parser.add_argument("--measure", action="store_true", help="then time specdec's q4 target alone on it")
    parser.add_argument("--json", type=Path, help="write the measurement here")
    args = parser.parse_args()
    if not args.out.is_file():
        write(args.shape, args.out)
        print(f"wrote {args.out} ({args.out.stat().st_size / 2**30:.2f} GiB)")
    if args.measure:
        result = measure(args.out)
        print(json.dumps(result, indent=1))
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
