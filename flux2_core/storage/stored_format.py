"""``StoredFormat``: the facts of a format a weight file keeps a layer in (ComfyUI's ``.comfy_quant`` JSON names it).
Loaders ask the format object instead of comparing names; ``LayerFormat`` adds what the file's spec says of a layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..errors import Flux2Error
from .rotation import DEFAULT_GROUP, is_power_of_4

E8M0_NAN = 255          # the one E8M0 code that is no power of two


@dataclass(frozen=True)
class ScaleRule:
    """Valid scale values: a multiplying scale may be zero, a dividing one (SVDQuant's smoothing) must be positive."""
    divides: bool = False       # the activations are divided by it: zero would make them infinite
    exponents: bool = False     # E8M0 codes, 2^(code - 127): every code is a power of two but E8M0_NAN

    def count_bad(self, scale: Tensor) -> int:
        """How many values of ``scale`` (in its file dtype, or widened to float32) no quantizer writes."""
        if self.exponents:
            return int((scale.view(torch.uint8) == E8M0_NAN).sum())
        values = scale.float()
        low = values <= 0 if self.divides else values < 0
        return int((low | ~torch.isfinite(values)).sum())

    def bad(self) -> str:
        return "NaN (E8M0 code 255)" if self.exponents else f"negative{', zero' if self.divides else ''}, NaN or infinite"


@dataclass(frozen=True)
class StoredTensor:
    """One tensor a format stores for a layer."""
    dtypes: tuple[str, ...]             # the safetensors dtype codes its writers store it in
    # checked as it is read: anything with ScaleRule's ``count_bad`` and ``bad``; None: codes, every value valid
    scale: ScaleRule | None = None
    # one entry per output row (dim 0), so a layer joined from several of a file's (diffusers' q, k, v) concatenates
    rows: bool = False


# some of ComfyUI's files store float8 values as uint8 bytes
FP8_E4M3 = ("F8_E4M3", "U8")
INT8 = StoredTensor(("I8",))
FLOAT_SCALES = ("F32", "BF16", "F16")
SCALE = StoredTensor(FLOAT_SCALES, ScaleRule())
# safetensors code -> torch dtype, for tensors a layer keeps as the file has them (``LayerFormat.held``)
HELD_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F8_E4M3": torch.float8_e4m3fn}


@dataclass(frozen=True)
class LayerFile:
    """One layer as the file's header describes it (spec, shapes, dtypes; no byte read), for a format's ``read``."""
    name: str                                   # the format name the file gives
    spec: dict
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]                      # safetensors dtype codes
    where: str                                  # "<file>: layer <key>", what every message begins with
    show: Callable[[object], str] = repr        # a file's value in a message (the loader's cuts it short)

    def corrupt(self, what: str) -> Flux2Error:
        return Flux2Error(f"{self.where} {what}; the file is corrupt, download it again")

    def whole(self, key: str, default: int) -> int:
        """The spec's ``key``, a positive whole number (``default`` where the spec has none)."""
        value = self.spec.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise Flux2Error(f"{self.where}: its {key} is {self.show(value)}, not a positive whole number; the file is "
                             f"corrupt, download it again")
        return value

    def matrix(self, packed_inputs: int = 1) -> tuple[int, int]:
        """(rows, inputs) of the layer's 2-D weight; ``packed_inputs``: inputs a stored column holds."""
        shape = self.shapes.get("weight")
        if shape is None or len(shape) != 2:
            raise self.corrupt(f"says it is {self.name} but has no 2-D weight ({self.show(shape)})")
        return shape[0], shape[1] * packed_inputs

    def rotation(self, inputs: int) -> int:
        """The spec's ConvRot group (``convrot_groupsize``): a power of 4 dividing ``inputs``."""
        group = self.whole("convrot_groupsize", DEFAULT_GROUP)
        if not is_power_of_4(group) or inputs % group:
            raise self.corrupt(f"is {self.name} with a ConvRot group of {group}, which is not a power of 4 that divides "
                               f"its {inputs} inputs")
        return group

    def scale_count(self, name: str = "weight_scale") -> int | None:
        shape = self.shapes.get(name)
        return None if shape is None else math.prod(shape)


@dataclass(frozen=True, eq=False)
class StoredFormat:
    """One stored format. A format is one layout: two names for one layout are one format (``float8_e4m3fn`` and
    its ``_rowwise``); one name with two layouts is two (ComfyUI's tiled nvfp4, BFL's plain one)."""
    title: str                                  # as messages name it ("int8", "W4A4")
    names: tuple[str, ...]                      # the names files give it
    storage: type[nn.Module]                    # the class that holds a layer in it
    tensors: dict[str, StoredTensor]            # what it stores for a layer, by name after the layer's ("weight", ...)
    weight_dtype: torch.dtype                   # what the weight's codes are (uint8 files of float8 are read as it)
    # the spec and the header's tensors checked -> the layer's format; None: a 2-D weight, nothing else read
    read: Callable[[StoredFormat, LayerFile], LayerFormat] | None = None
    # (layer format, in_features, out_features, per_item, device) -> the layer; None: ``fp8_choice`` holds it
    make: Callable[..., nn.Module] | None = None
    packed_inputs: int = 1                      # inputs a stored weight column holds (two 4-bit values a byte: 2)
    rotates: bool = False                       # may be stored in ConvRot's basis
    # the loader's fp8 choice holds it (Fp8Linear, or dequantized with fp8=False) instead of keeping it as stored
    fp8_choice: bool = False
    # a tensor beside a weight that marks this format in a file naming none (BFL's nvfp4)
    known_by: str = ""
    # (model, device, dtype, asked) -> {kind: (runs, note)}: whether its layers multiply in their own format; None: never
    matmul: Callable[..., dict[str, tuple[bool, str]]] | None = None

    @property
    def joins_rows(self) -> bool:
        """Whether a layer may be assembled from several layers of a file as stored (``StoredTensor.rows``)."""
        return any(t.rows for t in self.tensors.values())

    def layer(self, file: LayerFile) -> LayerFormat:
        """``file`` checked (each tensor in a dtype the format stores it in, then the format's own checks)."""
        self.check_dtypes(file)
        if self.read is not None:
            return self.read(self, file)
        if not self.fp8_choice:              # the fp8 choice's reader takes any weight and scale shapes it knows
            file.matrix(self.packed_inputs)
        return LayerFormat(self, file.name)

    def check_dtypes(self, file: LayerFile) -> None:
        """Check each tensor's header dtype: a same-size other dtype would be read at its bytes (int32 as float32)."""
        for tensor, stored in self.tensors.items():
            dtype = file.dtypes.get(tensor)
            if dtype is not None and dtype not in stored.dtypes:
                allowed = (f"{', '.join(stored.dtypes[:-1])}{' or ' if len(stored.dtypes) > 1 else ''}"
                           f"{stored.dtypes[-1]}")
                raise Flux2Error(f"{file.where} is {file.name}, which stores its {tensor} as {allowed}, but this file "
                                 f"has it as {dtype}; the file is damaged or was written wrongly, download it again or "
                                 f"use another release of these weights")

    def dequantize(self, fmt: LayerFormat, state: dict[str, Tensor], rows: int, inputs: int) -> Tensor:
        """A layer's stored tensors -> float32 [rows, inputs], through the layer's ``float_weight``."""
        layer = fmt.linear(inputs, rows, device=state["weight"].device)
        layer.load_state_dict(state, assign=True)
        return layer.float_weight()


@dataclass(frozen=True)
class LayerFormat:
    format: StoredFormat
    name: str                    # the name the file gives it
    rotation: int = 0            # ConvRot group (a power of 4); 0: none
    block: int = 0               # a block format: the side of a block; a grouped one: the inputs a group holds
    per_row: bool = True         # a scale per output row, else one per tensor
    # (name, dtype) of tensors kept as the file holds them, for formats whose tensors vary by file
    held: tuple[tuple[str, torch.dtype], ...] = ()
    rank: int = 0                # a low-rank branch's rank (SVDQuant)
    bits: int = 0                # a code's width where a format's vary by layer (OrbitQuant); 0: packed_inputs says
    # further (name, value) settings the storage keeps (OrbitQuant's, for its kernels)
    options: tuple[tuple[str, object], ...] = ()

    def inputs(self, columns: int) -> int:
        """The inputs a stored weight of ``columns`` columns holds."""
        return columns * 8 // self.bits if self.bits else columns * self.format.packed_inputs

    @property
    def tensors(self) -> dict[str, StoredTensor]:
        return self.format.tensors

    def linear(self, in_features: int, out_features: int, per_item: bool = False, device=None) -> nn.Module:
        """The layer holding a weight [out, in] in this format as the file stores it."""
        return self.format.make(self, in_features, out_features, per_item, device)

    def describe(self) -> str:
        return self.name + (f" with ConvRot (group {self.rotation})" if self.rotation else "")
