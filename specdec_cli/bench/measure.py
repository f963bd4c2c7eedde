"""The measurement behind `specdec compare`: every configuration on the same prompts, in one process.
Configurations and runs are in runs.py, the rows and the theory in theory.py, HF's peers in peers.py,
memory and forward timing in probes.py, the Rich tables and the plot in report.py.

Fairness rules, in order of how much they matter:
  - models are loaded once and every configuration runs after one warm-up generation;
  - prompt-major order: for each prompt, every configuration runs on it before the next prompt, so
    drift (thermal, other processes) hits all of them alike; the order rotates by one per prompt so no
    configuration always runs first (`run_order`);
  - every run starts from fresh caches (a new decoder per run: no prefix reuse across prompts);
  - the same EOS ids, token budget and sampling settings for all, the HF peers included; new tokens
    are counted the same way for all: the tokens after the prompt, up to and including the first EOS.

No Rich and no printing here: report.py renders the rows that `Benchmark.summary` returns."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from specdec_cli.bench.peers import (assistant_settings, hf_generate, hf_generation_config, pad_token_id,
                                     quiet_transformers)
from specdec_cli.bench.quality import agreement, reference_tokens
from specdec_cli.bench.probes import (
    BackgroundLoad, ForwardCounter, MemoryProbe, environment, forward_seconds, prompt_reader,
)
from specdec_cli.bench.runs import (
    DRAFT, HF_ASSISTED, HF_LOOKUP, HF_LOOKUP_TOKENS, PLAIN_DRAFT, SCHEMA, TARGET, WARMUP_TOKENS, BenchSettings,
    Configuration, Run, run_order,
)
from specdec_cli.bench.theory import summary_row
from specdec_cli.engine import GenerationStats, cut_at_eos
from specdec_cli.errors import InputError, first_line
from specdec_cli.models import LoadedModel
from specdec_cli.models.loading.preflight import held_weight_bytes
from specdec_cli.models.paths import replacing
from specdec_cli.prompts import Prompt
from specdec_cli.session import build_decoder, encode_chat, encode_completion, encode_folding_system, eos_token_ids

ProgressCallback = Callable[[int, int, int, Configuration], None]  # (done, total, prompt index, configuration)


class Benchmark:
    """Loaded models, the configurations and the prompts; `measure()` runs it all and keeps the raw runs."""

    def __init__(self, target: LoadedModel, draft: LoadedModel | None, configs: Sequence[Configuration],
                 prompts: Sequence[Prompt], settings: BenchSettings, plain_draft: LoadedModel | None = None) -> None:
        """plain_draft: the draft without specdec's own quantisation, for HF assisted's PLAIN_DRAFT runs."""
        self.prompt_ids = encode_prompts(prompts, target.tokenizer, settings.system)
        self.target, self.draft = target, draft
        self.configs = list(configs)
        self.prompts = list(prompts)
        self.settings = settings
        self.eos_ids = eos_token_ids(target)
        self.order = run_order(len(prompts), settings.repeats, len(self.configs))
        self.runs: list[Run] = []
        self.warmup: dict = {}
        self.left_out: dict[str, str] = {}  # a peer that failed on this pair in the warm-up: its name, and why
        self.quality: dict | None = None
        self.models_used: dict[str, list[str]] = {}
        if plain_draft is not None and draft is not None:  # a draft of another tokenizer: HF is given both (peers.py)
            plain_draft.vocabulary_overlap = draft.vocabulary_overlap
        self.loaded = {TARGET: target, DRAFT: draft, PLAIN_DRAFT: plain_draft}
        models = {role: loaded.model for role, loaded in self.loaded.items() if loaded is not None}
        self.weight_bytes = {role: held_weight_bytes(model) for role, model in models.items()}
        self._models = models
        self._probe = MemoryProbe(target.device)
        self.background = BackgroundLoad()

    def measure(self, on_progress: ProgressCallback | None = None) -> list[Run]:
        counter = ForwardCounter(self._models)
        self.background.begin()
        try:
            with quiet_transformers():
                self._warm_up(counter)
                plan, done = [(prompt, repeat, self.configs[index]) for prompt, repeat, index in self.order], 0
                for prompt, repeat, config in plan:
                    if config.name in self.left_out:
                        continue
                    try:
                        run = self._counted_run(config, self.prompt_ids[prompt], self.settings.max_new_tokens,
                                                counter)
                    except Exception as error:  # a peer on a prompt it does not take: see `_leave_out`
                        self._leave_out(config, error)
                        continue
                    run.prompt_index, run.repeat, done = prompt, repeat, done + 1
                    self.runs.append(run)
                    if on_progress:
                        on_progress(done, len(self.order), prompt, config)
        finally:
            counter.close()
        return self.runs

    def _draft_prompt(self, prompt_ids: list[int]) -> list[int]:
        """The prompt as the draft reads it: the target's ids, or, for a draft of another tokenizer, their text in
        the draft's own ids (the target's ids lie past the rows of a smaller vocabulary)."""
        if self.draft is None or self.draft.vocabulary_overlap is None:
            return prompt_ids
        text = self.target.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        return self.draft.tokenizer.encode(text, add_special_tokens=True)

    def _warm_up(self, counter: ForwardCounter) -> None:
        """One short generation per configuration (also noting which models each runs), then the timing
        of single-token forwards of each model for the cost ratio c."""
        first_prompt = self.prompt_ids[0]
        for config in list(self.configs):
            try:
                self._counted_run(config, first_prompt, WARMUP_TOKENS, counter)
            except Exception as error:
                self._leave_out(config, error)
        prompts = {TARGET: first_prompt, DRAFT: self._draft_prompt(first_prompt)}
        seconds = {role: forward_seconds(self._models[role], prompts[role]) for role in (TARGET, DRAFT)
                   if role in self._models}
        self.warmup = {f"{role}_forward_seconds": value for role, value in seconds.items()}
        if DRAFT in seconds:
            self.warmup["c_forward"] = seconds[DRAFT] / seconds[TARGET]

    def _leave_out(self, config: Configuration, error: Exception) -> None:
        """A peer whose run raised (transformers' own generate on a pair it does not take: HF's universal assisted
        generation raised IndexError on a real pair of two tokenizers): its runs so far are dropped and the others are
        measured as if it had never been asked for; the report says why it is missing. Our own configurations raise."""
        if config.kind not in (HF_ASSISTED, HF_LOOKUP):
            raise error
        kept = [(prompt, repeat, self.configs[index]) for prompt, repeat, index in self.order
                if self.configs[index] is not config]
        self.configs.remove(config)
        self.order = [(prompt, repeat, self.configs.index(other)) for prompt, repeat, other in kept]
        self.runs = [run for run in self.runs if run.configuration != config.name]
        self.left_out[config.name] = f"{type(error).__name__}: {first_line(error)}"

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
        sizes = {} if config.tree_budget is None else {"tree_budget": config.tree_budget}
        decoder = build_decoder(self.target, self.draft, config.drafter, config.k, **sizes)
        return self._run_engine(config, decoder, prompt_ids, max_new_tokens)

    def _run_engine(self, config: Configuration, decoder, prompt_ids: list[int], max_new_tokens: int) -> Run:
        stats, tokens, first, first_seconds, finish_reason = GenerationStats(), [], None, 0.0, "length"
        self._probe.start()
        started = time.perf_counter()
        for event in decoder.stream(prompt_ids, self.settings.params, max_new_tokens):
            if first is None:
                first, first_seconds = event, time.perf_counter() - started
            tokens += event.tokens
            stats.add_step(event)
            self._probe.sample()
            finish_reason = event.finish_reason or finish_reason
        stats.seconds = time.perf_counter() - started
        return Run.from_stats(config.name, tokens, stats, finish_reason, self._probe.peak(), first, first_seconds)

    def _run_hf(self, config: Configuration, prompt_ids: list[int], max_new_tokens: int, counter: ForwardCounter) -> Run:
        assistant = self.loaded[config.assistant] if config.kind == HF_ASSISTED else None
        generation_config = hf_generation_config(
            self.settings.params, max_new_tokens, self.eos_ids, pad_token_id(self.target, self.eos_ids),
            lookup=config.kind == HF_LOOKUP,
        )
        forwards = counter.counts[TARGET]
        new_tokens, seconds = hf_generate(self.target, assistant, prompt_ids, generation_config, self.settings.params,
                                          self._probe)
        tokens = cut_at_eos(new_tokens, self.eos_ids)
        finish_reason = "stop" if tokens and tokens[-1] in self.eos_ids else "length"
        steps = counter.counts[TARGET] - forwards
        return Run(config.name, -1, -1, tokens, seconds, steps, finish_reason, self._probe.peak())

    def measure_quality(self, reference: LoadedModel) -> dict:
        """The target's greedy output (the baseline's first runs) against `reference`'s — the same model
        unquantised — on the same prompts: identical prompts and the median first divergence; and the tokens per
        second of each on them (the reference timed after the configurations, one run: the speed a user who kept
        the unquantised weights would get here)."""
        baseline = {run.prompt_index: run.tokens for run in self.runs
                    if run.configuration == self.configs[0].name and run.repeat == 0}
        with quiet_transformers():
            tokens, seconds = reference_tokens(reference.model, self.prompt_ids, self.settings.max_new_tokens,
                                               self.eos_ids)
        label = self.target.precision + (", prompts read in bfloat16" if prompt_reader(self.target) != "target" else "")
        speeds = {"reference_tokens_per_second": sum(map(len, tokens.values())) / seconds if seconds > 0 else None,
                  "target_tokens_per_second": self.summary()[0]["tokens_per_second"]}  # the table's own figure
        self.quality = agreement(tokens, baseline) | {"target": label, "reference": reference.precision} | speeds
        return self.quality

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
            "environment": environment(self.target, self.draft, self.background),
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
        if self.left_out:
            report["left_out"] = self.left_out
        if self.quality is not None:
            report["quality"] = self.quality
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
            "hf_assisted": assistant_settings(self.draft),
            "warmup_tokens": WARMUP_TOKENS,
        }


def encode_prompts(prompts: Sequence[Prompt], tokenizer, system: str | None) -> list[list[int]]:
    """Every prompt's ids (`encode_prompt`); no prompts at all is a mistake."""
    if not prompts:
        raise InputError("no prompts to run", "choose other categories or another prompt file")
    return [encode_prompt(prompt, tokenizer, system) for prompt in prompts]


def encode_prompt(prompt: Prompt, tokenizer, system: str | None = None) -> list[int]:
    """Raw text as it is; a conversation through the chat template; a single user turn through the
    chat template when the model has one (with the system prompt), else as raw text."""
    if prompt.messages is not None:
        return encode_chat(tokenizer, prompt.messages)
    if prompt.as_user_turn and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt.text}]
        return encode_folding_system(tokenizer, messages)[0]  # a template without a system role: it opens the turn
    return encode_completion(tokenizer, prompt.text)


def write_json(path: Path, report: dict) -> None:
    """Write the report whole or not at all: a temporary file beside `path`, renamed over it."""
    with replacing(path, "choose a writable path for --json") as temporary:
        temporary.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
