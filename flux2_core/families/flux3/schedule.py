"""FLUX 3 Image Klein's schedule: one shift at every size, ``steps + 1`` sigmas from 1 (noise) to 0 (clean)."""

from __future__ import annotations

import torch

from ...checks import check_steps

FLUX3_ALPHA = 6.93      # FLUX 3 Image Klein's shift, the same at every size


def flux3_schedule(steps: int, image_tokens: int = 0) -> list[float]:
    """FLUX 3 Image Klein's: alpha·t / (1 + (alpha - 1)·t) in float32, t the float64 grid from 1 to 0 rounded to float32
    (as its reference; torch's float32 linspace differs from it in the last bit at some steps). The image's size
    (``image_tokens``) does not change it."""
    check_steps(steps)
    t = torch.linspace(1, 0, steps + 1, dtype=torch.float64).float()
    return (FLUX3_ALPHA * t / (1.0 + (FLUX3_ALPHA - 1.0) * t)).tolist()
