"""Rich text for the terminal: tokens styled by where they came from, the legend, the stats line.

It knows nothing of torch or models: it takes token texts, provenance names ("accepted", "resampled",
"bonus", "target") and plain numbers."""

from __future__ import annotations

from collections.abc import Mapping

from rich.segment import Segment, Segments
from rich.style import Style
from rich.text import Text

# One style per provenance. "target" (nothing was drafted) stays plain, like ordinary output.
STYLES: dict[str, str] = {
    "accepted": "green",           # a draft token the target kept
    "resampled": "bold red",       # the target's correction at the first rejected draft
    "bonus": "bold blue underline",  # the target's extra token after a fully accepted draft
    "target": "",
}

LEGEND_LABELS = (
    ("accepted", "accepted draft"),
    ("resampled", "target's correction"),
    ("bonus", "bonus token"),
)


def token(text: str, provenance: str, styled: bool = True) -> Segments:
    """One piece of a reply, in its provenance's style (plain when `styled` is False). The text goes
    out as it is: no tab expansion, no wrapping, nothing stripped (Rich's `Text` would do all three)."""
    style = Style.parse(STYLES[provenance]) if styled and STYLES[provenance] else None
    return Segments([Segment(text, style)])


def legend() -> Text:
    """The one line that explains the colours."""
    parts: list[Text | str | tuple[str, str]] = ["tokens: "]
    for provenance, label in LEGEND_LABELS:
        parts += [(label, STYLES[provenance]), " · "]
    parts.append("plain: target alone")
    return Text.assemble(*parts)


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.0f}%"


def _drafting(numbers: Mapping[str, float]) -> str:
    if not numbers["drafted"]:
        return "nothing drafted"
    return (
        f"{_percent(numbers['acceptance_rate'])} accepted ({numbers['accepted']}/{numbers['drafted']} drafted)"
    )


def _held(numbers: Mapping[str, float]) -> list[str]:
    """Where the policy kept steps from drafting (drafting measured slower): on how many, and why."""
    if not numbers.get("held_steps"):
        return []
    return [f"no drafting on {numbers['held_steps']}/{numbers['steps']} steps ({numbers.get('policy') or 'the policy'})"]


def stats_line(numbers: Mapping[str, float], label: str = "", note: str = "") -> Text:
    """`[label: ]N tokens · T tok/s · A% accepted (a/d drafted) · S tokens/step · draft Xs, verify Ys[ · note]`.

    `numbers` holds new_tokens, tokens_per_second, drafted, accepted, acceptance_rate,
    tokens_per_step, draft_seconds and verify_seconds (as `GenerationStats.as_dict()` gives them)."""
    fields = [
        f"{numbers['new_tokens']} token{'' if numbers['new_tokens'] == 1 else 's'}",
        f"{numbers['tokens_per_second']:.1f} tok/s",
        _drafting(numbers),
        *_held(numbers),
        f"{numbers['tokens_per_step']:.2f} tokens/step",
        f"draft {numbers['draft_seconds']:.2f}s, verify {numbers['verify_seconds']:.2f}s",
    ]
    if note:
        fields.append(note)
    prefix = f"{label}: " if label else ""
    return Text(prefix + " · ".join(fields), style="dim")


def notice(message: str) -> Text:
    """A short line from the chat itself (a command's answer), set apart from replies."""
    return Text(message, style="dim italic")
