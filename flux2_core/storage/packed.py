"""Weights kept in a file's packed format (nvfp4, mxfp8, 2-D block-scaled int8 / fp8, ConvRot W4A4), dequantized at
each call. State dicts use ComfyUI's names; padding stays until dequantized; adapters patch the dequantized weight.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import kitchen
from ..errors import Flux2Error
from .linear import item_by_item, linear
from .protocol import StoredLinear
from .rotation import rotate_weight
from .stored_format import (
    FP8_E4M3,
    INT8,
    SCALE,
    LayerFile,
    LayerFormat,
    ScaleRule,
    StoredFormat,
    StoredTensor,
)

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)   # fp4 codes
FP4_BLOCK, MX_BLOCK = 16, 32
W4A4_GROUP = 64            # comfy-kitchen's only int4 quantization group


def up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# Codecs

def unswizzle(scales: Tensor, rows: int, cols: int) -> Tensor:
    """Block scales in cuBLAS's tiled layout (128 x 4 tiles stored as 32 x 16: row r at (r % 32, 4 * (r // 32) + c))
    -> [rows, cols]."""
    tiles_r, tiles_c = up(rows, 128) // 128, up(cols, 4) // 4
    tiled = scales.reshape(tiles_r, tiles_c, 32, 4, 4)              # [tile row, tile col, r % 32, r // 32, column]
    plain = tiled.permute(0, 3, 2, 1, 4).reshape(tiles_r * 128, tiles_c * 4)
    return plain[:rows, :cols]


def fp4_values(packed: Tensor, high_first: bool, dtype: torch.dtype = torch.float32) -> Tensor:
    """uint8 [N, K/2], two E2M1 codes a byte -> [N, K]."""
    first, second = (packed >> 4, packed & 0x0F) if high_first else (packed & 0x0F, packed >> 4)
    codes = torch.stack([first, second], dim=-1).reshape(packed.shape[0], -1)
    return torch.tensor(E2M1, dtype=dtype, device=packed.device)[codes.long()]


def dequantize_nvfp4(packed: Tensor, block_scale: Tensor, global_scale: Tensor, swizzled: bool = True) -> Tensor:
    """-> float32 [N, K] (padded). ``swizzled`` (ComfyUI): high nibble first, tiled scales; else BFL's plain [N, K/16]."""
    values = fp4_values(packed, high_first=swizzled)
    rows, blocks = values.shape[0], values.shape[1] // FP4_BLOCK
    scales = unswizzle(block_scale, rows, blocks) if swizzled else block_scale
    if scales.shape != (rows, blocks):
        raise ValueError(f"an nvfp4 weight [{rows}, {values.shape[1]}] has block scales {list(block_scale.shape)}; "
                         f"expected [{rows}, {blocks}]")
    scale = global_scale.float() * scales.float()
    return (values.reshape(rows, blocks, FP4_BLOCK) * scale[..., None]).reshape(values.shape)


def dequantize_mxfp8(weight: Tensor, block_scale: Tensor) -> Tensor:
    """float8 [N, K] with E8M0 scales (2^(e-127), 0 for e = 0) per 32 along K, tiled -> float32 [N, K]."""
    rows, blocks = weight.shape[0], weight.shape[1] // MX_BLOCK
    exponents = unswizzle(block_scale.view(torch.uint8), rows, blocks)
    scale = (exponents.to(torch.int32) << 23).view(torch.float32)            # the exponent field of a float32
    return (weight.float().reshape(rows, blocks, MX_BLOCK) * scale[..., None]).reshape(weight.shape)


def unpack_int4(packed: Tensor) -> Tensor:
    """int8 [N, K/2], two signed nibbles a byte (the first element in the low one) -> int8 [N, K] in [-8, 7]."""
    nibbles = torch.stack([packed & 0x0F, (packed >> 4) & 0x0F], dim=-1).reshape(packed.shape[0], -1)
    return torch.where(nibbles >= 8, nibbles - 16, nibbles).to(torch.int8)


def dequantize_w4a4(packed: Tensor, scale: Tensor, rotation: int) -> Tensor:
    """ConvRot W4A4: signed int4 x a scale per row, turned back from the ConvRot basis -> float32 [N, K]."""
    return rotate_weight(unpack_int4(packed).float() * scale.float().reshape(-1, 1), rotation)


def dequantize_blocks(weight: Tensor, scale: Tensor, block: int) -> Tensor:
    """int8 or float8 [N, K] x a float32 scale per block x block [ceil(N/b), ceil(K/b)] -> float32 [N, K]."""
    rows, cols = weight.shape
    full = scale.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return weight.float() * full


# Layers

class DequantizedLinear(nn.Module, StoredLinear):
    """A bias-free linear [out, in] whose weight ``dequantized`` rebuilds at each call."""

    merges_adapters = False
    # bytes per value a call needs beside its result while it dequantizes (peak measured, 4096 x 4096, bf16)
    work_bytes = 12

    def __init__(self, in_features: int, out_features: int, item_by_item: bool):
        super().__init__()
        self.in_features, self.out_features, self.item_by_item = in_features, out_features, item_by_item
        self.weight_patch = None                  # merge_weight: adapters merged as the weight is dequantized

    def dequantized(self, device) -> Tensor:
        """float32 [out, in]."""
        raise NotImplementedError

    def float_weight(self, dtype: torch.dtype = torch.float32, device=None) -> Tensor:
        weight = self.dequantized(device or self.weight.device)
        return (weight if self.weight_patch is None else self.weight_patch(weight)).to(dtype)

    def merge_weight(self, patch) -> None:
        self.weight_patch = patch

    def unmerge_weight(self) -> None:
        self.weight_patch = None

    def stored(self, device) -> tuple[Tensor, ...]:
        return tuple(t if device is None else t.to(device) for t in self.stored_tensors())

    def call_bytes(self, dtype: torch.dtype) -> int:
        return self.in_features * self.out_features * (self.work_bytes + dtype.itemsize)

    def forward(self, x: Tensor) -> Tensor:
        weight = self.float_weight(x.dtype, x.device)
        return item_by_item(lambda item: linear(item, weight), x) if self.item_by_item else linear(x, weight)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.kind}"


class NvFp4Linear(DequantizedLinear):
    """``weight`` uint8 [N', K'/2] (ComfyUI pads to 16), float8 ``weight_scale``, float32 global ``weight_scale_2``."""

    kind = "nvfp4"
    work_bytes = 14             # the nibbles, their int64 codes, the float32 values and the scaled product

    def __init__(self, in_features: int, out_features: int, item_by_item: bool = False, swizzled: bool = True,
                 device=None):
        super().__init__(in_features, out_features, item_by_item)
        self.swizzled = swizzled
        rows, cols = (up(out_features, 16), up(in_features, 16)) if swizzled else (out_features, in_features)
        scales = (up(rows, 128), up(cols // FP4_BLOCK, 4)) if swizzled else (rows, cols // FP4_BLOCK)
        self.register_buffer("weight", torch.empty(rows, cols // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.empty(scales, dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_scale_2", torch.ones((), device=device))

    def stored_tensors(self) -> tuple[Tensor, ...]:
        return self.weight, self.weight_scale, self.weight_scale_2

    def dequantized(self, device) -> Tensor:
        weight = dequantize_nvfp4(*self.stored(device), swizzled=self.swizzled)
        return weight[: self.out_features, : self.in_features]


class MxFp8Linear(DequantizedLinear):
    """``weight`` float8 e4m3 [N', K'] (padded to 32), ``weight_scale`` E8M0 exponents per 32 (tiled)."""

    kind = "mxfp8"

    def __init__(self, in_features: int, out_features: int, item_by_item: bool = False, device=None):
        super().__init__(in_features, out_features, item_by_item)
        rows, cols = up(out_features, MX_BLOCK), up(in_features, MX_BLOCK)
        self.register_buffer("weight", torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_scale", torch.empty(up(rows, 128), up(cols // MX_BLOCK, 4), dtype=torch.uint8,
                                                         device=device))

    def stored_tensors(self) -> tuple[Tensor, ...]:
        return self.weight, self.weight_scale

    def dequantized(self, device) -> Tensor:
        return dequantize_mxfp8(*self.stored(device))[: self.out_features, : self.in_features]


class BlockScaledLinear(DequantizedLinear):
    """``weight`` int8 or float8 e4m3 [N, K], ``weight_scale`` float32 per block x block."""

    def __init__(self, in_features: int, out_features: int, block: int, dtype: torch.dtype,
                 item_by_item: bool = False, device=None):
        super().__init__(in_features, out_features, item_by_item)
        self.block = block
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.register_buffer("weight_scale", torch.empty(-(-out_features // block), -(-in_features // block),
                                                         device=device))

    @property
    def kind(self) -> str:
        return "int8 blocks" if self.weight.dtype == torch.int8 else "fp8 blocks"

    def stored_tensors(self) -> tuple[Tensor, ...]:
        return self.weight, self.weight_scale

    def dequantized(self, device) -> Tensor:
        return dequantize_blocks(*self.stored(device), self.block)


class W4A4Linear(DequantizedLinear):
    """ConvRot W4A4: ``weight`` int8 [N, K/2] (two signed int4 a byte), ``weight_scale`` float32 [N]."""

    kind = "w4a4"
    work_bytes = 9

    def __init__(self, in_features: int, out_features: int, rotation: int, item_by_item: bool = False, device=None):
        super().__init__(in_features, out_features, item_by_item)
        self.rotation, self.int4_matmul = rotation, False
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, device=device))

    def stored_tensors(self) -> tuple[Tensor, ...]:
        return self.weight, self.weight_scale

    def dequantized(self, device) -> Tensor:
        return dequantize_w4a4(*self.stored(device), self.rotation)

    def forward(self, x: Tensor) -> Tensor:
        if self.int4_matmul and self.weight_patch is None:
            call = lambda item: kitchen.convrot_w4a4_linear(item, self.weight, self.weight_scale, self.rotation)
            return item_by_item(call, x) if self.item_by_item else call(x)
        return super().forward(x)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", ConvRot group {self.rotation}" + (", int4 matmul" if self.int4_matmul else "")


def use_int4_matmul(model: nn.Module, device) -> bool | None:
    """Whether W4A4 layers multiply in int4 (GPU kernel only: the eager code is no faster); None without them."""
    layers = [m for m in model.modules() if isinstance(m, W4A4Linear)]
    if not layers:
        return None
    device = torch.device(device)
    on = device.type == "cuda" and not kitchen.available("convrot_w4a4_linear") and bool(
        kitchen.gpu_backends("convrot_w4a4_linear"))
    for layer in layers:
        layer.int4_matmul = on
    return on


def int4_note(on: bool) -> str:
    return "W4A4 int4 matmul: on" if on else "W4A4 int4 matmul: off (no GPU kernel here); the weights are dequantized"


# The formats these layers hold

# e4m3 block scales are zero for an all-zero block and the tiles' padding
NVFP4_TENSORS = {"weight": StoredTensor(("U8",)), "weight_scale": StoredTensor(FP8_E4M3, ScaleRule()),
                 "weight_scale_2": SCALE}
# ComfyUI's (tiled scales, the first value in the high nibble)
NVFP4_FORMAT = StoredFormat(
    "nvfp4", ("nvfp4",), NvFp4Linear, NVFP4_TENSORS, torch.uint8,
    make=lambda f, i, o, per_item, device: NvFp4Linear(i, o, per_item, swizzled=True, device=device),
    packed_inputs=2)
# BFL's (ModelOpt's) files name no format, so known by the global scale; "nvfp4_modelopt" is our name for it
NVFP4_PLAIN_FORMAT = StoredFormat(
    "nvfp4", ("nvfp4_modelopt",), NvFp4Linear, NVFP4_TENSORS, torch.uint8,
    make=lambda f, i, o, per_item, device: NvFp4Linear(i, o, per_item, swizzled=False, device=device),
    packed_inputs=2, known_by="weight_scale_2")

MXFP8_FORMAT = StoredFormat(
    "mxfp8", ("mxfp8",), MxFp8Linear,
    {"weight": StoredTensor(FP8_E4M3), "weight_scale": StoredTensor(("F8_E8M0", "U8"), ScaleRule(exponents=True))},
    torch.float8_e4m3fn, make=lambda f, i, o, per_item, device: MxFp8Linear(i, o, per_item, device))


def _blocks_format(title: str, name: str, weight: StoredTensor, dtype: torch.dtype, block: int) -> StoredFormat:
    """int8 or fp8 with a float32 scale per 2-D block; ``block``: the default side where the spec has no group_size."""
    def read(fmt: StoredFormat, file: LayerFile) -> LayerFormat:
        file.matrix()
        return LayerFormat(fmt, file.name, block=file.whole("group_size", block))

    return StoredFormat(title, (name,), BlockScaledLinear, {"weight": weight, "weight_scale": SCALE}, dtype,
                        read, lambda f, i, o, per_item, device: BlockScaledLinear(
                            i, o, f.block, f.format.weight_dtype, per_item, device))


INT8_BLOCKS_FORMAT = _blocks_format("int8 blocks", "int8_blockwise", INT8, torch.int8, 128)
FP8_BLOCKS_FORMAT = _blocks_format("fp8 blocks", "float8_e4m3fn_blockwise", StoredTensor(FP8_E4M3),
                                   torch.float8_e4m3fn, 64)


def _read_w4a4(fmt: StoredFormat, file: LayerFile) -> LayerFormat:
    """Always in ConvRot's basis; quantized in comfy-kitchen's one group, which must divide the inputs."""
    _, inputs = file.matrix(fmt.packed_inputs)
    rotation = file.rotation(inputs)
    if file.whole("quant_group_size", W4A4_GROUP) != W4A4_GROUP or inputs % W4A4_GROUP:
        raise Flux2Error(f"{file.where} is W4A4 with a quantization group of "
                         f"{file.spec.get('quant_group_size', W4A4_GROUP)} over {inputs} inputs; only {W4A4_GROUP} "
                         f"(comfy-kitchen's), dividing the inputs, can be run")
    return LayerFormat(fmt, file.name, rotation)


def int4_matmuls(model: nn.Module, device, dtype: torch.dtype, asked: dict) -> dict:
    """W4A4's ``StoredFormat.matmul``: comfy-kitchen's int4 kernel where it has one (``use_int4_matmul``)."""
    on = use_int4_matmul(model, device)
    return {} if on is None else {W4A4Linear.kind: (on, int4_note(on))}


W4A4_FORMAT = StoredFormat(
    "W4A4", ("convrot_w4a4",), W4A4Linear, {"weight": INT8, "weight_scale": SCALE}, torch.int8, _read_w4a4,
    lambda f, i, o, per_item, device: W4A4Linear(i, o, f.rotation, per_item, device), packed_inputs=2, rotates=True,
    matmul=int4_matmuls)
