"""What the engine refuses, for the CLI and the nodes alike: a setting must be a finite number in range (``number``:
NaN slips through every comparison, ComfyUI's own min/max checks included); a number written as text (an option, a
part of one) is read by ``parse_number`` alone; a stage boundary's tensor must be
finite (``finite``: NaN there would become a black image; one check per stage, never per step: it syncs the device).
"""

from __future__ import annotations

import math
import numbers
import re

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


# More steps than anyone means (base models use 50); it bounds a schedule's size, which a typo could make huge.
MAX_STEPS = 10_000


def check_steps(steps: int) -> None:
    """A denoise's step count, which every schedule (each family's and the shared ones) is made for."""
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise Flux2Error(f"steps must be a whole number from 1 to {MAX_STEPS}, got {steps!r}; distilled Klein uses 4, "
                         f"base uses 50")


# ASCII digits only: str.isdigit() takes "²" (which int() refuses) and int() takes "٣" or "３" (no user means them);
# a length bound, since int() refuses over 4300 digits and float() makes inf of long ones.
WHOLE_TEXT = re.compile(r"[+-]?[0-9]+", re.ASCII)
REAL_TEXT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)
MAX_NUMBER_TEXT = 40


def parse_number(text: str, name: str, low: float | None = None, high: float | None = None, *, whole: bool = False,
                 above_low: bool = False, hint: str = "") -> int | float:
    """Text a user typed -> the number (an int with ``whole``), checked as ``number`` checks it; anything else is a
    Flux2Error naming ``name``."""
    kind = "a whole number" if whole else "a number"
    if not isinstance(text, str) or len(text.strip()) > MAX_NUMBER_TEXT:
        what = f"{len(text)} characters long" if isinstance(text, str) else f"a {type(text).__name__}"
        raise Flux2Error(f"{name} must be {kind} of at most {MAX_NUMBER_TEXT} characters, got one {what}"
                         f"{hint and '; ' + hint}")
    if not (WHOLE_TEXT if whole else REAL_TEXT).fullmatch(text.strip()):
        digits = "digits 0-9" + ("" if whole else ", a point and an exponent such as 1e-3")
        raise Flux2Error(f"{name} must be {kind} written with {digits}, got {text!r}{hint and '; ' + hint}")
    value = int(text) if whole else float(text)
    number(name, value, low, high, above_low=above_low, hint=hint)
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
