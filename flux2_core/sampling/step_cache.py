"""A step cache: fewer model calls on many-step runs, by reusing the last velocity while it would barely change.

A flow model's velocity changes slowly along a trajectory. Per sample, the predicted relative velocity change is
the latent's relative change since the model last ran times the rate measured over its last two calls; below
``threshold`` the last velocity is reused. The first ``WARMUP`` and last ``GUARD`` steps always run the model.

Each sample decides alone; the model is skipped only when every sample skips. The velocity is the one after CFG's
mix, so both passes skip together. Threshold 0 never skips, so the run equals the uncached one bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import checks

WARMUP = 0.15      # of the steps, always computed at the start (at least 2: the rate needs two model calls)
GUARD = 0.05       # of the steps, always computed at the end (at least 1: the last step sets the picture's detail)
MAX_THRESHOLD = 1.0


def check_threshold(threshold: float) -> float:
    return checks.number("cache", threshold, 0.0, MAX_THRESHOLD,
                         hint="0 turns the step cache off; higher skips more model calls")


@dataclass(frozen=True)
class CacheReport:
    """What a run's cache did, for the log and the PNG's settings."""

    threshold: float
    computed: int         # steps that ran the model (for at least one sample)
    skipped: int          # steps that reused the last velocity for every sample

    def line(self) -> str:
        total = self.computed + self.skipped
        return (f"step cache {self.threshold:g}: {self.skipped} of {total} model calls skipped "
                f"({self.computed} computed)")

    def record(self) -> dict:
        return {"threshold": self.threshold, "computed": self.computed, "skipped": self.skipped}


class StepCache:
    """One denoise's cache. ``wrap(velocity, steps)`` gives the velocity function the loop calls, once per step."""

    def __init__(self, threshold: float):
        self.threshold = check_threshold(threshold)
        self.computed_steps: list[int] = []
        self.skipped_steps: list[int] = []

    def report(self) -> CacheReport:
        return CacheReport(self.threshold, len(self.computed_steps), len(self.skipped_steps))

    def window(self, steps: int) -> range:
        """The steps that may reuse a velocity."""
        first = max(2, math.ceil(WARMUP * steps))
        last = steps - max(1, math.ceil(GUARD * steps))
        return range(first, max(first, last))

    def wrap(self, velocity: Callable[[Tensor, Tensor, Tensor], Tensor], steps: int
             ) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
        self.computed_steps, self.skipped_steps = [], []
        window = self.window(steps)
        last_x: Tensor | None = None          # [B, ...] the input at each sample's last model call (float32)
        last_v: Tensor | None = None          # [B, ...] the velocity it gave
        rate: Tensor | None = None            # [B] relative velocity change per relative input change; None: unknown

        def cached(x: Tensor, t: Tensor, t_next: Tensor) -> Tensor:
            nonlocal last_x, last_v, rate
            step = len(self.computed_steps) + len(self.skipped_steps)
            moved = None if last_x is None else relative_change(x.float(), last_x)        # [B]
            reuse = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
            if self.threshold > 0 and step in window and rate is not None:
                reuse = rate * moved < self.threshold
            if bool(reuse.all()):
                self.skipped_steps.append(step)
                return last_v.to(x.dtype)
            v = velocity(x, t, t_next)
            self.computed_steps.append(step)
            fresh = ~reuse
            if last_x is None:
                last_x, last_v = x.float(), v.float()
                return v
            changed = relative_change(v.float(), last_v)
            new_rate = changed / moved.clamp(min=torch.finfo(torch.float32).tiny)
            rate = new_rate if rate is None else torch.where(fresh, new_rate, rate)
            keep = fresh.view(-1, *([1] * (x.ndim - 1)))
            last_x, last_v = torch.where(keep, x.float(), last_x), torch.where(keep, v.float(), last_v)
            return torch.where(keep, v, last_v.to(v.dtype))
        return cached


def relative_change(x: Tensor, before: Tensor) -> Tensor:
    """Per sample: mean |x - before| / mean |before| (float32 [B])."""
    dims = tuple(range(1, x.ndim))
    return (x - before).abs().mean(dims) / before.abs().mean(dims).clamp(min=torch.finfo(torch.float32).tiny)
