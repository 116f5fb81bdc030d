"""Quantised checkpoints: formats recognised, weights dequantized to float32 (``weight.float() * scale``).

ComfyUI fp8 (per-tensor ``.weight_scale``, format in ``_quantization_metadata`` or ``.comfy_quant``; older
``scaled_fp8`` files: ``.scale_weight``), BFL fp8 (per-row ``.weight_scale`` [N]), BFL nvfp4, Hugging Face block fp8
(``.weight_scale_inv``) and unscaled float8. ``.input_scale`` is dropped; any other scheme is refused.
"""

from __future__ import annotations

import json

import torch

from ..errors import Flux2Error
from .checkpoint import Checkpoint, TensorInfo, read_tensor, short

# ---------------------------------------------------------------------------------------------------------------
# Quantised weights
# ---------------------------------------------------------------------------------------------------------------

UNSUPPORTED_SUFFIXES = {".qweight": "GPTQ/AWQ", ".qzeros": "GPTQ/AWQ", ".g_idx": "GPTQ", ".SCB": "bitsandbytes int8",
                        ".absmax": "bitsandbytes", ".quant_map": "bitsandbytes",
                        ".quant_state.bitsandbytes__nf4": "bitsandbytes nf4",
                        ".quant_state.bitsandbytes__fp4": "bitsandbytes fp4"}
COMFY_FP8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)   # nvfp4 codes


def comfy_formats(ckpt: Checkpoint, prefix: str) -> dict[str, str]:
    """Layer key (prefix stripped) -> format. Refuses other tools' quantisations (GPTQ, bitsandbytes)."""
    keys = [k for k in ckpt.tensors if k.startswith(prefix)]
    for key in keys:
        for suffix, tool in UNSUPPORTED_SUFFIXES.items():
            if key.endswith(suffix):
                raise Flux2Error(f"{ckpt.path} is quantised with {tool} ({key}), which is not supported; use the "
                                 f"bf16 or fp8 .safetensors release of these weights")
    formats = {}
    meta = ckpt.metadata.get("_quantization_metadata")
    if meta:
        layers = _json_object(meta, f"{ckpt.path}: its _quantization_metadata").get("layers", {})
        if not isinstance(layers, dict):
            raise Flux2Error(f"{ckpt.path}: the layers of its _quantization_metadata are {short(layers)}, not a JSON "
                             f"object; the file is corrupt, download it again")
        formats.update({k: v.get("format") if isinstance(v, dict) else v for k, v in layers.items()})
    for key in keys:
        if key.endswith(".comfy_quant"):
            formats[key[: -len(".comfy_quant")]] = _comfy_quant(ckpt, key).get("format")
    formats = {k[len(prefix):]: v for k, v in formats.items() if k.startswith(prefix)}
    for layer, fmt in formats.items():
        if not isinstance(fmt, str) or fmt not in COMFY_FP8:
            hint = " (ComfyUI's nvfp4 layout)" if fmt == "nvfp4" else ""
            raise Flux2Error(f"{ckpt.path}: layer {layer} uses the quantisation format {short(fmt)}{hint}, which "
                             f"cannot be loaded here; supported are bf16/fp16/fp32 and fp8 (float8_e4m3fn, "
                             f"float8_e5m2) files")
    return formats


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
    """BFL nvfp4: packed E2M1 codes [N, K/2] (even element in the low nibble), float8 scales [N, K/16] -> float32."""
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)     # [N, K]
    values = torch.tensor(E2M1, device=packed.device)[codes.long()]
    scale = block_scale.float() * global_scale.float()                                          # [N, K/16]
    if scale.shape != (codes.shape[0], codes.shape[1] // 16):
        raise Flux2Error(f"an nvfp4 weight [{codes.shape[0]}, {codes.shape[1]}] has block scales "
                         f"{list(block_scale.shape)}; expected [{codes.shape[0]}, {codes.shape[1] // 16}]")
    return values * scale.repeat_interleave(16, dim=1)
