"""Bias-free float linear layers. Eager float32 matmuls on CPU go through oneDNN: on AMD CPUs MKL's sgemm runs a
generic path (70-95 GFLOP/s on a 2-core EPYC; oneDNN: 200). Everything else uses ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..devices import kept_dtype
from .protocol import StoredLinear
from .request import LayerRequest, LayerStorage

ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_matmul(x: Tensor, weight: Tensor) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """x [..., in] @ weight [out, in]ᵀ. Compiled code gets F.linear: inductor lowers oneDNN's op only for frozen
    weights."""
    if (ONEDNN_LINEAR and x.is_cpu and x.dtype == weight.dtype == torch.float32 and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return onednn_matmul(x, weight)
    return F.linear(x, weight)


class Linear(nn.Linear, StoredLinear):

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight)

    def read_from(self, file) -> dict[str, Tensor]:
        return {"weight": file.values().to(file.dtype)}

    def float_weight(self, dtype: torch.dtype = torch.float32, device=None) -> Tensor:
        return self.weight.detach().to(device or self.weight.device, dtype)


class CastLinear(Linear):
    """A weight kept in the file's 16-bit dtype and cast at each call: half the memory of float32, same values (bf16
    and fp16 widen exactly)."""

    casts_weight = True            # in ComfyUI, its manual cast does the cast (nodes/host.py), as for its own layers

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, item_by_item: bool = False):
        super().__init__(in_features, out_features)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=self.weight.device))
        self.item_by_item = item_by_item

    def read_from(self, file) -> dict[str, Tensor]:
        return {"weight": file.values().to(self.weight.dtype)}      # the file's 16-bit values, kept

    @property
    def kind(self) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.weight.dtype, "float")

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight.to(x.dtype)
        return item_by_item(lambda item: linear(item, weight), x) if self.item_by_item else linear(x, weight)

    def call_bytes(self, dtype: torch.dtype) -> int:
        return 0 if dtype == self.weight.dtype else self.in_features * self.out_features * dtype.itemsize

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kept in {self.weight.dtype}"


class VectorLinear(Linear):
    """Per-item vectors [B, in], one item at a time: a batched matmul picks other kernels, so an image would depend
    on its batch (by 1e-6, which can flip a pixel)."""

    item_by_item = True

    def forward(self, x: Tensor) -> Tensor:
        return item_by_item(lambda item: linear(item, self.weight), x)


def item_by_item(fn, x: Tensor) -> Tensor:
    return torch.cat([fn(item) for item in x.split(1)]) if x.shape[0] > 1 else fn(x)


def _kept_dtype(request: LayerRequest, name: str) -> torch.dtype | None:
    """Layers of a 16-bit file computed in a wider dtype keep the file's dtype (``devices.kept_dtype``)."""
    dtype = request.dtype
    stored = kept_dtype(request.file.float_dtype(name + ".weight"), dtype) if request.quantizable(name) else dtype
    return None if stored == dtype else stored


KEPT = LayerStorage("kept", _kept_dtype, lambda i, o, per_item, dtype: CastLinear(i, o, dtype, item_by_item=per_item))
FLOAT = LayerStorage("float", lambda request, name: None,          # never asked: what no other kind picks
                     lambda i, o, per_item, _: (VectorLinear if per_item else Linear)(i, o))
