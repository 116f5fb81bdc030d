"""FLUX.2's schedule: BFL's empirical-mu shift, ``steps + 1`` sigmas from 1 to 0 that depend on the image's size, and
the largest size it serves. Values are float32 numbers as Python floats, as the reference's ``tolist()``.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch

from ...checks import check_steps
from ...errors import Flux2Error

# Straight lines mu(L) = a * L + b fitted by BFL at 10 and at 200 steps (L = noisy image tokens).
MU_10_STEPS = (8.73809524e-05, 1.89833333)
MU_200_STEPS = (0.00016927, 0.45666666)
MU_LARGE_IMAGE_TOKENS = 4300   # above this many tokens, mu is the 200-step line whatever the step count

def empirical_mu(image_tokens: int, steps: int) -> float:
    """BFL's ``compute_empirical_mu``. ``image_tokens`` = (height/16) * (width/16); references do not count."""
    a10, b10 = MU_10_STEPS
    a200, b200 = MU_200_STEPS
    mu_200 = a200 * image_tokens + b200
    if image_tokens > MU_LARGE_IMAGE_TOKENS:
        return mu_200
    mu_10 = a10 * image_tokens + b10
    slope = (mu_200 - mu_10) / 190
    return slope * steps + (mu_200 - 200 * slope)


def time_shift(mu: float, t: torch.Tensor) -> torch.Tensor:
    """In t's dtype; maps 0 -> 0 (1/0 = inf) and 1 -> 1 (within fp32 rounding)."""
    return math.exp(mu) / (math.exp(mu) + (1 / t - 1))


def flux2_schedule(steps: int, image_tokens: int) -> list[float]:
    """BFL's ``get_schedule``. mu grows with the image, and past about 4700^2 px (4 steps) the first float32 levels
    round to 1.0 and do nothing: such a size is refused with the largest that works.
    """
    check_steps(steps)
    if isinstance(image_tokens, bool) or not isinstance(image_tokens, int) or image_tokens < 1:
        raise Flux2Error(f"image_tokens must be a whole number >= 1, got {image_tokens!r}")
    sigmas = _shifted(steps, image_tokens)
    if not _usable(sigmas):
        side, limit = math.isqrt(image_tokens) * 16, math.isqrt(max_image_tokens(steps)) * 16
        raise Flux2Error(f"the FLUX.2 schedule cannot run {steps} steps at {image_tokens} image tokens (about "
                         f"{side}x{side} px): its shift mu = {empirical_mu(image_tokens, steps):.1f} grows with the "
                         f"image size, and in float32 (as in the reference) the first noise levels round to 1.0, so "
                         f"those steps would do nothing"
                         f"{'; here exp(mu) even overflows to NaN' if not all(map(math.isfinite, sigmas)) else ''}"
                         f". Generate at most about {limit}x{limit} px ({max_image_tokens(steps)} tokens) with "
                         f"{steps} steps and upscale, or use fewer steps (in ComfyUI also the Scheduler node's linear or "
                         f"power schedule)")
    return sigmas


def _shifted(steps: int, image_tokens: int) -> list[float]:
    t = torch.linspace(1, 0, steps + 1, dtype=torch.float32)
    try:
        return time_shift(empirical_mu(image_tokens, steps), t).tolist()
    except OverflowError:             # exp(mu) past float64 (from about 32768^2 px): NaN as float32 gives earlier
        return [math.nan] * (steps + 1)


def _usable(sigmas: list[float]) -> bool:
    return all(map(math.isfinite, sigmas)) and all(b < a for a, b in itertools.pairwise(sigmas))


def max_image_tokens(steps: int) -> int:
    """A bisection (usability only falls with size); kept per subnormal-flushing mode, which moves the edge."""
    return _max_image_tokens(steps, torch.tensor([1e-39]).mul(1.0).item() == 0.0)


@functools.lru_cache(maxsize=64)
def _max_image_tokens(steps: int, flushing: bool) -> int:
    low, high = MU_LARGE_IMAGE_TOKENS + 1, 1 << 24          # usable / not usable (16^2 * 2^24 px: far past overflow)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if _usable(_shifted(steps, mid)) else (low, mid)
    return low
