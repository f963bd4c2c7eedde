"""What `specdec compare` measures besides tokens and seconds: working memory (`MemoryProbe`), forward
calls per model (`ForwardCounter`), the weights' bytes, a single-token forward's time, the environment."""

from __future__ import annotations

import os
import platform
import resource
import statistics
import time

import torch

from specdec_cli.bench.runs import FORWARD_TIMINGS
from specdec_cli.models import LoadedModel
from specdec_cli.models.device import BackgroundLoad  # what the benchmarks' JSON reports, from here


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
        # Each model's decoder where it has one: a drafter scoring a subset of the vocabulary calls its SubsetHeadLM,
        # which runs the draft's decoder but never the draft's top-level forward (the draft then went uncounted, and
        # `compare`'s memory column left its weights out of the speculative rows).
        self._handles = [_counted(model).register_forward_pre_hook(self._counter(name))
                         for name, model in models.items()]

    def _counter(self, name: str):
        def count(module, args):
            self.counts[name] += 1
        return count

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _counted(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose calls count as `model`'s forwards: its decoder (one call per forward), else itself."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    return decoder if isinstance(decoder, torch.nn.Module) else model


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


def prompt_reader(target: LoadedModel) -> str:
    """Who reads the target's prompts: "bfloat16 copy" or "target in bfloat16 on AMX" (--prefill, models/prefill.py),
    or "target"."""
    from specdec_cli.engine.kv import prefill_path

    path = prefill_path(target.model)
    return "target" if path is None else path.reader


def environment(target: LoadedModel, draft: LoadedModel | None, background: BackgroundLoad | None = None) -> dict:
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
        "target_prompt_read": prompt_reader(target),
        "others_cpu_cores": background.cores() if background is not None else None,  # while it measured
    }
    if target.device.type == "cpu":  # the CPU decides the costs: its model and the flags that pick kernels
        from specdec_cli.models.formats.calibration import cpu

        record.update(cpu())
    if "int8" in (target.quantization, draft.quantization if draft else None):
        from specdec_cli.models.formats.int8 import matmul_name

        record["binding"] = matmul_name()  # which int8 matmul ran (binding.py)
    if "q4" in (target.quantization, draft.quantization if draft else None):
        from specdec_cli.models.native.binding import q4_pairs

        record["q4_pairs_up_to"] = q4_pairs()  # q4's blocks two at a time up to this many tokens (models/q4_pairs.py)
    if target.device.type == "cuda":
        record["gpu"] = torch.cuda.get_device_name(target.device)
    return record
