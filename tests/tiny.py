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
    from transformers import LlamaConfig, Qwen2Config

    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
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
