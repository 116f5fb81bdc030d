"""References attended through their keys and values (a KV edition: Klein 9B-KV): what a model's reference pass
makes once and every step attends to, in a form the code around the model (the caches, ComfyUI's model management,
sequence parallelism) holds without knowing the model: per block, one K and one V."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class ReferenceKV:
    """blocks[i] = (k, v), each [B, heads, num_tokens, head_dim], double blocks first; a batch of 1 broadcasts.
    From a sequence-parallel model each rank holds its heads/P heads, and ``parallel_id`` names the call that made them.
    """

    blocks: list[tuple[Tensor, Tensor]]
    num_tokens: int
    parallel_id: str | None = None

    @property
    def batch(self) -> int:
        return self.blocks[0][0].shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks[0][0].dtype

    @property
    def device(self) -> torch.device:
        return self.blocks[0][0].device

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.blocks)

    def to(self, device=None, dtype=None) -> ReferenceKV:
        return ReferenceKV([(k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype))
                            for k, v in self.blocks], self.num_tokens, self.parallel_id)
