"""A draft model whose output layer scores only a subset of the vocabulary (FR-Spec style).

A small draft spends a large share of its forward in its output layer (151,936 rows for Qwen2.5's
vocabulary). Scoring only the most frequent ids cuts that, and stays lossless: ids outside the subset get draft probability 0, which
the acceptance rule handles like any other draft distribution (the target can still emit them).

Without corpus statistics, a byte-level BPE's id order is its merge order, which follows frequency
in the tokenizer's training data: the first N ids plus every special token are a usable subset."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import torch

from specdec_cli.engine.kv import PREFILL_PATH, prefill_path
from specdec_cli.engine.sampling import spread


# A draft's default vocabulary: its 65,536 most frequent ids, for vocabularies of more than 1.5 times that (Qwen2.5's
# 151,936, Llama 3's 128,256, Gemma's 256,000). Scoring only those keeps the draft's acceptance while its output
# layer shrinks, so each draft step costs less; half as many ids saves no more time and accepts less.
DRAFT_VOCAB = 65536


def draft_vocabulary(tokenizer, vocab_size: int) -> torch.Tensor | None:
    """The ids a draft scores by default: `frequent_token_ids` of DRAFT_VOCAB where that drops at least a
    third of its output layer; None (the whole vocabulary) for smaller vocabularies."""
    if vocab_size <= DRAFT_VOCAB * 3 // 2:
        return None
    return frequent_token_ids(tokenizer, DRAFT_VOCAB, vocab_size)


def subset_head(causal_lm: torch.nn.Module, token_ids: torch.Tensor | None, share: bool = False) -> "SubsetHeadLM | None":
    """The head a drafter scores `token_ids` with (None: the whole vocabulary, no head); `share`: the one
    `shared_subset_head` keeps per model and id set."""
    if token_ids is None:
        return None
    return shared_subset_head(causal_lm, token_ids) if share else SubsetHeadLM(causal_lm, token_ids)


def shared_subset_head(causal_lm: torch.nn.Module, token_ids: torch.Tensor) -> "SubsetHeadLM":
    """A SubsetHeadLM of `causal_lm` for these ids, built once per model and id set (drafters are made
    per generation in `compare` and per turn elsewhere; the head's rows are copied only once)."""
    heads = causal_lm.__dict__.setdefault("_specdec_subset_heads", {})
    key = hashlib.sha256(token_ids.cpu().numpy().tobytes()).hexdigest()
    if key not in heads:
        heads[key] = SubsetHeadLM(causal_lm, token_ids)
    return heads[key]


def with_prompt_path(runner_model: torch.nn.Module, causal_lm: torch.nn.Module) -> torch.nn.Module:
    """`runner_model` (the causal LM, or a SubsetHeadLM of it) reading prompts as `causal_lm` does: its prefill path
    (models/prefill.py: a q4 draft's own weights on AMX), which writes into whatever cache it is given."""
    if runner_model is not causal_lm:
        path = prefill_path(causal_lm)
        if path is None:
            runner_model.__dict__.pop(PREFILL_PATH, None)  # a shared head follows its model's path being taken off too
        else:
            runner_model.__dict__[PREFILL_PATH] = path
    return runner_model


def frequent_token_ids(tokenizer, size: int, vocab_size: int) -> torch.Tensor:
    """The first `size` ids plus the special / added tokens (EOS must stay draftable), ascending."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    ids = set(range(min(size, vocab_size))) | {i for i in special if i < vocab_size}
    return torch.tensor(sorted(ids), dtype=torch.long)


class SubsetHeadLM(torch.nn.Module):
    """Wraps a transformers causal LM: same body and cache, logits over `token_ids` only.
    logits[..., j] scores token_ids[j]. The output layer may be an int8 one (models/int8.py): its subset
    rows are then an int8 layer too."""

    def __init__(self, causal_lm: torch.nn.Module, token_ids: torch.Tensor) -> None:
        super().__init__()
        self.body = causal_lm.get_decoder()
        self.config = causal_lm.config
        self.head, self.full_vocab_size = _subset_layer(causal_lm.get_output_embeddings(), token_ids)
        self.token_ids = token_ids.cpu()

    def token_id(self, index: int) -> int:
        """The vocabulary id that logits[..., index] scores."""
        return int(self.token_ids[index])

    def on_full_vocabulary(self, probs: torch.Tensor) -> torch.Tensor:
        """(|subset|,) probabilities as (V,): each id's mass in its own place, 0 outside the subset."""
        return spread(probs, self.token_ids, self.full_vocab_size)

    def forward(self, input_ids, cache=None, use_cache=True, logits_to_keep=0, attention_mask=None,
                position_ids=None, **kwargs):
        """As the causal LM's forward (a mask and position ids too, as a packed batch gives them); logits_to_keep:
        the last n positions, or the positions a 1-D tensor names."""
        hidden = self.body(input_ids=input_ids, cache=cache, use_cache=use_cache, attention_mask=attention_mask,
                           position_ids=position_ids).last_hidden_state
        if isinstance(logits_to_keep, torch.Tensor):
            hidden = hidden[:, logits_to_keep]
        elif logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return SimpleNamespace(logits=self.head(hidden))  # (1, n, |subset|)


def _subset_layer(head: torch.nn.Module, token_ids: torch.Tensor) -> tuple[torch.nn.Module, int]:
    """A bias-free linear layer holding `head`'s rows at token_ids (int8 if `head` is), and head's row count."""
    if hasattr(head, "select_rows"):  # an int8 or q4 layer: the same rows with their scales
        return head.select_rows(token_ids.cpu()), head.out_features
    weight = head.weight.detach()
    if type(weight) is not torch.Tensor and type(weight) is not torch.nn.Parameter:
        # an int4 (torchao) layer, opaque: its rows read back through the layer itself (x = the identity),
        # then re-quantised to int4 on their own
        from specdec_cli.models.formats.int4 import COMPUTE_DTYPE, quantize_int4

        dense = head(torch.eye(head.in_features, dtype=COMPUTE_DTYPE, device=weight.device)).t()  # (out, in)
        rows = dense[token_ids.to(weight.device)].contiguous()
        layer = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=False, dtype=rows.dtype)
        layer.weight = torch.nn.Parameter(rows, requires_grad=False)
        return quantize_int4(torch.nn.Sequential(layer))[0], weight.shape[0]
    rows = weight[token_ids.to(weight.device)].contiguous()
    layer = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
    layer.weight = torch.nn.Parameter(rows, requires_grad=False)
    return layer, head.weight.shape[0]
