"""comfy-kitchen's grouped 4-bit formats (W4A8, SVDQuant, AWQ) kept as stored, dequantized at each call where no
kernel multiplies them. Merged adapters patch the dequantized weight (and turn the kernel off).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import kitchen
from ..errors import Flux2Error
from .linear import item_by_item
from .packed import DequantizedLinear
from .rotation import rotate_weight
from .stored_format import (
    FLOAT_SCALES,
    HELD_DTYPES,
    INT8,
    LayerFile,
    LayerFormat,
    ScaleRule,
    StoredFormat,
    StoredTensor,
)

W4A8_GROUP = 16            # comfy-kitchen's default W4A8 group
SVDQUANT_GROUP = 64        # the one group of SVDQuant's int4 kernels
AWQ_GROUP = 64             # AWQ's usual group, where a file names none
# a unit input as SVDQuant's activation quantizer writes it: code 7 x (absmax / 7)
UNIT_CODE = 7.0


def unpack_nibbles(packed: Tensor) -> Tensor:
    """int8 [N, K/2], two 4-bit codes a byte (the even input in the low nibble) -> int64 codes [N, K] in [0, 15]."""
    raw = packed.view(torch.uint8).long()
    return torch.stack([raw & 0x0F, raw >> 4], dim=-1).reshape(packed.shape[0], -1)


def grouped(values: Tensor, group: int) -> Tensor:
    """[N, K] -> [N, K/group, group]."""
    return values.reshape(values.shape[0], -1, group)


class KitchenLinear(DequantizedLinear):
    """A layer comfy-kitchen multiplies in its own format (``op``) given a GPU kernel and no merged adapter."""

    op = ""

    def __init__(self, in_features: int, out_features: int, item_by_item: bool):
        super().__init__(in_features, out_features, item_by_item)
        self.kitchen_matmul = False

    def held(self, names: tuple[str, ...], device) -> tuple[Tensor, ...]:
        return tuple(getattr(self, n) if device is None else getattr(self, n).to(device) for n in names)

    def kitchen_call(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        if self.kitchen_matmul and self.weight_patch is None:
            return item_by_item(self.kitchen_call, x) if self.item_by_item else self.kitchen_call(x)
        return super().forward(x)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", {self.op}" if self.kitchen_matmul else "")


class W4A8Linear(KitchenLinear):
    """``weight`` int8 [N, K/2] (4-bit codes), ``weight_s_rel`` [N, K/group], ``weight_s_channel`` [N], optional
    ``weight_codebook`` [16] (else code - 8) and ``weight_correction`` [K/group, N]; in ConvRot's basis."""

    kind = "w4a8"
    op = "w4a8_int8_linear"
    # bytes per value alive at a dequantization's peak (int64 codes, float32 levels, grid, values, rotated product)
    work_bytes = 24

    def __init__(self, in_features: int, out_features: int, group: int, rotation: int,
                 held: dict[str, torch.dtype], item_by_item: bool = False, device=None):
        super().__init__(in_features, out_features, item_by_item)
        self.group, self.rotation = group, rotation
        groups = in_features // group
        shapes = {"weight_s_rel": (out_features, groups), "weight_s_channel": (out_features,),
                  "weight_codebook": (16,), "weight_correction": (groups, out_features)}
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.int8, device=device))
        for name, dtype in held.items():
            self.register_buffer(name, torch.empty(shapes[name], dtype=dtype, device=device))
        self.names = ("weight", *held)

    def stored_tensors(self) -> tuple[Tensor, ...]:
        return self.held(self.names, None)

    def optional(self, name: str, device) -> Tensor | None:
        return self.held((name,), device)[0] if name in self.names else None

    def dequantized(self, device) -> Tensor:
        weight, s_rel, s_channel = self.held(self.names[:3], device)
        codes = unpack_nibbles(weight)
        codebook = self.optional("weight_codebook", device)
        levels = codebook.float()[codes] if codebook is not None else codes.float() - 8
        # the codes on comfy-kitchen's int8 grid (what its kernels multiply), then the row scale
        grid = (grouped(levels, self.group) * s_rel.float()[..., None]).reshape(codes.shape).round().clamp(-127, 127)
        values = grouped(grid, self.group) * s_channel.float().reshape(-1, 1, 1)
        correction = self.optional("weight_correction", device)
        if correction is not None:
            values = values + correction.float().t()[..., None]
        return rotate_weight(values.reshape(codes.shape), self.rotation)

    def kitchen_call(self, x: Tensor) -> Tensor:
        weight, s_rel, s_channel = self.held(self.names[:3], None)
        return kitchen.w4a8_int8_linear(x, weight, s_rel, s_channel, self.optional("weight_codebook", None),
                                        self.optional("weight_correction", None), self.group, self.rotation)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", group {self.group}, ConvRot group {self.rotation}"


SVDQUANT_NAMES = ("weight", "weight_scale", "weight_proj_down", "weight_proj_up", "weight_smooth_factor")


class SvdQuantLinear(KitchenLinear):
    """int4 ``weight`` [N, K/2], ``weight_scale`` [K/64, N], ``weight_proj_down`` [K, R], ``weight_proj_up`` [N, R],
    ``weight_smooth_factor`` [K]; the weight is codes x scale / smoothing + proj_up @ proj_downᵀ."""

    kind = "svdquant"
    op = "scaled_mm_svdquant_w4a4"
    work_bytes = 28             # the int64 codes, signed and scaled codes, the low-rank product, its sum and the result

    def __init__(self, in_features: int, out_features: int, rank: int, held: dict[str, torch.dtype],
                 item_by_item: bool = False, device=None):
        super().__init__(in_features, out_features, item_by_item)
        shapes = {"weight_scale": (in_features // SVDQUANT_GROUP, out_features),
                  "weight_proj_down": (in_features, rank), "weight_proj_up": (out_features, rank),
                  "weight_smooth_factor": (in_features,)}
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.int8, device=device))
        for name in SVDQUANT_NAMES[1:]:
            self.register_buffer(name, torch.empty(shapes[name], dtype=held[name], device=device))

    def stored_tensors(self) -> tuple[Tensor, ...]:
        return self.held(SVDQUANT_NAMES, None)

    def dequantized(self, device) -> Tensor:
        weight, scale, down, up, smooth = self.held(SVDQUANT_NAMES, device)
        codes = unpack_nibbles(weight)
        signed = torch.where(codes >= 8, codes - 16, codes).float()
        residual = (grouped(signed, SVDQUANT_GROUP) * scale.float().t()[..., None]).reshape(codes.shape)
        # the smoothing's reciprocal rounded as the kernel's activation quantizer does, to match it bit for bit
        unit = UNIT_CODE * ((1.0 / smooth.float()) / UNIT_CODE)
        return unit * residual + (down.float() @ up.float().t()).t()

    def kitchen_call(self, x: Tensor) -> Tensor:
        weight, scale, down, up, smooth = self.held(SVDQUANT_NAMES, None)
        flat = x.reshape(-1, x.shape[-1]).to(scale.dtype)
        out = kitchen.svdquant_w4a4_linear(flat, weight, scale, down, up, smooth)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", rank {self.weight_proj_down.shape[1]}"


AWQ_NAMES = ("weight", "weight_scale", "weight_zeros")


class AwqLinear(KitchenLinear):
    """AWQ W4A16: ``weight`` int8 [N, K/2] (unsigned 4-bit codes), ``weight_scale`` and ``weight_zeros``
    [K/group, N] in the file's float dtype; the weight is (code - 8) x scale + zero."""

    kind = "awq"
    op = "gemv_awq_w4a16"
    work_bytes = 20             # the int64 codes, the centred codes, their scaled values and the result

    def __init__(self, in_features: int, out_features: int, group: int, held: dict[str, torch.dtype],
                 item_by_item: bool = False, device=None):
        super().__init__(in_features, out_features, item_by_item)
        self.group = group
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.int8, device=device))
        for name in AWQ_NAMES[1:]:
            self.register_buffer(name, torch.empty(in_features // group, out_features, dtype=held[name],
                                                   device=device))

    def stored_tensors(self) -> tuple[Tensor, ...]:
        return self.held(AWQ_NAMES, None)

    def dequantized(self, device) -> Tensor:
        weight, scale, zeros = self.held(AWQ_NAMES, device)
        codes = unpack_nibbles(weight)
        # comfy-kitchen's order of operations: its dequantize, bit for bit
        values = (grouped(codes.float(), self.group) - 8.0) * scale.float().t()[..., None]
        return (values + zeros.float().t()[..., None]).reshape(codes.shape)

    def kitchen_call(self, x: Tensor) -> Tensor:
        weight, scale, zeros = self.held(AWQ_NAMES, None)
        return kitchen.awq_w4a16_linear(x.to(scale.dtype), weight, scale, zeros, self.group).to(x.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", group {self.group}"


def use_kitchen_matmul(model: torch.nn.Module, device) -> dict[str, bool]:
    """{kind: whether it multiplies in its own format}: only with a comfy-kitchen GPU kernel."""
    layers = [m for m in model.modules() if isinstance(m, KitchenLinear)]
    device, on = torch.device(device), {}
    for layer in layers:
        if layer.op not in on:
            on[layer.op] = device.type == "cuda" and not kitchen.available(layer.op) and bool(
                kitchen.gpu_backends(layer.op))
        layer.kitchen_matmul = on[layer.op]
    return {layer.kind: on[layer.op] for layer in layers}


def kitchen_note(kind: str, on: bool) -> str:
    return f"{kind} matmul in its own format: {'on' if on else 'off (no GPU kernel here); dequantized'}"


# The formats these layers hold

def need(file: LayerFile, name: str, shape: tuple[int, ...]) -> None:
    """The layer's ``name`` present in ``shape``, else a Flux2Error naming the layer, the format and the tensor."""
    got = file.shapes.get(name)
    if got is None:
        raise Flux2Error(f"{file.where} is {file.name} but has no {name}; the file is corrupt or was cut, download "
                         f"it again")
    if tuple(got) != tuple(shape):
        raise file.corrupt(f"is {file.name}, whose {name} for its weight is {list(shape)}, but the file has "
                           f"{list(got)}")


def held_tensors(file: LayerFile, names: tuple[str, ...]) -> tuple[tuple[str, torch.dtype], ...]:
    """(name, dtype) of each of ``names`` the file holds (dtypes already checked by ``check_dtypes``)."""
    return tuple((n, HELD_DTYPES[file.dtypes[n]]) for n in names if n in file.shapes)


def bad_group(file: LayerFile, group: int, inputs: int, allowed: str) -> Flux2Error:
    return Flux2Error(f"{file.where} is {file.name} with a group_size of {group} over {inputs} inputs; {allowed} can "
                      f"be run")


def _read_w4a8(fmt: StoredFormat, file: LayerFile) -> LayerFormat:
    """4-bit codes only (a 6-bit row is 3K/4 bytes); the group scales give K."""
    rows, cols = file.matrix()
    group = file.whole("group_size", W4A8_GROUP)
    if group < 4 or (16 % group and group % 16):
        raise bad_group(file, group, 2 * cols, "only groups of 4, 8, 16 or a multiple of 16 (comfy-kitchen's)")
    scales = file.shapes.get("weight_s_rel")
    need(file, "weight_s_rel", (rows, scales[1] if scales is not None and len(scales) == 2 else 2 * cols // group))
    inputs = file.shapes["weight_s_rel"][1] * group
    if cols * 8 == inputs * 6:
        raise Flux2Error(f"{file.where} is {file.name} with 6-bit codes (W6A8), which cannot be run here; use its "
                         f"4-bit (W4A8) release")
    if cols * 2 != inputs:
        raise file.corrupt(f"is {file.name} with a weight of {cols} bytes a row and {file.shapes['weight_s_rel'][1]} "
                           f"groups of {group}, which is not 4 bits an input")
    rotation = file.rotation(inputs)
    need(file, "weight_s_channel", (rows,))
    if "weight_codebook" in file.shapes:
        need(file, "weight_codebook", (16,))
    if "weight_correction" in file.shapes:
        need(file, "weight_correction", (inputs // group, rows))
    names = ("weight_s_rel", "weight_s_channel", "weight_codebook", "weight_correction")
    return LayerFormat(fmt, file.name, rotation, block=group, held=held_tensors(file, names))


def _read_svdquant(fmt: StoredFormat, file: LayerFile) -> LayerFormat:
    """comfy-kitchen's natural layout, groups of 64, signed activations (unsigned ones need a bias; ours have none)."""
    if len(file.shapes.get("weight", ())) == 4:
        raise Flux2Error(f"{file.where} is {file.name} in comfy-kitchen's tile-packed layout, which cannot be loaded "
                         f"here; use a file in its natural [N, K/2] layout")
    rows, inputs = file.matrix(fmt.packed_inputs)
    group = file.whole("group_size", SVDQUANT_GROUP)
    if group != SVDQUANT_GROUP or inputs % SVDQUANT_GROUP:
        raise bad_group(file, group, inputs, f"only {SVDQUANT_GROUP} (its kernels'), dividing the inputs,")
    if file.spec.get("act_unsigned"):
        raise Flux2Error(f"{file.where} is {file.name} with unsigned activations (act_unsigned), whose shifted input "
                         f"a bias must take back; the layers of these models have no bias, so this file is not for "
                         f"them")
    down = file.shapes.get("weight_proj_down")
    rank = down[1] if down is not None and len(down) == 2 else 0
    need(file, "weight_scale", (inputs // SVDQUANT_GROUP, rows))
    need(file, "weight_proj_down", (inputs, rank))
    need(file, "weight_proj_up", (rows, rank))
    need(file, "weight_smooth_factor", (inputs,))
    return LayerFormat(fmt, file.name, block=group, rank=rank, held=held_tensors(file, SVDQUANT_NAMES[1:]))


def _read_awq(fmt: StoredFormat, file: LayerFile) -> LayerFormat:
    rows, inputs = file.matrix(fmt.packed_inputs)
    group = file.whole("group_size", AWQ_GROUP)
    if inputs % group or group % 2:
        raise bad_group(file, group, inputs, "only an even group dividing the inputs")
    need(file, "weight_scale", (inputs // group, rows))
    need(file, "weight_zeros", (inputs // group, rows))
    return LayerFormat(fmt, file.name, block=group, held=held_tensors(file, AWQ_NAMES[1:]))


def kitchen_matmuls(model: torch.nn.Module, device, dtype: torch.dtype, asked: dict) -> dict:
    """The grouped 4-bit formats' ``StoredFormat.matmul`` (one rule for the three: ``use_kitchen_matmul``)."""
    return {kind: (on, kitchen_note(kind, on)) for kind, on in use_kitchen_matmul(model, device).items()}


# ComfyUI's name, then comfy-kitchen's operation name, which some files give
W4A8_FORMAT = StoredFormat(
    "W4A8", ("asym_w4a8_int8", "w4a8_int8"), W4A8Linear,
    {"weight": INT8, "weight_s_rel": StoredTensor(("F8_E4M3", "F32"), ScaleRule()),
     "weight_s_channel": StoredTensor(("F32",), ScaleRule()), "weight_codebook": StoredTensor(("F32",)),
     "weight_correction": StoredTensor(FLOAT_SCALES)},
    torch.int8, _read_w4a8,
    lambda f, i, o, per_item, device: W4A8Linear(i, o, f.block, f.rotation, dict(f.held), per_item, device),
    packed_inputs=2, rotates=True, matmul=kitchen_matmuls)

SVDQUANT_FORMAT = StoredFormat(
    "SVDQuant", ("svdquant_w4a4",), SvdQuantLinear,
    {"weight": INT8, "weight_scale": StoredTensor(FLOAT_SCALES, ScaleRule()),
     "weight_proj_down": StoredTensor(FLOAT_SCALES), "weight_proj_up": StoredTensor(FLOAT_SCALES),
     "weight_smooth_factor": StoredTensor(FLOAT_SCALES, ScaleRule(divides=True))},
    torch.int8, _read_svdquant,
    lambda f, i, o, per_item, device: SvdQuantLinear(i, o, f.rank, dict(f.held), per_item, device), packed_inputs=2,
    matmul=kitchen_matmuls)

AWQ_FORMAT = StoredFormat(
    "AWQ", ("awq_w4a16",), AwqLinear,
    {"weight": INT8, "weight_scale": StoredTensor(FLOAT_SCALES, ScaleRule()),
     "weight_zeros": StoredTensor(FLOAT_SCALES)},
    torch.int8, _read_awq,
    lambda f, i, o, per_item, device: AwqLinear(i, o, f.block, dict(f.held), per_item, device), packed_inputs=2,
    matmul=kitchen_matmuls)
