"""`specdec compare`'s output: rows of plain numbers in (from `Benchmark.summary`), Rich tables and the
PNG plot out. Nothing is measured or computed here beyond formatting."""

from __future__ import annotations

from pathlib import Path

from rich.markup import escape
from rich.table import Table

from specdec_cli.bench.measure import Benchmark
from specdec_cli.bench.runs import POSITIONS
from specdec_cli.bench.throughput import ThroughputBenchmark
from specdec_cli.models.paths import replacing


def _fixed(value: float | None, pattern: str = "{:.1f}") -> str:
    return "–" if value is None else pattern.format(value)


def _speedup(row: dict) -> tuple[str, str]:
    spread = "–" if row["speedup_min"] is None else f"{row['speedup_min']:.2f}–{row['speedup_max']:.2f}"
    return _fixed(row["speedup"], "×{:.2f}"), spread


def _measurement_cells(row: dict) -> list[str]:
    at = "/".join(_fixed(value, "{:.2f}") for value in row["acceptance_at"])
    identical = "–" if row["identical"] is None else f"{row['identical']}/{row['compared']}"
    return [
        escape(row["configuration"]), _fixed(row["tokens_per_second"]), _fixed(row["median_tokens_per_second"]),
        *_speedup(row), _fixed(row["first_step_seconds"], "{:.2f}"), _fixed(row["decode_tokens_per_second"]),
        _fixed(row["decode_speedup"], "×{:.2f}"), _fixed(row["acceptance_rate"], "{:.2f}"),
        _fixed(row["tokens_per_step"], "{:.2f}"),
        "–" if row["acceptance_rate"] is None else at, _fixed(row["draft_share"], "{:.0%}"),
        f"{row['memory_bytes'] / 2**20:,.0f}", identical,
    ]


def measurement_table(benchmark: Benchmark, by_category: bool) -> Table:
    rows = benchmark.summary()
    table = Table(
        "configuration", "tok/s", "median tok/s", "speedup", "range", "1st step s", "decode tok/s", "decode ×",
        "accept", "tok/step", "accept @1/2/3/4", "draft %", "memory MiB", "identical",
        title=_title(benchmark), caption=_caption(benchmark) + _policy_lines(rows), caption_justify="left",
    )
    for row in rows:
        table.add_row(*_measurement_cells(row))
    for category in benchmark.categories() if by_category else ():
        table.add_section()
        table.add_row(f"[bold]{escape(category)}[/]")
        for row in benchmark.summary(category):
            table.add_row(*_measurement_cells(row | {"configuration": "  " + row["configuration"]}))
    return table


def _policy_lines(rows: list[dict]) -> str:
    """The policy's choices where it held steps back: each such configuration's drafted and held shares of its
    steps, and the reason it gave last."""
    return "".join(
        f"\npolicy, {escape(row['configuration'])}: drafted on {row['drafted_steps']:.0%} of steps, held back "
        f"{row['held_steps']:.0%} ({escape(row['policy'] or '')})"
        for row in rows if row.get("held_steps"))


def _title(benchmark: Benchmark | ThroughputBenchmark) -> str:
    settings = benchmark.settings
    mode = "greedy" if settings.params.greedy else f"temperature {settings.params.temperature:g}"
    return (f"{len(benchmark.prompts)} prompts × {settings.repeats} · {settings.max_new_tokens} new tokens · {mode} · "
            f"{benchmark.target.device} {str(benchmark.target.dtype).removeprefix('torch.')}")


def _caption(benchmark: Benchmark) -> str:
    memory = "CUDA peak allocated" if benchmark.target.device.type == "cuda" else "peak RSS growth, sampled per step"
    return (
        "speedup: tok/s over the target alone's on the same prompts (range: min–max over prompts). "
        "1st step s: mean seconds until the first step's tokens (the prompt's prefill, the draft's too, and the "
        "first draft: the time to first token of the target alone); decode: tokens after it over the time after it "
        "(llama.cpp's tg), × over the target alone's. "
        "accept: accepted/drafted; @i: at draft position i. draft %: share of time spent drafting.\n"
        f"memory: weights of the models a configuration runs + its working memory ({memory}). "
        "identical: prompts whose greedy output equals the target alone's, token for token."
    )


def throughput_table(benchmark: ThroughputBenchmark) -> Table:
    """`compare --batch-size`: one row per configuration; a peer that cannot run here has dashes, and the
    caption says why."""
    rows = benchmark.summary()
    unavailable = "".join(f"\n{escape(row['configuration'])} cannot run here: {escape(row['unavailable'])}"
                          for row in rows if row["unavailable"])
    held = "".join(f"\n{escape(row['configuration'])}: {escape(row['policy'])}" for row in rows if row.get("policy"))
    table = Table("configuration", "new tokens", "seconds", "tok/s", "vs target alone", "accept", "drafted steps",
                  "identical",
                  title=_title(benchmark) + f" · batch size {benchmark.batch_size}", caption_justify="left",
                  caption="every configuration answers all the prompts at this batch size in one pass (× --repeats); "
                          "tok/s: its new tokens over the pass's wall time. vs target alone: over the target alone's "
                          "tok/s at the same batch size. identical: prompts whose greedy output equals the target "
                          "alone's, token for token. drafted steps: the rows' steps that drafted (the policy "
                          "stops drafting where it measured slower than not, and says so below)." + unavailable + held)
    for row in rows:
        identical = "–" if row["identical"] is None else f"{row['identical']}/{row['compared']}"
        tokens, seconds = ("–", "–") if row["unavailable"] else (f"{row['new_tokens']:,}", f"{row['seconds']:.1f}")
        table.add_row(escape(row["configuration"]), tokens, seconds, _fixed(row["tokens_per_second"]),
                      _fixed(row["ratio"], "×{:.2f}"), _fixed(row["acceptance_rate"], "{:.2f}"),
                      _fixed(row.get("drafted_steps"), "{:.0%}"), identical)
    return table


def theory_tables(rows: list[dict], warmup: dict) -> list[Table]:
    """The chains' theory table and the trees', each when a row has that theory (none: nothing drafted)."""
    chains = [theory_table(rows, warmup)] if _with_theory(rows, "chain") else []
    return chains + ([tree_theory_table(rows)] if _with_theory(rows, "tree") else [])


def _with_theory(rows: list[dict], kind: str) -> list[tuple[dict, dict]]:
    """(row, its theory) for the rows whose theory is of `kind` ("chain" or "tree")."""
    return [(row, row["theory"]) for row in rows if row["theory"] is not None and row["theory"]["kind"] == kind]


def theory_table(rows: list[dict], warmup: dict) -> Table:
    cells = []
    for row, theory in _with_theory(rows, "chain"):
        model, lookup = theory["model"], theory["lookup"]
        steps = model["steps"] + lookup["steps"]
        lookup_cell = (f"{lookup['steps'] / steps:.0%} · α {lookup['alpha']:.2f} · γ {lookup['gamma']:.1f}"
                       if lookup["steps"] else "–")
        cells.append([escape(row["configuration"]), f"{model['alpha']:.2f}", f"{model['gamma']:.2f}",
                      f"{theory['c']:.3f}", lookup_cell, *_outcome(row, theory)])
    return _table(
        ["configuration", "α", "γ", "c", "lookup steps", "expected", "measured", "efficiency"], cells,
        title="theory: expected = (1 - α^(γ+1)) / ((1 - α)(γc + 1))",
        caption="α accepted/drafted · γ mean drafted per step · c = seconds to draft one token / one target step "
                "(both measured in this run, prefill left out). Lookup steps (free drafts: share of steps, their α "
                "and γ) enter with c = 0; expected = (tokens per step of both sources) / (cost of both), weighed by "
                "steps." + _forward_note(warmup),
    )


def tree_theory_table(rows: list[dict]) -> Table:
    cells = [[escape(row["configuration"]), _fixed(theory.get("tree_share"), "{:.0%}"),
              f"{theory['nodes_per_step']:.1f}", f"{theory['accepted']:.2f}", f"{theory['expected_accepted']:.2f}",
              f"{theory['c']:.3f}", *_outcome(row, theory)]
             for row, theory in _with_theory(rows, "tree")]
    return _table(
        ["configuration", "tree steps", "nodes/tree", "accepted/step", "expected accepted", "c", "expected",
         "measured", "efficiency"], cells,
        title=escape("tree theory: expected = (1 + E[accepted]) / (c + 1)"),
        caption="tree steps: share of steps that verified a tree (the others drafted a chain, looked up, or did not "
                "draft). E\\[accepted] per step: in a tree step Σ over its nodes of Π a along the node's path, a being "
                "a place in the tree (its sibling ranks from the root) accepted once its parent was, in this run; in "
                "the other steps each kind's (1 - α^(γ+1)) / (1 - α) - 1; weighed by their share of steps. "
                "accepted/step as measured. c = seconds drafting / one target step (prefill left out); the verify "
                "counts as one target step.",
    )


def _outcome(row: dict, theory: dict) -> list[str]:
    """expected, measured, efficiency."""
    return [_fixed(theory["expected_speedup"], "×{:.2f}"), _fixed(row["speedup"], "×{:.2f}"),
            _fixed(theory["efficiency"], "{:.0%}")]


def _table(columns: list[str], cells: list[list[str]], title: str, caption: str) -> Table:
    table = Table(*columns, title=title, caption=caption, caption_justify="left")
    for row_cells in cells:
        table.add_row(*row_cells)
    return table


def _forward_note(warmup: dict) -> str:
    """The cross-check: single-token forwards timed at warm-up."""
    if "c_forward" not in warmup:
        return ""
    return (f"\nsingle-token forward at warm-up: target {warmup['target_forward_seconds'] * 1e3:.1f} ms, "
            f"draft {warmup['draft_forward_seconds'] * 1e3:.1f} ms (c = {warmup['c_forward']:.3f})")


def write_plot(path: Path, rows: list[dict]) -> None:
    """Speedup per configuration (whiskers: min–max over prompts) and acceptance by draft position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (speed_axes, accept_axes) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [row["configuration"] for row in rows]
    speedups = [row["speedup"] or 0.0 for row in rows]
    below = [s - (row["speedup_min"] if row["speedup_min"] is not None else s) for s, row in zip(speedups, rows)]
    above = [(row["speedup_max"] if row["speedup_max"] is not None else s) - s for s, row in zip(speedups, rows)]
    speed_axes.barh(names, speedups, xerr=[below, above], color="tab:blue")
    speed_axes.axvline(1.0, color="grey", linestyle="--")
    speed_axes.invert_yaxis()
    speed_axes.set_xlabel("speedup over the target alone (whiskers: min–max over prompts)")
    for row in rows:
        if row["acceptance_rate"] is not None:
            accept_axes.plot(range(1, POSITIONS + 1), row["acceptance_at"], marker="o", label=row["configuration"])
    accept_axes.set(xlabel="draft position", ylabel="acceptance", ylim=(0, 1.05), xticks=range(1, POSITIONS + 1))
    if accept_axes.lines:
        accept_axes.legend()
    figure.tight_layout()
    try:
        with replacing(path, "choose a writable path for --plot") as temporary:  # no cut-short image, nor old one cut
            figure.savefig(temporary, dpi=120, format=path.suffix.lstrip(".").lower())
    finally:
        plt.close(figure)
