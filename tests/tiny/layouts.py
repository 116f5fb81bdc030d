"""Writers for the file layouts users have, beyond what the tiny model builders write, for loader tests.

    save_prefixed(state_dict, path, "vae.")                     # one file, every key behind a prefix
    sd, meta = comfy_fp8(state_dict, layers)                    # ComfyUI "fp8mixed": per-tensor scales + metadata
    sd = w4_quant(state_dict, layers, "svdquant_w4a4")          # comfy-kitchen's grouped 4-bit formats
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


# comfy-kitchen's grouped 4-bit formats, by the names ComfyUI's files give them -> (its layout class, the name its
# layout's ``Params`` gives the tensor kept in ``scale``)
W4_LAYOUTS = {"asym_w4a8_int8": "AsymW4A8Int8Layout", "svdquant_w4a4": "TensorCoreSVDQuantW4A4Layout",
              "awq_w4a16": "TensorCoreAWQW4A16Layout"}


def convrot_group(inputs: int, target: int = 256) -> int:
    """The largest power of 4 up to ``target`` dividing ``inputs`` (comfy-kitchen's W4A8 needs one dividing K)."""
    group = target
    while inputs % group:
        group //= 4
    return group


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """int [N, K] codes in [0, 15] (or signed in [-8, 7]) -> int8 [N, K/2], the even input in the low nibble."""
    low, high = codes[:, 0::2].int() & 0x0F, codes[:, 1::2].int() & 0x0F
    return (low | (high << 4)).to(torch.uint8).view(torch.int8)


def svdquant_tensors(weight: torch.Tensor, rank: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """An SVDQuant layer by the format's rules (comfy-kitchen has no quantizer for it: it is calibrated offline):
    a weight-only smoothing s = sqrt(max |w| per input), the top ``rank`` singular directions as the low-rank branch,
    the rest times s quantized to signed int4 [-7, 7] with a scale per 64 inputs."""
    n, k = weight.shape
    smooth = weight.abs().amax(dim=0).sqrt().clamp(min=1e-2)
    u, s, vh = torch.linalg.svd(weight, full_matrices=False)
    up, down = (u[:, :rank] * s[:rank]).to(dtype), vh[:rank].t().to(dtype)                # [N, R], [K, R]
    residual = ((weight - up.float() @ down.float().t()) * smooth.to(dtype).float()).reshape(n, k // 64, 64)
    scale = (residual.abs().amax(dim=-1) / 7).clamp(min=1e-8).to(dtype)                       # [N, K/64]
    codes = (residual / scale.float()[..., None]).round().clamp(-7, 7).reshape(n, k)
    return {"": pack_nibbles(codes), "_scale": scale.t().contiguous(), "_proj_down": down.contiguous(),
            "_proj_up": up.contiguous(), "_smooth_factor": smooth.to(dtype)}


def awq_tensors(weight: torch.Tensor, group: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """An AWQ layer (comfy-kitchen has no quantizer for it): per group of ``group`` inputs, codes in [0, 15] between
    the group's min and max, its weight (code - 8) x scale + zero, so zero = min + 8 x scale."""
    n, k = weight.shape
    groups = weight.reshape(n, k // group, group)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15).clamp(min=1e-8).to(dtype)
    zeros = (low + 8 * scale.float()).to(dtype)
    codes = ((groups - low[..., None]) / scale.float()[..., None]).round().clamp(0, 15).reshape(n, k)
    return {"": pack_nibbles(codes), "_scale": scale.t().contiguous(), "_zeros": zeros.t().contiguous()}


def w4_quant(state_dict: dict[str, torch.Tensor], layers: list[str], kind: str, dtype: torch.dtype = torch.float32,
             rank: int = 4, **options) -> dict[str, torch.Tensor]:
    """ComfyUI's layout of comfy-kitchen's grouped 4-bit formats: each ``layer.weight`` in ``layers`` in ``kind``
    (a ``W4_LAYOUTS`` name), its tensors under the names comfy-kitchen's layout saves them by
    (``state_dict_tensors``), its ``.comfy_quant`` object as ComfyUI's files give it. W4A8 by comfy-kitchen's own
    quantizer (``options``: its quantize options; the ConvRot group the largest power of 4 up to 256 dividing the
    inputs); SVDQuant and AWQ, which comfy-kitchen cannot quantize, by ``svdquant_tensors`` / ``awq_tensors`` with
    their small tensors in ``dtype``."""
    from comfy_kitchen.tensor import get_layout_class

    layout = get_layout_class(W4_LAYOUTS[kind])
    out = dict(state_dict)
    for layer in layers:
        weight = out.pop(layer + ".weight").float()
        inputs = weight.shape[1]
        if kind == "asym_w4a8_int8":
            group, rotation = options.get("group_size", 16), convrot_group(inputs)
            qdata, params = layout.quantize(weight, **(options | {"convrot_groupsize": rotation}))
            tensors = layout.state_dict_tensors(qdata, params)
            spec = {"format": kind, "group_size": group, "convrot": True, "convrot_groupsize": rotation}
        elif kind == "svdquant_w4a4":
            tensors = svdquant_tensors(weight, rank, dtype)
            spec = {"format": kind, "group_size": 64, "rank": rank, "act_unsigned": False}
        else:
            group = next(g for g in (64, 32, 16) if inputs % g == 0)
            tensors = awq_tensors(weight, group, dtype)
            spec = {"format": kind, "group_size": group}
        for suffix, tensor in tensors.items():
            out[f"{layer}.weight{suffix}"] = tensor.contiguous()
        out[layer + ".comfy_quant"] = torch.tensor(list(json.dumps(spec).encode()), dtype=torch.uint8)
    return out


def w4_weight(sd: dict, layer: str, kind: str, dtype: torch.dtype = torch.float32):
    """The layer ``w4_quant`` wrote, as ComfyUI holds it: a comfy-kitchen QuantizedTensor of its tensors, its
    original dtype ``dtype``."""
    from comfy_kitchen.tensor import QuantizedTensor, get_layout_class

    layout = get_layout_class(W4_LAYOUTS[kind])
    spec = json.loads(bytes(sd[layer + ".comfy_quant"].tolist()))
    qdata = sd[layer + ".weight"]
    shape = (qdata.shape[0], qdata.shape[1] * 2)
    if kind == "asym_w4a8_int8":
        params = layout.Params(scale=sd[layer + ".weight_s_rel"], s_channel=sd[layer + ".weight_s_channel"],
                               correction=sd.get(layer + ".weight_correction"),
                               codebook=sd.get(layer + ".weight_codebook"), orig_dtype=dtype, orig_shape=shape,
                               group_size=spec["group_size"], convrot_groupsize=spec["convrot_groupsize"])
    elif kind == "svdquant_w4a4":
        params = layout.Params(scale=sd[layer + ".weight_scale"], orig_dtype=dtype, orig_shape=shape,
                               proj_down=sd[layer + ".weight_proj_down"], proj_up=sd[layer + ".weight_proj_up"],
                               smooth_factor=sd[layer + ".weight_smooth_factor"])
    else:
        params = layout.Params(scale=sd[layer + ".weight_scale"], zeros=sd[layer + ".weight_zeros"],
                               orig_dtype=dtype, orig_shape=shape, group_size=spec["group_size"])
    return QuantizedTensor(qdata, W4_LAYOUTS[kind], params)


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
