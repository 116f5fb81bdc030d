"""A toy stored format, defined here alone, to show that a format is one object and one storage class: registering it
(``storage.formats.register``) is all the engine needs to load a file holding layers in it, run them, stream them and
put LoRAs on them. No engine file names it.

The format: int16 codes with a float32 scale per output row, w ≈ w16 · row_scale, max |w16[row]| = 32767; a file
marks each such layer with a ``.comfy_quant`` object ``{"format": "toy_int16_rowwise"}`` and stores its tensors as
``weight`` (I16 [out, in]) and ``row_scale`` (F32 [out]): a scale name no other format uses.
"""

from __future__ import annotations

import json

import torch
from torch import Tensor, nn

from flux2_core.errors import Flux2Error
from flux2_core.storage.linear import item_by_item, linear
from flux2_core.storage.protocol import StoredLinear
from flux2_core.storage.stored_format import LayerFile, LayerFormat, ScaleRule, StoredFormat, StoredTensor

INT16_MAX = 32767
NAME = "toy_int16_rowwise"


def quantize_int16(weight: Tensor) -> tuple[Tensor, Tensor]:
    """weight [out, in] -> (w16 int16 [out, in], float32 scale [out])."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / INT16_MAX).clamp(min=1e-12)
    return torch.round(w / scale[:, None]).clamp_(-INT16_MAX, INT16_MAX).to(torch.int16), scale


class Int16Linear(nn.Module, StoredLinear):
    """State: ``weight`` int16 [out, in], ``row_scale`` float32 [out]; the weight dequantized at each call. A merge
    quantizes the merged weight again."""

    kind = "toy int16"
    merges_adapters = False

    def __init__(self, in_features: int, out_features: int, item_by_item: bool = False, device=None):
        super().__init__()
        self.in_features, self.out_features, self.item_by_item = in_features, out_features, item_by_item
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int16, device=device))
        self.register_buffer("row_scale", torch.empty(out_features, device=device))

    def float_weight(self, dtype: torch.dtype = torch.float32, device=None) -> Tensor:
        device = device or self.weight.device
        return (self.weight.to(device).float() * self.row_scale.to(device)[:, None]).to(dtype)

    def stored_tensors(self) -> tuple[Tensor, ...]:
        return self.weight, self.row_scale

    def write_weight(self, weight: Tensor) -> None:
        w16, scale = quantize_int16(weight)
        self.weight.copy_(w16)
        self.row_scale.copy_(scale)

    def call_bytes(self, dtype: torch.dtype) -> int:
        return self.in_features * self.out_features * dtype.itemsize

    def forward(self, x: Tensor) -> Tensor:
        weight = self.float_weight(x.dtype, x.device)
        return item_by_item(lambda item: linear(item, weight), x) if self.item_by_item else linear(x, weight)


def _read(fmt: StoredFormat, file: LayerFile) -> LayerFormat:
    rows, _ = file.matrix()
    if file.scale_count("row_scale") != rows:
        raise Flux2Error(f"{file.where} is {file.name} but has no row_scale of {rows} values; the file is corrupt")
    return LayerFormat(fmt, file.name)


TOY_FORMAT = StoredFormat(
    "toy int16", (NAME,), Int16Linear,
    {"weight": StoredTensor(("I16",)), "row_scale": StoredTensor(("F32",), ScaleRule())}, torch.int16, _read,
    lambda f, i, o, per_item, device: Int16Linear(i, o, per_item, device))


def toy_file(state_dict: dict[str, Tensor], layers: list[str]) -> dict[str, Tensor]:
    """``state_dict`` with each ``layer.weight`` in ``layers`` stored in the toy format, marked as ComfyUI marks its
    quantized layers."""
    out = dict(state_dict)
    for layer in layers:
        out[layer + ".weight"], out[layer + ".row_scale"] = quantize_int16(out[layer + ".weight"])
        out[layer + ".comfy_quant"] = torch.tensor(list(json.dumps({"format": NAME}).encode()), dtype=torch.uint8)
    return out


def dequantized(state_dict: dict[str, Tensor], layers: list[str]) -> dict[str, Tensor]:
    """The float state dict a toy file stands for: each toy layer's codes times its row scales, in float32."""
    out = {k: v for k, v in state_dict.items() if not k.endswith((".row_scale", ".comfy_quant"))}
    for layer in layers:
        out[layer + ".weight"] = state_dict[layer + ".weight"].float() * state_dict[layer + ".row_scale"][:, None]
    return out
