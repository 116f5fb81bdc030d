"""The format a weight file stores one layer in, as ComfyUI's quantized files name it: each layer's ``.comfy_quant``
tensor (the bytes of a JSON object, ``{"format": "int8_tensorwise", "convrot": true, ...}``) or an entry of the file's
``_quantization_metadata`` header; BFL's own nvfp4 files (no such object) are named here "nvfp4_modelopt".

``FORMATS`` maps every format name we run to its ``Format``: the storage that keeps it as stored and the tensors it
stores for a layer, each with the dtypes its writers store it in and, for a scale, the values they write. A name not
in it is refused; so is a tensor in another dtype (its bytes would mean something else) and a scale no quantizer
writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .quant import SCALE_SUFFIXES

E8M0_NAN = 255          # the one E8M0 code that is no power of two


@dataclass(frozen=True)
class ScaleRule:
    """The values a quantizer writes in a scale: finite and positive (each clamps its amax above zero)."""
    zero: bool = False          # a block's scale: 0 where the block was all zero (or is padding)
    exponents: bool = False     # E8M0 codes, 2^(code - 127): every code is a power of two but E8M0_NAN

    def count_bad(self, scale: Tensor) -> int:
        """How many values of ``scale`` (in its file dtype, or widened to float32) no quantizer writes."""
        if self.exponents:
            return int((scale.view(torch.uint8) == E8M0_NAN).sum())
        values = scale.float()
        low = values < 0 if self.zero else values <= 0
        return int((low | ~torch.isfinite(values)).sum())

    def bad(self) -> str:
        return "NaN (E8M0 code 255)" if self.exponents else f"negative{'' if self.zero else ', zero'}, NaN or infinite"


@dataclass(frozen=True)
class StoredTensor:
    """One tensor a format stores for a layer."""
    dtypes: tuple[str, ...]             # the safetensors dtype codes its writers store it in
    scale: ScaleRule | None = None      # None: codes, whose every value means something


@dataclass(frozen=True)
class Format:
    storage: str                                         # the storage kind that keeps it (see FORMATS)
    tensors: dict[str, StoredTensor] = field(default_factory=dict)   # by name after the layer's ("weight", ...)


# uint8 holding float8 bytes is how some of ComfyUI's files store float8 values (read as the float8 they hold)
FP8_E4M3 = ("F8_E4M3", "U8")
INT8 = StoredTensor(("I8",))
# a float32 scale may be stored in 16 bits (widened exactly as it is read)
FLOAT_SCALES = ("F32", "BF16", "F16")
SCALE = StoredTensor(FLOAT_SCALES, ScaleRule())
BLOCK_SCALE = StoredTensor(FLOAT_SCALES, ScaleRule(zero=True))


def _fp8(weight: tuple[str, ...]) -> Format:
    """Float8 weights with an optional per-tensor or per-row scale, under any scale name the fp8 reader takes."""
    return Format("fp8", {"weight": StoredTensor(weight)} | {s.removeprefix("."): SCALE for s in SCALE_SUFFIXES})


# packed E2M1 pairs, e4m3 scales per 16 values (zero for an all-zero block and for the tiles' padding), a global scale
NVFP4 = Format("nvfp4", {"weight": StoredTensor(("U8",)), "weight_scale": StoredTensor(FP8_E4M3, ScaleRule(zero=True)),
                         "weight_scale_2": SCALE})

# format name -> Format. Storage kinds: "fp8" (storage.quant.Fp8Linear: per-tensor or per-row scale), "int8"
# (storage.int8.Int8Linear: per-tensor or per-row scale, optionally ConvRot), "blocks" (int8 or fp8 with a scale per
# 2-D block, storage.packed.BlockScaledLinear), "nvfp4", "mxfp8", "w4a4" (storage.packed)
FORMATS = {
    "float8_e4m3fn": _fp8(FP8_E4M3), "float8_e5m2": _fp8(("F8_E5M2", "U8")), "float8_e4m3fn_rowwise": _fp8(FP8_E4M3),
    "float8_e4m3fn_blockwise": Format("blocks", {"weight": StoredTensor(FP8_E4M3), "weight_scale": BLOCK_SCALE}),
    "int8_blockwise": Format("blocks", {"weight": INT8, "weight_scale": BLOCK_SCALE}),
    "int8_tensorwise": Format("int8", {"weight": INT8, "weight_scale": SCALE}),
    "nvfp4": NVFP4, "nvfp4_modelopt": NVFP4,
    "mxfp8": Format("mxfp8", {"weight": StoredTensor(FP8_E4M3),
                              "weight_scale": StoredTensor(("F8_E8M0", "U8"), ScaleRule(exponents=True))}),
    "convrot_w4a4": Format("w4a4", {"weight": INT8, "weight_scale": SCALE}),     # two int4 a byte, a scale per row
}
# the block size of the 2-D block formats where a file's object gives none (the converter's defaults)
DEFAULT_BLOCKS = {"float8_e4m3fn_blockwise": 64, "int8_blockwise": 128}
W4A4_GROUP = 64            # comfy-kitchen's only int4 quantization group


@dataclass(frozen=True)
class LayerFormat:
    name: str                    # a key of FORMATS
    rotation: int = 0            # ConvRot group (a power of 4); 0: none
    block: int = 0               # the "blocks" formats: the side of a block
    per_row: bool = True         # int8: a scale per output row, else one per tensor

    @property
    def storage(self) -> str:
        return FORMATS[self.name].storage

    @property
    def tensors(self) -> dict[str, StoredTensor]:
        return FORMATS[self.name].tensors

    def describe(self) -> str:
        return self.name + (f" with ConvRot (group {self.rotation})" if self.rotation else "")
