"""HF transformers' own speculative generation, run as `compare`'s peers on the same prompts and settings:
assisted generation (`assistant_model=draft`) and prompt lookup (`prompt_lookup_num_tokens`)."""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from contextlib import contextmanager

import torch

from specdec_cli.bench.probes import MemoryProbe
from specdec_cli.bench.runs import HF_LOOKUP_TOKENS
from specdec_cli.engine import SamplingParams
from specdec_cli.models import LoadedModel


def hf_generate(target: LoadedModel, assistant: LoadedModel | None, prompt_ids: list[int], generation_config,
                params: SamplingParams, probe: MemoryProbe) -> tuple[list[int], float]:
    """HF's generate on one prompt: the new tokens (EOS not cut yet) and the seconds it took. An assistant of another
    tokenizer drafts through HF's universal assisted generation (it is given both tokenizers)."""
    input_ids = torch.tensor([prompt_ids], device=target.device)
    extra = {"assistant_model": assistant.model} if assistant else {}
    if assistant is not None and assistant.vocabulary_overlap is not None:
        extra |= {"tokenizer": target.tokenizer, "assistant_tokenizer": assistant.tokenizer}
    with _assistant_config_restored(assistant):
        if not params.greedy:
            torch.manual_seed(params.seed or 0)
        probe.start()
        started = time.perf_counter()
        output = target.model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), generation_config=generation_config,
            stopping_criteria=_probe_criteria(probe), **extra,
        )
        new_tokens = output[0, len(prompt_ids):].tolist()  # .tolist() waits for the device
        return new_tokens, time.perf_counter() - started


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


def assistant_settings(draft: LoadedModel | None) -> dict:
    """What HF's assisted generation drafts with: the assistant's generation config, else HF's defaults."""
    config = draft.model.generation_config if draft else None
    names = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    return {name: getattr(config, name, None) if getattr(config, name, None) is not None else "HF default" for name in names}


def pad_token_id(target: LoadedModel, eos_ids: Sequence[int]) -> int:
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
def quiet_transformers():
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)
