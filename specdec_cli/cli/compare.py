"""`specdec compare`: every configuration on the same prompts, side by side, against the target alone.

Thin: options → bench.Benchmark → Rich tables (stdout), progress (stderr), --json, --plot."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from specdec_cli import bench
from specdec_cli.cli.app import error_console, report_errors
from specdec_cli.cli.options import (
    AllowPickleOption, DeviceOption, Draft4bitOption, DraftInt8Option, DraftOption, DtypeOption, LoadIn4bitOption,
    LoadIn8bitOption, MaxNewTokensOption, ModelChoice, ProfileOption, Target4bitOption, TargetOption,
    TemperatureOption, TrustRemoteCodeOption, choose_models, decoding_settings, load_choice,
)
from specdec_cli.errors import InputError, MissingExtraError
from specdec_cli.models import LoadedModel, load_model
from specdec_cli.prompts import builtin_prompts, read_prompt_file, select_prompts
from specdec_cli.session import parse_k, sampling_params

DEFAULT_MAX_NEW_TOKENS = 128
_PROMPTS, _OUTPUT = "Prompts", "Output"

# --k and --drafter take comma-separated lists here, unlike the single values of chat and run.
KListOption = Annotated[str | None, typer.Option(
    "--k", help="Draft lengths to compare, comma-separated: numbers and/or auto, e.g. 1,2,4,8,auto. Default: the profile's.",
    rich_help_panel="Decoding")]
DrafterListOption = Annotated[str | None, typer.Option(
    "--drafter", help="Drafters to compare, comma-separated, e.g. model,ngram. Default: the profile's.",
    rich_help_panel="Models")]
PromptsOption = Annotated[Path | None, typer.Option(
    "--prompts", help='JSONL file: {"prompt"} lines (raw text), {"messages"} lines (chat template) or Spec-Bench '
    '{"question_id","category","turns"} lines (first turn). Default: the built-in set (chat, code, summarisation, qa, '
    "translation, math).", rich_help_panel=_PROMPTS)]
CategoryOption = Annotated[list[str] | None, typer.Option(
    "--category", help="Only this category (repeat for more).", rich_help_panel=_PROMPTS)]
NPromptsOption = Annotated[int | None, typer.Option(
    "--n-prompts", help="At most N prompts PER CATEGORY (the first N of each, in file order).", rich_help_panel=_PROMPTS)]
RepeatsOption = Annotated[int, typer.Option("--repeats", help="Run every prompt R times (all configurations each time).")]
ByCategoryOption = Annotated[bool, typer.Option("--by-category", help="Add one row group per category.", rich_help_panel=_OUTPUT)]
WithHfOption = Annotated[bool, typer.Option(
    "--with-hf", help=f"Also run HF generate(assistant_model=draft) and HF prompt lookup "
    f"(prompt_lookup_num_tokens={bench.HF_LOOKUP_TOKENS}) on the same prompts.")]
JsonOption = Annotated[Path | None, typer.Option(
    "--json", help="Write every raw measurement and the environment to this file.", rich_help_panel=_OUTPUT)]
PlotOption = Annotated[Path | None, typer.Option(
    "--plot", help="Write a PNG: speedup per configuration, acceptance by draft position (needs the plot extra).",
    rich_help_panel=_OUTPUT)]


@report_errors
def compare_command(
    profile: ProfileOption = None, target: TargetOption = None, draft: DraftOption = None,
    drafter: DrafterListOption = None, device: DeviceOption = None, dtype: DtypeOption = None,
    target_4bit: Target4bitOption = False, draft_4bit: Draft4bitOption = False,
    load_in_4bit: LoadIn4bitOption = False, load_in_8bit: LoadIn8bitOption = False,
    draft_int8: DraftInt8Option = None,
    trust_remote_code: TrustRemoteCodeOption = False, allow_pickle: AllowPickleOption = False,
    prompts: PromptsOption = None, category: CategoryOption = None, n_prompts: NPromptsOption = None,
    k: KListOption = None, max_new_tokens: MaxNewTokensOption = None, temperature: TemperatureOption = None,
    repeats: RepeatsOption = 1, by_category: ByCategoryOption = False, with_hf: WithHfOption = False,
    json_path: JsonOption = None, plot: PlotOption = None,
) -> None:
    """Benchmark speculative configurations against the target alone on the same prompts, with the
    theory's expected speedup beside each measurement. Greedy unless --temperature; 128 new tokens
    unless --max-new-tokens."""
    drafters = _split(drafter)
    choice = choose_models(
        profile, target, draft, _drafter_for_choice(drafters), device, dtype, target_4bit, draft_4bit,
        load_in_4bit, load_in_8bit, trust_remote_code, allow_pickle, draft_int8=draft_int8,
    )
    settings = decoding_settings(
        choice.profile, temperature=temperature if temperature is not None else 0.0,
        max_new_tokens=max_new_tokens if max_new_tokens is not None else DEFAULT_MAX_NEW_TOKENS,
    )
    ks = [parse_k(value) for value in _split(k)] or [settings.k]
    chosen_prompts = select_prompts(read_prompt_file(prompts) if prompts else builtin_prompts(), category or (), n_prompts)
    _check_outputs(json_path, plot)
    bench_settings = bench.BenchSettings(
        sampling_params(settings.temperature, settings.top_p, settings.top_k, None if settings.temperature == 0 else 0),
        settings.max_new_tokens, repeats, settings.system,
    )
    target_model, draft_model = load_choice(choice)
    if with_hf and draft_model is None:
        error_console().print("note: HF assisted generation needs a draft model — skipped (HF prompt lookup runs)")
    plain_draft = _plain_draft(choice, draft_model) if with_hf else None
    configs = bench.configurations(drafters or [choice.drafter], ks, with_hf, draft_model is not None,
                                   plain_draft=draft_model.quantization if plain_draft else None)
    benchmark = bench.Benchmark(target_model, draft_model, configs, chosen_prompts, bench_settings, plain_draft)
    _measure(benchmark, json_path)
    console = Console()
    if not console.is_terminal:  # a file or a pipe: keep the whole table instead of folding it to 80 columns
        console = Console(width=200)
    console.print(measurement_table(benchmark, by_category))
    console.print(theory_table(benchmark.summary(), benchmark.warmup))
    if json_path:
        bench.write_json(json_path, benchmark.report(by_category))
        error_console().print(f"wrote {json_path}")
    if plot:
        write_plot(plot, benchmark.summary())
        error_console().print(f"wrote {plot}")


def _plain_draft(choice: ModelChoice, draft: LoadedModel | None) -> LoadedModel | None:
    """The draft as HF users load it, when ours carries specdec's own int8 (HF cannot load that): HF assisted
    runs with both, so the int8 lever shows as ours. bitsandbytes drafts are HF's own: HF gets them as they are."""
    if draft is None or draft.quantization != "int8":
        return None
    plain = load_model(choice.draft, device=choice.device, dtype=choice.dtype, trust_remote_code=choice.trust_remote_code,
                       allow_pickle=choice.allow_pickle)
    error_console().print(plain.describe("draft for HF assisted"), markup=False)
    return plain


def _split(values: str | None) -> list[str]:
    return [value.strip() for value in (values or "").split(",") if value.strip()]


def _drafter_for_choice(drafters: list[str]) -> str | None:
    """What `choose_models` needs to load the right models: a draft model unless only n-gram is asked."""
    if drafters and all(name == "ngram" for name in drafters):
        return "ngram"
    return "model" if "model" in drafters else None


def _check_outputs(json_path: Path | None, plot: Path | None) -> None:
    """Fail before minutes of measuring, not after."""
    for path, flag in ((json_path, "--json"), (plot, "--plot")):
        if path is not None and not path.parent.is_dir():
            raise InputError(f"no folder {path.parent} for {flag}", "create it or choose another path")
    if plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise MissingExtraError("--plot needs matplotlib", "pip install 'specdec[plot]'")


def _measure(benchmark: bench.Benchmark, json_path: Path | None) -> None:
    """Run it with a progress bar on stderr; on Ctrl-C keep what was measured in --json."""
    total = len(benchmark.order)
    n_prompts = len(benchmark.prompts)
    per_prompt = len(benchmark.configs) * benchmark.settings.repeats
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    console = error_console()
    started = time.perf_counter()
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("warming up", total=total)

        def advance(done: int, _total: int, prompt: int, config: bench.Configuration) -> None:
            progress.update(task, completed=done, description=f"prompt {prompt + 1}/{n_prompts} · {config.name}")
            if not console.is_terminal and done % per_prompt == 0:  # no live bar: one line per prompt instead
                console.print(f"prompt {prompt + 1}/{n_prompts} measured ({done}/{total} runs, "
                              f"{time.perf_counter() - started:.0f} s)", markup=False)

        try:
            benchmark.measure(advance)
        except KeyboardInterrupt:
            if json_path and benchmark.runs:
                bench.write_json(json_path, benchmark.report(by_category=False) | {"interrupted": True})
                error_console().print(f"wrote the {len(benchmark.runs)} runs measured so far to {json_path}")
            raise


# ---- rendering: rows of plain numbers in, Rich tables out ---------------------------------------


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
        *_speedup(row), _fixed(row["acceptance_rate"], "{:.2f}"), _fixed(row["tokens_per_step"], "{:.2f}"),
        "–" if row["acceptance_rate"] is None else at, _fixed(row["draft_share"], "{:.0%}"),
        f"{row['memory_bytes'] / 2**20:,.0f}", identical,
    ]


def measurement_table(benchmark: bench.Benchmark, by_category: bool) -> Table:
    table = Table(
        "configuration", "tok/s", "median tok/s", "speedup", "range", "accept", "tok/step", "accept @1/2/3/4",
        "draft %", "memory MiB", "identical",
        title=_title(benchmark), caption=_caption(benchmark), caption_justify="left",
    )
    for row in benchmark.summary():
        table.add_row(*_measurement_cells(row))
    for category in benchmark.categories() if by_category else ():
        table.add_section()
        table.add_row(f"[bold]{escape(category)}[/]")
        for row in benchmark.summary(category):
            table.add_row(*_measurement_cells(row | {"configuration": "  " + row["configuration"]}))
    return table


def _title(benchmark: bench.Benchmark) -> str:
    settings = benchmark.settings
    mode = "greedy" if settings.params.greedy else f"temperature {settings.params.temperature:g}"
    return (f"{len(benchmark.prompts)} prompts × {settings.repeats} · {settings.max_new_tokens} new tokens · {mode} · "
            f"{benchmark.target.device} {str(benchmark.target.dtype).removeprefix('torch.')}")


def _caption(benchmark: bench.Benchmark) -> str:
    memory = "CUDA peak allocated" if benchmark.target.device.type == "cuda" else "peak RSS growth, sampled per step"
    return (
        "speedup: tok/s over the target alone's on the same prompts (range: min–max over prompts). "
        "accept: accepted/drafted; @i: at draft position i. draft %: share of time spent drafting.\n"
        f"memory: weights of the models a configuration runs + its working memory ({memory}). "
        "identical: prompts whose greedy output equals the target alone's, token for token."
    )


def theory_table(rows: list[dict], warmup: dict) -> Table:
    table = Table(
        "configuration", "α", "γ", "c", "lookup steps", "expected", "measured", "efficiency",
        title="theory: expected = (1 - α^(γ+1)) / ((1 - α)(γc + 1))",
        caption="α accepted/drafted · γ mean drafted per step · c = seconds to draft one token / one target step "
                "(both measured in this run, prefill left out). Lookup steps (free drafts: share of steps, their α "
                "and γ) enter with c = 0; expected = (tokens per step of both sources) / (cost of both), weighed by "
                "steps." + _forward_note(warmup),
        caption_justify="left",
    )
    for row in rows:
        theory = row["theory"]
        if theory is None:
            continue
        model, lookup = theory["model"], theory["lookup"]
        steps = model["steps"] + lookup["steps"]
        lookup_cell = (f"{lookup['steps'] / steps:.0%} · α {lookup['alpha']:.2f} · γ {lookup['gamma']:.1f}"
                       if lookup["steps"] else "–")
        table.add_row(
            escape(row["configuration"]), f"{model['alpha']:.2f}", f"{model['gamma']:.2f}", f"{theory['c']:.3f}",
            lookup_cell, _fixed(theory["expected_speedup"], "×{:.2f}"), _fixed(row["speedup"], "×{:.2f}"),
            _fixed(theory["efficiency"], "{:.0%}"),
        )
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
            accept_axes.plot(range(1, bench.POSITIONS + 1), row["acceptance_at"], marker="o", label=row["configuration"])
    accept_axes.set(xlabel="draft position", ylabel="acceptance", ylim=(0, 1.05), xticks=range(1, bench.POSITIONS + 1))
    if accept_axes.lines:
        accept_axes.legend()
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=120)
    except OSError as error:
        raise InputError(f"cannot write {path}: {error.strerror}", "choose a writable path for --plot") from None
    finally:
        plt.close(figure)
