"""What the engine refuses, for the CLI and the nodes alike: a setting must be a finite number in range (``number``:
NaN slips through every comparison, ComfyUI's own min/max checks included); a stage boundary's tensor must be
finite (``finite``: NaN there would become a black image; one check per stage, never per step: it syncs the device).
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from .errors import Flux2Error


def number(name: str, value, low: float | None = None, high: float | None = None, *, above_low: bool = False,
           hint: str = "") -> float:
    """((low, high] with ``above_low``); ``hint`` says what the setting does."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise Flux2Error(f"{name} must be a number, got {value!r}{hint and '; ' + hint}")
    try:
        value = float(value)
    except OverflowError:                 # an integer beyond float's range
        value = math.inf
    if not math.isfinite(value):
        raise Flux2Error(f"{name} must be a finite number, got {value}{hint and '; ' + hint}")
    too_low = low is not None and (value <= low if above_low else value < low)
    if too_low or (high is not None and value > high):
        span = f"{'(' if above_low else '['}{'-inf' if low is None else f'{low:g}'}, {'inf' if high is None else f'{high:g}'}]"
        raise Flux2Error(f"{name} must be in {span}, got {value:g}{hint and '; ' + hint}")
    return value


def finite(x: Tensor, stage: str, causes: list[str]) -> Tensor:
    """``causes``: most likely first."""
    if not bool(torch.isfinite(x).all()):
        raise Flux2Error(f"{stage} hold NaN or infinite values, so the image would come out black; the run was "
                         f"stopped. Likely causes: {'; or '.join(causes)}")
    return x


def dtype_cause(dtype: torch.dtype, model: str) -> list[str]:
    return [f"{model} runs in float16, which overflowed (its largest value is 65504): use bfloat16 or float32"] \
        if dtype == torch.float16 else []
