"""How a model's 8-bit layers multiply, decided once where the model will run: fp8 layers in fp8 (``quant``:
torch._scaled_mm) and int8 layers in int8 (``int8``: comfy-kitchen's W8A8) where the device does that faster, else
their weights cast to the compute dtype. Every loader (the CLI, the Python API, the ComfyUI loader, follower
processes) calls ``choose_matmuls`` once its model is loaded and quantized."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..quant import use_fp8_matmul
from .int8 import use_int8_matmul


@dataclass(frozen=True)
class MatmulChoice:
    """What ``choose_matmuls`` decided; a note is "" when the model has no layers of that kind."""

    fp8: bool
    fp8_note: str
    int8: bool
    int8_note: str

    @property
    def notes(self) -> list[str]:
        return [note for note in (self.fp8_note, self.int8_note) if note]


def choose_matmuls(model: nn.Module, device, dtype: torch.dtype, fp8="auto", int8="auto") -> MatmulChoice:
    """Set the matmul of the model's fp8 and int8 layers for ``device`` and compute ``dtype``: each choice "auto" (the
    faster path where it runs), True (refused with the reason where it cannot) or False."""
    fp8_on, fp8_note = use_fp8_matmul(model, fp8, torch.device(device), dtype)
    int8_on, int8_note = use_int8_matmul(model, int8, torch.device(device), dtype)
    return MatmulChoice(fp8_on, fp8_note, int8_on, int8_note)
