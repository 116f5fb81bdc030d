"""References as keys and values (Klein 9B-KV): made once by the reference pass, attended by every step; per block
one K and one V, so caches and hosts can hold them without knowing the model."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class ReferenceKV:
    """blocks[i] = (k, v), each [B, heads, num_tokens, head_dim], double blocks first; a batch of 1 broadcasts.
    Sequence-parallel ranks hold heads/P heads each; ``parallel_id`` names the call that made them."""

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
