"""Where the models' linear layers are made: the one seam for weight storage (ComfyUI's ``operations=`` idea).

Storage is chosen at construction by each layer's full name, never by swapping layers in afterwards. Per-item vector
layers stay per item in every storage, so a batch stays equal to single runs.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..storage import choices
from ..storage.request import LayerRequest


class Layers:
    """``request``: what the load asks (None: all float). ``chosen``, shared by every scope: full name -> storage."""

    def __init__(self, request: LayerRequest | None = None, prefix: str = "", chosen: dict[str, str] | None = None):
        self.request, self.prefix, self.chosen = request, prefix, {} if chosen is None else chosen

    def scope(self, name: str) -> Layers:
        scoped = copy.copy(self)                  # the same request and ``chosen``, under a longer prefix
        scoped.prefix = f"{self.prefix}{name}."
        return scoped

    def linear(self, name: str, in_features: int, out_features: int, per_item: bool = False) -> nn.Module:
        """Bias-free [out, in]; ``per_item``: one batch item at a time, for the per-item vectors [B, in]."""
        full = self.prefix + name
        storage, picked = choices.choose(self.request, full)
        self.chosen[full] = storage.name
        return storage.linear(in_features, out_features, per_item, picked)

    def embedding(self, name: str, rows: int, dim: int, dtype: torch.dtype = torch.float32) -> nn.Module:
        """Float ``nn.Embedding``, or GGUF blocks whose looked-up rows are dequantized to ``dtype``."""
        return choices.made_embedding(self.request, self.prefix + name, rows, dim, dtype)
