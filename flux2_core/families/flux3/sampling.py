"""How FLUX 3 Image Klein is sampled beyond its schedule: its noise (token-major, through bf16, as its reference),
a float32 latent between steps, its references' ids and sizes."""

from __future__ import annotations

import torch
from torch import Tensor

from ...models import rope
from ..family import ReferenceFit

# one reference: fitted to 4 MP and 4096 px a side, reflect-padded to its 16-px canvas (64 px at least); several: each
# at most 1 MP, centre-cropped to 16 px; at most 10
REFERENCES = ReferenceFit(single_pixels=4 * 1024 * 1024, multi_pixels=1024 * 1024, min_side=1, max_aspect=None,
                          max_count=10, padded=True, max_side=4096, pad_min=64)


def noise(drawn: Tensor) -> Tensor:
    """Its reference draws [h*w, 128] tokens and rounds them through bf16: the same values in the order drawn, read
    token by token ([n, 128, h, w] -> [n, h*w, 128], the buffer unchanged), put on the grid, rounded."""
    n, channels, h, w = drawn.shape
    return rope.unpack(drawn.reshape(n, h * w, channels), h, w).to(torch.bfloat16).float()


def latent_dtype(compute: torch.dtype) -> torch.dtype:
    """Its reference keeps the latent in float32 between steps in every compute dtype."""
    return torch.float32
