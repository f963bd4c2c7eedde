"""Checks made before any weights are loaded: do the tokenizers agree, and will the weights fit."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re

import torch

from specdec_cli.errors import CacheWriteError, IncompatibleModelsError, InsufficientMemoryError
from specdec_cli.models.device import GIB, available_memory_bytes, format_gib
from specdec_cli.models.formats.quant import canonical, compute_dtype, linear_bytes
from specdec_cli.models.paths import atomic_file, specdec_home

_SPECIAL_TOKENS = ("bos", "eos", "pad", "unk")
# bos/eos must match exactly (they decide where text starts and stops); pad/unk only when both define them,
# since tokenizer classes differ on defaults (Qwen2Tokenizer sets unk, a plain fast tokenizer does not).
_REQUIRED_SPECIAL_TOKENS = ("bos", "eos")
ESTIMATES = "weight-estimates.json"  # in the specdec home: a local config's estimate per format and dtype
ESTIMATE_FORMULA = 1  # raise when estimate_weight_bytes counts differently: figures stored before are not reused
# Headroom over the weights for activations, the KV cache and the runtime itself.
MEMORY_MARGIN_FACTOR = 1.15
MEMORY_MARGIN_BYTES = GIB // 2


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


def tokenizer_difference(target_tokenizer, draft_tokenizer) -> str | None:
    """Why the draft cannot draft in the target's ids (None: the same token→id map over the ids both have, and the
    same special tokens; a padded vocabulary passes)."""
    common = min(len(target_tokenizer), len(draft_tokenizer))
    target_map = _ids_to_tokens(target_tokenizer, common)
    draft_map = _ids_to_tokens(draft_tokenizer, common)
    token_id = _first_difference(target_map, draft_map)
    if token_id is not None:
        return f"their tokenizers differ (id {token_id} is {target_map.get(token_id)!r} vs {draft_map.get(token_id)!r})"
    target_special, draft_special = _special_tokens(target_tokenizer), _special_tokens(draft_tokenizer)
    for role in _SPECIAL_TOKENS:
        both_defined = target_special[role][0] is not None and draft_special[role][0] is not None
        if (role in _REQUIRED_SPECIAL_TOKENS or both_defined) and target_special[role] != draft_special[role]:
            return f"their {role} tokens differ ({target_special[role]} vs {draft_special[role]})"
    return None


def check_tokenizers_compatible(target_tokenizer, draft_tokenizer, target_name: str, draft_name: str) -> None:
    """IncompatibleModelsError where the draft cannot draft in the target's ids (`tokenizer_difference`)."""
    why = tokenizer_difference(target_tokenizer, draft_tokenizer)
    if why is not None:
        raise _incompatible(target_name, draft_name, why)


# A pair of tokenizers whose smaller vocabulary has less than this share of its tokens in the other's is warned about:
# the draft's text is made of words the target splits otherwise, and little of it is likely to be accepted. (The
# smaller one's share: a small draft vocabulary cannot hold most of a large target's tokens, and need not, since its
# text is tokenised again for the target.)
LOW_OVERLAP = 0.5


def vocabulary_shares(target_tokenizer, draft_tokenizer) -> tuple[float, float]:
    """(the share of the target's token strings that the draft's vocabulary has too, the share of the draft's that
    the target's has), both written as text: a byte-level BPE's byte characters (Ġ for a space) and SentencePiece's
    ▁ and <0xNN> byte tokens read back as the characters they stand for; special and added tokens and parts of
    characters left out."""
    target_tokens, draft_tokens = _token_texts(target_tokenizer), _token_texts(draft_tokenizer)
    common = len(target_tokens & draft_tokens)
    return common / max(len(target_tokens), 1), common / max(len(draft_tokens), 1)


def vocabulary_overlap(target_tokenizer, draft_tokenizer) -> float:
    """The share of the target's token strings that the draft's vocabulary has too (`vocabulary_shares`)."""
    return vocabulary_shares(target_tokenizer, draft_tokenizer)[0]


def cross_vocabulary_line(shares: tuple[float, float], target_name: str, draft_name: str) -> str:
    """The one line a pair of different tokenizers gets (`shares`: `vocabulary_shares`): a note, or a warning where
    even the smaller vocabulary has little of itself in the other."""
    said = (f"the draft {draft_name} has another tokenizer than the target {target_name}: it has {shares[0]:.0%} of "
            f"the target's tokens, and the target {shares[1]:.0%} of its own; it drafts text, which the target "
            "verifies as its own tokens (lossless)")
    if max(shares) < LOW_OVERLAP:
        return (f"warning: {said}, but with so few tokens in common little of it may be accepted: a draft of the "
                "target's family, or --drafter ngram, may be faster")
    return f"note: {said}"


def _token_texts(tokenizer) -> set[str]:
    """The tokenizer's token strings as text (`vocabulary_overlap`): its special and added tokens left out, and the
    tokens that are part of a character (a byte of one), which say nothing of the words a tokenizer knows."""
    added = set(tokenizer.get_added_vocab())
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    byte_level = type(decoder).__name__ == "ByteLevel"
    texts = {_as_text(token, byte_level) for token in tokenizer.get_vocab() if token not in added}
    return {text for text in texts if "\ufffd" not in text}


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _as_text(token: str, byte_level: bool) -> str:
    if byte_level:
        raw = bytes(_BYTE_OF_CHARACTER.get(character, 0x3F) for character in token)  # 0x3F: "?", never a byte char
        return raw.decode("utf-8", errors="replace")
    byte = _BYTE_TOKEN.fullmatch(token)
    if byte:
        return bytes([int(byte.group(1), 16)]).decode("utf-8", errors="replace")
    return token.replace("\u2581", " ")


def _byte_characters() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte in a byte-level BPE's tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    characters, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            characters[chr(byte)] = byte
        else:
            characters[chr(256 + extra)] = byte
            extra += 1
    return characters


_BYTE_OF_CHARACTER = _byte_characters()


# ---- memory -----------------------------------------------------------------------------------


def _layer_shapes(config) -> tuple[list[tuple[int, int]], tuple[int, int], int, bool]:
    """(in, out) of every Linear layer but the output layer, the output layer's (in, out), the count
    of all other weights, and whether the output layer is tied to the input embedding; read from the
    model `config` describes, built on the meta device so nothing is allocated."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    linears = [module for module in model.modules() if isinstance(module, torch.nn.Linear) and module is not head]
    tied = head.weight is model.get_input_embeddings().weight
    total = sum(parameter.numel() for parameter in model.parameters())
    other = total - sum(module.weight.numel() for module in linears) - (0 if tied else head.weight.numel())
    shapes = [(module.in_features, module.out_features) for module in linears]
    return shapes, (head.weight.shape[1], head.weight.shape[0]), other, tied


def estimate_weight_bytes(config, dtype: torch.dtype, quantization: str | None) -> int:
    """Bytes the weights of `config`'s model take when loaded at `dtype` with `quantization`: the Linear
    layers in their format (quant.linear_bytes), everything else at the dtype the model computes in.
    int8/int4/q4 quantise the output layer too (a tied one gets a copy beside the embedding); nf4/bnb8
    leave it to bitsandbytes, which keeps it."""
    shapes, head_shape, other, tied = _layer_shapes(config)
    name = canonical(quantization)
    if name == "auto":  # not resolved yet (`profiles list`): int8, the larger of what it means on a CPU without a
        # calibration (int8 on an AVX2-only CPU; q4, smaller, on an AVX512-VNNI one: quant.UNCALIBRATED)
        name = "int8"
    width = compute_dtype(name, dtype).itemsize
    linear = sum(linear_bytes(name, *shape, dtype) for shape in shapes)
    if name in ("int8", "int4", "q4"):
        return int(linear + linear_bytes(name, *head_shape, dtype) + width * other)
    head = 0 if tied else head_shape[0] * head_shape[1] * width  # a tied head is in `other`
    return int(linear + head + width * other)


def held_weight_bytes(model: torch.nn.Module) -> int:
    """The bytes a loaded model holds in weights: parameters and buffers (specdec's int8 and q4 layers keep their
    packed weights as buffers), plus the packed weights of torch's dynamic int8 Linear layers, which are neither, and
    the bfloat16 copy that reads its prompts (loading/prefill.py), where it has one."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    from specdec_cli.engine.kv import prefill_path

    tensors = list(model.parameters()) + list(model.buffers())
    if (copy := getattr(prefill_path(model), "decoder", None)) is not None:  # an AmxPromptPath holds no weights
        tensors += list(copy.parameters()) + list(copy.buffers())
    packed = [module.weight() for module in model.modules() if isinstance(module, DynamicLinear)]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors + packed)


def fits(needed: int, available: int) -> bool:
    """Whether `needed` bytes of weights, with the pre-flight's margin, fit in `available` bytes."""
    return needed * MEMORY_MARGIN_FACTOR + MEMORY_MARGIN_BYTES <= available


def check_memory(weights: dict[str, int], device: torch.device) -> None:
    """Refuse when the weights (name → bytes) plus a margin exceed the device's free memory."""
    needed = sum(weights.values())
    available = available_memory_bytes(device)
    if fits(needed, available):
        return
    parts = " + ".join(f"{name} ~{format_gib(size)}" for name, size in weights.items())
    where = "VRAM" if device.type == "cuda" else "RAM"
    raise InsufficientMemoryError(
        f"the weights need {parts} = ~{format_gib(needed)} but only {format_gib(available)} of {where} is free",
        "try --load-in-4bit, a smaller pair, or close other programs",
    )


def estimate_local_weight_bytes(spec: str, dtype: torch.dtype, quantization: str | None) -> int | None:
    """The weight estimate for `spec` from a config already on this machine, or None (no network is used; a config
    that cannot be read or built gives None too: loading the model says what is wrong with it). Kept in the specdec
    home by the config's bytes, so `profiles list` builds each model on the meta device once (building them was
    most of its time)."""
    from specdec_cli.models.loading.resolve import local_config_folder

    folder = local_config_folder(spec)
    if folder is None:
        return None
    try:
        config = (folder / "config.json").read_bytes()
    except OSError:
        return None
    key = f"{ESTIMATE_FORMULA}:{hashlib.sha256(config).hexdigest()}:{dtype}:{quantization}"
    stored = _stored_estimates()
    if type(stored.get(key)) is int:  # not a bool, nor anything else a damaged file holds
        return stored[key]
    from transformers import AutoConfig

    try:
        estimate = estimate_weight_bytes(AutoConfig.from_pretrained(folder), dtype, quantization)
    except Exception:  # a broken or foreign config: the model class's own code raises what it raises
        return None
    _store_estimates({**stored, key: estimate})
    return estimate


def _stored_estimates() -> dict:
    try:
        stored = json.loads((specdec_home() / ESTIMATES).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, or not readable: the estimates are made again
        return {}
    return stored if isinstance(stored, dict) else {}


def _store_estimates(estimates: dict) -> None:
    """Replace the stored estimates whole (paths.atomic_file); where the home cannot be written (full, read-only, a
    file), keep none."""
    with contextlib.suppress(OSError, CacheWriteError), atomic_file(specdec_home() / ESTIMATES) as staging:
        staging.write_text(json.dumps(estimates), encoding="utf-8")
