"""An input embedding kept as its `.gguf`'s own blocks, for the in-place loader (loading/gguf_model.py): the file's
mapped bytes, not a copy, and a lookup dequantises only the rows it gathers, with the gguf package's own
dequantisation — per block, so each row is what a dequantisation of the whole table gives, bit for bit. A table of
152,064 rows × 3,584 (Qwen2.5-7B's) took 2.03 GiB in float32; now at most the file's 0.29 GiB (Q4_K), resident as
its rows are looked up. The demo pair's two took 1.38 GiB; now at most 0.21.

The module keeps its class (Gemma's scaled embedding still scales) with `weight` a meta tensor of the table's shape
and dtype: code that asks what the table is gets its answer, code that would read its values fails loudly."""

from __future__ import annotations

from functools import cache

import numpy as np
import torch

F32 = 0  # gguf.GGMLQuantizationType.F32: kept as float32, as before (blocks would save nothing)


def keeps(kind: int) -> bool:
    """Whether an embedding of gguf type `kind` is kept as blocks (every type but F32)."""
    return kind != F32


class BlockRows(torch.nn.Embedding):
    """An nn.Embedding whose table is `blocks` (rows, bytes a row) uint8 of gguf type `kind` (see the module)."""

    blocks: np.ndarray
    kind: int

    @property
    def weight(self) -> torch.Tensor:
        return torch.empty(self.num_embeddings, self.embedding_dim, dtype=torch.float32, device="meta")

    def rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(*input_ids.shape, embedding_dim) float32: the table's rows of `input_ids`, as gguf dequantises them."""
        from gguf import dequantize

        ids = input_ids.detach().cpu().numpy().reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_embeddings):
            raise IndexError(f"token ids must lie in 0..{self.num_embeddings - 1} (the embedding's rows); got "
                             f"{input_ids.tolist()}")
        values = np.ascontiguousarray(dequantize(self.blocks[ids], self.kind), dtype=np.float32)
        return torch.from_numpy(values).reshape(*input_ids.shape, self.embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.rows(input_ids).to(input_ids.device)


def keep_as_blocks(embedding: torch.nn.Embedding, blocks: np.ndarray, kind: int) -> None:
    """Make `embedding` (an nn.Embedding, or a subclass such as Gemma's scaled one) read its rows from `blocks`
    (rows, bytes a row: a view of the mapped file, not copied), in place: its class gains BlockRows' lookup under its
    own forward."""
    embedding.__class__ = _from_blocks(type(embedding))
    embedding._parameters.pop("weight", None)
    embedding.blocks = blocks  # the file's own pages where `blocks` maps them: resident as rows are looked up
    embedding.kind = kind


@cache
def _from_blocks(cls: type) -> type:
    """`cls` with BlockRows' lookup under its own forward (BlockRows itself for a plain nn.Embedding)."""
    return BlockRows if cls is torch.nn.Embedding else type(f"{cls.__name__}FromBlocks", (cls, BlockRows), {})
