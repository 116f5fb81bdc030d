"""Writers for the file layouts users have, beyond what the tiny model builders write, for loader tests.

    save_prefixed(state_dict, path, "vae.")                     # one file, every key behind a prefix
    sd, meta = comfy_fp8(state_dict, layers)                    # ComfyUI "fp8mixed": per-tensor scales + metadata
    write_sparse_safetensors(path, shapes)                      # a real-size file whose data is all zero and sparse
    write_pickle_checkpoint(path, marker)                       # a pickle that would create ``marker`` if unpickled
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch
from safetensors.torch import save_file

FP8_MAX = 448.0     # largest float8_e4m3fn value


def save_prefixed(state_dict: dict[str, torch.Tensor], path: str | Path, prefix: str = "",
                  metadata: dict[str, str] | None = None) -> Path:
    """Write ``state_dict`` as one safetensors file with ``prefix`` before every key."""
    save_file({prefix + k: v.contiguous() for k, v in state_dict.items()}, str(path), metadata=metadata)
    return Path(path)


def comfy_fp8(state_dict: dict[str, torch.Tensor], layers: list[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """ComfyUI's mixed-precision layout: each ``layer.weight`` in ``layers`` becomes float8_e4m3fn with a per-tensor
    float32 ``layer.weight_scale`` (absmax / 448) and an ``input_scale``; the rest stays as it is. Returns the tensors
    and the safetensors metadata with ``_quantization_metadata`` (format from ComfyUI's QUANTIZATION.md)."""
    out = dict(state_dict)
    for layer in layers:
        weight = out.pop(layer + ".weight").float()
        scale = weight.abs().max() / FP8_MAX
        out[layer + ".weight"] = (weight / scale).to(torch.float8_e4m3fn)
        out[layer + ".weight_scale"] = scale.reshape(())
        out[layer + ".input_scale"] = torch.tensor(1.0)
    return out, comfy_fp8_metadata(layers)


def comfy_fp8_metadata(layers: list[str]) -> dict[str, str]:
    """The safetensors metadata naming ``layers`` as float8_e4m3fn (ComfyUI's ``_quantization_metadata``)."""
    meta = {"format_version": "1.0", "layers": {layer: {"format": "float8_e4m3fn"} for layer in layers}}
    return {"_quantization_metadata": json.dumps(meta)}


# ComfyUI's format names -> (comfy-kitchen's layout class, its quantize options)
KITCHEN_LAYOUTS = {
    "int8_tensorwise": ("TensorWiseINT8Layout", {}),
    "int8_rowwise": ("TensorWiseINT8Layout", {"per_channel": True}),
    "int8_convrot": ("TensorWiseINT8Layout", {"per_channel": True, "convrot": True}),
    "nvfp4": ("TensorCoreNVFP4Layout", {}),
    "mxfp8": ("TensorCoreMXFP8Layout", {}),
    "convrot_w4a4": ("TensorCoreConvRotW4A4Layout", {}),
}


def comfy_quant(state_dict: dict[str, torch.Tensor], layers: list[str], kind: str, rotation: int = 0
                ) -> dict[str, torch.Tensor]:
    """ComfyUI's quantized layout written by comfy-kitchen itself: each ``layer.weight`` in ``layers`` quantized by
    the layout ``KITCHEN_LAYOUTS[kind]`` names, its tensors saved under the layout's own state-dict names, and its
    ``.comfy_quant`` JSON object (format, ConvRot group) as ComfyUI reads it. ``rotation``: the ConvRot group."""
    from comfy_kitchen.tensor import get_layout_class

    layout_name, options = KITCHEN_LAYOUTS[kind]
    layout = get_layout_class(layout_name)
    fmt = {"int8_rowwise": "int8_tensorwise", "int8_convrot": "int8_tensorwise"}.get(kind, kind)
    out = dict(state_dict)
    for layer in layers:
        weight = out.pop(layer + ".weight").float()
        group = rotation
        while group and weight.shape[1] % group:             # a narrower layer: the largest power of 4 that fits
            group //= 4
        extra = {"convrot_groupsize": group} if rotation else {}
        qdata, params = layout.quantize(weight, **options, **extra)
        for suffix, tensor in layout.state_dict_tensors(qdata, params).items():
            out[f"{layer}.weight{suffix}"] = tensor.contiguous()
        spec = {"format": fmt} | ({"convrot": True, "convrot_groupsize": group} if rotation else {})
        out[layer + ".comfy_quant"] = torch.tensor(list(json.dumps(spec).encode()), dtype=torch.uint8)
    return out


def kitchen_weight(sd: dict, layer: str, kind: str):
    """The layer ``comfy_quant`` wrote, as ComfyUI holds it: a comfy-kitchen QuantizedTensor of its tensors (float32
    as the original)."""
    from comfy_kitchen.tensor import QuantizedTensor, get_layout_class

    layout_name, _options = KITCHEN_LAYOUTS[kind]
    layout = get_layout_class(layout_name)
    qdata, scale = sd[layer + ".weight"], sd[layer + ".weight_scale"]
    spec = json.loads(bytes(sd[layer + ".comfy_quant"].tolist()))
    if kind == "nvfp4":
        params = layout.Params(scale=sd[layer + ".weight_scale_2"], block_scale=scale, orig_dtype=torch.float32,
                               orig_shape=(qdata.shape[0], qdata.shape[1] * 2))
    elif kind == "convrot_w4a4":
        params = layout.Params(scale=scale, orig_dtype=torch.float32, orig_shape=(qdata.shape[0], qdata.shape[1] * 2),
                               convrot_groupsize=spec["convrot_groupsize"])
    elif kind == "mxfp8":
        params = layout.Params(scale=scale, orig_dtype=torch.float32, orig_shape=tuple(qdata.shape))
    else:
        params = layout.Params(scale=scale, orig_dtype=torch.float32, orig_shape=tuple(qdata.shape),
                               convrot=bool(spec.get("convrot")), convrot_groupsize=spec.get("convrot_groupsize", 256))
    return QuantizedTensor(qdata, layout_name, params)


def write_sparse_safetensors(path: str | Path, shapes: dict[str, tuple[int, ...]], dtype: str = "BF16") -> Path:
    """A valid safetensors file with these tensors, all zero; the data is a hole in the file, so this is instant
    and takes no disk space even for billions of parameters. For tests that only read headers."""
    size = {"BF16": 2, "F32": 4, "F8_E4M3": 1}[dtype]
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = size * int(torch.tensor(shape).prod().item()) if shape else size
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return Path(path)


class _CreatesMarker:
    """Unpickling this object creates the marker file: proof that a loader ran pickle code."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def write_pickle_checkpoint(path: str | Path, marker: str | Path) -> Path:
    """A torch.save checkpoint (zip + pickle) that would create the folder ``marker`` if anyone unpickled it."""
    torch.save({"state_dict": {"img_in.weight": torch.zeros(2, 2)}, "payload": _CreatesMarker(str(marker))}, str(path))
    return Path(path)
