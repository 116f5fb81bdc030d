"""Noise schedules: pure functions that return sigmas, from 1 (pure noise) down to 0 (clean image).

A schedule is a plain list of ``steps + 1`` Python floats; step i moves from ``sigmas[i]`` to ``sigmas[i + 1]``.
The values are float32 numbers (as in the reference, which builds them as an fp32 tensor and calls ``tolist()``),
so the sampler's step sizes ``sigmas[i + 1] - sigmas[i]`` are exactly the reference's.

* ``flux2_schedule``: the reference's schedule for every FLUX.2 model: ``linspace(1, 0, steps + 1)`` shifted by
  the empirical ``mu``, which depends on the number of noisy image tokens (references are not counted).
* ``linear_schedule`` / ``power_schedule``: unshifted alternatives, ``(1 - i/steps) ** rho``.
* ``check_sigmas``: validates user-given sigmas.
* ``truncate_for_strength``: the tail of a schedule that image-to-image with a denoise strength runs.
"""

from __future__ import annotations

import itertools
import math

import torch

from .errors import Flux2Error

# Straight lines mu(L) = a * L + b fitted by BFL at 10 and at 200 steps (L = noisy image tokens).
MU_10_STEPS = (8.73809524e-05, 1.89833333)
MU_200_STEPS = (0.00016927, 0.45666666)
MU_LARGE_IMAGE_TOKENS = 4300   # above this many tokens, mu is the 200-step line whatever the step count


def _check_steps(steps: int) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise Flux2Error(f"steps must be a whole number >= 1, got {steps!r}; distilled Klein uses 4, base uses 50")


def empirical_mu(image_tokens: int, steps: int) -> float:
    """The shift ``mu`` of BFL's ``compute_empirical_mu``: linear in the step count, interpolated between fits at
    10 and 200 steps (so extrapolated for 4 steps), and the 200-step fit alone above 4300 tokens.

    ``image_tokens`` = (height/16) * (width/16) of the image being generated; reference tokens do not count.
    """
    a10, b10 = MU_10_STEPS
    a200, b200 = MU_200_STEPS
    mu_200 = a200 * image_tokens + b200
    if image_tokens > MU_LARGE_IMAGE_TOKENS:
        return mu_200
    mu_10 = a10 * image_tokens + b10
    slope = (mu_200 - mu_10) / 190
    return slope * steps + (mu_200 - 200 * slope)


def time_shift(mu: float, t: torch.Tensor) -> torch.Tensor:
    """exp(mu) / (exp(mu) + 1/t - 1), in t's dtype; maps 0 -> 0 (1/0 = inf) and 1 -> 1 (within fp32 rounding)."""
    return math.exp(mu) / (math.exp(mu) + (1 / t - 1))


def linear_schedule(steps: int) -> list[float]:
    """1, 1 - 1/steps, ..., 0 (float32 values)."""
    _check_steps(steps)
    return torch.linspace(1, 0, steps + 1, dtype=torch.float32).tolist()


def flux2_schedule(steps: int, image_tokens: int) -> list[float]:
    """BFL's ``get_schedule``: the linear schedule shifted by ``empirical_mu(image_tokens, steps)``, in float32."""
    _check_steps(steps)
    if image_tokens < 1:
        raise Flux2Error(f"image_tokens must be >= 1, got {image_tokens}")
    t = torch.linspace(1, 0, steps + 1, dtype=torch.float32)
    return time_shift(empirical_mu(image_tokens, steps), t).tolist()


def power_schedule(steps: int, rho: float = 1.0) -> list[float]:
    """(1 - i/steps) ** rho for i = 0..steps: rho > 1 spends more steps near the clean end, rho < 1 near the noise.

    This is Karras' rho schedule with sigma_max = 1 and sigma_min = 0; rho = 1 is the linear schedule.
    """
    _check_steps(steps)
    if not rho > 0:
        raise Flux2Error(f"rho must be > 0, got {rho}; 1 gives the linear schedule")
    t = torch.linspace(1, 0, steps + 1, dtype=torch.float32)
    return (t ** rho).tolist()


def check_sigmas(sigmas) -> list[float]:
    """User-given sigmas as a list of floats: at least two, all in [0, 1], strictly decreasing.

    They need not start at 1 (image-to-image) nor end at 0 (the result then keeps some noise).
    """
    values = [float(s) for s in (sigmas.tolist() if isinstance(sigmas, torch.Tensor) else sigmas)]
    if len(values) < 2:
        raise Flux2Error(f"sigmas need at least two values (one step), got {values}; e.g. [1.0, 0.5, 0.0]")
    if not all(0.0 <= s <= 1.0 for s in values):   # also rejects nan
        raise Flux2Error(f"sigmas must lie in [0, 1] (1 = pure noise, 0 = clean), got {values}")
    if any(b >= a for a, b in itertools.pairwise(values)):
        raise Flux2Error(f"sigmas must strictly decrease, got {values}")
    return values


def truncate_for_strength(sigmas: list[float], strength: float) -> list[float]:
    """The tail of ``sigmas`` that image-to-image runs at denoise ``strength`` in (0, 1].

    Rule (the same as diffusers' image-to-image pipelines): of ``n = len(sigmas) - 1`` steps, skip the first
    ``int(n - n * strength)`` and run the rest, so strength 1 runs the whole schedule from pure noise and strength
    0.5 with 4 steps runs the last 2 (sigmas[2:]). The sampler starts from the encoded image noised to the first
    sigma of the tail: ``x = (1 - s) * image + s * noise``.
    """
    if not 0.0 < strength <= 1.0:
        raise Flux2Error(f"denoise strength must be in (0, 1], got {strength}; 1 ignores the input image")
    steps = len(sigmas) - 1
    start = int(steps - steps * strength)
    if start >= steps:
        raise Flux2Error(f"denoise strength {strength} with {steps} steps leaves no step to run; "
                         f"raise the strength to at least {1 / steps:.3g} or use more steps")
    return list(sigmas[start:])
