"""Where the models' linear layers are made: the one seam for weight storage (ComfyUI's ``operations=`` idea).

The model asks for each layer by its full name (the BFL key without ``.weight``), and the storage is chosen per layer
at construction, never by swapping layers in afterwards: ``storage.choices`` lists the storages in the order they
are asked (a file's own format, int8 made at load, GGUF blocks, fp8, a kept 16-bit weight; else float), each made
by its record. Per-item vector layers (timestep embedding, modulations) stay per item in every storage, so a batch
stays equal to single runs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from ..storage import choices


class Layers:
    """The choosers by storage name (``storage.choices``): ``stored(name)`` (the ``LayerFormat`` a file keeps the
    layer in), ``int8(name)`` ("plain" or "convrot": ``StorageAsk.int8_kind``), ``ggml(name)`` (a GGML type),
    ``fp8(name)``, ``kept(name)`` (a 16-bit dtype to keep the weight in); each answers None or False where it does not
    pick the layer. ``chosen`` (shared by every scope) records the storage name that made each linear, by its full
    name: what a loader reports of its options (``weights.storage_outcome``) is read from it."""

    def __init__(self, fp8: Callable[[str], bool] | None = None, prefix: str = "",
                 ggml: Callable[[str], int | None] | None = None, int8: Callable[[str], str | None] | None = None,
                 kept: Callable[[str], torch.dtype | None] | None = None,
                 stored: Callable[[str], object | None] | None = None, chosen: dict[str, str] | None = None):
        self.prefix, self.chosen = prefix, {} if chosen is None else chosen
        self.pickers = {"stored": stored, "int8": int8, "ggml": ggml, "fp8": fp8, "kept": kept}

    def scope(self, name: str) -> Layers:
        scoped = copy.copy(self)                  # the same choosers and ``chosen``, under a longer prefix
        scoped.prefix = f"{self.prefix}{name}."
        return scoped

    def linear(self, name: str, in_features: int, out_features: int, per_item: bool = False) -> nn.Module:
        """Bias-free [out, in]; ``per_item``: one batch item at a time, for the per-item vectors [B, in]."""
        full = self.prefix + name
        storage, picked = self.choice(full)
        self.chosen[full] = storage.name
        return storage.linear(in_features, out_features, per_item, picked)

    def choice(self, full: str) -> tuple[choices.LayerStorage, object]:
        """The storage ``linear`` makes the layer ``full`` in, and what its chooser picked: the first in
        ``choices.ORDER`` whose chooser picks it, else float."""
        for storage in choices.ORDER:
            pick = self.pickers[storage.name]
            picked = None if pick is None else pick(full)
            if picked is not None and picked is not False:
                return storage, picked
        return choices.FLOAT, None

    def embedding(self, name: str, rows: int, dim: int, dtype: torch.dtype = torch.float32) -> nn.Module:
        """Float ``nn.Embedding``, or GGUF blocks whose looked-up rows are dequantized to ``dtype``."""
        ggml = self.pickers["ggml"]
        return choices.embedding(rows, dim, None if ggml is None else ggml(self.prefix + name), dtype)
