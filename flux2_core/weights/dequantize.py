"""Quantised checkpoints: the format of each quantized layer, and float8 weights dequantized to float32.

ComfyUI's quantized files name each layer's format (``.comfy_quant`` or ``_quantization_metadata``; older
``scaled_fp8`` files: ``.scale_weight``): ``comfy_formats`` reads them into ``storage.layer_format.LayerFormat`` and
refuses a format no storage here runs, naming it and the layer, before anything is read, as it refuses a tensor of
the layer in a dtype its format does not store (``check_dtypes``). BFL's own fp8 (per-row
``.weight_scale`` [N]) and nvfp4 (``.weight_scale_2``), Hugging Face block fp8 (``.weight_scale_inv``) and unscaled
float8 need no such object. ``.input_scale`` (a static activation scale) is dropped: activations are quantized per
token where a kernel quantizes them at all.
"""

from __future__ import annotations

import json
import math

import torch

from ..errors import Flux2Error
from ..storage.layer_format import DEFAULT_BLOCKS, FORMATS, W4A4_GROUP, LayerFormat
from ..storage.packed import dequantize_nvfp4 as _dequantize_nvfp4
from ..storage.rotation import DEFAULT_GROUP, is_power_of_4
from .checkpoint import Checkpoint, TensorInfo, read_tensor, short

# ---------------------------------------------------------------------------------------------------------------
# Quantised weights
# ---------------------------------------------------------------------------------------------------------------

UNSUPPORTED_SUFFIXES = {".qweight": "GPTQ/AWQ", ".qzeros": "GPTQ/AWQ", ".g_idx": "GPTQ", ".SCB": "bitsandbytes int8",
                        ".absmax": "bitsandbytes", ".quant_map": "bitsandbytes",
                        ".quant_state.bitsandbytes__nf4": "bitsandbytes nf4",
                        ".quant_state.bitsandbytes__fp4": "bitsandbytes fp4"}
COMFY_FP8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
             "float8_e4m3fn_rowwise": torch.float8_e4m3fn}
PACKED_INPUTS = {"nvfp4": 2, "w4a4": 2}          # stored columns per input: two 4-bit values a byte


def comfy_formats(ckpt: Checkpoint, prefix: str) -> dict[str, LayerFormat]:
    """Layer key (prefix stripped) -> its format. Refuses other tools' quantisations (GPTQ, bitsandbytes) and the
    formats no storage here runs."""
    keys = [k for k in ckpt.tensors if k.startswith(prefix)]
    for key in keys:
        for suffix, tool in UNSUPPORTED_SUFFIXES.items():
            if key.endswith(suffix):
                raise Flux2Error(f"{ckpt.path} is quantised with {tool} ({key}), which is not supported; use the "
                                 f"bf16 or fp8 .safetensors release of these weights")
    objects: dict[str, object] = {}
    meta = ckpt.metadata.get("_quantization_metadata")
    if meta:
        layers = _json_object(meta, f"{ckpt.path}: its _quantization_metadata").get("layers", {})
        if not isinstance(layers, dict):
            raise Flux2Error(f"{ckpt.path}: the layers of its _quantization_metadata are {short(layers)}, not a JSON "
                             f"object; the file is corrupt, download it again")
        objects.update(layers)
    for key in keys:
        if key.endswith(".comfy_quant"):
            objects[key[: -len(".comfy_quant")]] = _comfy_quant(ckpt, key)
    for key in keys:                                  # BFL's (ModelOpt's) nvfp4: a global scale, no format object
        layer = key.removesuffix(".weight_scale_2")
        if key.endswith(".weight_scale_2") and layer not in objects:
            objects[layer] = {"format": "nvfp4_modelopt"}
    return {k[len(prefix):]: layer_format(ckpt, k, v) for k, v in objects.items() if k.startswith(prefix)}


def layer_format(ckpt: Checkpoint, layer: str, spec: object) -> LayerFormat:
    """One layer's format object (or, in older headers, its bare name) -> LayerFormat, checked against its tensors."""
    spec = spec if isinstance(spec, dict) else {"format": spec}
    spec = {**spec.get("params", {}), **spec} if isinstance(spec.get("params"), dict) else spec   # older nesting
    name = spec.get("format")
    where = f"{ckpt.path}: layer {layer}"
    if not isinstance(name, str) or name not in FORMATS:
        raise Flux2Error(f"{where} uses the quantisation format {short(name)}, which cannot be loaded here; "
                         f"supported are bf16/fp16/fp32 files and these formats: {', '.join(sorted(FORMATS))}")
    storage = FORMATS[name].storage
    weight = ckpt.tensors.get(layer + ".weight")
    if spec.get("convrot") and storage not in ("int8", "w4a4"):
        raise Flux2Error(f"{where} is {name} with ConvRot, which this pack runs for int8 and W4A4 only")
    check_dtypes(ckpt, layer, name)
    if storage == "fp8":                               # storage.quant reads and checks these itself
        return LayerFormat(name)
    if weight is None or len(weight.shape) != 2:
        raise Flux2Error(f"{where} says it is {name} but has no 2-D weight ({short(weight and weight.shape)}); the "
                         f"file is corrupt, download it again")
    inputs = weight.shape[1] * PACKED_INPUTS.get(storage, 1)
    rotation = 0
    if spec.get("convrot") or storage == "w4a4":
        rotation = _whole(spec.get("convrot_groupsize", DEFAULT_GROUP), where, "convrot_groupsize")
        if not is_power_of_4(rotation) or inputs % rotation:
            raise Flux2Error(f"{where} is {name} with a ConvRot group of {rotation}, which is not a power of 4 that "
                             f"divides its {inputs} inputs; the file is corrupt, download it again")
    if storage == "w4a4" and (_whole(spec.get("quant_group_size", W4A4_GROUP), where, "quant_group_size")
                              != W4A4_GROUP or inputs % W4A4_GROUP):
        raise Flux2Error(f"{where} is W4A4 with a quantization group of {spec.get('quant_group_size', W4A4_GROUP)} "
                         f"over {inputs} inputs; only {W4A4_GROUP} (comfy-kitchen's), dividing the inputs, can be run")
    block = _whole(spec.get("group_size", DEFAULT_BLOCKS[name]), where, "group_size") if storage == "blocks" else 0
    scale = ckpt.tensors.get(layer + ".weight_scale")
    per_row = scale is not None and math.prod(scale.shape) == weight.shape[0] > 1
    if storage == "int8" and scale is None:
        raise Flux2Error(f"{where} is int8 but has no weight_scale; the file is corrupt or was cut, download it again")
    if storage == "int8" and math.prod(scale.shape) not in (1, weight.shape[0]):
        raise Flux2Error(f"{where} is int8 with a scale of shape {list(scale.shape)}; expected one per tensor or one "
                         f"per row ({weight.shape[0]}); the file is corrupt, download it again")
    return LayerFormat(name, rotation, block, per_row)


def check_dtypes(ckpt: Checkpoint, layer: str, name: str) -> None:
    """Each tensor of the layer the file holds in a dtype its format stores it in, from the header, before any byte is
    read: a tensor of the same item size in another dtype would be taken at its bytes (an int32 scale read as float32
    bits, fp8 bytes as int8 codes)."""
    for tensor, stored in FORMATS[name].tensors.items():
        info = ckpt.tensors.get(f"{layer}.{tensor}")
        if info is not None and info.dtype not in stored.dtypes:
            raise Flux2Error(f"{ckpt.path}: layer {layer} is {name}, which stores its {tensor} as "
                             f"{', '.join(stored.dtypes[:-1])}{' or ' if len(stored.dtypes) > 1 else ''}{stored.dtypes[-1]}, but this file has it as {info.dtype}; the file is damaged "
                             f"or was written wrongly, download it again or use another release of these weights")


def _whole(value: object, where: str, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise Flux2Error(f"{where}: its {what} is {short(value)}, not a positive whole number; the file is corrupt, "
                         f"download it again")
    return value


def _comfy_quant(ckpt: Checkpoint, key: str) -> dict:
    """The bytes of a JSON object, stored as uint8 [n]."""
    info = ckpt.tensors[key]
    if info.dtype not in ("U8", "I8") or len(info.shape) != 1:
        raise Flux2Error(f"{ckpt.path}: {key} is {info.dtype} {list(info.shape)}, not the bytes of JSON text (U8 [n]); "
                         f"the file is corrupt, download it again")
    return _json_object(_read_small(info).numpy().tobytes(), f"{ckpt.path}: {key}")


def _json_object(text: str | bytes, where: str) -> dict:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):    # JSONDecodeError, UnicodeDecodeError, over-long ints
        value = None
    if not isinstance(value, dict):
        raise Flux2Error(f"{where} is not a JSON object; the file is corrupt, download it again")
    return value


def _read_small(info: TensorInfo) -> torch.Tensor:
    with open(info.file, "rb") as f:
        return read_tensor(info, f)


def dequantize(weight: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int]) -> torch.Tensor:
    """float8 weight [N, K] (or any shape for a per-tensor scale) -> float32 weight * scale.

    scale: None or one number (per tensor), [N] or [N, 1] (per row), or [ceil(N/bn), ceil(K/bk)] (per block).
    """
    w = weight.float()
    if scale is None or scale.numel() == 1:
        return w if scale is None else w * scale.float().reshape(())
    scale = scale.float()
    if scale.numel() == w.shape[0]:
        return w * scale.reshape(-1, *([1] * (w.ndim - 1)))
    if w.ndim == 2 and scale.ndim == 2 and scale.shape == (-(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])):
        full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        return w * full[: w.shape[0], : w.shape[1]]
    raise Flux2Error(f"a float8 weight {list(w.shape)} has a scale of shape {list(scale.shape)}, which is not a known "
                     f"quantisation (per tensor, per row or per {block[0]}x{block[1]} block)")


def dequantize_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """BFL's (ModelOpt's) nvfp4: packed E2M1 codes [N, K/2] (even element in the low nibble), float8 scales [N, K/16]
    -> float32."""
    try:
        return _dequantize_nvfp4(packed, block_scale, global_scale, swizzled=False)
    except ValueError as e:
        raise Flux2Error(str(e)) from None
