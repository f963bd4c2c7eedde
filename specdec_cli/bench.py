"""The measurement behind `specdec compare`: every configuration on the same prompts, in one process.

Fairness rules, in order of how much they matter:
  - models are loaded once and every configuration runs after one warm-up generation;
  - prompt-major order: for each prompt, every configuration runs on it before the next prompt, so
    drift (thermal, other processes) hits all of them alike; the order rotates by one per prompt so no
    configuration always runs first (`run_order`);
  - every run starts from fresh caches (a new decoder per run: no prefix reuse across prompts);
  - the same EOS ids, token budget and sampling settings for all, the HF peers included; new tokens
    are counted the same way for all: the tokens after the prompt, up to and including the first EOS.

Speedup is throughput over the baseline's on the same runs, (tokens/s) / (baseline tokens/s); when
the outputs are identical (greedy, lossless) that is the baseline's time over the configuration's.

No Rich and no printing here: the CLI renders the rows that `Benchmark.summary` returns."""

from __future__ import annotations

import copy
import json
import os
import platform
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdec_cli.engine import GenerationStats, SamplingParams, expected_tokens
from specdec_cli.errors import InputError
from specdec_cli.models import LoadedModel
from specdec_cli.prompts import Prompt
from specdec_cli.session import build_decoder, encode_chat, encode_completion, eos_token_ids

SCHEMA = "specdec.compare/1"
BASELINE, SPECDEC, HF_ASSISTED, HF_LOOKUP = "baseline", "specdec", "hf-assisted", "hf-lookup"
TARGET, DRAFT, PLAIN_DRAFT = "target", "draft", "plain draft"  # the roles of the loaded models
HF_LOOKUP_TOKENS = 10  # prompt_lookup_num_tokens (HF's docs' value); max_matching_ngram_size stays HF's default, 2
WARMUP_TOKENS = 8
POSITIONS = 4  # acceptance is reported at draft positions 1..POSITIONS
FORWARD_TIMINGS = 5  # single-token forwards timed per model at warm-up, for the cost ratio c


# ---- configurations and order -------------------------------------------------------------------


@dataclass(frozen=True)
class Configuration:
    name: str
    kind: str  # BASELINE | SPECDEC | HF_ASSISTED | HF_LOOKUP
    drafter: str = "none"  # a name `session.build_decoder` knows; "none" for the baseline and HF
    k: int | str = 0
    assistant: str = DRAFT  # HF assisted: which loaded draft it is given (DRAFT or PLAIN_DRAFT)


def configurations(drafters: Sequence[str], ks: Sequence[int | str], with_hf: bool, has_draft: bool,
                   plain_draft: str | None = None) -> list[Configuration]:
    """The baseline, every drafter × k (k = 0 is the baseline itself; repeats dropped), then HF's peers
    (assisted generation only when there is a draft model). `plain_draft` names the quantisation that
    only specdec applies to the draft (int8): HF assisted then runs twice, with the draft as HF users
    load it and with ours, so that our quantisation lever is not credited to the engine."""
    chosen = [Configuration("target alone", BASELINE)]
    for drafter in dict.fromkeys(drafters):
        chosen += [Configuration(f"{drafter} k={k}", SPECDEC, drafter, k) for k in dict.fromkeys(ks) if k != 0]
    if with_hf and has_draft and plain_draft:
        chosen.append(Configuration("HF assisted", HF_ASSISTED, assistant=PLAIN_DRAFT))
        chosen.append(Configuration(f"HF assisted ({plain_draft} draft)", HF_ASSISTED))
    elif with_hf and has_draft:
        chosen.append(Configuration("HF assisted", HF_ASSISTED))
    if with_hf:
        chosen.append(Configuration(f"HF prompt lookup ({HF_LOOKUP_TOKENS})", HF_LOOKUP))
    return chosen


def run_order(n_prompts: int, repeats: int, n_configurations: int) -> list[tuple[int, int, int]]:
    """(prompt index, repeat, configuration index) in run order: prompt-major, rotated by one per trial."""
    order = []
    for trial, (prompt, repeat) in enumerate((p, r) for p in range(n_prompts) for r in range(repeats)):
        order += [(prompt, repeat, (trial + i) % n_configurations) for i in range(n_configurations)]
    return order


# ---- theory -------------------------------------------------------------------------------------


def expected_speedup(alpha: float, gamma: float, c: float) -> float:
    """Leviathan et al. (2023): expected speedup of speculative decoding over the target alone, for
    per-token acceptance rate `alpha`, draft length `gamma` and cost ratio `c` (one draft forward /
    one target forward): (1 - α^(γ+1)) / ((1 - α)(γc + 1)). At α = 1 it is the limit (γ + 1) / (γc + 1)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    return expected_tokens(alpha, gamma) / (gamma * c + 1)


def identical_prompts(baseline: dict[tuple[int, int], list[int]], other: dict[tuple[int, int], list[int]]) -> tuple[int, int]:
    """(n, N): of the N prompts that both ran, how many gave exactly the baseline's tokens in every repeat.
    Keys are (prompt index, repeat)."""
    prompts: dict[int, bool] = {}
    for key in baseline.keys() & other.keys():
        prompts[key[0]] = prompts.get(key[0], True) and baseline[key] == other[key]
    return sum(prompts.values()), len(prompts)


# ---- one run ------------------------------------------------------------------------------------


@dataclass
class Run:
    """One configuration on one prompt: the raw measurement written to --json."""

    configuration: str
    prompt_index: int
    repeat: int
    tokens: list[int]
    seconds: float
    steps: int  # target forwards (verification steps), the prefill included
    finish_reason: str
    working_bytes: int  # memory growth during the run (see MemoryProbe)
    drafted: int | None = None  # None: not reported (HF peers)
    accepted: int | None = None
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    draft_seconds: float | None = None
    verify_seconds: float | None = None
    prefill: dict | None = None  # the first step (the prompt's prefill): drafted, draft_seconds, verify_seconds, free
    lookup_steps: int = 0  # steps whose draft was free (prompt lookup); included in steps/drafted/accepted
    lookup_drafted: int = 0
    lookup_accepted: int = 0


class MemoryProbe:
    """Working memory of a run: the peak over the level at its start. CUDA: torch.cuda.max_memory_allocated
    (exact); elsewhere the process RSS (psutil), sampled after every step. Weights are counted apart."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.base = self.high = 0

    def start(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base = self.high = _rss()

    def sample(self) -> None:
        if not self.cuda:
            self.high = max(self.high, _rss())

    def peak(self) -> int:
        self.sample()
        high = torch.cuda.max_memory_allocated(self.device) if self.cuda else self.high
        return max(0, high - self.base)


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


class ForwardCounter:
    """Counts forward calls per model (a pre-hook on each), kept on for the whole measurement so every
    configuration pays the same: HF peers' steps and which models a configuration runs come from it."""

    def __init__(self, models: dict[str, torch.nn.Module]) -> None:
        self.counts = dict.fromkeys(models, 0)
        self._handles = [model.register_forward_pre_hook(self._counter(name)) for name, model in models.items()]

    def _counter(self, name: str):
        def count(module, args):
            self.counts[name] += 1
        return count

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def cut_at_eos(tokens: list[int], eos_ids: Sequence[int]) -> list[int]:
    """The tokens up to and including the first EOS id (all of them when there is none)."""
    for position, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: position + 1]
    return tokens


# ---- the benchmark ------------------------------------------------------------------------------


@dataclass
class BenchSettings:
    params: SamplingParams
    max_new_tokens: int
    repeats: int = 1
    system: str | None = None  # system prompt for single-turn prompts (chat template only)

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise InputError(f"--repeats must be at least 1, got {self.repeats}", "pass a positive number")


ProgressCallback = Callable[[int, int, int, Configuration], None]  # (done, total, prompt index, configuration)


class Benchmark:
    """Loaded models, the configurations and the prompts; `measure()` runs it all and keeps the raw runs."""

    def __init__(self, target: LoadedModel, draft: LoadedModel | None, configs: Sequence[Configuration],
                 prompts: Sequence[Prompt], settings: BenchSettings, plain_draft: LoadedModel | None = None) -> None:
        """plain_draft: the draft without specdec's own quantisation, for HF assisted's PLAIN_DRAFT runs."""
        if not prompts:
            raise InputError("no prompts to run", "choose other categories or another prompt file")
        self.target, self.draft = target, draft
        self.configs = list(configs)
        self.prompts = list(prompts)
        self.settings = settings
        self.eos_ids = eos_token_ids(target)
        self.prompt_ids = [encode_prompt(prompt, target.tokenizer, settings.system) for prompt in prompts]
        self.order = run_order(len(prompts), settings.repeats, len(self.configs))
        self.runs: list[Run] = []
        self.warmup: dict = {}
        self.models_used: dict[str, list[str]] = {}
        self.loaded = {TARGET: target, DRAFT: draft, PLAIN_DRAFT: plain_draft}
        models = {role: loaded.model for role, loaded in self.loaded.items() if loaded is not None}
        self.weight_bytes = {role: _weight_bytes(model) for role, model in models.items()}
        self._models = models
        self._probe = MemoryProbe(target.device)

    def measure(self, on_progress: ProgressCallback | None = None) -> list[Run]:
        counter = ForwardCounter(self._models)
        try:
            with _quiet_transformers():
                self._warm_up(counter)
                for done, (prompt, repeat, index) in enumerate(self.order, start=1):
                    config = self.configs[index]
                    run = self._counted_run(config, self.prompt_ids[prompt], self.settings.max_new_tokens, counter)
                    run.prompt_index, run.repeat = prompt, repeat
                    self.runs.append(run)
                    if on_progress:
                        on_progress(done, len(self.order), prompt, config)
        finally:
            counter.close()
        return self.runs

    def _warm_up(self, counter: ForwardCounter) -> None:
        """One short generation per configuration (also noting which models each runs), then the timing
        of single-token forwards of each model for the cost ratio c."""
        first_prompt = self.prompt_ids[0]
        for config in self.configs:
            self._counted_run(config, first_prompt, WARMUP_TOKENS, counter)
        seconds = {role: forward_seconds(self._models[role], first_prompt) for role in (TARGET, DRAFT)
                   if role in self._models}
        self.warmup = {f"{role}_forward_seconds": value for role, value in seconds.items()}
        if DRAFT in seconds:
            self.warmup["c_forward"] = seconds[DRAFT] / seconds[TARGET]

    def _counted_run(self, config: Configuration, prompt_ids: list[int], max_new_tokens: int, counter: ForwardCounter) -> Run:
        """A run that also notes which models it ran (a drafter may call the draft model only sometimes)."""
        before = dict(counter.counts)
        run = self._run(config, prompt_ids, max_new_tokens, counter)
        used = self.models_used.setdefault(config.name, [])
        used += [role for role in counter.counts if counter.counts[role] > before[role] and role not in used]
        return run

    def _run(self, config: Configuration, prompt_ids: list[int], max_new_tokens: int, counter: ForwardCounter) -> Run:
        if config.kind in (HF_ASSISTED, HF_LOOKUP):
            return self._run_hf(config, prompt_ids, max_new_tokens, counter)
        decoder = build_decoder(self.target, self.draft, config.drafter, config.k)
        return self._run_engine(config, decoder, prompt_ids, max_new_tokens)

    def _run_engine(self, config: Configuration, decoder, prompt_ids: list[int], max_new_tokens: int) -> Run:
        stats, tokens, first, finish_reason = GenerationStats(), [], None, "length"
        self._probe.start()
        started = time.perf_counter()
        for event in decoder.stream(prompt_ids, self.settings.params, max_new_tokens):
            tokens += event.tokens
            stats.add_step(event)
            self._probe.sample()
            first = first or event
            finish_reason = event.finish_reason or finish_reason
        seconds = time.perf_counter() - started
        return Run(
            config.name, -1, -1, tokens, seconds, stats.steps, finish_reason, self._probe.peak(),
            stats.drafted, stats.accepted, stats.drafted_at, stats.accepted_at, stats.draft_seconds,
            stats.verify_seconds,
            {"drafted": first.drafted, "draft_seconds": first.draft_seconds, "verify_seconds": first.verify_seconds,
             "free": first.free},
            stats.lookup_steps, stats.lookup_drafted, stats.lookup_accepted,
        )

    def _run_hf(self, config: Configuration, prompt_ids: list[int], max_new_tokens: int, counter: ForwardCounter) -> Run:
        model = self.target.model
        input_ids = torch.tensor([prompt_ids], device=self.target.device)
        assistant = self.loaded[config.assistant] if config.kind == HF_ASSISTED else None
        extra = {"assistant_model": assistant.model} if assistant else {}
        generation_config = hf_generation_config(
            self.settings.params, max_new_tokens, self.eos_ids, _pad_id(self.target, self.eos_ids),
            lookup=config.kind == HF_LOOKUP,
        )
        forwards = counter.counts[TARGET]
        with _assistant_config_restored(assistant):
            if not self.settings.params.greedy:
                torch.manual_seed(self.settings.params.seed or 0)
            self._probe.start()
            started = time.perf_counter()
            output = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), generation_config=generation_config,
                stopping_criteria=_probe_criteria(self._probe), **extra,
            )
            new_tokens = output[0, len(prompt_ids):].tolist()  # .tolist() waits for the device
            seconds = time.perf_counter() - started
        tokens = cut_at_eos(new_tokens, self.eos_ids)
        finish_reason = "stop" if tokens and tokens[-1] in self.eos_ids else "length"
        steps = counter.counts[TARGET] - forwards
        return Run(config.name, -1, -1, tokens, seconds, steps, finish_reason, self._probe.peak())

    # ---- results ----

    def memory_bytes(self, config: Configuration) -> int:
        return sum(self.weight_bytes[role] for role in self.models_used.get(config.name, [TARGET]))

    def summary(self, category: str | None = None) -> list[dict]:
        """One row per configuration over all prompts, or over one category's prompts."""
        chosen = {i for i, prompt in enumerate(self.prompts) if category is None or prompt.category == category}
        runs = [run for run in self.runs if run.prompt_index in chosen]
        by_config = {config.name: [run for run in runs if run.configuration == config.name] for config in self.configs}
        baseline = by_config[self.configs[0].name]
        return [
            summary_row(config, by_config[config.name], baseline, self.settings.params.greedy, self.memory_bytes(config))
            for config in self.configs
        ]

    def categories(self) -> list[str]:
        return list(dict.fromkeys(prompt.category for prompt in self.prompts))

    def report(self, by_category: bool) -> dict:
        """Everything, for --json: environment, settings, prompts, order, every raw run, the summaries."""
        report = {
            "schema": SCHEMA,
            "environment": environment(self.target, self.draft),
            "settings": self._settings_record(),
            "configurations": [asdict(config) | {"models": self.models_used.get(config.name, [])} for config in self.configs],
            "weight_bytes": self.weight_bytes,
            "warmup": self.warmup,
            "prompts": [
                {"index": i, "id": prompt.id, "category": prompt.category, "prompt_tokens": len(ids)}
                for i, (prompt, ids) in enumerate(zip(self.prompts, self.prompt_ids))
            ],
            "order": [[prompt, repeat, self.configs[index].name] for prompt, repeat, index in self.order],
            "runs": [asdict(run) for run in self.runs],
            "summary": self.summary(),
        }
        if by_category:
            report["summary_by_category"] = {category: self.summary(category) for category in self.categories()}
        return report

    def _settings_record(self) -> dict:
        params = self.settings.params
        return {
            "max_new_tokens": self.settings.max_new_tokens, "repeats": self.settings.repeats,
            "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k, "seed": params.seed,
            "system": self.settings.system, "eos_token_ids": list(self.eos_ids),
            "hf_prompt_lookup_num_tokens": HF_LOOKUP_TOKENS,
            "hf_assisted": _assistant_settings(self.draft),
            "warmup_tokens": WARMUP_TOKENS,
        }


# ---- aggregation --------------------------------------------------------------------------------


def summary_row(config: Configuration, runs: list[Run], baseline: list[Run], greedy: bool, memory_bytes: int) -> dict:
    """The table row of one configuration over `runs` (and the baseline's runs on the same prompts)."""
    base = {(run.prompt_index, run.repeat): run for run in baseline}
    paired = [(run, base[(run.prompt_index, run.repeat)]) for run in runs if (run.prompt_index, run.repeat) in base]
    speedups = [_rate(run) / _rate(b) for run, b in paired if _rate(b) and _rate(run)]
    new_tokens, seconds = sum(len(run.tokens) for run in runs), sum(run.seconds for run in runs)
    baseline_rate = _ratio(sum(len(b.tokens) for _, b in paired), sum(b.seconds for _, b in paired))
    overall = _ratio(_ratio(new_tokens, seconds), baseline_rate)
    identical = identical_prompts(
        {(b.prompt_index, b.repeat): b.tokens for _, b in paired}, {(r.prompt_index, r.repeat): r.tokens for r, _ in paired}
    ) if greedy else None
    row = {
        "configuration": config.name, "kind": config.kind, "drafter": config.drafter, "k": config.k,
        "prompts": len({run.prompt_index for run in runs}), "runs": len(runs),
        "new_tokens": new_tokens, "seconds": round(seconds, 4),
        "tokens_per_second": _ratio(new_tokens, seconds),
        "median_tokens_per_second": statistics.median(_rate(run) for run in runs) if runs else None,
        "speedup": overall,
        "speedup_min": min(speedups, default=None), "speedup_max": max(speedups, default=None),
        "tokens_per_step": _ratio(new_tokens, sum(run.steps for run in runs)),
        "memory_bytes": memory_bytes + max((run.working_bytes for run in runs), default=0),
        "identical": identical[0] if identical else None, "compared": identical[1] if identical else None,
    }
    return row | _drafting_fields(runs) | {"theory": theory(runs, baseline, overall)}


def _drafting_fields(runs: list[Run]) -> dict:
    """Acceptance and the draft/verify split; None for runs that do not report drafting (HF peers)."""
    reported = [run for run in runs if run.drafted is not None]
    if not reported or len(reported) != len(runs):
        return {"acceptance_rate": None, "acceptance_at": [None] * POSITIONS, "draft_share": None}
    drafted_at, accepted_at = _sum_positions(run.drafted_at for run in runs), _sum_positions(run.accepted_at for run in runs)
    draft_seconds = sum(run.draft_seconds for run in runs)
    drafted = sum(run.drafted for run in runs)
    return {
        "acceptance_rate": _ratio(sum(run.accepted for run in runs), drafted),
        "acceptance_at": [_ratio(accepted_at[i], drafted_at[i]) for i in range(POSITIONS)],
        "draft_share": _ratio(draft_seconds, draft_seconds + sum(run.verify_seconds for run in runs)) if drafted else None,
    }


def theory(runs: list[Run], baseline: list[Run], measured: float | None) -> dict | None:
    """The expected speedup from the run's own α, γ and c, and the efficiency measured / expected.

    Steps are of two sources. Model steps (a draft model's drafts, or none at all): α = accepted /
    drafted, γ = mean drafted per step, c = the seconds of drafting one token over the seconds of one
    baseline target step (both after the prefill step, measured in this run). Lookup steps (free drafts,
    c = 0) get their own α and γ. The expectation weighs each source's tokens per step and cost per step
    by its share of steps; without lookup steps it is Leviathan et al.'s formula. None when nothing
    was drafted."""
    drafted = sum(run.drafted or 0 for run in runs)
    if not drafted or any(run.drafted is None for run in runs):
        return None
    model = _source(
        sum(run.steps - run.lookup_steps for run in runs),
        sum(run.drafted - run.lookup_drafted for run in runs),
        sum(run.accepted - run.lookup_accepted for run in runs),
    )
    lookup = _source(sum(run.lookup_steps for run in runs), sum(run.lookup_drafted for run in runs),
                     sum(run.lookup_accepted for run in runs))
    model_drafted_after_prefill = sum(
        run.drafted - run.lookup_drafted - (0 if run.prefill.get("free") else run.prefill["drafted"]) for run in runs
    )
    draft_cost = _ratio(
        sum(run.draft_seconds - run.prefill["draft_seconds"] for run in runs if run.drafted > run.lookup_drafted),
        model_drafted_after_prefill,
    )
    target_step = target_step_seconds(baseline)
    if not target_step or (model["drafted"] and draft_cost is None):  # no decode-step cost to compare
        return None
    c = draft_cost / target_step if draft_cost is not None else 0.0
    steps = model["steps"] + lookup["steps"]
    tokens = sum(source["steps"] * source["tokens_per_step"] for source in (model, lookup))
    cost = model["steps"] * (model["gamma"] * c + 1) + lookup["steps"]
    expected = tokens / cost if steps else None
    efficiency = _ratio(measured, expected)
    return {
        "alpha": sum(run.accepted for run in runs) / drafted, "gamma": drafted / sum(run.steps for run in runs),
        "c": c, "model": model, "lookup": lookup, "expected_speedup": expected, "efficiency": efficiency,
    }


def _source(steps: int, drafted: int, accepted: int) -> dict:
    """α, γ and the i.i.d. expectation of tokens per step of one source of drafts."""
    alpha = accepted / drafted if drafted else 0.0
    gamma = drafted / steps if steps else 0.0
    return {"steps": steps, "drafted": drafted, "accepted": accepted, "alpha": alpha, "gamma": gamma,
            "tokens_per_step": expected_tokens(alpha, gamma)}


def target_step_seconds(baseline: list[Run]) -> float | None:
    """Mean seconds of one decoding step of the target alone, the prefill step left out."""
    decode_steps = sum(run.steps - 1 for run in baseline)
    decode_seconds = sum(run.verify_seconds - run.prefill["verify_seconds"] for run in baseline if run.prefill)
    return decode_seconds / decode_steps if decode_steps > 0 else None


def _sum_positions(rows) -> list[int]:
    total = [0] * POSITIONS
    for row in rows:
        for i, count in enumerate(row[:POSITIONS]):
            total[i] += count
    return total


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def _rate(run: Run) -> float:
    return len(run.tokens) / run.seconds if run.seconds else 0.0


# ---- prompts, HF and the environment ------------------------------------------------------------


def encode_prompt(prompt: Prompt, tokenizer, system: str | None = None) -> list[int]:
    """Raw text as it is; a conversation through the chat template; a single user turn through the
    chat template when the model has one (with the system prompt), else as raw text."""
    if prompt.messages is not None:
        return encode_chat(tokenizer, prompt.messages)
    if prompt.as_user_turn and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt.text}]
        return encode_chat(tokenizer, messages)
    return encode_completion(tokenizer, prompt.text)


def hf_generation_config(params: SamplingParams, max_new_tokens: int, eos_ids: Sequence[int], pad_id: int, lookup: bool):
    """HF's generate settings matching ours: same budget and EOS ids, greedy or the same sampling
    transform, and nothing of a checkpoint's own defaults that would change the output (penalties)."""
    from transformers import GenerationConfig

    sampling = (
        {"do_sample": False} if params.greedy
        else {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k}
    )
    return GenerationConfig(
        max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=list(eos_ids), pad_token_id=pad_id,
        repetition_penalty=1.0, no_repeat_ngram_size=0, **sampling,
        **({"prompt_lookup_num_tokens": HF_LOOKUP_TOKENS} if lookup else {}),
    )


def _assistant_settings(draft: LoadedModel | None) -> dict:
    """What HF's assisted generation drafts with: the assistant's generation config, else HF's defaults."""
    config = draft.model.generation_config if draft else None
    names = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    return {name: getattr(config, name, None) if getattr(config, name, None) is not None else "HF default" for name in names}


def _pad_id(target: LoadedModel, eos_ids: Sequence[int]) -> int:
    pad = target.tokenizer.pad_token_id
    return pad if pad is not None else eos_ids[0]


def _probe_criteria(probe: MemoryProbe):
    """A stopping criterion that never stops: it samples memory once per HF step, as the engine runs do."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class SampleMemory(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            probe.sample()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([SampleMemory()])


@contextmanager
def _assistant_config_restored(draft: LoadedModel | None):
    """HF keeps an assistant's adapted draft length across generate calls under the "heuristic"
    schedule: restore its generation config so no prompt inherits another's state."""
    saved = copy.deepcopy(draft.model.generation_config) if draft else None
    try:
        yield
    finally:
        if draft:
            draft.model.generation_config = saved


@contextmanager
def _quiet_transformers():
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


@torch.inference_mode()
def forward_seconds(model: torch.nn.Module, prompt_ids: list[int], repeats: int = FORWARD_TIMINGS) -> float:
    """Median seconds of a single-token forward after a prefill of `prompt_ids`."""
    from specdec_cli.engine import CachedModel

    runner = CachedModel(model)
    sequence = list(prompt_ids)
    runner.extend(sequence)
    timings = []
    for _ in range(repeats):
        sequence.append(prompt_ids[-1])
        started = time.perf_counter()
        runner.extend(sequence)[-1, 0].item()  # .item() waits for the device
        timings.append(time.perf_counter() - started)
    return statistics.median(timings)


def _weight_bytes(model: torch.nn.Module) -> int:
    """Parameters and buffers, plus the packed weights of int8 (torch dynamic) Linear layers, which are neither."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    tensors = list(model.parameters()) + list(model.buffers())
    packed = [module.weight() for module in model.modules() if isinstance(module, DynamicLinear)]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors + packed)


def environment(target: LoadedModel, draft: LoadedModel | None) -> dict:
    import transformers

    from specdec_cli.models.device import dtype_name

    record = {
        "device": str(target.device), "dtype": dtype_name(target.dtype),
        "target": target.name, "target_source": target.source, "target_quantization": target.quantization,
        "draft": draft.name if draft else None, "draft_source": draft.source if draft else None,
        "draft_quantization": draft.quantization if draft else None,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "process_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
    }
    if target.device.type == "cuda":
        record["gpu"] = torch.cuda.get_device_name(target.device)
    return record


def write_json(path: Path, report: dict) -> None:
    try:
        path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    except OSError as error:
        raise InputError(f"cannot write {path}: {error.strerror}", "choose a writable path for --json") from None
