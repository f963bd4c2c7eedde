"""The sampled step's passes over vocabulary-wide rows in C (sampling_kernels.c): the k best scores of a few rows
and the ids a distribution gives mass to: the engine's `RowKernels` (engine/sampling.py), handed to it by the
settings that load a model once the library has loaded (binding.row_kernels); without them sampling runs its torch
code, which gives the same results (tested against each other)."""

from __future__ import annotations

import ctypes

import torch

MAX_K = 128  # more candidates than this go to torch.topk: each hit is an insertion into k sorted slots


class CRowKernels:
    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library

    def top_k(self, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(R, W) float32 -> the k best values (R, k) and their ids (R, k), best first; None where torch.topk
        must decide (k out of range, a NaN, fewer than k values above -inf)."""
        if not 0 < k <= min(MAX_K, rows.shape[-1]) or rows.dtype != torch.float32 or rows.device.type != "cpu":
            return None
        rows = rows.contiguous()
        values = torch.empty(rows.shape[0], k, dtype=torch.float32)
        ids = torch.empty(rows.shape[0], k, dtype=torch.int64)
        declined = self.library.specdec_top_k_rows(rows.data_ptr(), rows.shape[0], rows.shape[1], k,
                                                   values.data_ptr(), ids.data_ptr())
        return None if declined else (values, ids)

    def support(self, probs: torch.Tensor) -> torch.Tensor | None:
        """(W,) float32 -> the ids of its nonzero entries, in order (torch.nonzero(probs).flatten()); None for
        another dtype or device."""
        if probs.dtype != torch.float32 or probs.dim() != 1 or probs.device.type != "cpu":
            return None
        probs = probs.contiguous()
        ids = torch.empty(probs.shape[0], dtype=torch.int64)
        count = self.library.specdec_support(probs.data_ptr(), probs.shape[0], ids.data_ptr())
        return ids[:count]
