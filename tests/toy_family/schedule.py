"""The toy's schedule: a straight line from 1 to 0, shifted towards the noisy end by SHIFT (the same at every size)."""

from __future__ import annotations

from flux2_core.checks import check_steps

SHIFT = 2.0


def toy_schedule(steps: int, image_tokens: int) -> list[float]:
    """SHIFT·t / (1 + (SHIFT - 1)·t) on t = 1, (steps - 1)/steps, ..., 0."""
    check_steps(steps)
    grid = [1 - i / steps for i in range(steps + 1)]
    return [SHIFT * t / (1 + (SHIFT - 1) * t) for t in grid]
