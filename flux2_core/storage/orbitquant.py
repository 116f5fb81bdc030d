"""OrbitQuant's packed formats, dequantized at each call where orbitquant's own kernels don't run.

OrbitQuant rows are rotated by RPBH (seeded permutation, ±1 signs, Hadamard per block / sqrt(B)) and stored as a norm x
a codebook level per value, so x·Wᵀ = (x·R)·(W·R)ᵀ. The dequantized path does not quantize activations.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from .linear import item_by_item, linear
from .packed import DequantizedLinear
from .stored_format import FLOAT_SCALES, LayerFile, LayerFormat, ScaleRule, StoredFormat, StoredTensor
from .w4 import need

BITS = (2, 3, 4, 6, 8)          # the widths orbitquant writes
RTN_GROUP = 64                  # its modulation layers' group


def unpack_codes(packed: Tensor, bits: int, inputs: int) -> Tensor:
    """uint8 [N, inputs·bits/8], codes packed lowest bit first -> int32 [N, inputs]. Rows start on a byte."""
    rows = packed.shape[0]
    if 8 % bits == 0:                                  # whole codes in a byte: a shift per field
        fields = [(packed >> (i * bits)) & ((1 << bits) - 1) for i in range(8 // bits)]
        return torch.stack(fields, dim=-1).reshape(rows, inputs).int()
    # 3 and 6 bits: 8 codes in 3 bytes (4 in 3 at 6 bits) read as one 24-bit number, low byte first
    triples = packed.reshape(rows, -1, 3).int()
    word = triples[..., 0] | (triples[..., 1] << 8) | (triples[..., 2] << 16)
    shifts = torch.arange(0, 24, bits, device=packed.device, dtype=torch.int32)
    return ((word[..., None] >> shifts) & ((1 << bits) - 1)).reshape(rows, inputs)


def hadamard_blocks(x: Tensor, block: int) -> Tensor:
    """x [..., K] -> each block of ``block`` inputs times the unscaled Sylvester Hadamard matrix."""
    shape = x.shape
    y = x.reshape(-1, block)
    half = 1
    while half < block:
        pairs = y.reshape(-1, block // (2 * half), 2, half)
        first, second = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((first + second, first - second), dim=2).reshape(-1, block)
        half *= 2
    return y.reshape(shape)


def rotate(x: Tensor, order: Tensor, signs: Tensor, block: int) -> Tensor:
    """x [..., K] -> x·R: permuted, signed, Hadamard over each block, / sqrt(block)."""
    turned = x.index_select(-1, order.to(x.device)) * signs.to(x.device, x.dtype)
    return hadamard_blocks(turned, block) * block ** -0.5


def rotate_back(x: Tensor, order: Tensor, signs: Tensor, block: int) -> Tensor:
    """x·Rᵀ (R's inverse): what turns rows stored in the rotated basis back."""
    turned = hadamard_blocks(x, block) * block ** -0.5 * signs.to(x.device, x.dtype)
    return torch.empty_like(turned).index_copy_(-1, order.to(x.device), turned)


@functools.cache
def orbitquant_module():
    """orbitquant where it is installed, else None; its kernel auto-fetch is off unless the user set it."""
    os.environ.setdefault("ORBITQUANT_KERNELS_AUTOFETCH", "0")
    try:
        import orbitquant
    except ImportError:
        return None
    return orbitquant


def kernels_run(device: torch.device) -> bool:
    """Whether orbitquant's own layers run the calls on ``device``: an NVIDIA GPU, orbitquant installed."""
    return device.type == "cuda" and orbitquant_module() is not None


class OrbitLinear(DequantizedLinear):
    """``weight`` uint8 [N, K·bits/8], ``weight_norms`` [N], ``weight_levels`` [2^bits], ``weight_order`` [K],
    ``weight_signs`` [K]. orbitquant's layer is kept outside the module's state, so it is neither saved nor moved."""

    kind = "orbitquant"
    work_bytes = 14             # the int32 codes, the levels they pick and the scaled rows in float32 (measured)

    def __init__(self, in_features: int, out_features: int, bits: int, block: int, norms: torch.dtype,
                 item_by_item: bool = False, device=None):
        super().__init__(in_features, out_features, item_by_item)
        self.bits, self.block = bits, block
        self.register_buffer("weight", torch.empty(out_features, in_features * bits // 8, dtype=torch.uint8,
                                                   device=device))
        self.register_buffer("weight_norms", torch.empty(out_features, dtype=norms, device=device))
        self.register_buffer("weight_levels", torch.empty(1 << bits, device=device))
        self.register_buffer("weight_order", torch.empty(in_features, dtype=torch.int64, device=device))
        self.register_buffer("weight_signs", torch.empty(in_features, dtype=torch.int8, device=device))
        self.kernel_on = False
        self.settings: dict = {}                 # the artifact's quantization settings, for orbitquant's layer
        object.__setattr__(self, "_kernel", (None, None))    # (the device it was made on, orbitquant's layer)

    def stored_tensors(self) -> tuple[Tensor, ...]:
        return self.weight, self.weight_norms, self.weight_levels, self.weight_order, self.weight_signs

    def rotated(self, device) -> Tensor:
        """float32 [N, K]: the weight in the rotated basis, norm x level[code]."""
        codes = unpack_codes(self.weight.to(device), self.bits, self.in_features)
        levels = self.weight_levels.to(device).float()[codes]
        return levels * self.weight_norms.to(device).float()[:, None]

    def dequantized(self, device) -> Tensor:
        return rotate_back(self.rotated(device), self.weight_order, self.weight_signs, self.block)

    def forward(self, x: Tensor) -> Tensor:
        if self.weight_patch is not None:
            return super().forward(x)
        if self.kernel_on:
            return self.kernel()(x)
        weight = self.rotated(x.device).to(x.dtype)
        turned = rotate(x.float(), self.weight_order, self.weight_signs, self.block).to(x.dtype)
        return item_by_item(lambda item: linear(item, weight), turned) if self.item_by_item else linear(turned, weight)

    def kernel(self):
        """orbitquant's layer over the codes and norms where they are now (a host may swap them: streamed weights)."""
        device, layer = self._kernel
        if layer is None or device != self.weight.device:
            layer = kernel_layer(self)
            object.__setattr__(self, "_kernel", (self.weight.device, layer))
        elif layer.packed_weight_indices.data_ptr() != self.weight.data_ptr():
            layer.packed_weight_indices.data = self.weight.reshape(-1)
            layer.row_norms.data = self.weight_norms.to(torch.bfloat16)
            layer.clear_dequantized_cache()
        return layer

    def _apply(self, fn, recurse: bool = True):
        object.__setattr__(self, "_kernel", (None, None))     # a move: the old layer must not keep the old tensors
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", {self.bits} bits, RPBH block {self.block}" + (
            ", orbitquant's kernels" if self.kernel_on else "")


class Int4GroupLinear(DequantizedLinear):
    """``weight`` uint8 [N, G·64/2] (low nibble first), ``weight_scale`` [N, G] bf16: weight = (code - 8) x scale."""

    kind = "int4 RTN"
    work_bytes = 6              # the codes and their scaled values (measured)

    def __init__(self, in_features: int, out_features: int, group: int, item_by_item: bool = False, device=None):
        super().__init__(in_features, out_features, item_by_item)
        self.group = group
        groups = -(-in_features // group)
        self.register_buffer("weight", torch.empty(out_features, groups * group // 2, dtype=torch.uint8,
                                                   device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, groups, dtype=torch.bfloat16, device=device))

    def stored_tensors(self) -> tuple[Tensor, ...]:
        return self.weight, self.weight_scale

    def dequantized(self, device) -> Tensor:
        codes = unpack_codes(self.weight.to(device), 4, self.weight.shape[1] * 2).float() - 8
        scales = self.weight_scale.to(device).float()
        values = codes.reshape(self.out_features, -1, self.group) * scales[..., None]
        return values.reshape(self.out_features, -1)[:, : self.in_features]


# Orbitquant's kernels

def kernel_layer(layer: OrbitLinear):
    """orbitquant's ``OrbitQuantLinear`` over views of ``layer``'s codes and norms."""
    oq = orbitquant_module()
    settings = dict(layer.settings, weight_bits=layer.bits, runtime_mode=layer.settings.get("runtime_mode", "auto_fused"))
    config = oq.OrbitQuantConfig.from_dict(settings)
    kernel = oq.OrbitQuantLinear(in_features=layer.in_features, out_features=layer.out_features, config=config,
                                 module_name="", source_weight_layout="linear",
                                 bias=None, packed_weight_indices=layer.weight.reshape(-1),
                                 row_norms=layer.weight_norms.to(torch.bfloat16), debug_weight=None)
    return kernel


def same_transform(layer: OrbitLinear, kernel) -> bool:
    """Whether the rotation and codebook orbitquant rebuilds from the settings are the artifact's own."""
    return (torch.equal(kernel.rotation.permutation, layer.weight_order.cpu())
            and torch.equal(kernel.rotation.signs, layer.weight_signs.cpu())
            and torch.equal(kernel.weight_codebook.centroids.float(), layer.weight_levels.float().cpu()))


def use_orbitquant_kernels(model: torch.nn.Module, device, dtype: torch.dtype, asked: dict) -> dict:
    """``StoredFormat.matmul``: orbitquant's kernels where they rebuild the artifact's rotation and codebook."""
    layers = [m for m in model.modules() if isinstance(m, OrbitLinear)]
    if not layers:
        return {}
    device = torch.device(device)
    on, why = kernels_run(device), ""
    if on:
        firsts = {(m.in_features, m.bits): m for m in reversed(layers)}
        differ = [m for m in firsts.values() if not same_transform(m, kernel_layer(m))]
        if differ:
            on, why = False, (f"dequantized: the rotation or codebook orbitquant makes from this artifact's settings "
                              f"is not the one its codes were made in ({differ[0].in_features} inputs)")
    for layer in layers:
        layer.kernel_on = on
    if on:
        note = ("orbitquant matmul: orbitquant's own kernels (activations quantized as the format does; it makes "
                "each width's activation codebook at its first use, minutes at 8 bits, then keeps it on disk)")
    elif why:
        note = f"orbitquant matmul: {why}"
    elif device.type == "cuda":
        note = "orbitquant matmul: dequantized (install orbitquant for its GPU kernels)"
    else:
        note = "orbitquant matmul: dequantized (activations not quantized)"
    return {"orbitquant": (on, note)}


# The formats

@dataclass(frozen=True)
class ValueRule:
    """A ``StoredTensor.scale`` rule for "permutation", "signs" or codebook "levels" tensors."""
    kind: str

    def count_bad(self, values: Tensor) -> int:
        if self.kind == "permutation":
            return int((values.sort().values != torch.arange(values.numel(), device=values.device)).sum())
        if self.kind == "signs":
            return int(((values != 1) & (values != -1)).sum())
        finite = torch.isfinite(values)
        return int((~finite).sum()) + int((values.diff() <= 0).sum())

    def bad(self) -> str:
        return {"permutation": "not a permutation of the inputs (repeated or out of range)",
                "signs": "neither 1 nor -1"}.get(self.kind, "not finite and rising")


# orbitquant's quantization_config.json settings and their valid values
SETTINGS = {"activation_bits": lambda v: v in BITS, "rotation_seed": lambda v: type(v) is int and v >= 0,
            "block_size": lambda v: v == "paper" or (type(v) is int and v > 0 and not v & (v - 1)),
            "codebook_version": lambda v: v in (1, 2), "activation_kernel_backend": lambda v: isinstance(v, str),
            "activation_eps": lambda v: type(v) in (int, float) and 0 < v < 1}

def _read_orbitquant(fmt: StoredFormat, file: LayerFile) -> LayerFormat:
    bits, block = file.whole("bits", 4), file.whole("block", 1)
    if bits not in BITS:
        raise file.corrupt(f"says its codes are {bits} bits, which OrbitQuant never writes ({BITS})")
    rows, cols = file.matrix()
    if (cols * 8) % bits:
        raise file.corrupt(f"has {cols} bytes of {bits}-bit codes a row, which is no whole number of codes")
    inputs = cols * 8 // bits
    if 8 % bits and cols % 3:
        raise file.corrupt(f"has {cols} bytes of {bits}-bit codes a row, not whole groups of 3 bytes")
    if block & (block - 1) or inputs % block:
        raise file.corrupt(f"has an RPBH block of {block}, which is no power of two dividing its {inputs} inputs")
    need(file, "weight_norms", (rows,))
    need(file, "weight_levels", (1 << bits,))
    need(file, "weight_order", (inputs,))
    need(file, "weight_signs", (inputs,))
    norms = {"BF16": torch.bfloat16}.get(file.dtypes["weight_norms"], torch.float32)
    given = file.spec.get("settings", {})
    wrong = [k for k, v in given.items() if k not in SETTINGS or not SETTINGS[k](v)] if isinstance(given, dict) else [
        "settings"]
    if wrong:
        raise file.corrupt(f"has the quantization setting {wrong[0]} = {file.show(given.get(wrong[0], given))}, "
                           f"which orbitquant never writes")
    settings = tuple(sorted(given.items()))
    return LayerFormat(fmt, file.name, block=block, bits=bits, held=(("weight_norms", norms),), options=settings)


def _read_int4(fmt: StoredFormat, file: LayerFile) -> LayerFormat:
    group = file.whole("group_size", RTN_GROUP)
    rows, cols = file.matrix()
    if (2 * cols) % group:
        raise file.corrupt(f"has {2 * cols} 4-bit codes a row, which is no whole number of groups of {group}")
    need(file, "weight_scale", (rows, 2 * cols // group))
    return LayerFormat(fmt, file.name, block=group)


def _orbit_layer(fmt: LayerFormat, inputs: int, rows: int, per_item: bool, device) -> OrbitLinear:
    layer = OrbitLinear(inputs, rows, fmt.bits, fmt.block, dict(fmt.held)["weight_norms"], per_item, device)
    layer.settings = dict(fmt.options)
    return layer


ORBITQUANT_FORMAT = StoredFormat(
    "OrbitQuant", ("orbitquant_rpbh",), OrbitLinear,
    {"weight": StoredTensor(("U8",), rows=True), "weight_norms": StoredTensor(("BF16", "F32"), ScaleRule(), rows=True),
     "weight_levels": StoredTensor(("F32",), ValueRule("levels")),
     "weight_order": StoredTensor(("I64",), ValueRule("permutation")),
     "weight_signs": StoredTensor(("I8",), ValueRule("signs"))},
    torch.uint8, _read_orbitquant, _orbit_layer, matmul=use_orbitquant_kernels)

ORBITQUANT_INT4_FORMAT = StoredFormat(
    "OrbitQuant int4", ("orbitquant_int4_rtn",), Int4GroupLinear,
    {"weight": StoredTensor(("U8",)), "weight_scale": StoredTensor(FLOAT_SCALES[1:2], ScaleRule())},
    torch.uint8, _read_int4,
    lambda fmt, i, o, per_item, device: Int4GroupLinear(i, o, fmt.block, per_item, device), packed_inputs=2)
