"""comfy-kitchen (ComfyUI's kernel library) where it helps: an op is taken from it only on CUDA, eagerly, with a GPU
backend for it; otherwise plain torch runs and the log says once why. ``FLUX2_NO_KITCHEN=1`` turns it off.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger("flux2_klein")


@functools.cache
def _imported() -> tuple[object | None, str]:
    """(the comfy_kitchen module or None, why not). Imported on first use: it imports torch._dynamo (seconds)."""
    try:
        import comfy_kitchen
        return comfy_kitchen, ""
    except ImportError as error:               # not installed, or its own imports fail (it needs `packaging`)
        return None, str(error)


def __getattr__(name: str):
    """``kitchen.ck`` (the module or None) and ``kitchen.MISSING`` (why it is None), imported when first read."""
    if name == "ck":
        return _imported()[0]
    if name == "MISSING":
        return _imported()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def available(op: str) -> str | None:
    if os.environ.get("FLUX2_NO_KITCHEN"):
        reason = "turned off (FLUX2_NO_KITCHEN is set)"
    elif (ck := _imported()[0]) is None:
        reason = f"comfy-kitchen is not importable ({_imported()[1]}); pip install comfy-kitchen packaging"
    elif not hasattr(ck, op):
        reason = f"this comfy-kitchen ({getattr(ck, '__version__', 'unknown version')}) has no {op}; update it"
    else:
        return None
    log.info("FLUX.2 Klein: %s runs in plain torch: %s", op, reason)
    return reason


def forget() -> None:
    """For when its backends or FLUX2_NO_KITCHEN changed in a running process."""
    available.cache_clear()
    _fusing.cache_clear()


def gpu_backends(op: str) -> list[str]:
    ck = _imported()[0]
    if ck is None:
        return []
    return [name for name, info in ck.list_backends().items() if name in ("cuda", "triton")
            and info.get("available") and not info.get("disabled") and op in info.get("capabilities", ())]


@functools.cache
def _fusing(op: str, device_type: str) -> bool:
    # a CPU run never imports the package for these
    if device_type != "cpu" and available(op):
        return False
    if device_type != "cuda":
        reason = "comfy-kitchen's kernels are for GPUs (its CPU code is the same torch ops)"
    elif not gpu_backends(op):
        reason = "comfy-kitchen has no GPU backend for it here (its CUDA build needs CUDA 13; Triton is not installed)"
    else:
        return True
    log.info("FLUX.2 Klein: %s runs in plain torch on %s: %s", op, device_type, reason)
    return False


def fused(x: torch.Tensor, op: str) -> bool:
    return not torch.compiler.is_compiling() and _fusing(op, x.device.type)


def rms_rope(q: torch.Tensor, k: torch.Tensor, q_scale: torch.Tensor, k_scale: torch.Tensor, table: torch.Tensor,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k [B, heads, L, D], then RoPE by a table [B, L, D/2, 2], in one kernel."""
    cos, sin = table.unbind(-1)
    rotation = torch.stack([cos, -sin, sin, cos], dim=-1).unflatten(-1, (2, 2))[:, None]   # [B, 1, L, D/2, 2, 2]
    q, k = _imported()[0].rms_rope(q, k, rotation, q_scale, k_scale, 1e-6)
    return q.to(dtype), k.to(dtype)


def adaln(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(1 + scale) · LayerNorm(x) + shift (no affine, eps 1e-6) in one kernel."""
    return _imported()[0].adaln(x, scale, shift, 1e-6)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, rotation: int = 0) -> torch.Tensor:
    """x [..., K] @ (weight [N, K] int8 · weight_scale [N] or [])ᵀ, dynamic W8A8; ``rotation``: ConvRot group size."""
    return _imported()[0].int8_linear(x, weight, weight_scale, out_dtype=x.dtype, convrot=bool(rotation),
                                      convrot_groupsize=rotation or 256)


def convrot_w4a4_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        rotation: int) -> torch.Tensor:
    """x [..., K] @ the ConvRot W4A4 weight (int8 [N, K/2] packed int4 · weight_scale [N])ᵀ."""
    return _imported()[0].convrot_w4a4_linear(x, weight, weight_scale, convrot_groupsize=rotation)


def w4a8_int8_linear(x: torch.Tensor, weight: torch.Tensor, s_rel: torch.Tensor, s_channel: torch.Tensor,
                     codebook: torch.Tensor | None, correction: torch.Tensor | None, group: int,
                     rotation: int) -> torch.Tensor:
    """x [..., K] @ the grouped W4A8 weight ᵀ (codes [N, K/2], s_rel [N, K/group], s_channel [N], codebook [16] or
    None, correction [K/group, N] or None); x turned by ConvRot and quantized to int8 per token."""
    return _imported()[0].w4a8_int8_linear(x, weight, s_rel, s_channel, codebook=codebook, correction=correction,
                                           group_size=group, convrot_groupsize=rotation, out_dtype=x.dtype)


def svdquant_w4a4_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, proj_down: torch.Tensor,
                         proj_up: torch.Tensor, smooth: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ the SVDQuant weight ᵀ (int4 codes [N, K/2], scales [K/64, N]) plus the low-rank branch
    x @ proj_down [K, R] @ proj_upᵀ [R, N] -> [M, N]."""
    ck = _imported()[0]
    q, scales, low_rank = ck.quantize_svdquant_w4a4(x, smooth=smooth, lora_down=proj_down)
    out = ck.scaled_mm_svdquant_w4a4(act=q, wgt=weight, ascales=scales, wscales=scale, lora_act_in=low_rank,
                                     lora_up=proj_up)
    return out[: x.shape[0]]                       # the activation quantizer pads the rows to 256


def awq_w4a16_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor,
                     group: int) -> torch.Tensor:
    """x [..., K] @ the AWQ weight ((codes [N, K/2] - 8) x scale + zeros, both [K/group, N])ᵀ, x as it is."""
    return _imported()[0].gemv_awq_w4a16(x, weight, scale, zeros, group_size=group)
