"""The storage kinds a linear layer is made in, asked in order for each layer of a load; a layer none picks is float.
"""

from __future__ import annotations

import torch
from torch import nn

from .formats import STORED
from .ggml_layers import GGML_STORAGE, embedding
from .int8 import INT8_AT_LOAD
from .linear import FLOAT, KEPT
from .quant import FP8_STORAGE
from .request import LayerRequest, LayerStorage, StorageAsk

ORDER = (STORED, INT8_AT_LOAD, GGML_STORAGE, FP8_STORAGE, KEPT)


def choose(request: LayerRequest | None, name: str) -> tuple[LayerStorage, object]:
    """(kind, pick) for the layer ``name``: the first in ``ORDER`` that picks it, else float."""
    if request is not None:
        for kind in ORDER:
            picked = kind.pick(request, name)
            if picked is not None and picked is not False:
                return kind, picked
    return FLOAT, None


def made_embedding(request: LayerRequest | None, name: str, rows: int, dim: int, dtype: torch.dtype) -> nn.Module:
    """A float ``nn.Embedding``, or the GGUF blocks the file stores it in (the GGUF kind's pick, as for a linear)."""
    return embedding(rows, dim, None if request is None else GGML_STORAGE.pick(request, name), dtype)


def made_at_load(ask: StorageAsk) -> LayerStorage | None:
    """The kind a load's options quantize layers into as they are read; None where they quantize nothing
    (fp8=False only dequantizes)."""
    return INT8_AT_LOAD if ask.int8 else FP8_STORAGE if ask.fp8 is True else None
