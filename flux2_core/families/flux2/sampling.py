"""How FLUX.2 is sampled beyond its schedule: its noise, the latent's dtype between steps, its references' ids and
sizes."""

from __future__ import annotations

import torch
from torch import Tensor

from ..family import ReferenceFit

REFERENCES = ReferenceFit(single_pixels=2024 * 2024, multi_pixels=1024 * 1024, min_side=64, max_aspect=8.0,   # "2024"
                          max_count=None, padded=False, max_side=0, pad_min=0)                           # as BFL's code


def noise(drawn: Tensor) -> Tensor:
    """The seed's draw as it comes: [n, 128, h, w] in float32, channels first, as BFL's reference draws it."""
    return drawn


def latent_dtype(compute: torch.dtype) -> torch.dtype:
    """FLUX.2's latent between steps: in bfloat16 BFL's reference keeps the latent and time in bf16 (and ours equals
    it there); in float16 BFL has no reference, and ComfyUI's native FLUX.2 is the one users compare with: a float32
    latent and time, the model's input cast to float16 at each call."""
    return torch.bfloat16 if compute == torch.bfloat16 else torch.float32
