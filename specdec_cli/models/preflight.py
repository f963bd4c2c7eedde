"""Checks made before any weights are loaded: do the tokenizers agree, and will the weights fit."""

from __future__ import annotations

import torch

from specdec_cli.errors import IncompatibleModelsError, InsufficientMemoryError

_SPECIAL_TOKENS = ("bos", "eos", "pad", "unk")
# bos/eos must match exactly (they decide where text starts and stops); pad/unk only when both define them,
# since tokenizer classes differ on defaults (Qwen2Tokenizer sets unk, a plain fast tokenizer does not).
_REQUIRED_SPECIAL_TOKENS = ("bos", "eos")
GIB = 1024**3
# Headroom over the weights for activations, the KV cache and the runtime itself.
MEMORY_MARGIN_FACTOR = 1.15
MEMORY_MARGIN_BYTES = GIB // 2
# nf4 stores 4 bits per weight plus one fp32 absmax per 64 weights (double-quantised: ~0.127 bits).
_BYTES_PER_WEIGHT = {"4bit": 4.25 / 8, "8bit": 1.0}


# ---- tokenizers -------------------------------------------------------------------------------


def _ids_to_tokens(tokenizer, limit: int) -> dict[int, str]:
    return {token_id: token for token, token_id in tokenizer.get_vocab().items() if token_id < limit}


def _first_difference(target_map: dict[int, str], draft_map: dict[int, str]) -> int | None:
    for token_id in sorted(target_map.keys() | draft_map.keys()):
        if target_map.get(token_id) != draft_map.get(token_id):
            return token_id
    return None


def _special_tokens(tokenizer) -> dict[str, tuple[str | None, int | None]]:
    return {
        role: (getattr(tokenizer, f"{role}_token", None), getattr(tokenizer, f"{role}_token_id", None))
        for role in _SPECIAL_TOKENS
    }


def _incompatible(target_name: str, draft_name: str, why: str) -> IncompatibleModelsError:
    return IncompatibleModelsError(
        f"the draft {draft_name} cannot draft for the target {target_name}: {why}",
        "pick a draft from the same model family, or use --drafter ngram",
    )


def check_tokenizers_compatible(target_tokenizer, draft_tokenizer, target_name: str, draft_name: str) -> None:
    """Same token→id map over the ids both have, and the same special tokens. A padded vocabulary passes."""
    common = min(len(target_tokenizer), len(draft_tokenizer))
    target_map = _ids_to_tokens(target_tokenizer, common)
    draft_map = _ids_to_tokens(draft_tokenizer, common)
    token_id = _first_difference(target_map, draft_map)
    if token_id is not None:
        why = f"their tokenizers differ (id {token_id} is {target_map.get(token_id)!r} vs {draft_map.get(token_id)!r})"
        raise _incompatible(target_name, draft_name, why)
    target_special, draft_special = _special_tokens(target_tokenizer), _special_tokens(draft_tokenizer)
    for role in _SPECIAL_TOKENS:
        both_defined = target_special[role][0] is not None and draft_special[role][0] is not None
        if (role in _REQUIRED_SPECIAL_TOKENS or both_defined) and target_special[role] != draft_special[role]:
            why = f"their {role} tokens differ ({target_special[role]} vs {draft_special[role]})"
            raise _incompatible(target_name, draft_name, why)


# ---- memory -----------------------------------------------------------------------------------


def _parameter_counts(config) -> tuple[int, int, int]:
    """(weights in quantisable Linear layers, all other weights, weights of an output layer that is not
    tied to the input embedding) of the model `config` describes, counted on the meta device so nothing
    is allocated."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    output_layer = model.get_output_embeddings()
    linear = sum(
        module.weight.numel()
        for module in model.modules()
        if isinstance(module, torch.nn.Linear) and module is not output_layer
    )
    total = sum(parameter.numel() for parameter in model.parameters())
    tied = output_layer.weight is model.get_input_embeddings().weight
    return linear, total - linear, 0 if tied else output_layer.weight.numel()


def estimate_weight_bytes(config, dtype: torch.dtype, quantization: str | None) -> int:
    """Bytes the weights of `config`'s model take at `dtype`; with 4bit/8bit the Linear layers
    (not the embeddings or the output layer, which bitsandbytes keeps) shrink accordingly."""
    linear, other, untied_head = _parameter_counts(config)
    if quantization == "int8":
        # Every Linear in int8, the output layer too (a tied one gets an int8 copy beside the embedding,
        # an untied one is replaced); everything else in fp32.
        head = untied_head or config.vocab_size * config.hidden_size
        return int(linear + head + 4 * (other - untied_head))
    full_width = torch.empty(0, dtype=dtype).element_size()
    linear_width = _BYTES_PER_WEIGHT.get(quantization, full_width)
    return int(linear * linear_width + other * full_width)


def available_memory_bytes(device: torch.device) -> int:
    """Free VRAM on a CUDA device, else free RAM (mps shares system memory)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def format_gib(size: int) -> str:
    return f"{size / GIB:.1f} GiB"


def check_memory(weights: dict[str, int], device: torch.device) -> None:
    """Refuse when the weights (name → bytes) plus a margin exceed the device's free memory."""
    needed = sum(weights.values())
    available = available_memory_bytes(device)
    if needed * MEMORY_MARGIN_FACTOR + MEMORY_MARGIN_BYTES <= available:
        return
    parts = " + ".join(f"{name} ~{format_gib(size)}" for name, size in weights.items())
    where = "VRAM" if device.type == "cuda" else "RAM"
    raise InsufficientMemoryError(
        f"the weights need {parts} = ~{format_gib(needed)} but only {format_gib(available)} of {where} is free",
        "try --load-in-4bit, a smaller pair, or close other programs",
    )


def estimate_local_weight_bytes(spec: str, dtype: torch.dtype, quantization: str | None) -> int | None:
    """The weight estimate for `spec` from a config already on this machine, or None (no network is used)."""
    from transformers import AutoConfig

    from specdec_cli.models.resolve import local_config_folder

    folder = local_config_folder(spec)
    if folder is None:
        return None
    return estimate_weight_bytes(AutoConfig.from_pretrained(folder), dtype, quantization)
