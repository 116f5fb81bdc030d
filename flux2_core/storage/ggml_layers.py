"""GGUF weight storage: layers keep a file's quantized blocks (uint8 [rows, row bytes]) and dequantize them at every
call. The blocks are never re-quantized; adapters patch the dequantized weight.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import ggml
from .linear import item_by_item, linear
from .protocol import Storage, StoredLinear, census
from .request import LayerStorage

# Peak bytes per value while dequantizing, beside the result: measured 6.7 (Q4_0) to 10.7 (Q3_K). The fused kernel
# needs less, but the plain path is its fallback, so the estimate is the plain path's.
DEQUANTIZE_BYTES_PER_VALUE = 11


class GGMLLinear(nn.Module, StoredLinear):
    """A bias-free Linear [out, in] of ``ggml.QUANTIZED`` blocks; a merge patches the weight as it is dequantized."""

    merges_adapters = False
    follows_input = True

    def __init__(self, in_features: int, out_features: int, qtype: int, item_by_item: bool = False, device=None):
        super().__init__()
        self.in_features, self.out_features, self.qtype = in_features, out_features, int(qtype)
        self.item_by_item = item_by_item          # per-item vectors, as linear.VectorLinear (batch invariance)
        self.weight_patch = None                  # merge_weight: adapters merged as the weight is dequantized
        self.register_buffer("weight", torch.empty(out_features, ggml.row_bytes(qtype, in_features),
                                                   dtype=torch.uint8, device=device))

    @property
    def kind(self) -> str:
        return ggml.type_name(self.qtype)

    def float_weight(self, dtype: torch.dtype = torch.float32, device=None) -> Tensor:
        """[out, in], exact in float32, with ``weight_patch`` applied."""
        blocks = self.weight if device is None else self.weight.to(device, non_blocking=True)
        weight = ggml.dequantize(blocks, self.qtype, (self.out_features, self.in_features), dtype, fused=True)
        return weight if self.weight_patch is None else self.weight_patch(weight)

    def merge_weight(self, patch) -> None:
        self.weight_patch = lambda weight: patch(weight.float()).to(weight.dtype)

    def unmerge_weight(self) -> None:
        self.weight_patch = None

    def call_bytes(self, dtype: torch.dtype) -> int:
        return self.in_features * self.out_features * (DEQUANTIZE_BYTES_PER_VALUE + dtype.itemsize)

    def read_from(self, file) -> dict[str, Tensor]:
        return {"weight": file.blocks()}

    def forward(self, x: Tensor) -> Tensor:
        """x [..., in] -> [..., out]; the weight is dequantized where x is."""
        weight = self.float_weight(x.dtype, x.device)
        return item_by_item(lambda item: linear(item, weight), x) if self.item_by_item else linear(x, weight)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {ggml.type_name(self.qtype)}"


class GGMLEmbedding(nn.Module, Storage):
    """[num, dim] as GGML blocks; a lookup dequantizes only its rows (Qwen3's 151,936 stay as in the file)."""

    follows_input = True

    def __init__(self, num_embeddings: int, embedding_dim: int, qtype: int, dtype: torch.dtype = torch.float32,
                 device=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.qtype, self.dtype = num_embeddings, embedding_dim, int(qtype), dtype
        self.register_buffer("weight", torch.empty(num_embeddings, ggml.row_bytes(qtype, embedding_dim),
                                                   dtype=torch.uint8, device=device))

    @property
    def kind(self) -> str:
        return ggml.type_name(self.qtype)

    def forward(self, ids: Tensor) -> Tensor:
        rows = self.weight[ids.reshape(-1).to(self.weight.device)]
        values = ggml.dequantize(rows, self.qtype, (rows.shape[0], self.embedding_dim), self.dtype)
        return values.reshape(*ids.shape, self.embedding_dim).to(ids.device)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {ggml.type_name(self.qtype)}, lookups in {self.dtype}"


# GGUF blocks, for each quantizable layer the file stores in them
GGML_STORAGE = LayerStorage(
    "ggml", lambda request, name: request.file.ggml_type(name + ".weight") if request.quantizable(name) else None,
    lambda i, o, per_item, qtype: GGMLLinear(i, o, qtype, item_by_item=per_item))


def embedding(rows: int, dim: int, qtype: int | None, dtype: torch.dtype) -> nn.Module:
    """A float ``nn.Embedding``, or GGUF blocks whose looked-up rows are dequantized to ``dtype``."""
    if qtype is not None:
        return GGMLEmbedding(rows, dim, qtype, dtype)
    # always loaded from a file: no random init (on the meta device torch's init imports torch._dynamo, ~1 s)
    return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))


QUANTIZED_NAMES = frozenset(ggml.type_name(q) for q in ggml.QUANTIZED)


def gguf_types(model: nn.Module) -> dict[str, int]:
    """{"Q4_K": 40, "Q6_K": 8}; {} for none."""
    return {kind: n for kind, n in census(model).items() if kind in QUANTIZED_NAMES}

