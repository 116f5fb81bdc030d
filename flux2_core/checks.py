"""What the engine refuses, shared by the CLI and the nodes: numbers a user gives, tensors between stages.

* ``number``: a setting (cfg, strength, a LoRA strength, ...) must be a finite number in its range. NaN slips
  through every ``<`` / ``>`` comparison, so ranges alone do not catch it (ComfyUI's own min/max checks do not).
* ``finite``: one ``torch.isfinite(x).all()`` at a stage boundary (prompt embeddings, the denoised latent, the
  decoded image, an encoded image): a NaN or inf there would become a black image, so the run stops instead, naming
  the stage and what usually causes it. One check per stage, never per step: it costs one device sync.

The memory a stage needs, against what the device has free, is checked by ``memory.check_memory``.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from .errors import Flux2Error


def number(name: str, value, low: float | None = None, high: float | None = None, *, above_low: bool = False,
           hint: str = "") -> float:
    """``value`` as a float, refused unless it is a finite number within [low, high] ((low, high] with
    ``above_low``); ``hint`` is appended to the message (what the setting does, the usual values)."""
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
    """``x`` if it holds no NaN or inf, else a Flux2Error naming ``stage`` and the likely ``causes`` (most likely
    first). One reduction and one device sync."""
    if not bool(torch.isfinite(x).all()):
        raise Flux2Error(f"{stage} hold NaN or infinite values, so the image would come out black; the run was "
                         f"stopped. Likely causes: {'; or '.join(causes)}")
    return x


def dtype_cause(dtype: torch.dtype, model: str) -> list[str]:
    """The overflow cause for a stage computed in ``dtype`` by ``model`` (empty when the dtype cannot overflow)."""
    return [f"{model} runs in float16, which overflowed (its largest value is 65504): use bfloat16 or float32"] \
        if dtype == torch.float16 else []
