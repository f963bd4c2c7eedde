"""A quantised target reads its prompts in bfloat16, where that is faster (`--prefill`): a q4 target on a CPU with
AMX-BF16 with its own weights (`AmxPromptPath`), else with a bfloat16 copy of its decoder.

Why: a prompt's forward is arithmetic, not memory. specdec's q4 and int8 matmuls multiply on the vector unit
(VNNI), or for q4 on AMX's tiles with a float step per group of 32 and token, so on a CPU with AMX a q4 target reads
a long prompt far slower than oneDNN's bfloat16 matmul on AMX's tiles reads it with the same weights in bfloat16
(docs/cpu-runtime.md, "Reading the prompt"); the tokens after the prompt are still decoded and verified by the
quantised target, which is what is fast for the few tokens of a decoding step.

The AMX path (q4 on a CPU with AMX-BF16: `amx_reads`) needs no copy: the C decoder stack with q4_amx.c's bfloat16
matmul (isa 4: each weight's exact value rounded to bfloat16, the matmul's inputs rounded to bfloat16, products
summed in float32 on the tiles; norms, attention and the residual stream in float32 as the target has them). It
reads about as fast as the copy, without the copy's memory and its load.

The bfloat16 copy (an int8 target, or a CPU without AMX-BF16) is the target's own weights loaded again without
quantisation (for a .gguf, its dequantised values), its decoder only: the embedding rows come from the quantised
model, and no logits are made.

Either way the path computes the prompt's keys and values, which go into the target's cache in float32; everything
after them runs as before. So the target is "the prompt read in bfloat16, the answer written in q4": a prompt's
entries are not the ones q4 would make, but they are the same for the target alone and for every drafter (the
engine reads a prompt through the path in one way: kv.py's `prefill`), so speculation stays exact against that
target.

Where: `auto` takes it for a q4 or int8 target on the fast path (runtime/architectures.py; the copy: where it fits in
memory beside what is loaded), where `specdec calibrate` timed the path reading a prompt at least GAIN times as fast
as the target on this machine, or, not calibrated, on a CPU with AMX-BF16; `bf16` asks for it (refused in one line
where it cannot be); `none` keeps it off.
Only prompt parts of `min_tokens` or more go through it: AMX_MIN_TOKENS for the AMX path, MIN_TOKENS for the copy
(shorter parts q4 reads as fast itself).

`chat` loads the copy in a thread of its own (`LoadingPath`) while the first message is typed: its start is the
quantised pair's; a message sent before the load is done waits for it (the load and a forward never run at once:
`load_meanwhile`)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from specdec_cli.engine.cache_layers import new_cache
from specdec_cli.engine.kv import PREFILL_PATH, full_attention, prefill_path
from specdec_cli.errors import InputError, InsufficientMemoryError, ModelLoadError, SpecdecError
from specdec_cli.models.device import cpu_flags
from specdec_cli.models.loading import preflight
from specdec_cli.models.runtime.architectures import DECODER_CLASSES, slow_path_reason

SETTINGS = ("auto", "bf16", "none")
# Prompt parts shorter than this are left to the target itself: the copy's lead over q4 grows with the tokens of a
# forward, and the copy reads all but the last token, which q4 then reads in a forward of its own, so a shorter part
# gains nothing.
MIN_TOKENS = 128
AMX_FLAGS = {"amx_bf16", "amx_tile"}


class PrefillPath:
    """Feeds prompt tokens through a bfloat16 decoder into a float32 cache (see the module)."""

    reader = "bfloat16 copy"
    row_exact = False  # oneDNN's matmul and SDPA round a row by what else the forward holds: a cache kept is read anew

    def __init__(self, decoder: torch.nn.Module, embedding: torch.nn.Module, min_tokens: int = MIN_TOKENS) -> None:
        self.decoder = decoder  # a fast-path decoder (LlamaModel, Qwen2Model, ...) in bfloat16, without its embedding
        self.embedding = embedding  # the quantised model's
        self.min_tokens = min_tokens
        self.dtype = next(decoder.parameters()).dtype

    @torch.inference_mode()
    def __call__(self, cache, new_ids: list[int]) -> None:
        """Append `new_ids`' keys and values, after the entries `cache` holds, to `cache` in its own dtype."""
        from transformers import DynamicCache

        held = cache.get_seq_length()
        scratch = DynamicCache(config=self.decoder.config)
        if held:
            for index, layer in enumerate(cache.layers):
                scratch.update(layer.keys.to(self.dtype), layer.values.to(self.dtype), index)
        ids = torch.tensor([new_ids], dtype=torch.long)
        positions = torch.arange(held, held + len(new_ids)).unsqueeze(0)
        self.decoder(inputs_embeds=self.embedding(ids).to(self.dtype), cache=scratch, position_ids=positions,
                     use_cache=True)
        for layer, fresh in zip(cache.layers, scratch.layers):
            dtype = layer.keys.dtype if layer.keys is not None else torch.float32
            layer.update(fresh.keys[..., held:, :].to(dtype), fresh.values[..., held:, :].to(dtype))


AMX_ISA = 4  # the C library's isa for a prompt read: q4's bfloat16 matmul on AMX (q4_amx.c)
AMX_MIN_TOKENS = 24  # prompts this long or more: fewer read as fast in q4 itself
# Tokens a forward at most: a long prompt read in pieces of this size went faster than in larger or smaller ones.
AMX_PIECE = 256


class AmxPromptPath:
    """A q4 target reads its prompts with its own weights through q4_amx.c's bfloat16 matmul (the C decoder stack with
    isa 4): each weight its exact value rounded to bfloat16, each matmul input rounded to bfloat16, their products
    summed in float32 on AMX's tiles; everything else (norms, attention, the residual stream) in float32 as the
    target computes it. No copy: no memory, nothing to load. Faster than the target's own q4 read from AMX_MIN_TOKENS
    tokens on, the more so the longer the prompt. Its rows do not depend on how
    many the forward holds, at any count (tested; attention is the target's row by row), so the rest of a prompt
    whose start is cached already reads as the whole prompt would (`row_exact`: kv.py's `prefill(fresh=True)`, how
    `run` and chat's /reset keep a shared prefix). Only where the CPU has AMX-BF16 (`amx_reads`)."""

    reader = "target in bfloat16 on AMX"  # as `compare` names who read the prompts
    decoder = None  # no weights of its own (the pre-flight counts a copy's)
    row_exact = True

    def __init__(self, model: torch.nn.Module, min_tokens: int = AMX_MIN_TOKENS) -> None:
        self.model = model
        self.min_tokens = min_tokens

    @torch.inference_mode()
    def __call__(self, cache, new_ids: list[int]) -> None:
        """Append `new_ids`' keys and values, after the entries `cache` (the engine's) holds."""
        from specdec_cli.models.runtime.decoder_stack import read_prompt

        pieces = -(-len(new_ids) // AMX_PIECE)
        size = -(-len(new_ids) // pieces)  # even pieces: none below AMX_MIN_TOKENS where the whole is not
        for start in range(0, len(new_ids), size):
            piece = torch.tensor([new_ids[start:start + size]], dtype=torch.long)
            if not read_prompt(self.model.model, cache, piece, AMX_ISA):
                raise RuntimeError("the target's decoder no longer runs in C: its prompt cannot be read on AMX")


def reads_on_amx(quantization: str | None, flags: set[str] | None = None) -> bool:
    """Whether a target in `quantization` reads its prompts on AMX with its own weights (an AmxPromptPath) rather than
    through a copy, where it reads in bfloat16 at all: q4 on a CPU with AMX-BF16 (`flags`: this CPU's where None).
    What `resolve` and `run`'s stored settings go by, before anything is loaded (`amx_reads` checks the model too)."""
    from specdec_cli.models.formats.quant import canonical

    return canonical(quantization) == "q4" and _has_amx(flags)


def amx_reads(target, flags: set[str] | None = None) -> bool:
    """Whether `target` (a LoadedModel) reads its prompts through an AmxPromptPath rather than a copy: a q4 model whose
    decoder runs in C, on a CPU with AMX-BF16 (`flags`, where given, stand for this CPU's) that the library can use."""
    from specdec_cli.models.native import binding
    from specdec_cli.models.runtime.decoder_stack import stacks_in_c

    if not reads_on_amx(getattr(target, "quantization", None), flags):
        return False
    library, isa, problem = binding.library()
    decoder = getattr(target.model, "model", None)
    return (problem is None and isa == 3 and bool(library.specdec_amx_bf16_ready()) and decoder is not None
            and stacks_in_c(decoder))


GAIN = 1.2  # a calibrated copy must read a prompt at least this much faster than the target itself


def _pays(model: str, quantization: str, flags: set[str] | None) -> bool:
    """Whether the copy reads prompts faster here: as `specdec calibrate` timed both on this machine (a 256-token
    prompt), else by the CPU: with AMX-BF16, not without (bfloat16 has no arithmetic edge over q4 without AMX's
    tiles)."""
    from specdec_cli.models.formats.calibration import calibrated_prompt_read

    measured = calibrated_prompt_read(model, quantization)
    if measured is not None:
        return measured["copy_seconds"] * GAIN <= measured["model_seconds"]
    return _has_amx(flags)


def _has_amx(flags: set[str] | None) -> bool:
    """Whether this CPU (or the one `flags` stand for) has AMX-BF16's tiles."""
    return (flags if flags is not None else cpu_flags()) >= AMX_FLAGS


def why_not(target) -> str | None:
    """Why `target` (a LoadedModel) cannot read prompts through a bfloat16 copy; None where it can."""
    if target.device.type != "cpu":
        return f"it is for CPU targets (this one is on {target.device.type})"
    if target.quantization not in ("q4", "int8"):
        return "it is for a q4 or int8 target (this one reads its prompts at its own precision already)"
    decoder = getattr(target.model, "model", None)
    if type(decoder).__name__ not in DECODER_CLASSES:
        return f"it takes the decoders of the fast path ({', '.join(DECODER_CLASSES)}), not {type(decoder).__name__}"
    if not full_attention(target.model.config):
        return "it takes full-attention layers only"
    return None


def check_setting(name: str) -> str:
    """`name` if it is a --prefill setting, else InputError."""
    if name not in SETTINGS:
        raise InputError(f"unknown --prefill {name!r}", f"use one of {', '.join(SETTINGS)}")
    return name


def wanted(setting: str, target, flags: set[str] | None = None) -> bool:
    """Whether to attach the path: `bf16` where it can (else InputError), `auto` where it reads faster here (`_pays`)
    and the copy fits in free memory with the pre-flight's margin, `none` never."""
    if check_setting(setting) == "none":
        return False
    problem = why_not(target)
    if setting == "bf16":
        if problem:
            raise InputError(f"--prefill bf16: {problem}", "drop --prefill or use --prefill none")
        return True
    if problem or not _pays(target.name, target.quantization, flags):
        return False
    if amx_reads(target, flags):
        return True  # nothing to load
    # The copy's bytes, its embedding and output layer included: loaded, then dropped.
    needed = preflight.estimate_weight_bytes(target.model.config, torch.bfloat16, None)
    return preflight.fits(needed, preflight.available_memory_bytes(target.device))


def resolve(setting: str, device: torch.device, target: str, quantization: str | None, draft: str | None,
            draft_quantization: str | None, flags: set[str] | None = None) -> str:
    """`setting` before anything is loaded, "bf16" or "none" (what `run` stores beside a file): `auto` as `wanted`
    decides it, from the target's config on this machine (its folder's, else its .gguf's metadata; none found:
    "none") and the pre-flight's estimates."""
    if setting != "auto":
        return setting
    from specdec_cli.models.loading.resolve import local_config

    if device.type != "cpu" or quantization not in ("q4", "int8") or (config := local_config(target)) is None:
        return "none"
    takes = slow_path_reason(config) is None and full_attention(config)
    if not takes or not _pays(target, quantization, flags):
        return "none"
    if reads_on_amx(quantization, flags):
        return "bf16"  # read by the q4 target's own weights on AMX (AmxPromptPath): no copy to fit
    needed = preflight.estimate_weight_bytes(config, torch.bfloat16, None)
    needed += preflight.estimate_weight_bytes(config, torch.float32, quantization)
    if draft is not None:
        needed += preflight.estimate_local_weight_bytes(draft, torch.float32, draft_quantization) or 0
    return "bf16" if preflight.fits(needed, preflight.available_memory_bytes(device)) else "none"


def attach(target, trust_remote_code: bool = False, allow_pickle: bool = False, progress: bool = True,
           background: bool = False) -> None:
    """Give the target's model its prefill path: an AmxPromptPath where `amx_reads`, else its weights loaded again in
    bfloat16, that decoder. `background`:
    give it a `LoadingPath` instead, which loads them (no progress shown) in a thread from `load_meanwhile` on, or
    when first needed; refused at once where the copy does not fit in free memory, as loading it would be."""
    if amx_reads(target):
        target.model.__dict__[PREFILL_PATH] = AmxPromptPath(target.model)
        return

    def load() -> PrefillPath:
        return load_copy(target, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle,
                         progress=progress and not background)

    if not background:
        path = load()
        warm(path, target.model.config)
        target.model.__dict__[PREFILL_PATH] = path
        return
    needed = preflight.estimate_weight_bytes(target.model.config, torch.bfloat16, None)
    try:
        preflight.check_memory({f"{target.name}'s bfloat16 copy (--prefill)": needed}, target.device)
    except InsufficientMemoryError as error:
        raise InsufficientMemoryError(error.message, "use --prefill none, or close other programs") from None
    target.model.__dict__[PREFILL_PATH] = LoadingPath(target.model, load, MIN_TOKENS)


def load_copy(target, min_tokens: int = MIN_TOKENS, trust_remote_code: bool = False, allow_pickle: bool = False,
              progress: bool = True) -> PrefillPath:
    """A PrefillPath over the target's (a LoadedModel's) weights loaded again in bfloat16, not attached."""
    from specdec_cli.models.loading.loaded import load_model

    copy = load_model(target.name, device="cpu", dtype="bfloat16", quantization="none",
                      trust_remote_code=trust_remote_code, allow_pickle=allow_pickle, progress=progress)
    return _path_of(target.model, copy.model.model, min_tokens)


def warm(path: PrefillPath, config) -> None:
    """One read: the copy's weights come in from the file on its first forward (a large part of that read),
    which would otherwise land on whichever generation reads a prompt first."""
    path(new_cache(config), [0] * path.min_tokens)


def load_meanwhile(model: torch.nn.Module) -> None:
    """Start loading `model`'s copy in a thread (chat: while the first message is typed), where it has a LoadingPath.
    Nothing else may run torch until `finish_loading`: transformers' loading sets process-wide state (the default
    dtype, for one) that a forward in another thread picks up (a decoder's buffers made in bfloat16, then overrun)."""
    path = prefill_path(model)
    if isinstance(path, LoadingPath):
        path.start()


def finish_loading(model: torch.nn.Module) -> None:
    """Wait for `model`'s copy where it is loading (ModelLoadError where that failed)."""
    path = prefill_path(model)
    if isinstance(path, LoadingPath):
        path.ready()


def settle(model: torch.nn.Module) -> None:
    """Before the process ends: a copy still loading finishes its load (no warm-up read) and its thread ends."""
    path = prefill_path(model)
    if isinstance(path, LoadingPath):
        path.close()


def attach_decoder(model: torch.nn.Module, decoder: torch.nn.Module, min_tokens: int = MIN_TOKENS) -> None:
    """Make `decoder` (the model's own class of decoder, in bfloat16) `model`'s prefill path."""
    model.__dict__[PREFILL_PATH] = _path_of(model, decoder, min_tokens)


def _path_of(model: torch.nn.Module, decoder: torch.nn.Module, min_tokens: int) -> PrefillPath:
    decoder.config._attn_implementation = "sdpa"  # its own config: oneDNN's bfloat16 attention
    embedding = model.get_input_embeddings()
    decoder.embed_tokens = None  # the quantised model's rows are used
    return PrefillPath(decoder.eval(), embedding, min_tokens)


class LoadingPath:
    """A prefill path whose copy `load` makes (then one `warm` read): in a thread of its own once `start`ed, else when
    first needed. A read waits for it, then puts the loaded path in its place on the model; a load that failed takes
    the path off the model instead (the target reads its prompts from then on) and that read raises ModelLoadError
    saying so. Its memory count waits too. The thread is not a daemon, and `close` ends it sooner: a process that
    ends while the thread runs inside torch is aborted ("terminate called without an active exception")."""

    reader = PrefillPath.reader

    def __init__(self, model: torch.nn.Module, load: Callable[[], PrefillPath], min_tokens: int) -> None:
        self.min_tokens = min_tokens
        self._model = model
        self._make = load
        self._loaded: PrefillPath | None = None
        self._failure: BaseException | None = None
        self._closing = False
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None and not self._done.is_set():
            self._thread = threading.Thread(target=self._load, name="specdec-prefill-copy")
            self._thread.start()

    def _load(self) -> None:
        try:
            loaded = self._make()
            if not self._closing:
                warm(loaded, self._model.config)
            self._loaded = loaded
        except BaseException as error:  # noqa: BLE001 - said by the read that needs the copy
            self._failure = error
        finally:
            self._done.set()

    def close(self) -> None:
        """Wait for the load under way, without its warm-up read."""
        self._closing = True
        if self._thread is not None:
            self._thread.join()

    def ready(self) -> PrefillPath:
        """The loaded path, waiting for it or loading it here (ModelLoadError where the load failed)."""
        if self._thread is None and not self._done.is_set():
            self._load()
        self._done.wait()
        if self._model.__dict__.get(PREFILL_PATH) is self:
            if self._loaded is None:
                del self._model.__dict__[PREFILL_PATH]
            else:
                self._model.__dict__[PREFILL_PATH] = self._loaded
        if self._loaded is None:
            failure = self._failure
            reason = failure.one_line() if isinstance(failure, SpecdecError) else f"{type(failure).__name__}: {failure}"
            raise ModelLoadError(f"the bfloat16 copy that reads prompts (--prefill) did not load ({reason})",
                                 "the target reads them from now on: send the message again, or use --prefill none")
        return self._loaded

    def __call__(self, cache, new_ids: list[int]) -> None:
        self.ready()(cache, new_ids)

    @property
    def decoder(self) -> torch.nn.Module:
        return self.ready().decoder
