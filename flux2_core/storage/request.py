"""What a load asks of each linear layer (``LayerRequest``), and the record every storage kind answers it with.

Each kind (``LayerStorage``, beside the class that holds it) reads its own pick from the request, so a loader names no
storage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from ..errors import Flux2Error
from .stored_format import LayerFormat


class LayerFacts(Protocol):
    """What a file says of one of our weight keys ("<layer>.weight"), from its header."""

    def stored_format(self, key: str) -> LayerFormat | None: ...   # a registered format it keeps the layer in
    def stores_fp8(self, key: str) -> bool: ...                      # float8 values with a scale
    def ggml_type(self, key: str) -> int | None: ...                 # GGUF blocks of that GGML type
    def float_dtype(self, key: str) -> torch.dtype | None: ...       # one plain float dtype


@dataclass(frozen=True)
class StorageAsk:
    """A load's options beyond the file's own storage. ``fp8``: None keeps the file's float8, True makes every
    quantizable layer fp8, False dequantizes. ``int8``: True or "convrot" makes every quantizable layer int8."""

    fp8: bool | None = None
    int8: bool | str = False

    def __post_init__(self):
        if self.fp8 not in (None, True, False):
            raise Flux2Error(f"fp8 must be None (as the file stores it), True or False, got {self.fp8!r}")
        if self.int8 not in (True, False, "convrot"):
            raise Flux2Error(f"int8 must be True, 'convrot' or False, got {self.int8!r}")

    @property
    def int8_kind(self) -> str | None:
        """What int8 at load makes: "plain", "convrot", or None."""
        return ("convrot" if self.int8 == "convrot" else "plain") if self.int8 else None

    @property
    def option(self) -> str | None:
        """As lines name it ("int8", "int8 ConvRot", "fp8"); None where it quantizes nothing."""
        if self.int8:
            return "int8 ConvRot" if self.int8 == "convrot" else "int8"
        return "fp8" if self.fp8 is True else None


def _nothing(name: str) -> bool:
    return False


@dataclass(frozen=True)
class LayerRequest:
    file: LayerFacts
    ask: StorageAsk = StorageAsk()
    dtype: torch.dtype = torch.float32                    # the model's compute dtype
    quantizable: Callable[[str], bool] = _nothing         # the layers options may store otherwise (a family's blocks)


@dataclass(frozen=True)
class LayerStorage:
    name: str                                             # what ``Layers.chosen`` and outcome lines record
    # (request, layer name) -> what the layer is made from; None or False: not this kind
    pick: Callable[[LayerRequest, str], object]
    # (in_features, out_features, per_item, the pick) -> the layer; per_item: one batch item at a time
    linear: Callable[[int, int, bool, object], nn.Module]
    # (request, layer name) -> the file already holds what this kind, asked at load, would make of the layer
    keeps: Callable[[LayerRequest, str], bool] = lambda request, name: False
