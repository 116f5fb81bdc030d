"""The storages a linear layer is made in, in the order ``models.layers.Layers`` asks for them: each one record
(``LayerStorage``) with the name its chooser goes by and how a pick becomes the layer. ``stored`` is a file's own
format (a ``StoredFormat``'s ``LayerFormat``: ``formats.py``), the others are made at load or kept as 16-bit; a
layer no chooser picks is ``float``. A new storage is a record here and a chooser in the loader; ``Layers`` names no
storage class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .ggml_layers import GGMLEmbedding, GGMLLinear
from .int8 import Int8Linear
from .linear import CastLinear, Linear, VectorLinear
from .quant import Fp8Linear
from .rotation import group_for
from .stored_format import LayerFormat


@dataclass(frozen=True)
class LayerStorage:
    name: str                                              # its chooser's name, and what ``Layers.chosen`` records
    # (in_features, out_features, per_item, what the chooser picked) -> the layer; per_item: one batch item at a
    # time (the per-item vectors), in every storage
    linear: Callable[[int, int, bool, object], nn.Module]
    keeps: Callable[[LayerFormat, object], bool] = lambda fmt, asked: False   # a file's format already holds what
    #                                                      a load-time option asking ``asked`` would make


def _int8(in_features: int, out_features: int, per_item: bool, picked) -> nn.Module:
    rotation = group_for(in_features) if picked == "convrot" else 0          # picked: "plain" or "convrot"
    return Int8Linear(in_features, out_features, item_by_item=per_item, rotation=rotation)


STORED = LayerStorage("stored", lambda i, o, per_item, fmt: fmt.linear(i, o, per_item))
INT8 = LayerStorage("int8", _int8, keeps=lambda fmt, asked: fmt.format.storage is Int8Linear
                    and bool(fmt.rotation) == (asked == "convrot"))
GGML = LayerStorage("ggml", lambda i, o, per_item, qtype: GGMLLinear(i, o, qtype, item_by_item=per_item))
FP8 = LayerStorage("fp8", lambda i, o, per_item, _: Fp8Linear(i, o, item_by_item=per_item))
KEPT = LayerStorage("kept", lambda i, o, per_item, dtype: CastLinear(i, o, dtype, item_by_item=per_item))
FLOAT = LayerStorage("float", lambda i, o, per_item, _: (VectorLinear if per_item else Linear)(i, o))
ORDER = (STORED, INT8, GGML, FP8, KEPT)          # asked in this order; FLOAT where none picks


def embedding(rows: int, dim: int, qtype: int | None, dtype: torch.dtype) -> nn.Module:
    """A float ``nn.Embedding``, or GGUF blocks whose looked-up rows are dequantized to ``dtype``."""
    if qtype is not None:
        return GGMLEmbedding(rows, dim, qtype, dtype)
    # the table is always loaded from a file: no random init (on the meta device torch's init would import
    # torch._dynamo, ~1 s)
    return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))
