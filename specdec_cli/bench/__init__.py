"""`specdec compare`'s measurement, as a package:

  runs.py     configurations, run order, settings, `Run` (the raw record)      — no torch
  theory.py   table rows from runs: speedup, acceptance, lossless counts, theory — no torch
  probes.py   memory, forward counts and timings, weights' bytes, the environment
  peers.py    HF's assisted generation and prompt lookup on the same prompts
  measure.py  `Benchmark`: warm-up, the measuring loop, the --json report
  batched_peers.py  HF's batched generation: generate over padded batches, generate_batch (continuous batching)
  throughput.py     `ThroughputBenchmark`: --batch-size's passes, rows and --json report
  report.py   the Rich tables and the plot"""

from specdec_cli.lazy import exports

# Imported on first use: `specdec compare --help` reads HF_LOOKUP_TOKENS from runs.py (no torch) without importing
# the measurement, transformers and torch under it.
_PARTS = {
    "measure": ("Benchmark", "ProgressCallback", "encode_prompt", "write_json"),
    "peers": ("hf_generation_config",),
    "probes": ("ForwardCounter", "MemoryProbe", "environment", "forward_seconds"),
    "report": ("measurement_table", "theory_table", "theory_tables", "throughput_table", "tree_theory_table",
               "write_plot"),
    "runs": ("BASELINE", "DRAFT", "FORWARD_TIMINGS", "HF_ASSISTED", "HF_LOOKUP", "HF_LOOKUP_TOKENS", "PLAIN_DRAFT",
             "POSITIONS", "SCHEMA", "SPECDEC", "TARGET", "WARMUP_TOKENS", "BenchSettings", "Configuration", "Run",
             "configurations", "run_order"),
    "throughput": ("BATCHED_DRAFTERS", "THROUGHPUT_SCHEMA", "BatchedConfiguration", "ThroughputBenchmark",
                   "batched_configurations", "check_batched_drafters"),
    "theory": ("expected_speedup", "identical_prompts", "summary_row", "target_step_seconds", "theory"),
}
__getattr__ = exports(__name__, {
    "cut_at_eos": ("specdec_cli.engine", "cut_at_eos"),
    **{name: (f".{part}", name) for part, names in _PARTS.items() for name in names},
})

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
