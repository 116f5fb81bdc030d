"""The protocol every weight storage class answers, so that patching, loading and streaming ask a layer instead of
testing its class.

    kind            "float", "bf16" / "fp16", "fp8", "int8" or a GGML type name ("Q4_K"), as reports show it
    follows_input   the layer moves its stored tensors to its input's device itself (GGUF), so a host may offload them
    merges_adapters adapters merge into the weight (float); else run-time branches, so a quantized weight is not
                    rounded again
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor, nn

from ..errors import Flux2Error

FLOAT_KINDS = ("float", "bf16", "fp16")        # weights held as plain floats, whatever the compute dtype


class Storage:
    """A mixin of an ``nn.Module``; the defaults are a float layer's."""

    kind = "float"
    follows_input = False

    def call_bytes(self, dtype: torch.dtype) -> int:
        return 0


class LayerSource(Protocol):
    """One linear of a file as a loader hands it to the layer that will hold it (``weights.loading``)."""

    dtype: torch.dtype             # the model's compute dtype

    @property
    def stored(self) -> bool: ...                           # the file keeps the layer in a registered format

    def as_stored(self) -> dict[str, Tensor]: ...           # the format's tensors as the file holds them
    def values(self) -> Tensor: ...                         # the weight [out, in]: the file's float, or dequantized
    def blocks(self) -> Tensor: ...                         # GGUF blocks as stored, uint8 [out, row bytes]
    def fp8(self) -> tuple[Tensor, Tensor]: ...             # float8 [out, in] and a scale per row [out]


class StoredLinear(Storage):
    """A bias-free linear [out, in]; one that cannot write its weight back (GGUF) overrides the merge methods."""

    merges_adapters = True
    item_by_item = False

    def float_weight(self, dtype: torch.dtype = torch.float32, device=None) -> Tensor:
        raise NotImplementedError

    def read_from(self, file: LayerSource) -> dict[str, Tensor]:
        """The layer's state (its own names) from ``file``; by default a format's tensors as stored."""
        if not file.stored:
            raise Flux2Error(f"a {type(self).__name__} layer holds a stored format, but the file does not store this "
                             f"layer in one; load the file this model was built for")
        return file.as_stored()

    def stored_tensors(self) -> tuple[Tensor, ...]:
        """The tensors a merge rewrites (and ``unmerge_weight`` restores)."""
        return (self.weight,)

    def write_weight(self, weight: Tensor) -> None:
        """float32 [out, in], in place (the same tensors stay)."""
        self.weight.copy_(weight)

    @torch.no_grad()
    def merge_weight(self, patch: Callable[[Tensor], Tensor]) -> None:
        self.unmerge_weight()
        # kept first (a plain attribute, not moved by .to()): a float32 weight is patched in place, so a half-done
        # merge must still be undone
        self._originals = tuple(t.detach().to("cpu", copy=True) for t in self.stored_tensors())
        try:
            self.write_weight(patch(self.float_weight(torch.float32, self.weight.device)))
        except BaseException:
            self.unmerge_weight()
            raise

    @torch.no_grad()
    def unmerge_weight(self) -> None:
        originals = getattr(self, "_originals", None)
        if originals is not None:
            for tensor, original in zip(self.stored_tensors(), originals):
                tensor.copy_(original)           # in place: the same Parameter / buffer objects stay
            self._originals = None


def stored_linears(model: nn.Module) -> list[tuple[str, StoredLinear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, StoredLinear)]


def census(model: nn.Module) -> dict[str, int]:
    """{"float": 12, "Q4_K": 40, ...}"""
    counts: dict[str, int] = {}
    for layer in model.modules():
        if isinstance(layer, Storage):
            counts[layer.kind] = counts.get(layer.kind, 0) + 1
    return dict(sorted(counts.items()))


def call_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """The most any one layer's call takes beside its input and output (0 for float models)."""
    return max((m.call_bytes(dtype) for m in model.modules() if isinstance(m, Storage)), default=0)
