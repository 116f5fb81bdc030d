"""How a model's quantized layers multiply, decided once where it runs: each format decides for its own layers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .formats import formats


@dataclass(frozen=True)
class MatmulChoice:
    """``used``: each held kind with a matmul of its own -> whether it runs; ``kind_notes``: kind -> the line saying
    so."""

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
    asked, used, notes = {"fp8": fp8, "int8": int8}, {}, {}
    for rule in dict.fromkeys(f.matmul for f in formats() if f.matmul is not None):     # each rule once, in order
        for kind, (on, note) in rule(model, torch.device(device), dtype, asked).items():
            used[kind], notes[kind] = on, note
    return MatmulChoice(used, notes)
