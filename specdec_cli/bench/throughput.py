"""`specdec compare --batch-size B`: throughput, not latency. Each configuration answers all the prompts at
batch size B in one pass — the target alone and each speculative configuration through the batched engine,
HF generate over left-padded batches, HF continuous batching (`generate_batch`) — and a row is its total new
tokens over the pass's wall time, against the target alone's at B.

Fairness, as in measure.py: models loaded once; one short warm-up pass per configuration; with --repeats R,
pass r runs every configuration once, the order rotated by one per pass (`run_order`), each from fresh
caches, with the same prompts, EOS ids, token budget and sampling; new tokens counted the same way for all
(up to and including each row's first EOS). No Rich and no printing here: report.py renders the rows."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from specdec_cli.bench.batched_peers import (
    PeerUnavailable, cb_attention, continuous_batching_settings, generate_batch, padded_generate,
)
from specdec_cli.bench.measure import encode_prompts
from specdec_cli.bench.peers import hf_generation_config, pad_token_id, quiet_transformers
from specdec_cli.bench.probes import BackgroundLoad, environment
from specdec_cli.bench.runs import WARMUP_TOKENS, BenchSettings, run_order
from specdec_cli.bench.theory import identical_prompts
from specdec_cli.engine import cut_at_eos
from specdec_cli.engine.batched import RowRequest
from specdec_cli.engine.stats import GenerationStats
from specdec_cli.errors import InputError
from specdec_cli.models import LoadedModel
from specdec_cli.prompts import Prompt
from specdec_cli.session import build_batched_decoder, eos_token_ids

THROUGHPUT_SCHEMA = "specdec.compare-throughput/1"
ENGINE, HF_PADDED, HF_CONTINUOUS = "batched", "hf-padded", "hf-generate-batch"
BATCHED_DRAFTERS = ("model", "ngram", "cascade")  # what the batched engine drafts with (the tree: not yet)


@dataclass(frozen=True)
class BatchedConfiguration:
    name: str
    kind: str  # ENGINE | HF_PADDED | HF_CONTINUOUS
    drafter: str = "none"  # the batched engine's drafter; "none" for the target alone and HF
    k: int | str = 0


@dataclass
class Pass:
    """One configuration over all the prompts at batch size B: the raw measurement written to --json."""

    configuration: str
    repeat: int
    tokens: list[list[int]]  # per prompt, in input order, cut at the first EOS
    seconds: float  # wall time of the whole pass
    drafted: int | None = None  # summed over the prompts; None: not reported (HF peers)
    accepted: int | None = None
    steps: int | None = None  # the rows' steps, summed; of them, those that drafted and those the policy held back
    drafted_steps: int | None = None
    held_steps: int | None = None
    policy: str | None = None  # why the policy held steps back (the measurement), the last time it did


ThroughputProgress = Callable[[int, int, BatchedConfiguration], None]  # (passes done, total, configuration)


def batched_configurations(drafters: Sequence[str], ks: Sequence[int | str], batch_size: int,
                           has_draft: bool) -> list[BatchedConfiguration]:
    """The target alone at B first (every row's reference), every drafter × k (k = 0 is the target alone:
    dropped), then HF's two batched peers."""
    check_batched_drafters(drafters)
    chosen = [BatchedConfiguration(f"target alone ×{batch_size}", ENGINE)]
    for drafter in dict.fromkeys(drafters):
        if drafter != "ngram" and not has_draft:
            raise InputError(f"the {drafter} drafter needs a draft model", "pass --draft NAME, or --drafter ngram")
        chosen += [BatchedConfiguration(f"{drafter} k={k} ×{batch_size}", ENGINE, drafter, k)
                   for k in dict.fromkeys(ks) if k != 0]
    return chosen + [BatchedConfiguration(f"HF generate, padded ×{batch_size}", HF_PADDED),
                     BatchedConfiguration(f"HF generate_batch ×{batch_size}", HF_CONTINUOUS)]


def check_batched_drafters(drafters: Sequence[str]) -> None:
    """Refuse a drafter the batched engine has not got (before any model loads)."""
    for drafter in drafters:
        if drafter not in BATCHED_DRAFTERS:
            raise InputError(f"--batch-size cannot run the {drafter} drafter",
                             f"choose from {', '.join(BATCHED_DRAFTERS)}, or drop --batch-size")


class ThroughputBenchmark:
    """Loaded models, the configurations, the prompts and B; `measure()` runs every pass and keeps them."""

    def __init__(self, target: LoadedModel, draft: LoadedModel | None, configs: Sequence[BatchedConfiguration],
                 prompts: Sequence[Prompt], settings: BenchSettings, batch_size: int) -> None:
        self.prompt_ids = encode_prompts(prompts, target.tokenizer, settings.system)
        self.target, self.draft = target, draft
        self.configs, self.prompts = list(configs), list(prompts)
        self.settings, self.batch_size = settings, batch_size
        self.eos_ids = eos_token_ids(target)
        self.order = [(repeat, index) for repeat, _, index in run_order(settings.repeats, 1, len(self.configs))]
        self.passes: list[Pass] = []
        self.unavailable: dict[str, str] = {}  # configuration name → why it cannot run here
        self.background = BackgroundLoad()

    def measure(self, on_progress: ThroughputProgress | None = None) -> list[Pass]:
        self.background.begin()
        with quiet_transformers():
            self._warm_up()
            for done, (repeat, index) in enumerate(self.order, start=1):
                config = self.configs[index]
                if config.name not in self.unavailable:
                    tokens, seconds, drafting = self._pass(config, self.prompt_ids, self.settings.max_new_tokens)
                    self.passes.append(Pass(config.name, repeat, tokens, seconds, *drafting))
                if on_progress:
                    on_progress(done, len(self.order), config)
        return self.passes

    def _warm_up(self) -> None:
        """One short pass per configuration over one batch of prompts; a peer that cannot run here is noted."""
        first_batch = self.prompt_ids[: self.batch_size]
        for config in self.configs:
            try:
                self._pass(config, first_batch, WARMUP_TOKENS)
            except PeerUnavailable as reason:
                self.unavailable[config.name] = str(reason)

    def _pass(self, config: BatchedConfiguration, prompt_ids: list[list[int]],
              max_new_tokens: int) -> tuple[list[list[int]], float, tuple[int | None, int | None]]:
        """(each prompt's new tokens cut at EOS, wall seconds, (drafted, accepted, steps, drafted steps, held steps,
        policy) or Nones)."""
        if config.kind == ENGINE:
            return self._engine_pass(config, prompt_ids, max_new_tokens)
        params, pad_id = self.settings.params, pad_token_id(self.target, self.eos_ids)
        generation_config = hf_generation_config(params, max_new_tokens, self.eos_ids, pad_id, lookup=False)
        started = time.perf_counter()
        if config.kind == HF_PADDED:
            new_tokens = padded_generate(self.target, prompt_ids, self.batch_size, generation_config, params, pad_id)
        else:
            new_tokens = generate_batch(self.target, prompt_ids, self.batch_size, generation_config, params)
        seconds = time.perf_counter() - started
        return [cut_at_eos(tokens, self.eos_ids) for tokens in new_tokens], seconds, ()

    def _engine_pass(self, config: BatchedConfiguration, prompt_ids: list[list[int]], max_new_tokens: int):
        decoder = build_batched_decoder(self.target, self.draft, config.drafter, config.k or 0, self.batch_size)
        requests = [RowRequest(ids, self.settings.params, max_new_tokens) for ids in prompt_ids]
        started = time.perf_counter()
        results = decoder.generate_many(requests)
        seconds = time.perf_counter() - started
        tokens = [cut_at_eos(result.tokens, self.eos_ids) for result in results]
        if config.drafter == "none":
            return tokens, seconds, ()
        stats = GenerationStats.total(result.stats for result in results)
        return tokens, seconds, (stats.drafted, stats.accepted, stats.steps, stats.drafted_steps, stats.held_steps,
                                 stats.policy)

    # ---- results ----

    def summary(self) -> list[dict]:
        """One row per configuration: its passes' new tokens over their seconds, against the target alone's."""
        baseline = [run for run in self.passes if run.configuration == self.configs[0].name]
        base_rate = _rate(baseline)
        return [self._row(config, [run for run in self.passes if run.configuration == config.name], baseline, base_rate)
                for config in self.configs]

    def _row(self, config: BatchedConfiguration, passes: list[Pass], baseline: list[Pass], base_rate: float | None) -> dict:
        new_tokens = sum(len(tokens) for run in passes for tokens in run.tokens)
        seconds = sum(run.seconds for run in passes)
        rate = _rate(passes)
        identical = identical_prompts(_by_prompt(baseline), _by_prompt(passes)) if self.settings.params.greedy else None
        drafted = sum(run.drafted or 0 for run in passes)
        steps = sum(run.steps or 0 for run in passes)
        policies = [run.policy for run in passes if run.policy]
        return {
            "configuration": config.name, "kind": config.kind, "drafter": config.drafter, "k": config.k,
            "batch_size": self.batch_size, "passes": len(passes), "prompts": len(self.prompts),
            "new_tokens": new_tokens, "seconds": round(seconds, 4), "tokens_per_second": rate,
            "ratio": rate / base_rate if rate and base_rate else None,
            "acceptance_rate": sum(run.accepted or 0 for run in passes) / drafted if drafted else None,
            "drafted_steps": sum(run.drafted_steps or 0 for run in passes) / steps if steps else None,
            "held_steps": sum(run.held_steps or 0 for run in passes) / steps if steps else None,
            "policy": policies[-1] if policies else None,
            "identical": identical[0] if identical and passes else None,
            "compared": identical[1] if identical and passes else None,
            "unavailable": self.unavailable.get(config.name),
        }

    def report(self) -> dict:
        """Everything, for --json: environment, settings, prompts, order, every raw pass, the summary."""
        return {
            "schema": THROUGHPUT_SCHEMA,
            "environment": environment(self.target, self.draft, self.background),
            "settings": self._settings_record(),
            "configurations": [asdict(config) for config in self.configs],
            "prompts": [{"index": i, "id": prompt.id, "category": prompt.category, "prompt_tokens": len(ids)}
                        for i, (prompt, ids) in enumerate(zip(self.prompts, self.prompt_ids))],
            "order": [[repeat, self.configs[index].name] for repeat, index in self.order],
            "unavailable": self.unavailable,
            "passes": [asdict(run) for run in self.passes],
            "summary": self.summary(),
        }

    def _settings_record(self) -> dict:
        params = self.settings.params
        return {
            "batch_size": self.batch_size, "max_new_tokens": self.settings.max_new_tokens,
            "repeats": self.settings.repeats, "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k, "seed": params.seed, "system": self.settings.system,
            "eos_token_ids": list(self.eos_ids), "warmup_tokens": WARMUP_TOKENS,
            "hf_continuous_batching": continuous_batching_settings(
                self.batch_size, self.prompt_ids, self.settings.max_new_tokens)
            | {"attention": cb_attention(self.target.model)},
        }


def _rate(passes: Sequence[Pass]) -> float | None:
    seconds = sum(run.seconds for run in passes)
    return sum(len(tokens) for run in passes for tokens in run.tokens) / seconds if seconds else None


def _by_prompt(passes: Sequence[Pass]) -> dict[tuple[int, int], list[int]]:
    """(prompt index, repeat) → tokens, as `identical_prompts` takes them."""
    return {(prompt, run.repeat): tokens for run in passes for prompt, tokens in enumerate(run.tokens)}
