"""How a model's quantized layers multiply, decided once where it runs (``choose_matmuls``, called by every loader):
fp8 in fp8 (``quant``), int8 in int8 (``int8``), the 4-bit formats in their own format (``packed``, ``w4``) where the
device does that faster, else the weights cast or dequantized to the compute dtype."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .int8 import Int8Linear, use_int8_matmul
from .packed import W4A4Linear, int4_note, use_int4_matmul
from .quant import Fp8Linear, use_fp8_matmul
from .w4 import kitchen_note, use_kitchen_matmul


@dataclass(frozen=True)
class MatmulChoice:
    """``used``: each kind of layer the model holds that has a matmul of its own (its storage's ``kind``: "fp8",
    "int8", "w4a4", "w4a8", "svdquant", "awq") -> whether that matmul runs; ``kind_notes``: the same kinds -> the line
    that says so. A kind the model does not hold is in neither."""

    used: dict[str, bool] = field(default_factory=dict)
    kind_notes: dict[str, str] = field(default_factory=dict)

    @property
    def notes(self) -> list[str]:
        return list(self.kind_notes.values())

    def note_for(self, kind: str) -> str:
        """The note of a storage kind (``census``'s names), "" for a kind without a matmul of its own."""
        return self.kind_notes.get(kind, "")

    def record(self) -> dict[str, str]:
        """{"<kind>_matmul": "on" | "off"} for every kind the model holds: what a picture's settings record."""
        return {f"{kind}_matmul": "on" if on else "off" for kind, on in self.used.items()}


def choose_matmuls(model: nn.Module, device, dtype: torch.dtype, fp8="auto", int8="auto") -> MatmulChoice:
    """Each choice "auto" (the faster path where it runs), True (Flux2Error where it cannot) or False."""
    fp8_on, fp8_note = use_fp8_matmul(model, fp8, torch.device(device), dtype)
    int8_on, int8_note = use_int8_matmul(model, int8, torch.device(device), dtype)
    used, notes = {}, {}
    for kind, on, note in ((Fp8Linear.kind, fp8_on, fp8_note), (Int8Linear.kind, int8_on, int8_note)):
        if note:                                # "" where the model holds no such layers
            used[kind], notes[kind] = on, note
    int4 = use_int4_matmul(model, device)
    if int4 is not None:
        used[W4A4Linear.kind], notes[W4A4Linear.kind] = int4, int4_note(int4)
    for kind, on in use_kitchen_matmul(model, device).items():
        used[kind], notes[kind] = on, kitchen_note(kind, on)
    return MatmulChoice(used, notes)
