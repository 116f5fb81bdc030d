"""Noise schedules: ``steps + 1`` sigmas from 1 (noise) to 0 (clean). The shared ones, the schedules by the
Scheduler node's names, and the rules for sigmas and strength; each family's own is in its package.

Values are float32 numbers as Python floats, as the reference's ``tolist()``, so step sizes match it exactly.
"""

from __future__ import annotations

import itertools

import torch

from .. import checks
from ..checks import check_steps
from ..errors import Flux2Error
from ..families import FAMILIES

SHARED = ("linear", "power")      # the schedules of no family, after the families' own
MODELS_OWN = "model's own"        # the schedule of the family of the model it is made for, whichever that is
# the Scheduler node's options; saved workflows store the text, so a listed name stays
SCHEDULES = (MODELS_OWN, *(f.schedule_name for f in FAMILIES.values()), *SHARED)


def linear_schedule(steps: int) -> list[float]:
    check_steps(steps)
    return torch.linspace(1, 0, steps + 1, dtype=torch.float32).tolist()


def power_schedule(steps: int, rho: float = 1.0) -> list[float]:
    """Karras' rho schedule with sigma_max 1, sigma_min 0: rho > 1 spends more steps near the clean end."""
    check_steps(steps)
    rho = checks.number("rho", rho, 0.0, None, above_low=True, hint="1 gives the linear schedule")
    t = torch.linspace(1, 0, steps + 1, dtype=torch.float32)
    return (t ** rho).tolist()


def check_model_for(name: str, model_given: bool) -> None:
    """``MODELS_OWN`` is the schedule of the model it is made for: refused where no model is given."""
    if name == MODELS_OWN and not model_given:
        raise Flux2Error(f"the schedule {MODELS_OWN!r} is the connected model's own: connect the model, or pick one "
                         f"of {', '.join(_named())}")


def named_schedule(name: str, steps: int, image_tokens: int, rho: float = 1.0, family=None) -> list[float]:
    """The schedule the Scheduler node's option ``name`` stands for (``family``'s own for ``MODELS_OWN``)."""
    check_model_for(name, family is not None)
    if name == MODELS_OWN:
        return family.schedule(steps, image_tokens)
    if name == "linear":
        return linear_schedule(steps)
    if name == "power":
        return power_schedule(steps, rho)
    named = next((f for f in FAMILIES.values() if f.schedule_name == name), None)
    if named is None:
        raise Flux2Error(f"unknown schedule {name!r}; use one of {', '.join(_named())}")
    return named.schedule(steps, image_tokens)


def _named() -> tuple[str, ...]:
    """The families registered now, then the shared schedules."""
    return (*(f.schedule_name for f in FAMILIES.values()), *SHARED)


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
    """As diffusers' image-to-image: of n steps skip the first ``int(n - n * strength)``."""
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
