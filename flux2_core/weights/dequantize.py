"""Quantised checkpoints: the format of each quantized layer, and float8 weights dequantized to float32.

ComfyUI's quantized files name each layer's format (``.comfy_quant`` or ``_quantization_metadata``); ``comfy_formats``
hands each to ``storage.formats.read_layer``, which refuses a format no storage here runs before anything is read. An
unnamed format is known by a tensor it has (BFL's nvfp4: ``.weight_scale_2``). ``.input_scale`` is dropped:
activations are quantized per token.
"""

from __future__ import annotations

import json

import torch

from ..errors import Flux2Error
from ..storage.formats import known_by, read_layer, stored_format
from ..storage.packed import dequantize_nvfp4 as _dequantize_nvfp4
from ..storage.stored_format import LayerFile, LayerFormat
from .checkpoint import Checkpoint, TensorInfo, read_tensor, short

UNSUPPORTED_SUFFIXES = {".qweight": "GPTQ/AWQ", ".qzeros": "GPTQ/AWQ", ".g_idx": "GPTQ", ".SCB": "bitsandbytes int8",
                        ".absmax": "bitsandbytes", ".quant_map": "bitsandbytes",
                        ".quant_state.bitsandbytes__nf4": "bitsandbytes nf4",
                        ".quant_state.bitsandbytes__fp4": "bitsandbytes fp4"}


def comfy_formats(ckpt: Checkpoint, prefix: str) -> dict[str, LayerFormat]:
    """Layer key (prefix stripped) -> its format. Refuses GPTQ, bitsandbytes and formats no storage here runs."""
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
    marked = known_by()           # formats a file may store without naming them (BFL's nvfp4: by its global scale)
    for key in keys:
        layer, _, tensor = key.rpartition(".")
        if tensor in marked and layer not in objects:
            objects[layer] = {"format": marked[tensor].names[0]}
    return {k[len(prefix):]: layer_format(ckpt, k, v) for k, v in objects.items() if k.startswith(prefix)}


def layer_format(ckpt: Checkpoint, layer: str, spec: object) -> LayerFormat:
    """One layer's format object (or its bare name) -> LayerFormat, checked against its tensors' headers."""
    spec = spec if isinstance(spec, dict) else {"format": spec}
    spec = {**spec.get("params", {}), **spec} if isinstance(spec.get("params"), dict) else spec   # older nesting
    fmt = stored_format(spec.get("format"))
    infos = {name: ckpt.tensors.get(f"{layer}.{name}") for name in (fmt.tensors if fmt else ())}
    infos = {name: info for name, info in infos.items() if info is not None}
    return read_layer(LayerFile(spec.get("format"), spec, {n: tuple(i.shape) for n, i in infos.items()},
                                {n: i.dtype for n, i in infos.items()}, f"{ckpt.path}: layer {layer}", short))


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
