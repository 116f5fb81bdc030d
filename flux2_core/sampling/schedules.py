"""Noise schedules: pure functions returning ``steps + 1`` sigmas from 1 (noise) to 0 (clean).

The values are float32 numbers as Python floats (the reference builds an fp32 tensor and calls ``tolist()``), so the
sampler's step sizes are exactly the reference's.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch

from .. import checks
from ..errors import Flux2Error

# Straight lines mu(L) = a * L + b fitted by BFL at 10 and at 200 steps (L = noisy image tokens).
MU_10_STEPS = (8.73809524e-05, 1.89833333)
MU_200_STEPS = (0.00016927, 0.45666666)
MU_LARGE_IMAGE_TOKENS = 4300   # above this many tokens, mu is the 200-step line whatever the step count
# More steps than anyone means (base models use 50); it bounds the schedule's size, which a typo could make huge.
MAX_STEPS = 10_000


def check_steps(steps: int) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise Flux2Error(f"steps must be a whole number from 1 to {MAX_STEPS}, got {steps!r}; distilled Klein uses 4, "
                         f"base uses 50")


def empirical_mu(image_tokens: int, steps: int) -> float:
    """BFL's ``compute_empirical_mu``: linear in the step count between fits at 10 and 200 steps (extrapolated for 4),
    the 200-step fit alone above 4300 tokens. ``image_tokens`` = (height/16) * (width/16); references do not count.
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
    """In t's dtype; maps 0 -> 0 (1/0 = inf) and 1 -> 1 (within fp32 rounding)."""
    return math.exp(mu) / (math.exp(mu) + (1 / t - 1))


def linear_schedule(steps: int) -> list[float]:
    check_steps(steps)
    return torch.linspace(1, 0, steps + 1, dtype=torch.float32).tolist()


def flux2_schedule(steps: int, image_tokens: int) -> list[float]:
    """BFL's ``get_schedule``. mu grows with the image, and in float32 the first levels then round to 1.0: from about
    4700^2 px at 4 steps (3950^2 at 200) the first steps would do nothing, and beyond about 11500^2 exp(mu) overflows.
    BFL and ComfyUI compute the same values; here such a size is refused with the largest that works.
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
    """A bisection: usability only falls with the size above MU_LARGE_IMAGE_TOKENS. At the edge the answer depends on
    whether the CPU flushes subnormals to zero (the CLI has it do so), so it is kept per mode.
    """
    return _max_image_tokens(steps, torch.tensor([1e-39]).mul(1.0).item() == 0.0)


@functools.lru_cache(maxsize=64)
def _max_image_tokens(steps: int, flushing: bool) -> int:
    low, high = MU_LARGE_IMAGE_TOKENS + 1, 1 << 24          # usable / not usable (16^2 * 2^24 px: far past overflow)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if _usable(_shifted(steps, mid)) else (low, mid)
    return low


def power_schedule(steps: int, rho: float = 1.0) -> list[float]:
    """Karras' rho schedule with sigma_max 1, sigma_min 0: rho > 1 spends more steps near the clean end."""
    check_steps(steps)
    rho = checks.number("rho", rho, 0.0, None, above_low=True, hint="1 gives the linear schedule")
    t = torch.linspace(1, 0, steps + 1, dtype=torch.float32)
    return (t ** rho).tolist()


FLUX3_ALPHA = 6.93      # FLUX 3 Image Klein's shift, the same at every size


def flux3_schedule(steps: int, alpha: float = FLUX3_ALPHA) -> list[float]:
    """FLUX 3 Image Klein's: alpha·t / (1 + (alpha - 1)·t) in float32, t the float64 grid from 1 to 0 rounded to float32
    (as its reference; torch's float32 linspace differs from it in the last bit at some steps)."""
    check_steps(steps)
    t = torch.linspace(1, 0, steps + 1, dtype=torch.float64).float()
    return (alpha * t / (1.0 + (alpha - 1.0) * t)).tolist()


SCHEDULES = ("flux2", "flux3", "linear", "power")


def named_schedule(name: str, steps: int, image_tokens: int, rho: float = 1.0) -> list[float]:
    if name == "flux2":
        return flux2_schedule(steps, image_tokens)
    if name == "flux3":
        return flux3_schedule(steps)
    if name == "linear":
        return linear_schedule(steps)
    if name == "power":
        return power_schedule(steps, rho)
    raise Flux2Error(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}")


def check_sigmas(sigmas) -> list[float]:
    """At least two, all in [0, 1], strictly decreasing; need not start at 1 nor end at 0."""
    values = [float(s) for s in (sigmas.tolist() if isinstance(sigmas, torch.Tensor) else sigmas)]
    if len(values) < 2:
        raise Flux2Error(f"sigmas need at least two values (one step), got {values}; e.g. [1.0, 0.5, 0.0]")
    if not all(0.0 <= s <= 1.0 for s in values):   # also rejects nan and inf
        raise Flux2Error(f"sigmas must be finite numbers in [0, 1] (1 = pure noise, 0 = clean), got {values}")
    if any(b >= a for a, b in itertools.pairwise(values)):
        raise Flux2Error(f"sigmas must strictly decrease, got {values}")
    return values


def truncate_for_strength(sigmas: list[float], strength: float) -> list[float]:
    """As diffusers' image-to-image: of n steps skip the first ``int(n - n * strength)``, so strength 0.5 with 4 steps
    runs sigmas[2:]; the sampler starts from the image noised to the tail's first sigma.
    """
    strength = check_strength(strength, True)
    steps = len(sigmas) - 1
    start = int(steps - steps * strength)
    if start >= steps:
        raise Flux2Error(f"denoise strength {strength} with {steps} steps leaves no step to run; "
                         f"raise the strength to at least {1 / steps:.3g} or use more steps")
    return list(sigmas[start:])


def check_strength(strength: float, image: bool) -> float:
    """In (0, 1]; below 1 needs a start image (else the CLI would ignore it, the node have nothing to noise)."""
    strength = checks.number("denoise strength", strength, 0.0, 1.0, above_low=True, hint="1 ignores the input image")
    if strength < 1 and not image:
        raise Flux2Error(f"denoise strength {strength:g} < 1 is image-to-image, but there is no image to start from: "
                         f"give one (the CLI's --image, the Denoise node's latent input) or set the strength to 1")
    return strength
