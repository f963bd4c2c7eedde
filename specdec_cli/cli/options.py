"""Model-selection options shared by chat, run and compare, and the one function that merges them
with a profile (`choose_models`) and the one that loads the result (`load_choice`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import typer
from rich.console import Console

from specdec_cli.errors import InputError
from specdec_cli.models import LoadedModel, load_pair
from specdec_cli.models.device import resolve_device
from specdec_cli.profiles import DEFAULT_PROFILE, DRAFTERS, Profile, load_profile

_MODELS = "Models"

def _text(*flags: str, help: str):
    return Annotated[str | None, typer.Option(*flags, help=help, rich_help_panel=_MODELS)]


def _flag(flag: str, help: str):
    return Annotated[bool, typer.Option(flag, help=help, rich_help_panel=_MODELS)]


ProfileOption = _text("--profile", "-p", help=f"Named model pair (see `specdec profiles list`). Default: {DEFAULT_PROFILE}.")
TargetOption = _text("--target", help="Target model: hub id org/name[@rev], local folder, .gguf file or demo:NAME.")
DraftOption = _text("--draft", help="Draft model (same forms as --target); implies --drafter model.")
DrafterOption = _text("--drafter", help="model: a draft model guesses; ngram: guesses come from text already seen; cascade: ngram when it matches, else the draft model.")
DeviceOption = _text("--device", help="auto, cpu, cuda, cuda:N or mps (auto: cuda, then mps, then cpu).")
DtypeOption = _text("--dtype", help="auto, bfloat16, float16 or float32.")
Target4bitOption = _flag("--target-4bit", help="Load the target in 4-bit (nf4).")
Draft4bitOption = _flag("--draft-4bit", help="Load the draft in 4-bit (nf4).")
LoadIn4bitOption = _flag("--load-in-4bit", help="Load both models in 4-bit (nf4, bf16 compute).")
LoadIn8bitOption = _flag("--load-in-8bit", help="Load both models in 8-bit.")
DraftInt8Option = Annotated[bool | None, typer.Option(
    "--draft-int8/--no-draft-int8",
    help="Quantise the draft to int8 with torch (CPU only; about twice as fast a draft step). Default: the profile's choice.",
    rich_help_panel=_MODELS)]
TrustRemoteCodeOption = _flag("--trust-remote-code", help="Allow model code from the hub to run (only for models you trust).")
AllowPickleOption = _flag("--allow-pickle", help="Allow .bin/.pt pickle weights, which can run code when loaded.")


@dataclass
class ModelChoice:
    """The profile merged with command-line overrides (flags win)."""

    profile: Profile
    target: str
    draft: str | None
    drafter: str  # "model" | "ngram" | "cascade"
    device: str
    dtype: str
    target_quantization: str | None
    draft_quantization: str | None
    trust_remote_code: bool
    allow_pickle: bool
    draft_int8_flag: bool | None = None  # --draft-int8 / --no-draft-int8 as given (None: the profile decides)


def _base_profile(profile: str | None, target: str | None, draft: str | None) -> Profile:
    """The named profile; without one, `--target` starts a blank profile and no model option at all means the default."""
    if profile is not None:
        return load_profile(profile)
    if target is None:
        return load_profile(DEFAULT_PROFILE)
    return Profile(name="(command line)", target=target, draft=draft, drafter="model" if draft else "ngram")


def _drafter_and_draft(base: Profile, draft: str | None, drafter: str | None) -> tuple[str, str | None]:
    if drafter is not None and drafter not in DRAFTERS:
        raise InputError(f"unknown drafter {drafter!r}", "use --drafter model, ngram or cascade")
    if draft is not None and drafter == "ngram":
        raise InputError("--draft and --drafter ngram contradict each other", "drop one of them")
    chosen_drafter = drafter or ("model" if draft is not None and base.drafter == "ngram" else base.drafter)
    chosen_draft = None if chosen_drafter == "ngram" else (draft or base.draft)
    if chosen_drafter != "ngram" and chosen_draft is None:
        raise InputError(f"--drafter {chosen_drafter} needs a draft model", "pass --draft NAME, or use --drafter ngram")
    return chosen_drafter, chosen_draft


def _quantizations(base: Profile, target_4bit: bool, draft_4bit: bool, load_in_4bit: bool, load_in_8bit: bool,
                   draft_int8: bool | None = None):
    if load_in_4bit and load_in_8bit:
        raise InputError("--load-in-4bit and --load-in-8bit contradict each other", "pick one")
    if draft_4bit and draft_int8:
        raise InputError("--draft-4bit and --draft-int8 contradict each other", "pick one")
    both = "4bit" if load_in_4bit else "8bit" if load_in_8bit else None
    profile_draft = None if draft_int8 is False and base.draft_quantization == "int8" else base.draft_quantization
    target_quantization = "4bit" if target_4bit else both or base.target_quantization
    draft_quantization = "4bit" if draft_4bit else "int8" if draft_int8 else both or profile_draft
    return target_quantization, draft_quantization


def choose_models(
    profile: str | None,
    target: str | None,
    draft: str | None,
    drafter: str | None,
    device: str | None,
    dtype: str | None,
    target_4bit: bool = False,
    draft_4bit: bool = False,
    load_in_4bit: bool = False,
    load_in_8bit: bool = False,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    draft_int8: bool | None = None,
) -> ModelChoice:
    """Merge a profile with command-line flags; a flag that is given always wins.

    - No model option at all: the `demo` profile.
    - `--target X` without `--profile`: X alone with the n-gram drafter, or with `--draft Y` the pair X+Y.
    - `--profile P --target X`: P's settings with X as target (P's draft kept; the tokenizer pre-flight
      refuses it if it does not fit X).
    - `--draft Y` always means the draft-model drafter; `--drafter ngram` drops the profile's draft.
    - `--load-in-4bit`/`--load-in-8bit` set both models; `--target-4bit`/`--draft-4bit`/`--draft-int8`
      set one (and win over the first two); `--no-draft-int8` drops a profile's int8 draft.
    """
    base = _base_profile(profile, target, draft)
    chosen_drafter, chosen_draft = _drafter_and_draft(base, draft, drafter)
    target_quantization, draft_quantization = _quantizations(
        base, target_4bit, draft_4bit, load_in_4bit, load_in_8bit, draft_int8)
    return ModelChoice(
        profile=base,
        target=target or base.target,
        draft=chosen_draft,
        drafter=chosen_drafter,
        device=device or base.device,
        dtype=dtype or base.dtype,
        target_quantization=target_quantization,
        draft_quantization=draft_quantization if chosen_draft else None,
        trust_remote_code=trust_remote_code,
        allow_pickle=allow_pickle,
        draft_int8_flag=draft_int8,
    )


def _draft_quantization(choice: ModelChoice, console: Console) -> str | None:
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


def load_choice(choice: ModelChoice, console: Console | None = None) -> tuple[LoadedModel, LoadedModel | None]:
    """Load the chosen pair (pre-flight checks first, progress on stderr) and say once per model what was chosen."""
    console = console or Console(stderr=True, highlight=False, soft_wrap=True)
    target, draft = load_pair(
        choice.target,
        choice.draft,
        device=choice.device,
        dtype=choice.dtype,
        target_quantization=choice.target_quantization,
        draft_quantization=_draft_quantization(choice, console),
        trust_remote_code=choice.trust_remote_code,
        allow_pickle=choice.allow_pickle,
        progress=not console.quiet,  # -q: no spinners, no "Loading weights" bars
    )
    console.print(target.describe("target"), markup=False)
    console.print(draft.describe("draft") if draft else "draft: n-gram lookup", markup=False)
    return target, draft


_DECODING = "Decoding"


def _decoding(kind, *flags: str, help: str):
    return Annotated[kind | None, typer.Option(*flags, help=help, rich_help_panel=_DECODING)]


# Defaults are None: "take the profile's value" (see `decoding_settings`).
KOption = _decoding(str, "--k", help="Draft length: a number (0 = target alone) or auto (drafts while the draft "
                    "model is confident, up to 20; not at all when drafting does not pay).")
TemperatureOption = _decoding(float, "--temperature", "-t", help="0 = greedy (exactly the target's argmax sequence).")
TopPOption = _decoding(float, "--top-p", help="Nucleus sampling: keep the smallest set of tokens with this mass.")
TopKOption = _decoding(int, "--top-k", help="Keep only the K most likely tokens (0 = all).")
SeedOption = _decoding(int, "--seed", help="Seed for sampling: same seed and input give the same output.")
MaxNewTokensOption = _decoding(int, "--max-new-tokens", "-n", help="Stop after this many new tokens.")
SystemOption = _decoding(str, "--system", help="System prompt for chat-template models.")


@dataclass
class DecodingSettings:
    """The profile's decoding defaults merged with command-line flags (flags win)."""

    k: int | str
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    max_new_tokens: int
    system: str | None


def decoding_settings(
    profile: Profile,
    k: str | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    max_new_tokens: int | None = None,
    system: str | None = None,
) -> DecodingSettings:
    from specdec_cli.session import parse_k, sampling_params

    settings = DecodingSettings(
        k=parse_k(k if k is not None else profile.k),
        temperature=temperature if temperature is not None else profile.temperature,
        top_p=top_p if top_p is not None else profile.top_p,
        top_k=top_k if top_k is not None else profile.top_k,
        seed=seed,
        max_new_tokens=max_new_tokens if max_new_tokens is not None else profile.max_new_tokens,
        system=system if system is not None else profile.system,
    )
    if settings.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {settings.max_new_tokens}", "pass a positive number")
    sampling_params(settings.temperature, settings.top_p, settings.top_k, seed)  # validates
    return settings
