"""Where the models' linear layers are made: the one seam for weight storage (ComfyUI's ``operations=`` idea).

The model asks for each layer by its full name (the BFL key without ``.weight``), so the storage (float, fp8, int8,
GGUF blocks, a quantized file's own format, whose ``LayerFormat`` makes the layer: ``storage.formats``) is chosen per
layer at construction, never by swapping layers in afterwards. Per-item vector layers (timestep embedding,
modulations) stay per item in every storage, so a batch stays equal to single runs.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum, auto

import torch
from torch import nn

from ..storage.ggml_layers import GGMLEmbedding, GGMLLinear
from ..storage.int8 import Int8Linear
from ..storage.linear import CastLinear, Linear, VectorLinear
from ..storage.quant import Fp8Linear
from ..storage.rotation import group_for
from ..storage.stored_format import LayerFormat


class Choice(Enum):
    """Which of ``Layers``' choosers made a linear, in the order they are asked: the storage a layer is held in, not
    the format a file names (a stored layer's format, ``LayerFormat``, makes its own layer)."""
    STORED = auto()     # kept in the format the file stores it in
    INT8 = auto()       # quantized to int8 at load (``--int8``)
    GGML = auto()       # GGUF blocks
    FP8 = auto()        # fp8: the file's own, or quantized at load (``--fp8``)
    KEPT = auto()       # a 16-bit weight kept in its dtype, cast at each call
    FLOAT = auto()      # the model's dtype


class Layers:
    """``stored(name)`` (the format a file keeps the layer in, or None), ``int8(name)``, ``ggml(name)`` (a GGML type or
    None), ``fp8(name)``, ``kept(name)`` (a 16-bit dtype to keep the weight in, cast at each call, or None) choose in
    that order; default: float in the model's dtype. ``convrot``: the int8 layers ``int8`` picks are quantized in
    ConvRot's basis. ``chosen`` (shared by every scope) records the ``Choice`` that made each linear, by its full
    name: what a loader reports of its options (``weights.storage_outcome``) is read from the choice itself."""

    def __init__(self, fp8: Callable[[str], bool] | None = None, prefix: str = "",
                 ggml: Callable[[str], int | None] | None = None, int8: Callable[[str], bool] | None = None,
                 kept: Callable[[str], torch.dtype | None] | None = None,
                 stored: Callable[[str], LayerFormat | None] | None = None, convrot: bool = False,
                 chosen: dict[str, Choice] | None = None):
        self.fp8, self.prefix, self.ggml = fp8 or (lambda name: False), prefix, ggml or (lambda name: None)
        self.int8, self.kept = int8 or (lambda name: False), kept or (lambda name: None)
        self.stored, self.convrot = stored or (lambda name: None), convrot
        self.chosen = {} if chosen is None else chosen

    def scope(self, name: str) -> Layers:
        return Layers(self.fp8, f"{self.prefix}{name}.", self.ggml, self.int8, self.kept, self.stored, self.convrot,
                      self.chosen)

    def linear(self, name: str, in_features: int, out_features: int, per_item: bool = False) -> nn.Module:
        """Bias-free [out, in]; ``per_item``: one batch item at a time, for the per-item vectors [B, in]."""
        full = self.prefix + name
        how = self.chosen[full] = self.choice(full)
        if how is Choice.STORED:
            return self.stored(full).linear(in_features, out_features, per_item)
        if how is Choice.INT8:
            rotation = group_for(in_features) if self.convrot else 0
            return Int8Linear(in_features, out_features, item_by_item=per_item, rotation=rotation)
        if how is Choice.GGML:
            return GGMLLinear(in_features, out_features, self.ggml(full), item_by_item=per_item)
        if how is Choice.FP8:
            return Fp8Linear(in_features, out_features, item_by_item=per_item)
        if how is Choice.KEPT:
            return CastLinear(in_features, out_features, self.kept(full), item_by_item=per_item)
        return (VectorLinear if per_item else Linear)(in_features, out_features)

    def choice(self, full: str) -> Choice:
        """Which storage ``linear`` makes for the layer ``full``: the first chooser above that picks it, else
        ``Choice.FLOAT``."""
        picked = ((Choice.STORED, self.stored(full) is not None), (Choice.INT8, bool(self.int8(full))),
                  (Choice.GGML, self.ggml(full) is not None), (Choice.FP8, bool(self.fp8(full))),
                  (Choice.KEPT, self.kept(full) is not None))
        return next((what for what, picks in picked if picks), Choice.FLOAT)

    def embedding(self, name: str, rows: int, dim: int, dtype: torch.dtype = torch.float32) -> nn.Module:
        """Float ``nn.Embedding``, or GGUF blocks whose looked-up rows are dequantized to ``dtype``."""
        qtype = self.ggml(self.prefix + name)
        if qtype is not None:
            return GGMLEmbedding(rows, dim, qtype, dtype)
        # the table is always loaded from a file: no random init (on the meta device torch's init would import
        # torch._dynamo, ~1 s)
        return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))
