from rich.text import Text

from specdec_cli import render
from tests.chat.ansi import styled_runs, terminal


def _codes(text) -> set[str]:
    console = terminal()
    console.print(text, end="")
    return {codes for codes, _ in styled_runs(console.export_text(styles=True))}


def test_three_draft_provenances_have_three_distinct_styles_and_target_is_plain():
    codes = {origin: _codes(render.token("tok", origin)) for origin in ("accepted", "resampled", "bonus", "target")}
    assert codes["target"] == {""}
    styled = [codes[origin] for origin in ("accepted", "resampled", "bonus")]
    assert all(len(found) == 1 and "" not in found for found in styled)
    assert len({next(iter(found)) for found in styled}) == 3


def test_unstyled_pieces_carry_no_style():
    for origin in ("accepted", "resampled", "bonus"):
        assert _codes(render.token("tok", origin, styled=False)) == {""}


def test_the_legend_is_one_line_naming_each_style_in_that_style():
    console = terminal()
    console.print(render.legend())
    ansi = console.export_text(styles=True)
    assert Text.from_ansi(ansi).plain == "tokens: accepted draft · target's correction · bonus token · plain: target alone\n"
    runs = dict((text, codes) for codes, text in styled_runs(ansi))
    for origin, label in render.LEGEND_LABELS:
        assert runs[label] == next(iter(_codes(render.token("x", origin))))


NUMBERS = {
    "new_tokens": 42, "tokens_per_second": 12.345, "drafted": 40, "accepted": 30, "acceptance_rate": 0.75,
    "tokens_per_step": 2.625, "draft_seconds": 1.2, "verify_seconds": 2.345,
}


def test_stats_line_says_every_number_on_one_line():
    assert render.stats_line(NUMBERS).plain == (
        "42 tokens · 12.3 tok/s · 75% accepted (30/40 drafted) · 2.62 tokens/step · draft 1.20s, verify 2.35s"
    )


def test_stats_line_with_nothing_drafted_a_label_and_a_note():
    numbers = {**NUMBERS, "drafted": 0, "accepted": 0, "acceptance_rate": 0.0}
    assert render.stats_line(numbers, label="session", note="interrupted").plain == (
        "session: 42 tokens · 12.3 tok/s · nothing drafted · 2.62 tokens/step · draft 1.20s, verify 2.35s · interrupted"
    )


def test_stats_line_says_on_how_many_steps_and_why_the_policy_stopped_drafting():
    numbers = {**NUMBERS, "steps": 16, "drafted_steps": 6, "held_steps": 10,
               "policy": "drafting did not pay: 9.1 vs 12.0 tok/s expected from the measured costs"}
    assert render.stats_line(numbers).plain == (
        "42 tokens · 12.3 tok/s · 75% accepted (30/40 drafted) · no drafting on 10/16 steps (drafting did not pay: "
        "9.1 vs 12.0 tok/s expected from the measured costs) · 2.62 tokens/step · draft 1.20s, verify 2.35s"
    )


def test_reply_text_goes_out_unchanged():
    console = terminal()
    console.print(render.token("\tif x:\r\n  ", "accepted", styled=False), end="")
    assert console.export_text() == "\tif x:\r\n  "


def test_stats_line_says_1_token_not_1_tokens():
    assert render.stats_line({**NUMBERS, "new_tokens": 1}).plain.startswith("1 token · ")
