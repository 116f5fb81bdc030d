"""The format a weight file stores one layer in, as ComfyUI's quantized files name it: each layer's ``.comfy_quant``
tensor (the bytes of a JSON object, ``{"format": "int8_tensorwise", "convrot": true, ...}``) or an entry of the file's
``_quantization_metadata`` header; BFL's own nvfp4 files (no such object) are named here "nvfp4_modelopt".

``FORMATS`` maps every format name we run to the storage that keeps it as stored; a name not in it is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

# format name -> storage kind: "fp8" (storage.quant.Fp8Linear: per-tensor or per-row scale), "int8"
# (storage.int8.Int8Linear: per-tensor or per-row scale, optionally ConvRot), "blocks" (int8 or fp8 with a scale per
# 2-D block, storage.packed.BlockScaledLinear), "nvfp4", "mxfp8", "w4a4" (storage.packed)
FORMATS = {
    "float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "float8_e4m3fn_rowwise": "fp8",
    "float8_e4m3fn_blockwise": "blocks", "int8_blockwise": "blocks",
    "int8_tensorwise": "int8",
    "nvfp4": "nvfp4", "nvfp4_modelopt": "nvfp4",
    "mxfp8": "mxfp8",
    "convrot_w4a4": "w4a4",
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
        return FORMATS[self.name]

    def describe(self) -> str:
        return self.name + (f" with ConvRot (group {self.rotation})" if self.rotation else "")
