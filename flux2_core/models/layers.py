"""Where the models' linear layers are made: the one seam for weight storage (ComfyUI's ``operations=`` idea).

The model asks for each layer by its full name (the BFL key without ``.weight``), so the storage (float, fp8, int8,
GGUF blocks, a quantized file's own format) is chosen per layer at construction, never by swapping layers in
afterwards. Per-item vector layers
(timestep embedding, modulations) stay per item in every storage, so a batch stays equal to single runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..storage.ggml_layers import GGMLEmbedding, GGMLLinear
from ..storage.int8 import Int8Linear
from ..storage.layer_format import LayerFormat
from ..storage.linear import CastLinear, Linear, VectorLinear
from ..storage.packed import BlockScaledLinear, MxFp8Linear, NvFp4Linear, W4A4Linear
from ..storage.quant import Fp8Linear
from ..storage.rotation import group_for

# LayerFormat.storage -> the layer that keeps a file's values of that format as stored
STORED_LINEARS: dict[str, Callable[..., nn.Module]] = {
    "int8": lambda f, i, o, per_item, device: Int8Linear(i, o, per_item, device, per_row=f.per_row,
                                                         rotation=f.rotation),
    "blocks": lambda f, i, o, per_item, device: BlockScaledLinear(
        i, o, f.block, torch.int8 if f.name.startswith("int8") else torch.float8_e4m3fn, per_item, device),
    "nvfp4": lambda f, i, o, per_item, device: NvFp4Linear(i, o, per_item, swizzled=f.name == "nvfp4", device=device),
    "mxfp8": lambda f, i, o, per_item, device: MxFp8Linear(i, o, per_item, device),
    "w4a4": lambda f, i, o, per_item, device: W4A4Linear(i, o, f.rotation, per_item, device),
}


def stored_linear(fmt: LayerFormat, in_features: int, out_features: int, per_item: bool = False,
                  device=None) -> nn.Module:
    return STORED_LINEARS[fmt.storage](fmt, in_features, out_features, per_item, device)


class Layers:
    """``stored(name)`` (the format a file keeps the layer in, or None), ``int8(name)``, ``ggml(name)`` (a GGML type or
    None), ``fp8(name)``, ``kept(name)`` (a 16-bit dtype to keep the weight in, cast at each call, or None) choose in
    that order; default: float in the model's dtype. ``convrot``: the int8 layers ``int8`` picks are quantized in
    ConvRot's basis. ``chosen`` (shared by every scope) records which of them made each linear, by its full name:
    what a loader reports of its options (``weights.storage_outcome``) is read from the choice itself."""

    def __init__(self, fp8: Callable[[str], bool] | None = None, prefix: str = "",
                 ggml: Callable[[str], int | None] | None = None, int8: Callable[[str], bool] | None = None,
                 kept: Callable[[str], torch.dtype | None] | None = None,
                 stored: Callable[[str], LayerFormat | None] | None = None, convrot: bool = False,
                 chosen: dict[str, str] | None = None):
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
        if how == "stored":
            return stored_linear(self.stored(full), in_features, out_features, per_item)
        if how == "int8":
            rotation = group_for(in_features) if self.convrot else 0
            return Int8Linear(in_features, out_features, item_by_item=per_item, rotation=rotation)
        if how == "ggml":
            return GGMLLinear(in_features, out_features, self.ggml(full), item_by_item=per_item)
        if how == "fp8":
            return Fp8Linear(in_features, out_features, item_by_item=per_item)
        if how == "kept":
            return CastLinear(in_features, out_features, self.kept(full), item_by_item=per_item)
        return (VectorLinear if per_item else Linear)(in_features, out_features)

    def choice(self, full: str) -> str:
        """Which storage ``linear`` makes for the layer ``full``, by the name of the chooser above that picks it
        ("stored", "int8", "ggml", "fp8", "kept"), else "float"."""
        picked = (("stored", self.stored(full) is not None), ("int8", bool(self.int8(full))),
                  ("ggml", self.ggml(full) is not None), ("fp8", bool(self.fp8(full))),
                  ("kept", self.kept(full) is not None))
        return next((what for what, picks in picked if picks), "float")

    def embedding(self, name: str, rows: int, dim: int, dtype: torch.dtype = torch.float32) -> nn.Module:
        """Float ``nn.Embedding``, or GGUF blocks whose looked-up rows are dequantized to ``dtype``."""
        qtype = self.ggml(self.prefix + name)
        if qtype is not None:
            return GGMLEmbedding(rows, dim, qtype, dtype)
        # the table is always loaded from a file: no random init (on the meta device torch's init would import
        # torch._dynamo, ~1 s)
        return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))
