"""`specdec compare`: every configuration on the same prompts, side by side, against the target alone.

Thin: options → bench.Benchmark → Rich tables (stdout), progress (stderr), --json, --plot. With --batch-size B:
options → bench.ThroughputBenchmark → one throughput table, progress, --json."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specdec_cli import bench
from specdec_cli.bench.runs import HF_LOOKUP_TOKENS
from specdec_cli.cli.app import PipeConsole, error_console, report_errors
from specdec_cli.cli.paths import check_result_path, json_object
from specdec_cli.cli.options import (
    AllowPickleOption, DeviceOption, Draft4bitOption, DraftInt8Option, DraftQuantOption, TargetQuantOption, DraftOption, DtypeOption, LoadIn4bitOption,
    LoadIn8bitOption, MaxNewTokensOption, ProfileOption, Target4bitOption, TargetOption, TemperatureOption,
    TrustRemoteCodeOption, PrefillOption,
)
from specdec_cli.errors import InputError, MissingExtraError, SpecdecError
from specdec_cli.profiles import DRAFTERS
from specdec_cli.prompts import builtin_prompts, read_prompt_file, select_prompts

DEFAULT_MAX_NEW_TOKENS = 128
_PROMPTS, _OUTPUT = "Prompts", "Output"

# --k and --drafter take comma-separated lists here, unlike the single values of chat and run.
KListOption = Annotated[str | None, typer.Option(
    "--k", help="Draft lengths to compare, comma-separated: numbers and/or auto, e.g. 1,2,4,8,auto. Default: the profile's.",
    rich_help_panel="Decoding")]
DrafterListOption = Annotated[str | None, typer.Option(
    "--drafter", help="Drafters to compare, comma-separated, e.g. model,ngram. Default: the profile's.",
    rich_help_panel="Models")]
TreeSizeOption = Annotated[str | None, typer.Option(
    "--tree-size", help="With --drafter tree: nodes per tree, comma-separated (one configuration each), e.g. 8,16,32. "
    "With --k auto the most a tree grown by value holds (default 32); with a fixed k its size (default: what the "
    "target's calibration keeps flat, else 16).", rich_help_panel="Decoding")]
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
    f"(prompt_lookup_num_tokens={HF_LOOKUP_TOKENS}) on the same prompts.")]
JsonOption = Annotated[Path | None, typer.Option(
    "--json", help="Write every raw measurement and the environment to this file.", rich_help_panel=_OUTPUT)]
QualityOption = Annotated[bool, typer.Option(
    "--quality/--no-quality", help="With a quantised target and greedy decoding: also decode every prompt with the "
    "target unquantised (timed) and report how often the outputs are identical, where they first diverge, and both "
    "speeds.",
    rich_help_panel=_OUTPUT)]
BatchSizeOption = Annotated[int | None, typer.Option(
    "--batch-size", help="Measure throughput at batch size B instead of one prompt at a time: the target alone, each "
    "speculative configuration (the batched engine) and HF's batched generate and generate_batch each answer all the "
    "prompts B at a time; rows are total tokens/s against the target alone's at B.", rich_help_panel="Decoding")]
PlotOption = Annotated[Path | None, typer.Option(
    "--plot", help="Write a PNG: speedup per configuration, acceptance by draft position (needs the plot extra).",
    rich_help_panel=_OUTPUT)]


@report_errors
def compare_command(
    profile: ProfileOption = None, target: TargetOption = None, draft: DraftOption = None,
    drafter: DrafterListOption = None, device: DeviceOption = None, dtype: DtypeOption = None,
    target_4bit: Target4bitOption = False, draft_4bit: Draft4bitOption = False,
    load_in_4bit: LoadIn4bitOption = False, load_in_8bit: LoadIn8bitOption = False,
    draft_int8: DraftInt8Option = None, target_quant: TargetQuantOption = None, draft_quant: DraftQuantOption = None,
    prefill: PrefillOption = None,
    trust_remote_code: TrustRemoteCodeOption = False, allow_pickle: AllowPickleOption = False,
    prompts: PromptsOption = None, category: CategoryOption = None, n_prompts: NPromptsOption = None,
    k: KListOption = None, max_new_tokens: MaxNewTokensOption = None, temperature: TemperatureOption = None,
    repeats: RepeatsOption = 1, by_category: ByCategoryOption = False, with_hf: WithHfOption = False,
    json_path: JsonOption = None, plot: PlotOption = None, quality: QualityOption = True,
    tree_size: TreeSizeOption = None, batch_size: BatchSizeOption = None,
) -> None:
    """Benchmark speculative configurations against the target alone on the same prompts, with the
    theory's expected speedup beside each measurement. Greedy unless --temperature; 128 new tokens
    unless --max-new-tokens."""
    from specdec_cli.engine.sampling import GREEDY_BELOW
    from specdec_cli.session import tree_nodes  # torch and the models: imported here, not for --help
    from specdec_cli.settings import (
        ModelOverrides, choose_models, decoding_settings, load_choice, load_plain_draft, parse_k, sampling_params,
        say_tree_note,
    )

    drafters = _drafter_names(drafter)
    _check_batch_size(batch_size, with_hf=with_hf, by_category=by_category, plot=plot)
    if batch_size is not None:
        bench.check_batched_drafters(drafters)  # before choose_models, which may ask for a draft the tree needs
    choice = choose_models(ModelOverrides(
        profile=profile, target=target, draft=draft, drafter=_drafter_for_choice(drafters), device=device, dtype=dtype,
        target_quant=target_quant, draft_quant=draft_quant, prefill=prefill,
        target_4bit=target_4bit, draft_4bit=draft_4bit, load_in_4bit=load_in_4bit, load_in_8bit=load_in_8bit,
        draft_int8=draft_int8, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle,
    ))
    settings = decoding_settings(
        choice.profile, temperature=temperature if temperature is not None else 0.0,
        max_new_tokens=max_new_tokens if max_new_tokens is not None else DEFAULT_MAX_NEW_TOKENS,
    )
    ks = [parse_k(value) for value in _split(k)] or [settings.k]
    _say_k_0_alone(ks, drafters or [choice.drafter])
    tree_budgets = _tree_sizes(tree_size, drafters)
    chosen_prompts = select_prompts(read_prompt_file(prompts) if prompts else builtin_prompts(), category or (), n_prompts)
    _check_outputs(json_path, plot, prompts)
    bench_settings = bench.BenchSettings(
        sampling_params(settings.temperature, settings.top_p, settings.top_k, None if settings.temperature < GREEDY_BELOW else 0),
        settings.max_new_tokens, repeats, settings.system,
    )
    if batch_size is not None:
        bench.check_batched_drafters(drafters or [choice.drafter])
    target_model, draft_model = load_choice(choice, error_console())
    if batch_size is not None:
        configs = bench.batched_configurations(drafters or [choice.drafter], ks, batch_size, draft_model is not None)
        benchmark = bench.ThroughputBenchmark(target_model, draft_model, configs, chosen_prompts, bench_settings, batch_size)
        _compare_throughput(benchmark, json_path)
        return
    if with_hf and draft_model is None:
        error_console().print("note: HF assisted generation needs a draft model — skipped (HF prompt lookup runs)")
    if "tree" in (drafters or [choice.drafter]) and draft_model is not None and choice.drafter != "tree":
        say_tree_note(target_model, draft_model, error_console())  # load_choice said it already otherwise
    plain_draft = load_plain_draft(choice, draft_model, error_console()) if with_hf else None
    configs = bench.configurations(drafters or [choice.drafter], ks, with_hf, draft_model is not None,
                                   plain_draft=draft_model.quantization if plain_draft else None,
                                   tree_budgets=tree_budgets,
                                   tree_default=lambda k: tree_nodes(target_model, k))
    benchmark = bench.Benchmark(target_model, draft_model, configs, chosen_prompts, bench_settings, plain_draft)
    _measure(benchmark, json_path)
    for name, why in benchmark.left_out.items():
        error_console().print(f"note: {name} failed on this pair and is left out ({why}; transformers' "
                              f"own code)", markup=False)
    _say_background(benchmark.background)
    quality_line = None
    if quality and target_model.quantization and bench_settings.params.greedy:
        quality_line = _measure_quality(benchmark, choice)
    console = _stdout_console()
    console.print(bench.measurement_table(benchmark, by_category))
    for table in bench.theory_tables(benchmark.summary(), benchmark.warmup):  # --k 0 alone: no drafts, no theory
        console.print(table)
    if quality_line:
        console.print(quality_line, markup=False, soft_wrap=True)  # one line, however wide
    _write_results(((json_path, lambda path: bench.write_json(path, benchmark.report(by_category))),
                    (plot, lambda path: bench.write_plot(path, benchmark.summary()))))


def _write_results(writes) -> None:
    """Each result file asked for, whichever fails: a --json that cannot be written (a full disk) left no --plot
    either, though the plot is a few kilobytes. Every failure is said, in order; the last one ends the command."""
    failures = []
    for path, write in writes:
        if path:
            try:
                write(path)
                error_console().print(f"wrote {path}", markup=False)
            except SpecdecError as error:
                failures.append(error)
    for error in failures[:-1]:
        error_console().print(f"error: {error.one_line()}", markup=False)
    if failures:
        raise failures[-1]


def _split(values: str | None) -> list[str]:
    return [value.strip() for value in (values or "").split(",") if value.strip()]


def _drafter_names(drafter: str | None) -> list[str]:
    """--drafter as a list of known drafters, refused before any model loads (a typo would cost the load)."""
    names = _split(drafter)
    unknown = [name for name in names if name not in DRAFTERS]
    if unknown:
        raise InputError(f"unknown drafter {unknown[0]!r}", f"use one or more of {', '.join(DRAFTERS)}, comma-separated")
    return names


def _say_k_0_alone(ks: list[int | str], drafters: list[str]) -> None:
    """k 0 is the target alone, which the table has anyway: a drafter asked for with no other k has no row, and
    without this note the table (the target alone) did not say why."""
    if all(k == 0 for k in ks):
        names = " or ".join(dict.fromkeys(drafters))
        error_console().print(f"note: no {names} configuration: k 0 drafts nothing (it is the target alone) — give "
                              "--k 1 or more, or auto", markup=False)


def _drafter_for_choice(drafters: list[str]) -> str | None:
    """What `choose_models` needs to load the right models: a draft model unless only n-gram is asked."""
    if drafters and all(name == "ngram" for name in drafters):
        return "ngram"
    return "model" if "model" in drafters or "tree" in drafters else None


def _tree_sizes(tree_size: str | None, drafters: list[str]) -> list[int]:
    """--tree-size as numbers >= 1; refused without --drafter tree (it would silently do nothing)."""
    if tree_size is None:
        return []
    if "tree" not in drafters:
        raise InputError("--tree-size needs --drafter tree", "add tree to --drafter, e.g. --drafter model,tree")
    sizes = _split(tree_size)
    if not sizes or not all(size.isdigit() and int(size) >= 1 for size in sizes):
        raise InputError(f"--tree-size {tree_size!r} is not a list of node counts", "give numbers >= 1, e.g. 8,16,32")
    return [int(size) for size in sizes]


def _check_batch_size(batch_size: int | None, **others: object) -> None:
    """--batch-size is a number >= 1, without the options of the per-prompt comparison it cannot honour."""
    if batch_size is None:
        return
    if batch_size < 1:
        raise InputError(f"--batch-size must be at least 1, got {batch_size}",
                         "pass a positive number, or leave it out to compare one prompt at a time")
    why = {"with_hf": "HF's assisted generation and prompt lookup take one prompt at a time (--batch-size runs HF's "
                      "batched generate and generate_batch anyway)",
           "by_category": "a batch mixes categories", "plot": "the plot is of the per-prompt comparison"}
    for name, given in others.items():
        if given:
            flag = "--" + name.replace("_", "-")
            raise InputError(f"{flag} cannot combine with --batch-size: {why[name]}", f"drop {flag} or --batch-size")


RESULT_SCHEMAS = ("specdec.compare/", "specdec.compare-throughput/")  # what --json may replace: an earlier result


def _check_outputs(json_path: Path | None, plot: Path | None, prompts: Path | None = None) -> None:
    """Fail before minutes of measuring, not after: each path a file name in a folder we can write, that replaces no
    file but an earlier result of its own kind (the prompts, a typo's other file: refused), --plot in a format
    matplotlib writes."""
    taken = {prompts.resolve(): "the --prompts file"} if prompts is not None else {}
    for path, flag in ((json_path, "--json"), (plot, "--plot")):
        if path is None:
            continue
        if path.resolve() in taken:
            raise InputError(f"{flag} {path} is {taken[path.resolve()]}", f"give {flag} another file name")
        taken[path.resolve()] = f"the {flag} file too"
        check_result_path(path, flag, "compare", _is_result if flag == "--json" else None)
    if plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise MissingExtraError("--plot needs matplotlib", "pip install 'specdec[plot]'")
    if plot is not None and plot.suffix:
        from matplotlib.backend_bases import FigureCanvasBase

        formats = FigureCanvasBase.get_supported_filetypes()
        if plot.suffix[1:].lower() not in formats:
            raise InputError(f"--plot {plot}: matplotlib cannot write .{plot.suffix[1:]} files",
                             f"end the name with one of .{', .'.join(sorted(formats))} (e.g. .png)")


def _is_result(path: Path) -> bool:
    """Whether `path` holds a JSON result `compare --json` wrote (whole, partial or interrupted)."""
    found = json_object(path)
    return found is not None and str(found.get("schema", "")).startswith(RESULT_SCHEMAS)


def _measure(benchmark: bench.Benchmark, json_path: Path | None) -> None:
    """Run it with a progress bar on stderr. --json is rewritten after every prompt (marked "partial"), so
    a benchmark that fails or is killed keeps what it measured; on Ctrl-C it is marked "interrupted"."""
    total = len(benchmark.order)
    n_prompts = len(benchmark.prompts)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    console = error_console()
    started = time.perf_counter()
    failed: list[InputError] = []
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("warming up", total=total)

        def advance(done: int, _total: int, prompt: int, config: bench.Configuration) -> None:
            progress.update(task, completed=done, total=len(benchmark.order),
                            description=f"prompt {prompt + 1}/{n_prompts} · {config.name}")
            per_prompt = len(benchmark.configs) * benchmark.settings.repeats  # fewer where a peer was left out
            if json_path and done % per_prompt == 0:
                _write_partial(json_path, benchmark.report(by_category=False) | {"partial": True}, failed, console)
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


def _write_partial(json_path: Path, report: dict, failed: list[InputError], console: Console) -> None:
    """Rewrite --json with what is measured so far. Where it cannot be written (a disk that filled up), say so once
    and measure on: the tables still print at the end, and --json is written again then. A failed partial write
    stopped the benchmark, and whatever it had measured was lost with it."""
    try:
        bench.write_json(json_path, report)
    except InputError as error:
        if not failed:
            console.print(f"note: {error.message}: measuring goes on; the tables print at the end, and --json is "
                          "written again then", markup=False)
        failed.append(error)


def _compare_throughput(benchmark: bench.ThroughputBenchmark, json_path: Path | None) -> None:
    """Measure with a progress bar on stderr, rewriting --json after every pass ("partial" until the end), then
    print the table."""
    console = error_console()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    failed: list[InputError] = []
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("warming up", total=len(benchmark.order))

        def advance(done: int, total: int, config: bench.BatchedConfiguration) -> None:
            progress.update(task, completed=done, description=config.name)
            if json_path:
                _write_partial(json_path, benchmark.report() | {"partial": True}, failed, console)
            if not console.is_terminal:  # no live bar: one line per pass instead
                console.print(f"pass {done}/{total} measured: {config.name}", markup=False)

        try:
            benchmark.measure(advance)
        except KeyboardInterrupt:
            if json_path and benchmark.passes:
                bench.write_json(json_path, benchmark.report() | {"interrupted": True})
                console.print(f"wrote the {len(benchmark.passes)} passes measured so far to {json_path}")
            raise
    _say_background(benchmark.background)
    for name, reason in benchmark.unavailable.items():
        console.print(f"note: {name} cannot run here: {reason}", markup=False)
    _stdout_console().print(bench.throughput_table(benchmark))
    if json_path:
        bench.write_json(json_path, benchmark.report())
        console.print(f"wrote {json_path}")


def _say_background(background) -> None:
    """A note when other processes took CPU time while the benchmark measured (the JSON keeps the figure always)."""
    from specdec_cli.models.device import busy_cores

    cores = background.cores()
    if cores is not None and cores >= busy_cores():
        error_console().print(f"note: other processes used {cores:.1f} cores on average while this measured: its "
                              "timings include them (measure on an idle machine)", markup=False)


def _stdout_console() -> Console:
    """A file or a pipe keeps the whole table instead of folding it to 80 columns."""
    console = PipeConsole()
    return console if console.is_terminal else PipeConsole(width=200)


def _measure_quality(benchmark: bench.Benchmark, choice) -> str:
    """Load the target unquantised and decode the prompts with it: what quantising the target changed."""
    from specdec_cli.models import load_model

    error_console().print("quality: decoding the prompts with the target unquantised (timed, after the configurations)",
                          markup=False)
    reference = load_model(choice.target, device=choice.device, dtype=choice.dtype, quantization=None,
                           trust_remote_code=choice.trust_remote_code, allow_pickle=choice.allow_pickle)
    found = benchmark.measure_quality(reference)
    del reference
    diverged = found["median_first_divergence"]
    where = "" if diverged is None else f"; the others first differ at token {diverged:g} (median)"
    ours, theirs = found["target_tokens_per_second"], found["reference_tokens_per_second"]
    speed = (f"; the {found['reference']} target alone decoded them at {theirs:.1f} tok/s here, the "
             f"quantised one at {ours:.1f} (×{ours / theirs:.2f}; one run)"
             if ours and theirs else "")
    return (f"quality: the {found['target']} target's greedy output equals the {found['reference']} target's on "
            f"{found['identical']}/{found['compared']} prompts{where}{speed}")
