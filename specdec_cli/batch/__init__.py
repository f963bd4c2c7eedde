"""Batch generation for `specdec run`: JSONL requests in, one JSONL record per request out, in order.

  requests.py    an input line → a `Request` (or one that carries why it cannot run)
  records.py     a finished request → its output record (specdec's or the OpenAI batch shape)
  writer.py      the output file: refusing to clobber, resuming, the durable writer
  sidecar.py     OUTPUT.settings.json: the settings a file was made with and its requests' digests, checked on --resume
  lock.py        `OutputLock`: one run per output file (an OS lock naming its holder's pid)
  loop.py        `run_batch` / `run_grouped` / `run_streamed`: the loop behind the `Generate` and `Stream` seams
  generation.py  `ModelGeneration` (one request at a time) and `BatchedGeneration` (the batched engine, a `Stream`)
  ray_workers.py `RayWorkers`: the same generation on Ray actors, a `Stream` (`--engine ray`; Ray imported lazily)

Importing this package loads no torch and no Rich."""

from specdec_cli.batch.generation import BatchedGeneration, ModelGeneration
from specdec_cli.batch.lock import OutputLock, lock_path
from specdec_cli.batch.loop import (
    BatchSummary, Generate, GenerateOne, Outcome, Stream, each, in_groups, one_at_a_time, pending_requests, run_batch,
    run_grouped, run_streamed,
)
from specdec_cli.batch.ray_workers import RayOptions, RayWorkers, WorkerReport, import_ray
from specdec_cli.batch.records import Completion, error_record, record_failed, record_key, record_stats, success_record
from specdec_cli.batch.requests import (
    CHAT_URL, COMPLETIONS_URL, MAX_SEED, OPENAI_KEYS, BadRecord, Request, parse_line, read_input, read_requests,
    refuse_one_document,
)
from specdec_cli.batch.sidecar import (
    check_resumed_requests, check_resumed_settings, record_settings, remember_requests, request_digests, settings_path,
    write_settings,
)
from specdec_cli.batch.writer import STDOUT, DurableWriter, check_output, output_name, read_finished

__all__ = [
    "CHAT_URL", "COMPLETIONS_URL", "MAX_SEED", "OPENAI_KEYS", "STDOUT", "BadRecord", "BatchSummary", "BatchedGeneration", "Completion", "DurableWriter",
    "Generate", "GenerateOne", "ModelGeneration", "Outcome", "OutputLock", "RayOptions", "RayWorkers", "Request", "Stream",
    "WorkerReport", "check_output", "check_resumed_requests", "check_resumed_settings", "each", "error_record", "import_ray", "in_groups",
    "lock_path", "one_at_a_time", "output_name", "parse_line", "pending_requests", "read_finished", "read_input", "read_requests",
    "record_failed", "record_key", "record_settings", "record_stats", "refuse_one_document", "remember_requests", "request_digests", "run_batch", "run_grouped", "run_streamed",
    "settings_path", "success_record", "write_settings",
]
