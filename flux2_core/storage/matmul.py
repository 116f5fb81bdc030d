"""How a model's 8-bit layers multiply, decided once where it runs (``choose_matmuls``, called by every loader): fp8
in fp8 (``quant``), int8 in int8 (``int8``) where the device does that faster, else the weights cast to the compute
dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .int8 import use_int8_matmul
from .packed import W4A4Linear, use_int4_matmul
from .quant import use_fp8_matmul
from .w4 import KitchenLinear, use_kitchen_matmul


@dataclass(frozen=True)
class MatmulChoice:
    """A note is "" when the model has no layers of that kind."""

    fp8: bool
    fp8_note: str
    int8: bool
    int8_note: str
    int4_note: str = ""
    w4_note: str = ""               # W4A8, SVDQuant, AWQ: comfy-kitchen's own matmul or the weight dequantized
    kinds: tuple[str, ...] = ()     # the storage kinds (``census``) of the layers the notes are about

    @property
    def notes(self) -> list[str]:
        """Every note there is, for whoever tells the user how the model's quantized layers multiply."""
        return [note for note in (self.fp8_note, self.int8_note, self.int4_note, self.w4_note) if note]


def choose_matmuls(model: nn.Module, device, dtype: torch.dtype, fp8="auto", int8="auto") -> MatmulChoice:
    """Each choice "auto" (the faster path where it runs), True (Flux2Error where it cannot) or False."""
    fp8_on, fp8_note = use_fp8_matmul(model, fp8, torch.device(device), dtype)
    int8_on, int8_note = use_int8_matmul(model, int8, torch.device(device), dtype)
    chosen = [m for m in model.modules() if getattr(m, "kind", None) in ("fp8", "int8")
              or isinstance(m, W4A4Linear | KitchenLinear)]          # the layers each use_* above decides for
    return MatmulChoice(fp8_on, fp8_note, int8_on, int8_note, use_int4_matmul(model, device),
                        use_kitchen_matmul(model, device), tuple(dict.fromkeys(m.kind for m in chosen)))
