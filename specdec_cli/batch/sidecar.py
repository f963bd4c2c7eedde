"""The settings an OUTPUT was made with, in `OUTPUT.settings.json` beside it, so that `--resume` with other
settings (a model, k, temperature, budget, system prompt ...) is refused instead of mixing two runs in one
file; and a digest of each request it answers, so that `--resume` with another input (whose lines take the same
ids: line numbers) is refused instead of counting its requests as answered. Written atomically (temporary file,
fsync, rename) when a run starts a file, and its digests when a run resumes it. No torch."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from specdec_cli.errors import InputError
from specdec_cli.models.paths import replacing

if TYPE_CHECKING:  # settings imports torch; this package must not
    from specdec_cli.batch.requests import Request
    from specdec_cli.settings import DecodingSettings, ModelChoice

FORMAT = 1


def settings_path(output: Path) -> Path:
    return output.with_name(output.name + ".settings.json")


def record_settings(choice: ModelChoice, settings: DecodingSettings) -> dict:
    """What shapes a record: the models and their formats, the drafter, k, sampling, budget, system prompt."""
    return {
        "target": choice.target, "draft": choice.draft, "drafter": choice.drafter, "device": choice.device,
        "dtype": choice.dtype, "target_quantization": choice.target_quantization,
        "draft_quantization": choice.draft_quantization, "k": settings.k, "temperature": settings.temperature,
        "top_p": settings.top_p, "top_k": settings.top_k, "seed": settings.seed,
        "max_new_tokens": settings.max_new_tokens, "system": settings.system,
        # A prompt read in bfloat16 (--prefill) gives other records; named only then, so that files made before the
        # option resume as they were. Read by a q4 target's own weights on AMX it gives others again than by the copy
        # (models/prefill.py): named too, so that a file begun one way is not resumed the other.
        **({"prefill": "bf16"} if choice.prefill == "bf16" else {}),
        **({"prompt_reader": "q4 on AMX"} if choice.prefill == "bf16" and _reads_on_amx(choice) else {}),
    }


def _reads_on_amx(choice: ModelChoice) -> bool:
    from specdec_cli.models.loading.prefill import reads_on_amx

    return reads_on_amx(choice.target_quantization)


def write_settings(output: Path, settings: dict, requests: dict[str, str] | None = None) -> None:
    """The settings OUTPUT is made with, and `requests`: {Request.key: Request.digest} of those it will answer."""
    _write(output, {"format": FORMAT, "settings": settings, **({"requests": requests} if requests else {})})


def remember_requests(output: Path, requests: dict[str, str]) -> None:
    """Resuming OUTPUT: its settings file (where it has one) takes the digests of the requests this run answers
    (`requests`), in place of whatever requests an earlier run left unanswered under the same keys."""
    stored = _read(output)
    if stored is not None and requests:
        _write(output, {**stored, "requests": {**_digests(stored), **requests}})


def request_digests(requests: Sequence[Request], pending: Sequence[Request]) -> dict[str, str]:
    """{Request.key: Request.digest} of the `pending` requests that are the first under their key in `requests` (the
    whole input): a later line with that key (a repeated id) is an error record whatever it says, so its digest must
    not stand for the first line's answer."""
    first = _first_under_each_key(requests)
    return {request.key: request.digest for request in pending if first[request.key] is request}


def _first_under_each_key(requests: Sequence[Request]) -> dict[str, Request]:
    first: dict[str, Request] = {}
    for request in requests:
        first.setdefault(request.key, request)
    return first


def _write(output: Path, content: dict) -> None:
    with replacing(settings_path(output), "choose an -o in a folder you can write") as temporary:
        with open(temporary, "w", encoding="utf-8") as file:
            json.dump(content, file, indent=1, ensure_ascii=False)
            file.write("\n")
            file.flush()
            os.fsync(file.fileno())


def read_settings(output: Path) -> dict | None:
    """The stored settings; None when OUTPUT has no settings file (made before specdec wrote one)."""
    stored = _read(output)
    return None if stored is None else stored["settings"]


def _read(output: Path) -> dict | None:
    path = settings_path(output)
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise InputError(f"cannot read {path}: {error}", "pass --force to resume without checking the settings, "
                         "or --overwrite to start again") from None
    if not isinstance(stored, dict) or not isinstance(stored.get("settings"), dict):
        raise InputError(f"{path} is not a specdec settings file",
                         "pass --force to resume without checking the settings, or --overwrite to start again")
    return stored


def _digests(stored: dict) -> dict[str, str]:
    """The request digests of a settings file; none in one made before specdec stored them."""
    requests = stored.get("requests")
    if not isinstance(requests, dict):
        return {}
    return {key: digest for key, digest in requests.items() if isinstance(digest, str)}


def settings_differences(stored: dict, current: dict) -> list[str]:
    """`name stored → current` for every setting that differs (JSON-compared, so 0 and 0.0 agree)."""
    current = json.loads(json.dumps(current))
    names = list(stored) + [name for name in current if name not in stored]
    return [f"{name} {_shown(stored.get(name))} → {_shown(current.get(name))}"
            for name in names if stored.get(name) != current.get(name)]


def _shown(value: object) -> str:
    return "none" if value is None else json.dumps(value, ensure_ascii=False)


def check_resumed_settings(output: Path, current: dict, force: bool) -> str | None:
    """Refuse to resume OUTPUT with other settings than it was made with (unless `force`); the returned
    line, if any, is a note to print (no settings file, or differences let through by --force)."""
    stored = read_settings(output)
    if stored is None:
        return (f"note: {output} has no settings file (made by an older specdec), so resuming cannot check that "
                "the settings match")
    differences = settings_differences(stored, current)
    if not differences:
        return None
    listed = ", ".join(differences)
    if force:
        return f"note: --force: resuming {output} with other settings than it was made with ({listed})"
    raise InputError(f"{output} was made with other settings: {listed}",
                     "run with the same settings, pass --force to mix them in one file, or --overwrite to start again")


def check_resumed_requests(output: Path, source: str, answered: list[Request], force: bool) -> str | None:
    """Refuse to resume OUTPUT where a request it already answers (`answered`: those of the input its records match
    by key) is not the one it answered under that key: another input, or a line edited since (unless `force`,
    which keeps those answers); the returned line, if any, is a note to print."""
    stored = _read(output)
    digests = {} if stored is None else _digests(stored)
    # The first under each key: a later line with it (a repeated id) is an error record, not that answer.
    firsts = _first_under_each_key(answered).values()
    changed = [request for request in firsts if digests.get(request.key, request.digest) != request.digest]
    if not changed:
        return None
    first = changed[0]
    which = f"line {first.line} (id {_shown(first.id)})" + (f" and {len(changed) - 1} more" if len(changed) > 1 else "")
    source = "the input" if source == "-" else source
    if force:
        return f"note: --force: {output} keeps its answers to other requests under the ids of {which} of {source}"
    raise InputError(f"{output} answers another request than {which} of {source} under the same id: it was made "
                     "from another input, or those lines changed since",
                     "resume with the input it was made from, write to another -o, or pass --force to keep those "
                     "answers")
