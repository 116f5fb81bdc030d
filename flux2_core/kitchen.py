"""comfy-kitchen (ComfyUI's own kernel library, in every ComfyUI install) where it helps, plain torch where it does
not: each op is taken from it only when the package, the op and a backend worth using are there; otherwise the
plain torch path runs and the log says once why.

    available(op)   None when comfy-kitchen has ``op``, else why not (logged once per op)

Its dispatch picks a backend per call (CUDA kernels on NVIDIA GPUs, Triton, or its eager reference in plain torch);
the choice of whether to call it at all is each caller's (``storage/int8.py``: the W8A8 matmul).
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger("flux2_klein")

try:
    import comfy_kitchen as ck
    MISSING = ""
except ImportError as error:                   # not installed, or its own imports fail (it needs `packaging`)
    ck, MISSING = None, str(error)


def backends() -> dict[str, bool]:
    """comfy-kitchen's backends by name, True where available ({} without the package)."""
    if ck is None:
        return {}
    return {name: bool(info.get("available")) and not info.get("disabled") for name, info in ck.list_backends().items()}


@functools.cache
def available(op: str) -> str | None:
    """None when comfy-kitchen has ``op``, else the reason (logged once)."""
    if ck is None:
        reason = f"comfy-kitchen is not importable ({MISSING}); pip install comfy-kitchen packaging"
    elif not hasattr(ck, op):
        reason = f"this comfy-kitchen ({getattr(ck, '__version__', 'unknown version')}) has no {op}; update it"
    else:
        return None
    log.info("FLUX.2 Klein: %s runs in plain torch: %s", op, reason)
    return reason


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ (weight [N, K] int8 · weight_scale [N])ᵀ with x quantized per token to int8 (dynamic W8A8),
    in x's dtype."""
    return ck.int8_linear(x, weight, weight_scale, out_dtype=x.dtype)
