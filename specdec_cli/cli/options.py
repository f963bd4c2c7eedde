"""The options shared by chat, run and compare, declared once as Typer aliases. Each command hands what it
was given to `settings` by name: the model options as a `settings.ModelOverrides`, the decoding ones as
`settings.decoding_settings`' keywords (both merged there with the profile)."""

from __future__ import annotations

from typing import Annotated

import typer

from specdec_cli.profiles import DEFAULT_PROFILE

_MODELS = "Models"

def _text(*flags: str, help: str):
    return Annotated[str | None, typer.Option(*flags, help=help, rich_help_panel=_MODELS)]


def _flag(flag: str, help: str):
    return Annotated[bool, typer.Option(flag, help=help, rich_help_panel=_MODELS)]


ProfileOption = _text("--profile", "-p", help=f"Named model pair (see `specdec profiles list`). Default: {DEFAULT_PROFILE}.")
TargetOption = _text("--target", help="Target model: hub id org/name[@rev], local folder, .gguf file or demo:NAME.")
DraftOption = _text("--draft", help="Draft model (same forms as --target); implies --drafter model.")
DrafterOption = _text("--drafter", help="model: a draft model guesses; ngram: guesses come from text already seen; cascade: ngram when it matches, else the draft model; tree: as cascade, with the draft model proposing a token tree (several candidates where it hesitates).")
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
TargetQuantOption = _text("--target-quant", help="Target weights: none, int8 (per-token int8 activations, CPU), int4 "
                          "(weight-only, CPU), q4 (4-bit weights, int8 activations, CPU), nf4, bnb8 (bitsandbytes) or auto. Default: the profile's.")
DraftQuantOption = _text("--draft-quant", help="Draft weights: none, int8, int4, q4, nf4, bnb8 or auto (as --target-quant). "
                         "Default: the profile's.")
PrefillOption = _text("--prefill", help="Who reads a prompt: auto (a q4/int8 target in bfloat16 on a CPU with AMX: "
                      "a q4 target with its own weights, else a bfloat16 copy where it fits in memory), bf16 (the "
                      "same; refused where it cannot be) or none (the target itself). The answer is always written by "
                      "the target as chosen. Default: auto.")
TrustRemoteCodeOption = _flag("--trust-remote-code", help="Allow model code from the hub to run (only for models you trust).")
AllowPickleOption = _flag("--allow-pickle", help="Allow .bin/.pt pickle weights, which can run code when loaded.")


_DECODING = "Decoding"


def _decoding(kind, *flags: str, help: str):
    return Annotated[kind | None, typer.Option(*flags, help=help, rich_help_panel=_DECODING)]


# Defaults are None: "take the profile's value" (see `decoding_settings`).
KOption = _decoding(str, "--k", help="Draft length: a number (0 = target alone) or auto (drafts while the draft "
                    "model is confident, up to 20; not at all when drafting does not pay).")
TemperatureOption = _decoding(float, "--temperature", "-t", help="0 = greedy (exactly the target's argmax sequence; so is anything below 1e-5, as in vLLM).")
TopPOption = _decoding(float, "--top-p", help="Nucleus sampling: keep the smallest set of tokens with this mass.")
TopKOption = _decoding(int, "--top-k", help="Keep only the K most likely tokens (0 = all, as vLLM's -1).")
SeedOption = _decoding(int, "--seed", help="Seed for sampling: same seed and input give the same output.")
MaxNewTokensOption = _decoding(int, "--max-new-tokens", "-n", help="Stop after this many new tokens.")
SystemOption = _decoding(str, "--system", help="System prompt for chat-template models.")

