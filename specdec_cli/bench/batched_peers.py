"""HF transformers' own batched generation, run as `compare --batch-size`'s peers on the same prompts:
`generate` over left-padded batches of up to B prompts, and continuous batching (`generate_batch`, a paged
cache, a finished row replaced by the next prompt). Both the target alone, with our EOS ids, budget and
sampling (`peers.hf_generation_config`); each returns every prompt's new tokens, EOS not cut yet.

What generate_batch needs on a CPU (transformers 5.x): explicit cache sizes. Left unset, it sizes its paged
cache from "free device memory", which on a CPU is 90% of the machine's RAM (psutil) — minutes of
allocating, or the machine's memory gone. And an attention implementation it accepts ("sdpa", "paged|eager"
or flash): specdec's int8/int4 targets compute attention row by row (`specdec_rowwise`, exact for one
sequence), which it refuses, so the target runs on "sdpa" for the call (the same int8 weights)."""

from __future__ import annotations

import contextlib
import io
import logging
import math
from collections.abc import Sequence

import torch

from specdec_cli.engine import SamplingParams
from specdec_cli.models import LoadedModel

PAGE_SIZE = 256  # tokens per page of the paged cache (transformers' default)
MAX_BATCH_TOKENS = 2048  # tokens in one forward: a batch's prompts prefill in one or a few forwards
CB_ATTENTION = ("sdpa", "paged|eager")  # what generate_batch takes on a CPU (flash too, on a GPU)


class PeerUnavailable(Exception):
    """A peer that cannot run here (this model, this device): the row says why instead of a measurement."""


def padded_generate(target: LoadedModel, prompts: Sequence[list[int]], batch_size: int, generation_config,
                    params: SamplingParams, pad_id: int) -> list[list[int]]:
    """HF `generate` over consecutive batches of up to `batch_size` prompts, each left-padded to its longest
    with an attention mask; a batch runs until its last row ends. New tokens per prompt, in input order."""
    if not params.greedy:
        torch.manual_seed(params.seed or 0)
    new_tokens = []
    for start in range(0, len(prompts), batch_size):
        input_ids, attention_mask = left_padded(prompts[start:start + batch_size], pad_id, target.device)
        output = target.model.generate(input_ids, attention_mask=attention_mask, generation_config=generation_config)
        new_tokens += output[:, input_ids.shape[1]:].tolist()  # .tolist() waits for the device
    return new_tokens


def left_padded(prompts: Sequence[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (rows, longest): each prompt right-aligned, pads masked out."""
    longest = max(len(prompt) for prompt in prompts)
    input_ids = torch.tensor([[pad_id] * (longest - len(prompt)) + prompt for prompt in prompts], device=device)
    mask = torch.tensor([[0] * (longest - len(prompt)) + [1] * len(prompt) for prompt in prompts], device=device)
    return input_ids, mask


def continuous_batching_settings(batch_size: int, prompts: Sequence[list[int]], max_new_tokens: int) -> dict:
    """The ContinuousBatchingConfig fields set explicitly: at most `batch_size` rows per forward (the same B as
    the other rows), and a cache that holds that many of the longest requests (see the module docstring)."""
    pages_per_request = math.ceil((max(map(len, prompts)) + max_new_tokens) / PAGE_SIZE)
    return {"max_requests_per_batch": batch_size, "page_size": PAGE_SIZE,
            "num_blocks": batch_size * pages_per_request + 1, "max_batch_tokens": MAX_BATCH_TOKENS}


def generate_batch(target: LoadedModel, prompts: Sequence[list[int]], batch_size: int, generation_config,
                   params: SamplingParams) -> list[list[int]]:
    """HF continuous batching over all the prompts, at most `batch_size` at a time. New tokens per prompt, in
    input order. PeerUnavailable when this transformers has no generate_batch or any request failed."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    if not hasattr(target.model, "generate_batch"):
        raise PeerUnavailable("this transformers has no generate_batch (transformers 5.x has)")
    settings = continuous_batching_settings(batch_size, prompts, generation_config.max_new_tokens)
    config = ContinuousBatchingConfig(**settings, seed=params.seed or 0)
    with _running_on_cb_attention(target.model), _cb_log() as errors, contextlib.redirect_stdout(io.StringIO()):
        try:
            outputs = target.model.generate_batch([list(prompt) for prompt in prompts], generation_config=generation_config,
                                                  continuous_batching_config=config)
        except (ValueError, RuntimeError, NotImplementedError, MemoryError) as error:
            raise PeerUnavailable(_first_line(str(error))) from None
    results = list(outputs.values())
    failed = [result.error for result in results if result.error is not None]
    if len(results) != len(prompts) or failed:
        reason = failed[0] if failed else errors[0] if errors else f"{len(prompts) - len(results)} requests never finished"
        raise PeerUnavailable(_first_line(str(reason)))
    return [list(result.generated_tokens) for result in results]  # generate_batch returns them in input order


def cb_attention(model: torch.nn.Module) -> str:
    """The attention implementation generate_batch runs the model with: its own, or SDPA instead of one
    continuous batching refuses (specdec's row-wise one)."""
    original = model.config._attn_implementation
    return original if original in CB_ATTENTION or "flash" in original else "sdpa"


@contextlib.contextmanager
def _running_on_cb_attention(model: torch.nn.Module):
    """Run on `cb_attention` for the call, then give the model its own attention back."""
    original = model.config._attn_implementation
    if cb_attention(model) == original:
        yield
        return
    model.set_attn_implementation(cb_attention(model))
    try:
        yield
    finally:
        model.set_attn_implementation(original)


@contextlib.contextmanager
def _cb_log():
    """transformers' continuous batching logs its failures (tracebacks included) on a logger of its own and
    carries on: keep those messages for the row's note instead of printing them. A filter on the logger,
    not a handler: generate_batch puts a tqdm handler of its own on it for the call."""
    logger = logging.getLogger("ContinuousBatchingLogger")
    messages: list[str] = []

    def keep(record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            messages.append(record.getMessage())
        return False  # printed by no handler

    logger.addFilter(keep)
    try:
        yield messages
    finally:
        logger.removeFilter(keep)


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or ["unknown error"])[0]
