"""A draft model whose output layer scores only a subset of the vocabulary (FR-Spec style).

A small draft spends a large share of its forward in its output layer (151,936 rows for Qwen2.5's
vocabulary). Scoring only the most frequent ids cuts that, and stays lossless: ids outside the subset get draft probability 0, which
the acceptance rule handles like any other draft distribution (the target can still emit them).

Without corpus statistics, a byte-level BPE's id order is its merge order, which follows frequency
in the tokenizer's training data: the first N ids plus every special token are a usable subset."""

from __future__ import annotations

from types import SimpleNamespace

import torch


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

    def forward(self, input_ids, cache=None, use_cache=True, logits_to_keep=0, **kwargs):
        hidden = self.body(input_ids=input_ids, cache=cache, use_cache=use_cache).last_hidden_state
        if logits_to_keep:
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
        from specdec_cli.models.int4 import COMPUTE_DTYPE, quantize_int4

        dense = head(torch.eye(head.in_features, dtype=COMPUTE_DTYPE, device=weight.device)).t()  # (out, in)
        rows = dense[token_ids.to(weight.device)].contiguous()
        layer = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=False, dtype=rows.dtype)
        layer.weight = torch.nn.Parameter(rows, requires_grad=False)
        return quantize_int4(torch.nn.Sequential(layer))[0], weight.shape[0]
    rows = weight[token_ids.to(weight.device)].contiguous()
    layer = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
    layer.weight = torch.nn.Parameter(rows, requires_grad=False)
    return layer, head.weight.shape[0]
