"""Where the models' linear layers are made: the one seam for weight storage (ComfyUI's ``operations=`` idea).

    model = Flux2Transformer(params)                                    # every layer float (linear.Linear)
    model = Flux2Transformer(params, Layers(fp8=lambda name: name.startswith("single_blocks.")))
    model = Flux2Transformer(params, Layers(ggml=file_types.get))             # a GGUF file's quantized layers

The model asks for each linear layer by its full name (the BFL key without ``.weight``, e.g.
``double_blocks.0.img_attn.qkv``), so the storage is chosen per layer, at construction, never by swapping layers in
afterwards:

    float   linear.Linear / linear.VectorLinear: an nn.Linear weight in the compute dtype (oneDNN on CPU)
    fp8     quant.Fp8Linear: float8 weight + float32 scale, computed in the compute dtype or in fp8 (use_fp8_matmul)
    int8    storage.int8.Int8Linear: int8 weight + float32 row scale, W8A8 where it is faster (use_int8_matmul)
    GGUF    ggml_layers.GGMLLinear: a GGUF file's blocks (Q8_0 ... Q2_K), dequantized at every call

Per-item vector layers (timestep embedding, modulations) stay per item in every storage, so a batch keeps equal to
single runs. Adapters sit on top of any storage (``patching.set_adapters``). The text encoder (``qwen3.py``) gets its
linears and its token table (``embedding``) from the same maker; ``quant.quantize_transformer`` converts a
transformer already in memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .ggml_layers import GGMLEmbedding, GGMLLinear
from .linear import Linear, VectorLinear
from .quant import Fp8Linear
from .storage.int8 import Int8Linear


class Layers:
    """Makes a model's linear layers: ``int8(name)`` says which to store in int8, ``ggml(name)`` gives the GGML type
    of those kept as GGUF blocks (None for the rest), ``fp8(name)`` says which others to store in fp8; default: every
    layer float."""

    def __init__(self, fp8: Callable[[str], bool] | None = None, prefix: str = "",
                 ggml: Callable[[str], int | None] | None = None, int8: Callable[[str], bool] | None = None):
        self.fp8, self.prefix, self.ggml = fp8 or (lambda name: False), prefix, ggml or (lambda name: None)
        self.int8 = int8 or (lambda name: False)

    def scope(self, name: str) -> Layers:
        """The same maker for the layers inside the submodule ``name`` (their names get ``name.`` in front)."""
        return Layers(self.fp8, f"{self.prefix}{name}.", self.ggml, self.int8)

    def linear(self, name: str, in_features: int, out_features: int, per_item: bool = False) -> nn.Module:
        """A bias-free linear layer [out, in] named ``name`` within this scope; ``per_item``: one batch item at a
        time (linear.VectorLinear), for the per-item vectors [B, in] of the modulations and embedders."""
        if self.int8(self.prefix + name):
            return Int8Linear(in_features, out_features, item_by_item=per_item)
        qtype = self.ggml(self.prefix + name)
        if qtype is not None:
            return GGMLLinear(in_features, out_features, qtype, item_by_item=per_item)
        if self.fp8(self.prefix + name):
            return Fp8Linear(in_features, out_features, item_by_item=per_item)
        return (VectorLinear if per_item else Linear)(in_features, out_features)

    def embedding(self, name: str, rows: int, dim: int, dtype: torch.dtype = torch.float32) -> nn.Module:
        """A token table [rows, dim] named ``name``: float ``nn.Embedding``, or GGUF blocks whose looked-up rows are
        dequantized to ``dtype`` (``ggml_layers.GGMLEmbedding``)."""
        qtype = self.ggml(self.prefix + name)
        if qtype is not None:
            return GGMLEmbedding(rows, dim, qtype, dtype)
        # the table is always loaded from a file: no random init (on the meta device torch's init would import
        # torch._dynamo, ~1 s)
        return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))
