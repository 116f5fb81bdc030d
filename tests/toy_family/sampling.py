"""How the toy is sampled beyond its schedule: a noise reading of its own (the seed's draw mirrored left to right and
negated: still standard normal, and told apart from every other family's), a float32 latent between steps."""

from __future__ import annotations

import torch
from torch import Tensor


def toy_noise(drawn: Tensor) -> Tensor:
    """[n, 128, h, w] as drawn -> the toy's start noise."""
    return -drawn.flip(-1)


def latent_dtype(compute: torch.dtype) -> torch.dtype:
    return torch.float32
