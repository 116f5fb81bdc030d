"""The storages a linear layer is made in, in the order ``models.layers.Layers`` asks for them: each one record
(``LayerStorage``) with the name its chooser goes by and how a pick becomes the layer. ``stored`` is a file's own
format (a ``StoredFormat``'s ``LayerFormat``: ``formats.py``), the others are made at load or kept as 16-bit; a
layer no chooser picks is ``float``. A load's options (``StorageAsk``) are a request the loader turns into
choosers; each layer reads its own tensors (``StoredLinear.read_from``). ``Layers`` names no storage class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import Flux2Error
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


@dataclass(frozen=True)
class StorageAsk:
    """A load's request beyond the file's own storage, checked as made. ``fp8``: None keeps what a file stores in
    float8, True also makes every quantizable layer fp8 as read, False dequantizes them all. ``int8``: True makes every
    quantizable layer int8 (per row), "convrot" in ConvRot's basis; False none."""

    fp8: bool | None = None
    int8: bool | str = False

    def __post_init__(self):
        if self.fp8 not in (None, True, False):
            raise Flux2Error(f"fp8 must be None (as the file stores it), True or False, got {self.fp8!r}")
        if self.int8 not in (True, False, "convrot"):
            raise Flux2Error(f"int8 must be True, 'convrot' or False, got {self.int8!r}")

    @property
    def made(self) -> LayerStorage | None:
        """The storage it quantizes layers into as they load; None where it quantizes nothing (fp8=False only
        dequantizes)."""
        return INT8 if self.int8 else FP8 if self.fp8 is True else None

    @property
    def int8_kind(self) -> str | None:
        """What the int8 chooser picks: "plain", "convrot", or None."""
        return ("convrot" if self.int8 == "convrot" else "plain") if self.int8 else None

    @property
    def option(self) -> str | None:
        """As lines name it ("int8", "int8 ConvRot", "fp8"); None where it quantizes nothing."""
        if self.int8:
            return "int8 ConvRot" if self.int8 == "convrot" else "int8"
        return "fp8" if self.fp8 is True else None


def embedding(rows: int, dim: int, qtype: int | None, dtype: torch.dtype) -> nn.Module:
    """A float ``nn.Embedding``, or GGUF blocks whose looked-up rows are dequantized to ``dtype``."""
    if qtype is not None:
        return GGMLEmbedding(rows, dim, qtype, dtype)
    # the table is always loaded from a file: no random init (on the meta device torch's init would import
    # torch._dynamo, ~1 s)
    return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))
