"""How FLUX 3 Image Klein is sampled beyond its schedule: its noise (token-major, through bf16, as its reference),
a float32 latent between steps, its references' ids and sizes."""

from __future__ import annotations

import torch

from ..family import NoiseDraw, ReferenceFit

NOISE = NoiseDraw(token_major=True, bf16=True)
# one reference: fitted to 4 MP and 4096 px a side, reflect-padded to its 16-px canvas (64 px at least); several: each
# at most 1 MP, centre-cropped to 16 px; at most 10
REFERENCES = ReferenceFit(single_pixels=4 * 1024 * 1024, multi_pixels=1024 * 1024, min_side=1, max_aspect=None,
                          max_count=10, padded=True, max_side=4096, pad_min=64)


def latent_dtype(compute: torch.dtype) -> torch.dtype:
    """Its reference keeps the latent in float32 between steps in every compute dtype."""
    return torch.float32
