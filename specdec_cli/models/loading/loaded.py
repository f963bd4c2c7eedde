"""Loading: a user's string → a `LoadedModel` on the chosen device, in eval mode.

The order matters: resolve both models, check memory from their configs, load and compare their
tokenizers, and only then load weights — so a pair that cannot work fails in seconds, not minutes."""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specdec_cli.errors import ModelLoadError, SpecdecError
from specdec_cli.models.device import dtype_name, resolve_device, resolve_dtype
from specdec_cli.models.formats import stored_layers
from specdec_cli.models.formats.quant import (check_quantization, compute_dtype, precision, quantization_config,
                                              resolve_auto)
from specdec_cli.models.loading import gguf, gguf_model, preflight
from specdec_cli.models.loading.gguf import config_of, keep_metadata, kept_metadata, require_gguf, shared_readers
from specdec_cli.models.loading.resolve import ModelSource, check_weight_format, resolve, weights_folder
from specdec_cli.models.progress import library_bars, status
from specdec_cli.models.runtime.decoder_stack import slow_path
from specdec_cli.models.runtime.quantize import quantize, quantized_in_place

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class LoadedModel:
    model: "PreTrainedModel"  # eval mode, on device
    tokenizer: "PreTrainedTokenizerBase"
    name: str  # what the user typed
    source: str  # resolved local path / hub id@rev
    device: torch.device
    dtype: torch.dtype  # compute dtype
    quantization: str | None  # None | "int8" | "int4" | "q4" | "nf4" | "bnb8" (canonical: aliases and auto resolved)
    eos_token_ids: tuple[int, ...]  # generation_config.eos_token_id ∪ tokenizer.eos_token_id
    vocab_size: int  # rows of the output layer (logits width)
    # A draft of another tokenizer than its target's: the share of the target's tokens its vocabulary has
    # (preflight.vocabulary_overlap); None: it drafts in the target's ids (or it is no draft)
    vocabulary_overlap: float | None = None

    @property
    def precision(self) -> str:
        """What it runs at, in words: `bfloat16`, `int8 weights, per-token int8 activations`, ..."""
        return precision(self.quantization, dtype_name(self.dtype))

    def describe(self, role: str) -> str:
        """One line saying what was chosen, e.g. `target: demo:qwen2.5-coder-1.5b · cpu · bfloat16`, or
        `target: demo:qwen2.5-coder-1.5b · cpu · float32 · int8 weights, per-token int8 activations`."""
        parts = [self.name, str(self.device), dtype_name(self.dtype)]
        if self.quantization:
            parts.append(self.precision)
        taken, layers = getattr(self.model, "_specdec_q4_from_gguf", (0, 0))
        if taken:
            types = sorted(getattr(self.model, "_specdec_kept_types", {}).items(), key=lambda item: (-item[1], item[0]))
            named = f" ({', '.join(f'{count} {kind}' for kind, count in types)})" if types else ""
            parts.append(f"{taken} of {layers} layers kept as the .gguf's own blocks{named}")
        requantised = getattr(self.model, "_specdec_requantised", {})
        if requantised:  # a type with no kernel: said, with what specdec did instead
            kinds = ", ".join(f"{count} {kind}" for kind, count in sorted(requantised.items()))
            which = "those types" if len(requantised) > 1 else "that type"
            parts.append(f"{kinds} requantised to q4 (no kernel for {which} yet)")
        if self.quantization in ("int8", "q4") and (reason := slow_path(self.model)):
            parts.append(reason)  # an architecture or setting the fast path does not compute: slower, said
        from specdec_cli.engine.kv import prefill_path

        if prefill_path(self.model) is not None:
            parts.append("prompts read in bfloat16 (--prefill)")
        return f"{role}: " + " · ".join(parts)


@dataclass(frozen=True)
class _Plan:
    """Everything decided before touching weights."""

    source: ModelSource
    device: torch.device
    dtype: torch.dtype
    quantization: str | None
    trust_remote_code: bool
    allow_pickle: bool
    progress: bool
    role: str = "target"  # or "draft": a quantised draft needs no row-exact attention

    def metadata_kwargs(self) -> dict:
        """from_pretrained arguments that locate the config/tokenizer: a folder, or a .gguf file not converted yet."""
        folder = self.source.metadata_folder or self.source.converted_folder(self.dtype)
        if folder is None and self.source.gguf_path is not None:
            folder = kept_metadata(self.source.gguf_path)  # what a load read from the file's metadata
        if folder is not None:
            return {"pretrained_model_name_or_path": str(folder), "trust_remote_code": self.trust_remote_code}
        gguf_path = self.source.gguf_path
        require_gguf()  # transformers reads the file with it: without it, an ImportError traceback
        return {"pretrained_model_name_or_path": str(gguf_path.parent), "gguf_file": gguf_path.name}


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# What a reader of a file cut short raises (gguf's header parsing: struct.error), beside OSError and ValueError.
CUT_SHORT = (struct.error, EOFError)


# transformers' word for a .gguf architecture it cannot convert (modeling_gguf_pytorch_utils.load_gguf_checkpoint).
_GGUF_ARCHITECTURE = re.compile(r"GGUF model with architecture (\S+) is not supported")


def _unreadable(plan: _Plan, what: str, error: Exception) -> ModelLoadError:
    """One line for a config or tokenizer that would not load; a .gguf that ends early is said to be cut short, one
    of an architecture transformers cannot read (a vision projector, say) is named as such."""
    unsupported = _GGUF_ARCHITECTURE.search(str(error)) if plan.source.kind == "gguf" else None
    if unsupported:
        return ModelLoadError(
            f"{plan.source.spec} holds a {unsupported.group(1)!r} model, which transformers cannot read from a .gguf",
            "pass the .gguf of a language model (llama, mistral, qwen2, qwen3, gemma, phi3, ...); an mmproj file is "
            "a vision part, not one")
    why = "the file ends before its header says it does (cut short?)" if isinstance(error, CUT_SHORT) else \
        _first_line(error)
    hint = "download the .gguf again (a cut or damaged file reads this way)" if plan.source.kind == "gguf" else \
        "check the model files"
    return ModelLoadError(f"cannot read the {what} of {plan.source.spec}: {why}", hint)


def _plan(spec, device, dtype, quantization, trust_remote_code, allow_pickle, progress, role="target",
          auto_formats=None) -> _Plan:
    chosen_device = resolve_device(device)
    chosen_dtype = resolve_dtype(dtype, chosen_device)
    if quantization == "auto":
        quantization = resolve_auto(role, chosen_device, spec, chosen_dtype, auto_formats)
    chosen_quantization = check_quantization(quantization, chosen_device)
    source = resolve(spec, progress)
    return _Plan(source, chosen_device, chosen_dtype, chosen_quantization, trust_remote_code, allow_pickle, progress,
                 role)


def _load_config(plan: _Plan):
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        kwargs = plan.metadata_kwargs()
        if "gguf_file" in kwargs:  # a .gguf not converted: its metadata, read once a process (gguf.config_of)
            return config_of(plan.source.gguf_path)
        return AutoConfig.from_pretrained(**kwargs)
    except StrictDataclassError as error:  # a value its config class refuses (heads that do not divide the width)
        raise _unreadable(plan, "config", error.__cause__ or error) from None
    except (OSError, ValueError, KeyError, *CUT_SHORT) as error:
        raise _unreadable(plan, "config", error) from None


def _reading_gguf(*plans: _Plan):
    """One reader per .gguf for the whole load where a .gguf is not converted yet (gguf.shared_readers)."""
    return shared_readers() if any("gguf_file" in plan.metadata_kwargs() for plan in plans) else nullcontext()


def _weight_bytes(plan: _Plan) -> int:
    """The weights' bytes for the memory pre-flight: a .gguf read in place by its own tensors' sizes
    (gguf_model.bytes_in_place), anything else from its config (whose model is built on the meta device either way:
    a config transformers cannot build is said here)."""
    config = _load_config(plan)
    try:
        estimate = preflight.estimate_weight_bytes(config, plan.dtype, plan.quantization)
        if plan.source.kind == "gguf" and plan.quantization == "q4":
            return gguf_model.bytes_in_place(plan.source.gguf_path)
        return estimate
    except SpecdecError:  # ours, already one line (a format's kernel choice, say): not the config's fault
        raise
    except Exception as error:  # the model class's own code on a config it cannot build (a head count of 0, say)
        raise ModelLoadError(f"the config of {plan.source.spec} does not describe a model transformers can build: "
                             f"{type(error).__name__}: {_first_line(error)}", "check the model's config") from None


def _load_tokenizer(plan: _Plan):
    from transformers import AutoTokenizer

    kwargs = plan.metadata_kwargs()
    kept = plan.source.gguf_path and kept_metadata(plan.source.gguf_path)
    if kept and kwargs["pretrained_model_name_or_path"] == str(kept):  # the tokenizer's own folder in it
        kwargs = {**kwargs, "pretrained_model_name_or_path": str(kept / gguf.TOKENIZER)}
    try:
        tokenizer = AutoTokenizer.from_pretrained(**kwargs)
    except (OSError, ValueError, KeyError, *CUT_SHORT) as error:
        raise _unreadable(plan, "tokenizer", error) from None
    if "gguf_file" in kwargs:  # read from the file's metadata: kept for the next load (gguf.keep_metadata)
        keep_metadata(plan.source.gguf_path, _load_config(plan), tokenizer)
    return tokenizer


# What a tokenizer is made of, but for its chat template: the draft never applies one (it reads the target's ids).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model")


def _same_tokenizer(target: _Plan, draft: _Plan) -> bool:
    """Whether the draft's tokenizer files are the target's byte for byte (the demo pair's are): then the draft
    shares the target's tokenizer instead of loading its own (parsing a large tokenizer.json is a noticeable part
    of a pair's load)."""
    folders = [plan.metadata_kwargs() for plan in (target, draft)]
    if any("gguf_file" in kwargs for kwargs in folders):  # a .gguf not converted yet: its tokenizer is in the file
        return False
    first, second = (Path(kwargs["pretrained_model_name_or_path"]) for kwargs in folders)
    try:
        found = [name for name in TOKENIZER_FILES if (first / name).is_file() or (second / name).is_file()]
        return bool(found) and all((first / name).read_bytes() == (second / name).read_bytes() for name in found)
    except OSError:
        return False


def _from_pretrained(plan: _Plan, folder: Path):
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    has_safetensors = check_weight_format(folder, plan.source.spec, plan.allow_pickle)
    try:
        return AutoModelForCausalLM.from_pretrained(
            str(folder),
            dtype=plan.dtype,
            quantization_config=quantization_config(plan.quantization),
            device_map={"": str(plan.device)},
            trust_remote_code=plan.trust_remote_code,
            use_safetensors=True if has_safetensors else None,
        )
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as error:  # SafetensorError: a cut file
        raise ModelLoadError(f"cannot load {plan.source.spec}: {_first_line(error)}", "check the model files and options") from None


def eos_token_ids(model, tokenizer) -> tuple[int, ...]:
    """generation_config.eos_token_id (an int or a list) ∪ tokenizer.eos_token_id, in that order."""
    generation_config = getattr(model, "generation_config", None)
    configured = getattr(generation_config, "eos_token_id", None)
    ids = configured if isinstance(configured, (list, tuple)) else [configured]
    ids = [*ids, tokenizer.eos_token_id]
    return tuple(dict.fromkeys(int(token_id) for token_id in ids if token_id is not None))


def output_rows(model) -> int:
    head = model.get_output_embeddings()
    return int(getattr(head, "out_features", None) or head.weight.shape[0])


def _load_weights(plan: _Plan, tokenizer) -> LoadedModel:
    if plan.source.kind == "gguf" and plan.quantization == "q4":  # read in place (_reads_in_place): no conversion
        with library_bars(False), status(f"loading {plan.source.spec} in q4 ...", plan.progress):
            parts = gguf_model.split_parts(plan.source.gguf_path)
            key = stored_layers.entry_key(None, parts, plan.dtype, "q4")
            model = gguf_model.load_q4(plan.source.gguf_path, _load_config(plan),
                                       None if key is None else (key, plan.source.spec))
            model = quantized_in_place(model, exact_rows=plan.role == "target")
        return _loaded(plan, model, tokenizer)
    if plan.source.kind == "gguf" and gguf_model.split_parts(plan.source.gguf_path) != [plan.source.gguf_path]:
        raise ModelLoadError(f"{plan.source.spec} is a split .gguf set, which specdec reads in place in q4 only",
                             "add --target-quant q4 (or --draft-quant q4), or merge the parts with llama.cpp's "
                             "llama-gguf-split --merge FIRST-PART OUT.gguf")
    with library_bars(plan.progress):  # downloads and a GGUF conversion take minutes: their bars, but not with -q
        folder = weights_folder(plan.source, plan.dtype, plan.allow_pickle, plan.progress)
    # Reading the folder takes seconds: specdec's spinner, not transformers' "Loading weights" bar under it
    with library_bars(False), status(f"loading {plan.source.spec} ...", plan.progress):
        model = _from_pretrained(plan, folder).eval()
    if plan.quantization in ("int8", "int4", "q4"):
        with status(f"quantising {plan.source.spec} to {plan.quantization} ...", plan.progress):
            model = quantize(model, plan.quantization, exact_rows=plan.role == "target",
                             store=_store(plan, folder))
    return _loaded(plan, model, tokenizer)


def _loaded(plan: _Plan, model, tokenizer) -> LoadedModel:
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=plan.source.spec,
        source=plan.source.location,
        device=plan.device,
        dtype=compute_dtype(plan.quantization, plan.dtype),
        quantization=plan.quantization,
        eos_token_ids=eos_token_ids(model, tokenizer),
        vocab_size=output_rows(model),
    )


def _store(plan: _Plan, folder: Path) -> tuple[str, str] | None:
    """(key, label) of the model's stored layers (formats/stored_layers.py), for an int8 or q4 load; None otherwise."""
    if plan.quantization not in ("int8", "q4"):
        return None
    key = stored_layers.entry_key(folder, plan.source.gguf_path, plan.dtype, plan.quantization)
    return None if key is None else (key, plan.source.spec)


def load_model(
    spec: str,
    *,
    device: str = "auto",
    dtype: str = "auto",
    quantization: str | None = None,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    progress: bool = True,
    auto_formats: tuple[str, ...] | None = None,
    role: str = "target",
) -> LoadedModel:
    """Resolve `spec`, check its weights fit in memory, then load tokenizer and weights. `auto_formats`: what
    quantization "auto" may pick for this (target) model (None: `quant.AUTO_FORMATS`); role: "target" or
    "draft" (what `auto` picks, and whether a quantised model gets row-exact attention)."""
    plan = _plan(spec, device, dtype, quantization, trust_remote_code, allow_pickle, progress, role=role,
                 auto_formats=auto_formats)
    with _reading_gguf(plan):
        preflight.check_memory({spec: _weight_bytes(plan)}, plan.device)
        tokenizer = _load_tokenizer(plan)
        if not _reads_in_place(plan):  # a conversion reads the file again: the same reader
            return _load_weights(plan, tokenizer)
    return _load_weights(plan, tokenizer)  # the metadata's reader let go first (hundreds of MB for a large vocabulary)


def load_pair(
    target: str,
    draft: str | None,
    *,
    device: str = "auto",
    dtype: str = "auto",
    target_quantization: str | None = None,
    draft_quantization: str | None = None,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    progress: bool = True,
    target_auto_formats: tuple[str, ...] | None = None,
    say: Callable[[str], object] | None = None,
) -> tuple[LoadedModel, LoadedModel | None]:
    """Target and (optional) draft: memory pre-flight for both, tokenizer pre-flight, then weights.
    `target_auto_formats`: what a target quantization of "auto" may pick (a profile's list). A draft of another
    tokenizer loads with its `vocabulary_overlap` measured, and `say` is given the line about it (a warning where
    the vocabularies share little) before any weights load."""
    if draft is None:
        target_model = load_model(
            target, device=device, dtype=dtype, quantization=target_quantization,
            trust_remote_code=trust_remote_code, allow_pickle=allow_pickle, progress=progress,
            auto_formats=target_auto_formats,
        )
        return target_model, None
    shared = (device, dtype)
    target_plan = _plan(target, *shared, target_quantization, trust_remote_code, allow_pickle, progress,
                        auto_formats=target_auto_formats)
    draft_plan = _plan(draft, *shared, draft_quantization, trust_remote_code, allow_pickle, progress, role="draft")
    with _reading_gguf(target_plan, draft_plan):
        preflight.check_memory(
            {f"target {target}": _weight_bytes(target_plan), f"draft {draft}": _weight_bytes(draft_plan)},
            target_plan.device,
        )
        target_tokenizer = _load_tokenizer(target_plan)
        draft_tokenizer = target_tokenizer if _same_tokenizer(target_plan, draft_plan) else _load_tokenizer(draft_plan)
        overlap = None
        if draft_tokenizer is not target_tokenizer and preflight.tokenizer_difference(target_tokenizer,
                                                                                      draft_tokenizer) is not None:
            shares = preflight.vocabulary_shares(target_tokenizer, draft_tokenizer)
            overlap = shares[0]
            if say is not None:
                say(preflight.cross_vocabulary_line(shares, target, draft))
        if not (_reads_in_place(target_plan) and _reads_in_place(draft_plan)):  # a conversion: the same readers
            return _pair_weights(target_plan, target_tokenizer, draft_plan, draft_tokenizer, overlap)
    return _pair_weights(target_plan, target_tokenizer, draft_plan, draft_tokenizer, overlap)


def _pair_weights(target_plan: _Plan, target_tokenizer, draft_plan: _Plan, draft_tokenizer,
                  overlap: float | None) -> tuple[LoadedModel, LoadedModel]:
    target_model, draft_model = _load_weights(target_plan, target_tokenizer), _load_weights(draft_plan, draft_tokenizer)
    draft_model.vocabulary_overlap = overlap
    return target_model, draft_model


def _reads_in_place(plan: _Plan) -> bool:
    """Whether `plan`'s weights are read without transformers' GGUF reader: a folder's, or a .gguf's in q4."""
    return plan.source.kind != "gguf" or plan.quantization == "q4"
