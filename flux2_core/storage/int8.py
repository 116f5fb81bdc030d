"""int8 weights: w ≈ w8 · scale, w8 [out, in] int8, float32 scale [out] per row or [] per tensor (ComfyUI's files hold
either). With ConvRot the stored w8 holds W·Hᵀ per group and each call turns its input by H first.

int8 matmul (W8A8, per-token activations) runs at twice bf16's rate on NVIDIA tensor cores since Turing, with about
1e-2 more relative error per layer; else the weight is cast (exactly) and the scale applied to the output.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import devices, kitchen
from ..errors import Flux2Error
from .linear import item_by_item, linear
from .protocol import StoredLinear, stored_linears
from .request import LayerRequest, LayerStorage
from .rotation import group_for, rotate_input, rotate_weight
from .stored_format import INT8, SCALE, LayerFile, LayerFormat, StoredFormat

INT8_MAX = 127
# int8 tensor cores (torch._int_mm on CUDA) from Turing (sm_75) on
INT8_MATMUL_CAPABILITY = (7, 5)
# On the CPU the integer kernel beats float32 from about 1024 inputs (0.44-0.87x its time; 1.0-1.2x at 512, where
# quantizing the activations costs more than it saves, measured at 1536 tokens); narrower layers stay float
INT8_CPU_MIN_INPUTS = 1024


def quantize_int8(weight: Tensor, per_row: bool = True) -> tuple[Tensor, Tensor]:
    """weight [out, in] -> (w8 [out, in] int8, float32 scale [out] or []), max|w8| = 127 per row / tensor."""
    w = weight.detach().float()
    amax = torch.linalg.vector_norm(w, float("inf"), dim=1 if per_row else None)
    scale = (amax / INT8_MAX).clamp(min=1e-12)
    w8 = torch.round(w / (scale[:, None] if per_row else scale)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return w8, scale


class Int8Linear(nn.Module, StoredLinear):
    """State dict: ``weight``, ``weight_scale``. A merge quantizes the merged weight again (in the same basis)."""

    kind = "int8"
    merges_adapters = False

    def __init__(self, in_features: int, out_features: int, item_by_item: bool = False, device=None,
                 per_row: bool = True, rotation: int = 0):
        super().__init__()
        self.in_features, self.out_features, self.item_by_item = in_features, out_features, item_by_item
        self.per_row, self.rotation = per_row, rotation
        self.int8_matmul = False          # use_int8_matmul
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features if per_row else (), device=device))

    @classmethod
    def from_linear(cls, layer: nn.Module, convrot: bool = False) -> Int8Linear:
        """Quantized per row; with ``convrot`` in ConvRot's basis where a group divides the inputs."""
        rotation = group_for(layer.in_features) if convrot else 0
        out = cls(layer.in_features, layer.out_features, getattr(layer, "item_by_item", False),
                  device=layer.weight.device, rotation=rotation)
        out.weight, out.weight_scale = out.quantized(layer.float_weight())
        return out

    def quantized(self, weight: Tensor) -> tuple[Tensor, Tensor]:
        return quantize_int8(rotate_weight(weight.float(), self.rotation) if self.rotation else weight, self.per_row)

    def read_from(self, file) -> dict[str, Tensor]:
        """A file's int8 as stored, else quantized here (per row) from its values."""
        if file.stored:
            return file.as_stored()
        weight, scale = self.quantized(file.values())
        return {"weight": weight, "weight_scale": scale}

    def forward(self, x: Tensor) -> Tensor:
        return item_by_item(self.matmul, x) if self.item_by_item else self.matmul(x)

    def matmul(self, x: Tensor) -> Tensor:
        if self.int8_matmul:
            return kitchen.int8_linear(x, self.weight, self.weight_scale, self.rotation)
        if self.rotation:
            x = rotate_input(x, self.rotation)
        y = linear(x, self.weight.to(x.dtype))                   # int8 -> bf16 / fp32 is exact (|w8| <= 128)
        return y.mul_(self.weight_scale)                          # per output, multiplied in float32 (as quant.Fp8Linear)

    def float_weight(self, dtype: torch.dtype = torch.float32, device=None) -> Tensor:
        device = device or self.weight.device
        scale = self.weight_scale.to(device)
        weight = self.weight.to(device).float() * (scale[:, None] if self.per_row else scale)
        return (rotate_weight(weight, self.rotation) if self.rotation else weight).to(dtype)

    def stored_tensors(self) -> tuple[Tensor, ...]:
        return self.weight, self.weight_scale

    def write_weight(self, weight: Tensor) -> None:
        w8, scale = self.quantized(weight)
        self.weight.copy_(w8)
        self.weight_scale.copy_(scale)

    def call_bytes(self, dtype: torch.dtype) -> int:
        """With int8 matmul: the transposed int8 copy the integer kernel takes; else the weight in ``dtype``."""
        return self.in_features * self.out_features * (1 if self.int8_matmul else dtype.itemsize)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, int8, per-{'row' if self.per_row else 'tensor'} "
                f"scale" + (f", ConvRot group {self.rotation}" if self.rotation else "")
                + (", int8 matmul" if self.int8_matmul else ""))


def _read_int8(fmt: StoredFormat, file: LayerFile) -> LayerFormat:
    """A 2-D weight, a scale of one value or one a row, the ConvRot group where the spec turns it."""
    rows, inputs = file.matrix()
    rotation = file.rotation(inputs) if file.spec.get("convrot") else 0
    scales = file.scale_count()
    if scales is None:
        raise Flux2Error(f"{file.where} is int8 but has no weight_scale; the file is corrupt or was cut, download it "
                         f"again")
    if scales not in (1, rows):
        raise file.corrupt(f"is int8 with a scale of shape {list(file.shapes['weight_scale'])}; expected one per "
                           f"tensor or one per row ({rows})")
    return LayerFormat(fmt, file.name, rotation, per_row=scales == rows > 1)


# ComfyUI's int8 files: a scale per tensor or per row (the name says tensorwise either way), optionally ConvRot
def int8_matmuls(model: nn.Module, device: torch.device, dtype: torch.dtype, asked: dict) -> dict:
    """The int8 format's ``StoredFormat.matmul``: ``use_int8_matmul`` with the int8 option asked."""
    on, note = use_int8_matmul(model, asked.get("int8", "auto"), device, dtype)
    return {Int8Linear.kind: (on, note)} if note else {}


INT8_FORMAT = StoredFormat(
    "int8", ("int8_tensorwise",), Int8Linear, {"weight": INT8, "weight_scale": SCALE}, torch.int8, _read_int8,
    lambda f, i, o, per_item, device: Int8Linear(i, o, per_item, device, per_row=f.per_row, rotation=f.rotation),
    rotates=True, matmul=int8_matmuls)


def _int8_layer(in_features: int, out_features: int, per_item: bool, kind: str) -> nn.Module:
    rotation = group_for(in_features) if kind == "convrot" else 0
    return Int8Linear(in_features, out_features, item_by_item=per_item, rotation=rotation)


def _keeps_int8(request: LayerRequest, name: str) -> bool:
    fmt = request.file.stored_format(name + ".weight")
    return fmt is not None and fmt.format.storage is Int8Linear and bool(fmt.rotation) == (request.ask.int8 == "convrot")


# int8 made at load (``StorageAsk.int8``): each quantizable layer, per row, plain or in ConvRot's basis
INT8_AT_LOAD = LayerStorage("int8", lambda request, name: request.ask.int8_kind if request.quantizable(name) else None,
                            _int8_layer, _keeps_int8)


def quantize_blocks(model: nn.Module, chosen, convrot: bool = False) -> list[str]:
    """The layers ``chosen(name)`` picks -> ``Int8Linear`` in place; their names. Call after the model's move."""
    names = [n for n, m in stored_linears(model) if m.kind != "int8" and chosen(n)]
    for name in names:
        model.set_submodule(name, Int8Linear.from_linear(model.get_submodule(name), convrot))
    return names


def int8_matmul_blocked(device: torch.device) -> str | None:
    """None with comfy-kitchen on NVIDIA GPUs from Turing on and on CPUs; else why not."""
    device = torch.device(device)
    missing = kitchen.available("int8_linear")
    if missing:
        return missing
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < INT8_MATMUL_CAPABILITY:
            return (f"int8 matmul needs compute capability 7.5 or newer (Turing and later); "
                    f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}")
        return None
    return None if device.type == "cpu" else f"int8 matmul runs on NVIDIA GPUs and CPUs, not on {device.type}"


def int8_matmul_pays(device: torch.device, dtype: torch.dtype) -> str | None:
    """None where it is faster: GPUs, and CPUs with 8-bit dot products in float32 (bf16's float kernel wins)."""
    blocked = int8_matmul_blocked(device)
    if blocked or torch.device(device).type != "cpu":
        return blocked
    if not devices.cpu_int8():
        return "this CPU has no 8-bit dot-product instructions (VNNI, AMX), without which int8 matmuls are slower"
    return None if dtype == torch.float32 else "on the CPU int8 matmul is faster than float32 matmuls only"


def use_int8_matmul(model: nn.Module, choice, device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """``choice``: "auto", True (Flux2Error where it cannot run) or False -> (on, a note, "" without int8 layers).
    Off on a CPU whose int8 sums would saturate, even when asked for."""
    if choice not in ("auto", True, False):
        raise Flux2Error(f"int8 matmul must be 'auto', True or False, got {choice!r}")
    layers = [m for _, m in stored_linears(model) if m.kind == "int8"]
    if choice is True and not layers:
        raise Flux2Error("int8 matmul needs int8 weights: store the blocks in int8 (--int8)")
    if not layers:
        return False, ""                     # nothing to decide: the device is not even asked
    blocked = int8_matmul_blocked(device) if choice is True else None
    if blocked:
        raise Flux2Error(f"cannot use int8 matmul: {blocked}")
    reason = int8_matmul_pays(device, dtype) if choice == "auto" else None
    wrong = devices.cpu_int8_saturates() if torch.device(device).type == "cpu" and choice is not False else ""
    if wrong:                                 # asked for or not: a wrong sum is never the faster path
        reason = f"{'asked for, but ' if choice is True else ''}{wrong}"
    on = not wrong and (choice is True or (choice == "auto" and reason is None))
    narrow_stay = choice == "auto" and torch.device(device).type == "cpu"
    for layer in layers:
        layer.int8_matmul = on and not (narrow_stay and layer.in_features < INT8_CPU_MIN_INPUTS)
    name = str(dtype).removeprefix("torch.")
    narrow = sum(not layer.int8_matmul for layer in layers) if on else 0
    return on, ((f"int8 matmul: on (activations quantized per token)"
                 f"{f'; {narrow} narrow layers compute in {name}, faster there' if narrow else ''}") if on else
                f"int8 matmul: off ({reason or 'turned off'}); the int8 weights compute in {name}")
