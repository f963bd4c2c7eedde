"""`specdec compare`'s measurement, as a package:

  runs.py     configurations, run order, settings, `Run` (the raw record)      — no torch
  theory.py   table rows from runs: speedup, acceptance, lossless counts, theory — no torch
  probes.py   memory, forward counts and timings, weights' bytes, the environment
  peers.py    HF's assisted generation and prompt lookup on the same prompts
  measure.py  `Benchmark`: warm-up, the measuring loop, the --json report
  batched_peers.py  HF's batched generation: generate over padded batches, generate_batch (continuous batching)
  throughput.py     `ThroughputBenchmark`: --batch-size's passes, rows and --json report
  report.py   the Rich tables and the plot"""

from specdec_cli.bench.measure import Benchmark, ProgressCallback, encode_prompt, write_json
from specdec_cli.bench.peers import hf_generation_config
from specdec_cli.bench.probes import ForwardCounter, MemoryProbe, environment, forward_seconds
from specdec_cli.bench.report import (
    measurement_table, theory_table, theory_tables, throughput_table, tree_theory_table, write_plot,
)
from specdec_cli.bench.runs import (
    BASELINE, DRAFT, FORWARD_TIMINGS, HF_ASSISTED, HF_LOOKUP, HF_LOOKUP_TOKENS, PLAIN_DRAFT, POSITIONS, SCHEMA, SPECDEC,
    TARGET, WARMUP_TOKENS, BenchSettings, Configuration, Run, configurations, run_order,
)
from specdec_cli.bench.throughput import (
    BATCHED_DRAFTERS, THROUGHPUT_SCHEMA, BatchedConfiguration, ThroughputBenchmark, batched_configurations,
    check_batched_drafters,
)
from specdec_cli.bench.theory import expected_speedup, identical_prompts, summary_row, target_step_seconds, theory
from specdec_cli.engine import cut_at_eos

__all__ = [
    "BASELINE", "BATCHED_DRAFTERS", "DRAFT", "FORWARD_TIMINGS", "HF_ASSISTED", "HF_LOOKUP", "HF_LOOKUP_TOKENS",
    "PLAIN_DRAFT", "POSITIONS", "SCHEMA", "SPECDEC", "TARGET", "THROUGHPUT_SCHEMA", "WARMUP_TOKENS",
    "BatchedConfiguration", "BenchSettings", "Benchmark", "Configuration", "ForwardCounter", "MemoryProbe",
    "ProgressCallback", "Run", "ThroughputBenchmark", "batched_configurations", "check_batched_drafters",
    "configurations", "cut_at_eos", "encode_prompt", "environment", "expected_speedup", "forward_seconds",
    "hf_generation_config", "identical_prompts", "measurement_table", "run_order", "summary_row",
    "target_step_seconds", "theory", "theory_table", "theory_tables", "throughput_table", "tree_theory_table",
    "write_json", "write_plot",
]
