"""Builders for tiny random models and tokenizers saved to folders (offline, a few hundred KB each).

General on purpose: the engine and chat tests can build their own fixtures from these."""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts several tokens and the target verifies them in one pass.",
    "for i in range(10):\n    print(i)\n",
    "Hello, how are you today? I am fine, thank you.",
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(path: Path | None = None, corpus: list[str] | None = None, vocab_size: int = 300):
    """A byte-level BPE tokenizer trained on `corpus`, with eos/bos/pad and a chat template; saved to `path` if given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus or CORPUS, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if path is not None:
        tokenizer.save_pretrained(path)
    return tokenizer


def tiny_config(arch: str, vocab_size: int, tokenizer):
    from transformers import LlamaConfig, Phi3Config, Qwen2Config, Qwen3Config

    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "phi3": Phi3Config}[arch]
    return config_class(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )


def build_tiny_model(path: Path, arch: str = "llama", vocab_size: int | None = None, seed: int = 0, tokenizer=None):
    """A random 2-layer, hidden-64 causal LM (`llama` or `qwen2`) with its tokenizer, saved as safetensors in `path`.
    `vocab_size` larger than the tokenizer gives a padded output layer. Returns the model."""
    from transformers import AutoModelForCausalLM

    tokenizer = tokenizer or build_tokenizer()
    config = tiny_config(arch, vocab_size or len(tokenizer), tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def _permute_for_gguf(weight, heads: int):
    """llama.cpp stores q/k rows interleaved per head (transformers undoes this when it reads a GGUF)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _gguf_tensors(model):
    """(gguf name, float32 array) for each weight of a tiny llama model."""
    import gguf

    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        array = tensor.float().numpy()
        base = hf_name.removesuffix(".weight")
        if base.endswith("q_proj"):
            array = _permute_for_gguf(array, config.num_attention_heads)
        elif base.endswith("k_proj"):
            array = _permute_for_gguf(array, config.num_key_value_heads)
        yield names.get_name(base) + ".weight", array


def _add_gguf_config(writer, config) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)


def _add_gguf_tokenizer(writer, tokenizer) -> None:
    import json

    import gguf

    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    id_to_token = {token_id: token for token, token_id in tokenizer.get_vocab().items()}
    tokens = [id_to_token[token_id] for token_id in range(len(id_to_token))]
    special = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if token in special else gguf.TokenType.NORMAL for token in tokens]
    )
    writer.add_token_merges([" ".join(merge) if isinstance(merge, list) else merge for merge in backend["model"]["merges"]])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(CHAT_TEMPLATE)


def build_tiny_gguf(path: Path, seed: int = 0):
    """A tiny random llama model written as an F32 `.gguf` file at `path` (with a byte-level BPE tokenizer).
    Returns the transformers model it was written from, to compare logits against."""
    import gguf
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer()
    config = tiny_config("llama", len(tokenizer), tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    writer = gguf.GGUFWriter(str(path), "llama")
    _add_gguf_config(writer, config)
    _add_gguf_tokenizer(writer, tokenizer)
    for name, array in _gguf_tensors(model):
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def random_blocks(kind: str, rows: int, width: int, generator):
    """(rows, width/block · block bytes) uint8: random ggml blocks of `kind` (Q4_0, Q4_1, Q4_K, Q5_0, Q8_0, Q6_K, Q5_K
    or Q2_K: any levels and scales), their float16 steps (and minimums) those of a sane tiny model (|w| < 0.3)."""
    import numpy as np

    channels, size = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "Q5_0": (32, 22), "Q8_0": (32, 34),
                      "Q6_K": (256, 210), "Q5_K": (256, 176), "Q2_K": (256, 84)}[kind]
    blocks = generator.integers(0, 256, size=(rows * width // channels, size), dtype=np.uint8)
    # (byte offset, low, high) of each float16 in a block: d first (Q6_K: last), then m (Q4_1) or dmin (Q4_K)
    halves = {"Q4_0": [(0, 0.005, 0.02)], "Q4_1": [(0, 0.005, 0.015), (2, -0.1, 0.0)],
              "Q4_K": [(0, 1e-4, 3e-4), (2, 1e-4, 3e-4)], "Q5_0": [(0, 0.002, 0.01)], "Q8_0": [(0, 1e-4, 1e-3)],
              "Q6_K": [(208, 1e-5, 5e-5)], "Q5_K": [(0, 5e-5, 1.5e-4), (2, 1e-4, 3e-4)],
              "Q2_K": [(80, 1e-4, 3e-4), (82, 1e-4, 3e-4)]}[kind]
    for offset, low, high in halves:
        blocks[:, offset:offset + 2] = generator.uniform(low, high, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def build_4bit_gguf(path: Path, arch: str = "qwen2", kind: str = "Q4_K", seed: int = 0, kinds: dict | None = None,
                    split_max_tensors: int = 0, sizes: tuple[int, int, int] | None = None, embedding: str = "F32",
                    tied: bool = False) -> dict:
    """A tiny random `arch` model (llama, qwen2, qwen3 or phi3; hidden 256: Q4_K needs rows of 256; qwen3's heads must be
    transformers' default 128 wide, its GGUF config leaves them out: sizes=(512, ...)) written as a `.gguf` whose
    Linear weights are random `kind` blocks (Q4_0, Q4_1 or Q4_K, as most of a Q4_K_M file's are), the rest F32.
    llama's q/k rows are stored as written, so transformers' reordering of them on load moves them. Returns {gguf
    tensor name: bytes}.
    kinds: {a piece of a gguf tensor name ("ffn_down"): its kind instead}; split_max_tensors: write a split set of
    parts of that many tensors (`path`'s name then gets -00001-of-0000N); sizes: (hidden, intermediate, layers)
    instead of (256, 512, the tiny config's); embedding: the input embedding's type (F32, F16, or random blocks of
    a kind above); tied: no output tensor (the output layer is the embedding, as in files of tied models)."""
    import gguf
    import numpy as np
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer()
    config = tiny_config(arch, len(tokenizer), tokenizer)
    config.hidden_size, config.intermediate_size = 256, 512
    if sizes is not None:
        config.hidden_size, config.intermediate_size, config.num_hidden_layers = sizes
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:1] * config.num_hidden_layers
    config.head_dim = config.hidden_size // config.num_attention_heads
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    _add_gguf_config(writer, config)
    _add_gguf_tokenizer(writer, tokenizer)
    generator, blocks = np.random.default_rng(seed), {}
    for hf_name, tensor in model.state_dict().items():
        base, _, suffix = hf_name.rpartition(".")
        name = f"{names.get_name(base)}.{suffix}"
        if tied and base == "lm_head":
            continue
        chosen = embedding if base == "model.embed_tokens" else next(
            (other for piece, other in (kinds or {}).items() if piece in name), kind)
        if tensor.dim() == 2 and chosen not in ("F32", "F16"):
            blocks[name] = random_blocks(chosen, *tensor.shape, generator)
            writer.add_tensor(name, blocks[name], raw_dtype=gguf.GGMLQuantizationType[chosen])
        else:
            writer.add_tensor(name, tensor.numpy().astype(np.float16 if chosen == "F16" else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return blocks


def build_gemma3_gguf(path: Path, kind: str = "Q4_K", seed: int = 0, embedding: str = "F32") -> None:
    """A tiny random Gemma 3 (a sliding-window layer and a global one, q/k norms, tied embedding; hidden 256, heads
    128 wide) written as llama.cpp writes one: architecture gemma3, its Linear weights random `kind` blocks, its norms
    stored as 1 + weight (transformers subtracts the 1 on load), the rest F32; the embedding `embedding` (F32, or
    random blocks of a kind)."""
    import gguf
    import numpy as np
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tokenizer = build_tokenizer()
    config = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=128, sliding_window=8,
                              max_position_embeddings=256, layer_types=["sliding_attention", "full_attention"],
                              bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config).eval()
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_sliding_window(config.sliding_window)
    writer.add_vocab_size(config.vocab_size)
    _add_gguf_tokenizer(writer, tokenizer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, config.num_hidden_layers)
    generator = np.random.default_rng(seed)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight":
            continue  # tied to the embedding
        base, _, suffix = hf_name.rpartition(".")
        name = f"{names.get_name(base)}.{suffix}"
        chosen = embedding if base == "model.embed_tokens" else kind
        if tensor.dim() == 2 and chosen != "F32":
            writer.add_tensor(name, random_blocks(chosen, *tensor.shape, generator),
                              raw_dtype=gguf.GGMLQuantizationType[chosen])
        else:
            values = tensor.float().numpy()
            if "norm" in name:  # random, so a norm read without transformers' -1 shows
                values = generator.uniform(0.5, 1.5, values.shape).astype(np.float32)
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def successor_batches(successor: torch.Tensor, alphabet: torch.Tensor, seed: int, batch: int = 32, length: int = 16):
    """Endless (batch, length) id sequences that start anywhere in `alphabet` and follow `successor`."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        columns = [alphabet[torch.randint(len(alphabet), (batch,), generator=generator)]]
        for _ in range(length - 1):
            columns.append(successor[columns[-1]])
        yield torch.stack(columns, 1)


def train_to_follow(model, successor: torch.Tensor, alphabet: torch.Tensor, steps: int, seed: int = 0):
    """Train `model` (in place, a few seconds for a tiny one) until it predicts successor[id] for every id in
    `alphabet` by a wide margin: a confident model, whose greedy choices no quantiser's noise can flip."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _, batch in zip(range(steps), successor_batches(successor, alphabet, seed)):
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def tokenless_tokenizer():
    """A stand-in tokenizer that knows no token (no end-of-turn tokens for `session.eos_token_ids` to add)."""
    from types import SimpleNamespace

    return SimpleNamespace(convert_tokens_to_ids=lambda token: None, convert_ids_to_tokens=lambda token_id: None)
