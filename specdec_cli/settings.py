"""What a command decided, as plain frozen objects: which models (`ModelChoice`) and how to decode
(`DecodingSettings`), each built from a profile and the command line's overrides by one function.

The commands in `cli/` only turn their options into `ModelOverrides` and keyword overrides; everything
below them (chat, batch, bench, scripts) takes these objects and never imports the CLI."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Protocol

from specdec_cli.engine.sampling import SamplingParams, use_row_kernels
from specdec_cli.errors import InputError
from specdec_cli.models import LoadedModel, load_model, load_pair, row_kernels
from specdec_cli.models.device import dtype_name, resolve_device, resolve_dtype
from specdec_cli.models.formats.quant import canonical, resolve_auto
from specdec_cli.profiles import DEFAULT_PROFILE, DRAFTERS, Profile, gguf_target_format, load_profile

MAX_K = 16


# ---- which models ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelOverrides:
    """The model flags as given on the command line; None / False leave the choice to the profile."""

    profile: str | None = None
    target: str | None = None
    draft: str | None = None
    drafter: str | None = None
    device: str | None = None
    dtype: str | None = None
    target_4bit: bool = False  # these four and draft_int8: the older quantisation flags (_older_quantization_flags)
    draft_4bit: bool = False
    load_in_4bit: bool = False
    load_in_8bit: bool = False
    trust_remote_code: bool = False
    allow_pickle: bool = False
    draft_int8: bool | None = None  # --draft-int8 / --no-draft-int8; None: the profile decides
    target_quant: str | None = None  # --target-quant: none, int8, int4, q4, nf4, bnb8, auto (not with an older flag)
    draft_quant: str | None = None   # --draft-quant, likewise for the draft
    prefill: str | None = None  # --prefill: auto, bf16, none (models/prefill.py)


@dataclass(frozen=True)
class ModelChoice:
    """The profile merged with command-line overrides (flags win)."""

    profile: Profile
    target: str
    draft: str | None
    drafter: str  # "model" | "ngram" | "cascade" | "tree"
    device: str
    dtype: str
    target_quantization: str | None
    draft_quantization: str | None
    trust_remote_code: bool
    allow_pickle: bool
    draft_int8_flag: bool | None = None  # --draft-int8 / --no-draft-int8 as given (None: the profile decides)
    prefill: str = "auto"  # who reads a prompt: "auto", "bf16" (in bfloat16: models/prefill.py), "none" (the target)


def choose_models(flags: ModelOverrides) -> ModelChoice:
    """Merge a profile with command-line flags; a flag that is given always wins.

    - No model option at all: the `demo` profile.
    - `--target X` without `--profile`: X alone with the n-gram drafter, or with `--draft Y` the pair X+Y.
    - `--profile P --target X`: P's settings with X as target (P's draft kept; the tokenizer pre-flight
      refuses it if it does not fit X).
    - `--draft Y` always means the draft-model drafter; `--drafter ngram` drops the profile's draft.
    - `--target-quant`/`--draft-quant` set one model's format; the older quantisation flags are shorthands read
      in one place (`_older_quantization_flags`), and may not stand beside them.
    """
    base = _base_profile(flags.profile, flags.target, flags.draft)
    chosen_drafter, chosen_draft = _drafter_and_draft(base, flags.draft, flags.drafter)
    target_quantization, draft_quantization = _quantizations(base, flags)
    return ModelChoice(
        profile=base,
        target=flags.target or base.target,
        draft=chosen_draft,
        drafter=chosen_drafter,
        device=flags.device or base.device,
        dtype=flags.dtype or base.dtype,
        target_quantization=target_quantization,
        draft_quantization=draft_quantization if chosen_draft else None,
        trust_remote_code=flags.trust_remote_code,
        allow_pickle=flags.allow_pickle,
        draft_int8_flag=flags.draft_int8,
        prefill=_prefill_setting(flags.prefill),
    )


def _prefill_setting(name: str | None) -> str:
    from specdec_cli.models.loading.prefill import check_setting

    return "auto" if name is None else check_setting(name)


def _base_profile(profile: str | None, target: str | None, draft: str | None) -> Profile:
    """The named profile; without one, `--target` starts a blank profile and no model option at all means the default."""
    if profile is not None:
        return load_profile(profile)
    if target is None:
        return load_profile(DEFAULT_PROFILE)
    return Profile(name="(command line)", target=target, draft=draft, drafter="model" if draft else "ngram")


def _drafter_and_draft(base: Profile, draft: str | None, drafter: str | None) -> tuple[str, str | None]:
    if drafter is not None and drafter not in DRAFTERS:
        raise InputError(f"unknown drafter {drafter!r}", f"use --drafter {', '.join(DRAFTERS[:-1])} or {DRAFTERS[-1]}")
    if draft is not None and drafter == "ngram":
        raise InputError("--draft and --drafter ngram contradict each other", "drop one of them")
    chosen_drafter = drafter or ("model" if draft is not None and base.drafter == "ngram" else base.drafter)
    chosen_draft = None if chosen_drafter == "ngram" else (draft or base.draft)
    if chosen_drafter != "ngram" and chosen_draft is None:
        raise InputError(f"--drafter {chosen_drafter} needs a draft model", "pass --draft NAME, or use --drafter ngram")
    return chosen_drafter, chosen_draft


def _quantizations(base: Profile, flags: ModelOverrides) -> tuple[str | None, str | None]:
    """Each model's format: its --target-quant / --draft-quant, else the older flags', the profile's, or the default."""
    older_target, older_draft = _older_quantization_flags(flags)
    target = (_explicit("target", flags.target_quant, older_target is not None) or older_target
              or base.target_quantization or gguf_target_format(flags.target or base.target, flags.device or base.device))
    draft = (_explicit("draft", flags.draft_quant, older_draft is not None) or older_draft
             or _profile_draft(base, flags))
    return target, draft


# The flags from before --target-quant / --draft-quant, kept as shorthands, are read in the two functions below
# and nowhere else. "4bit" and "8bit" are the names nf4 and bnb8 had; `canonical` reads them.


def _older_quantization_flags(flags: ModelOverrides) -> tuple[str | None, str | None]:
    """What the older flags ask of (target, draft), None where they ask nothing: --load-in-4bit / --load-in-8bit set
    both models; --target-4bit, --draft-4bit and --draft-int8 set one and win over those two."""
    if flags.load_in_4bit and flags.load_in_8bit:
        raise InputError("--load-in-4bit and --load-in-8bit contradict each other", "pick one")
    if flags.draft_4bit and flags.draft_int8:
        raise InputError("--draft-4bit and --draft-int8 contradict each other", "pick one")
    both = "4bit" if flags.load_in_4bit else "8bit" if flags.load_in_8bit else None
    target = "4bit" if flags.target_4bit else both
    draft = "4bit" if flags.draft_4bit else "int8" if flags.draft_int8 else both
    return target, draft


def _profile_draft(base: Profile, flags: ModelOverrides) -> str | None:
    """The profile's draft format (auto where it names none), but for an int8 one that --no-draft-int8 drops."""
    return None if flags.draft_int8 is False and base.draft_quantization == "int8" else base.draft_quantization


def _explicit(role: str, name: str | None, older_given: bool) -> str | None:
    """--target-quant / --draft-quant, checked by name; "none" stays "none" so it overrides a profile."""
    if name is None:
        return None
    if older_given:
        raise InputError(f"--{role}-quant and an older quantisation flag (--{role}-4bit, --load-in-4bit/8bit"
                         f"{', --draft-int8' if role == 'draft' else ''}) contradict each other", f"keep --{role}-quant alone")
    canonical(name)  # an unknown name: one line listing the formats
    return name


# ---- loading them ------------------------------------------------------------------------------


class Printer(Protocol):
    """Where loading says what it chose: a Rich Console fits, and so does `StderrPrinter`."""

    def print(self, text: str, *, markup: bool = ...) -> object: ...


class StderrPrinter:
    def print(self, text: str, *, markup: bool = False) -> None:
        print(text, file=sys.stderr)


def load_choice(choice: ModelChoice, console: Printer | None = None,
                background_prefill: bool = False) -> tuple[LoadedModel, LoadedModel | None]:
    """Load the chosen pair (pre-flight checks first, progress on stderr) and say once per model what was chosen;
    `background_prefill`: a bfloat16 copy that reads the target's prompts loads in a thread (models/prefill.py)."""
    console = console or StderrPrinter()
    target, draft = load_pair(
        choice.target,
        choice.draft,
        device=choice.device,
        dtype=choice.dtype,
        target_quantization=choice.target_quantization,
        draft_quantization=_draft_quantization(choice, console),
        trust_remote_code=choice.trust_remote_code,
        allow_pickle=choice.allow_pickle,
        progress=not getattr(console, "quiet", False),  # -q: no spinners, no "Loading weights" bars
        target_auto_formats=choice.profile.target_auto_formats,
        say=lambda line: console.print(line, markup=False),  # a draft of another tokenizer: before weights load
    )
    use_row_kernels(row_kernels())  # the engine samples through the C row passes where a model loaded the library
    _read_prompts(choice, target, draft, console, background_prefill)
    console.print(target.describe("target"), markup=False)
    console.print(draft.describe("draft") if draft else "draft: n-gram lookup", markup=False)
    if choice.drafter == "tree" and draft is not None:
        say_tree_note(target, draft, console)
    for note in (*dtype_notes(choice, target, draft), kernels_note(target, draft), float_target_note(choice, target)):
        if note:
            console.print(note, markup=False)
    return target, draft


def dtype_notes(choice: ModelChoice, target: LoadedModel, draft: LoadedModel | None) -> list[str]:
    """A line for each model whose format computes in another dtype than the one asked for (--dtype, or the
    profile's): int4 always computes in bfloat16, int8 and q4 in float32, and only the model's own line said so."""
    if choice.dtype.strip().lower() == "auto":
        return []
    notes = []
    for role, model in (("target", target), ("draft", draft)):
        if model is None or model.quantization is None:
            continue
        asked, computed = dtype_name(resolve_dtype(choice.dtype, model.device)), dtype_name(model.dtype)
        if computed != asked:
            notes.append(f"note: the {role} computes in {computed}, not the {asked} asked for: {model.quantization} "
                         f"always computes in {computed}")
    return notes


def kernels_note(target: LoadedModel, draft: LoadedModel | None) -> str | None:
    """The line saying why an int8 model runs on torch's oneDNN: specdec's kernels did not build (no C compiler).
    Without it `auto` runs the pair in int8 on oneDNN, several times slower than q4 on the kernels, and nothing says
    why; a compiler fixes it."""
    from specdec_cli.models.native import binding

    slow = [model for model in (target, draft) if model is not None and model.device.type == "cpu"
            and model.quantization == "int8"]
    problem = binding.build_problem() if slow else None
    if problem is None:
        return None
    return (f"note: {problem}, so int8 runs on torch's oneDNN matmul, several times slower, and q4 cannot run — "
            "install a C compiler (gcc) or set CC to one, then start again")


def float_target_note(choice: ModelChoice, target: LoadedModel) -> str | None:
    """The line for a target left float (no flag or profile asked) on a CPU where a quantised format runs."""
    if target.device.type != "cpu" or target.quantization or choice.target_quantization is not None:
        return None
    from specdec_cli.models.formats.calibration import auto_score, calibrated_seconds
    from specdec_cli.models.native import binding

    faster = resolve_auto("target", target.device, target.name, target.dtype, ("int8", "q4"))
    floating, (_, isa, problem) = dtype_name(target.dtype), binding.library()
    seconds = [calibrated_seconds(target.name, name, floating) for name in (None, faster)]
    # How much faster than bfloat16 by ISA: the demo target's auto scores, rounded down: AMD EPYC (AVX512-VNNI) ×4.1 q4,
    # ×3.7 int8 (benchmarks/2026-12-01-forward-costs-avx512-q4-lean.json); Intel Xeon with AMX ×3.8 q4, ×2.4 int8
    # (benchmarks/2026-12-05-forward-costs-intel-amx.json); none measured on an AVX2-only CPU (1).
    by_kind = {2: {"q4": "4", "int8": "3.5"}, 3: {"q4": "3.5", "int8": "2"}}
    figure = None if problem else by_kind.get(isa, {}).get(faster)
    how_much = f"×{figure} faster here (on this CPU kind)" if figure else "several times faster here"
    if all(seconds):  # calibrated: no line where it found the format no faster
        ratio = auto_score("target", seconds[0]) / auto_score("target", seconds[1])
        how_much = f"×{ratio:.1f} faster here (calibrated)" if ratio >= 1.1 else None
    return faster and how_much and (f"note: the target runs in {floating}; {faster} runs {how_much} — add --target-quant "
                                    f"{faster} for that speed (its output may differ slightly from the {floating} weights')")


def _read_prompts(choice: ModelChoice, target: LoadedModel, draft: LoadedModel | None, console: Printer,
                  background: bool) -> None:
    """Give the target its bfloat16 prefill path where `choice.prefill` wants it (models/prefill.py), and then a q4
    draft the AMX one where the CPU has it (never a copy)."""
    from specdec_cli.models.loading import prefill

    if not prefill.wanted(choice.prefill, target):
        return
    prefill.attach(target, choice.trust_remote_code, choice.allow_pickle,
                   progress=not getattr(console, "quiet", False), background=background)
    if draft is not None and prefill.amx_reads(draft):
        prefill.attach(draft)


def say_tree_note(target: LoadedModel, draft: LoadedModel, console: Printer) -> None:
    """The one line saying the tree drafter will draft chains, when a model cannot take a tree mask."""
    from specdec_cli.session import tree_note

    note = tree_note(target, draft)
    if note:
        console.print(note, markup=False)


def resolve_formats(choice: ModelChoice) -> ModelChoice:
    """The choice with `auto` formats (and `--prefill auto`) replaced by what this machine resolves them to (its
    calibration, its kernels), so that what `run` stores beside a file — and what Ray workers load — names the
    format: a resume on another machine then cannot silently continue a file in another precision."""
    if "auto" not in (choice.target_quantization, choice.draft_quantization, choice.prefill):
        return choice
    device = resolve_device(choice.device)
    dtype = resolve_dtype(choice.dtype, device)

    def resolved(role: str, spec: str | None, quantization: str | None, allowed) -> str | None:
        if quantization != "auto" or spec is None:
            return quantization
        return resolve_auto(role, device, spec, dtype, allowed) or "none"

    from specdec_cli.models.loading import prefill

    formats = replace(choice,
                      target_quantization=resolved("target", choice.target, choice.target_quantization,
                                                   choice.profile.target_auto_formats),
                      draft_quantization=resolved("draft", choice.draft, choice.draft_quantization, None))
    return replace(formats, prefill=prefill.resolve(choice.prefill, device, formats.target,
                                                    canonical(formats.target_quantization), formats.draft,
                                                    canonical(formats.draft_quantization)))


def _draft_quantization(choice: ModelChoice, console: Printer) -> str | None:
    """A profile's int8 draft (CPU only) is dropped on a GPU with a note; an explicit --draft-int8 is not
    (the loader refuses it with what to do instead)."""
    if choice.draft_quantization != "int8" or choice.draft_int8_flag is not None:
        return choice.draft_quantization
    device = resolve_device(choice.device)
    if device.type == "cpu":
        return "int8"
    console.print(f"note: the profile's int8 draft runs on the CPU only; the draft loads unquantised on {device.type}",
                  markup=False)
    return None


def load_plain_draft(choice: ModelChoice, draft: LoadedModel | None, console: Printer) -> LoadedModel | None:
    """The draft as HF users load it, when ours carries specdec's own int8 (HF cannot load that): HF assisted
    runs with both, so the int8 lever shows as ours. bitsandbytes drafts are HF's own: HF gets them as they are."""
    if draft is None or draft.quantization != "int8":
        return None
    plain = load_model(choice.draft, device=choice.device, dtype=choice.dtype, trust_remote_code=choice.trust_remote_code,
                       allow_pickle=choice.allow_pickle)
    console.print(plain.describe("draft for HF assisted"), markup=False)
    return plain


# ---- how to decode -----------------------------------------------------------------------------


def parse_k(value: str | int) -> int | str:
    """`auto` or a draft length 0..16 (0 = the target alone)."""
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    if text.isdigit() and int(text) <= MAX_K:
        return int(text)
    raise InputError(f"invalid draft length {value!r}", f"use a number from 0 to {MAX_K}, or auto")


def sampling_params(temperature: float, top_p: float, top_k: int, seed: int | None) -> SamplingParams:
    """SamplingParams, with a bad value as a user's InputError."""
    try:
        return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    except ValueError as error:
        raise InputError(str(error), "fix the sampling option") from None


@dataclass(frozen=True)
class DecodingSettings:
    """The profile's decoding defaults merged with command-line flags (flags win)."""

    k: int | str
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    max_new_tokens: int
    system: str | None

    def sampling(self) -> SamplingParams:
        return sampling_params(self.temperature, self.top_p, self.top_k, self.seed)


def decoding_settings(
    profile: Profile, *, k: str | None = None, temperature: float | None = None, top_p: float | None = None,
    top_k: int | None = None, seed: int | None = None, max_new_tokens: int | None = None, system: str | None = None,
) -> DecodingSettings:
    """The profile's values, each replaced by the flag that is given (None: not given); checked here."""
    settings = DecodingSettings(
        k=parse_k(k if k is not None else profile.k),
        temperature=temperature if temperature is not None else profile.temperature,
        top_p=top_p if top_p is not None else profile.top_p,
        top_k=(0 if top_k == -1 else top_k) if top_k is not None else profile.top_k,  # vLLM's -1: every token
        seed=seed,
        max_new_tokens=max_new_tokens if max_new_tokens is not None else profile.max_new_tokens,
        system=system if system is not None else profile.system,
    )
    if settings.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {settings.max_new_tokens}", "pass a positive number")
    # a byte that is not UTF-8 in the shell's argument: the tokenizer's traceback, after the load
    refuse_undecodable(system or "", "--system", "pass UTF-8 text (a shell in a UTF-8 locale)")
    settings.sampling()  # validates
    return settings


def refuse_undecodable(text: str, what: str, hint: str) -> None:
    """InputError naming the first byte of `text` that was not UTF-8: stdin and the shell's arguments keep such a
    byte as Python's surrogate escape, which the tokenizer cannot take (a TypeError traceback)."""
    odd = next((character for character in text if "\udc80" <= character <= "\udcff"), None)
    if odd is not None:
        raise InputError(f"{what} is not UTF-8 text (it holds the byte 0x{ord(odd) - 0xDC00:02x})", hint)
