"""Small eager computations (GGUF dequantization, fp8 activation quantization) run as one compiled kernel each.
The plain function stays the definition and the fallback: ``FLUX2_NO_FUSED=1``, a missing compiler or any kernel
failure means plain torch on that device type. The first kernel of a process compiles in ~10 s, later ones ~1 s.
"""

from __future__ import annotations

import logging
import os
import time
import types
from collections.abc import Callable

import torch

from ..devices import pin_vector_width

log = logging.getLogger("flux2_klein")

OFF_VARIABLE = "FLUX2_NO_FUSED"


# device type -> None (fused kernels used there) or why not; decided at the first call on that device type
_decided: dict[str, str | None] = {}
# (fn, device) -> its compiled twin; keys whose kernel has run (compiled without error)
_compiled: dict[tuple[Callable, torch.device], Callable] = {}
_proven: set[tuple[Callable, torch.device]] = set()


def unavailable(device_type: str) -> str | None:
    """Why fused kernels are not used on ``device_type`` ("cuda", "cpu", ...), or None when they are (logged once)."""
    if device_type in _decided:
        return _decided[device_type]
    if os.environ.get(OFF_VARIABLE):
        reason = f"turned off ({OFF_VARIABLE} is set)"
    elif device_type == "cuda" and not _has_triton():
        reason = "Triton is not installed (torch.compile's code generator for GPUs); pip install triton"
    elif device_type not in ("cuda", "cpu"):
        reason = f"they are made for CUDA and the CPU, not {device_type}"
    else:
        log.info("FLUX.2 Klein: fused kernels on %s (GGUF dequantization, fp8 activation quantization): each is "
                 "compiled at its first call; %s=1 turns them off", device_type, OFF_VARIABLE)
        reason = None
    if reason:
        log.info("FLUX.2 Klein: fused kernels not used on %s, plain torch instead: %s", device_type, reason)
    _decided[device_type] = reason
    return reason


def _has_triton() -> bool:
    from torch.utils._triton import has_triton

    return has_triton()


def forget() -> None:
    """For tests, or when FLUX2_NO_FUSED changed."""
    _decided.clear()
    _compiled.clear()
    _proven.clear()


def own_code(fn: Callable, name: str) -> Callable:
    """``fn`` under its own code object: dynamo keys graphs and its recompile limit per code object, so closures
    from one ``def`` would share one."""
    names = {"co_name": name, **({"co_qualname": name} if hasattr(fn.__code__, "co_qualname") else {})}  # 3.11+
    code = fn.__code__.replace(**names)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def eager_numerics() -> dict[str, bool]:
    """Inductor options for eager CUDA's rounding (exact division, no flush to zero); free for memory-bound kernels."""
    from torch._inductor import config

    numerics = getattr(config, "eager_numerics", None)
    return {f"eager_numerics.{name}": True for name in ("division_rounding", "disable_ftz") if hasattr(numerics, name)}


def compiled(fn: Callable, device: torch.device) -> Callable:
    """One per device, not device type: dynamo guards on the index, so GPUs would share one recompile limit."""
    key = (fn, device)
    if key not in _compiled:
        name = f"{fn.__name__}_{device.type}{'' if device.index is None else device.index}"
        if device.type == "cpu":
            pin_vector_width()
        _compiled[key] = torch.compile(own_code(fn, name), fullgraph=True, options=eager_numerics())
    return _compiled[key]


def call(fn: Callable[[torch.Tensor], object], x: torch.Tensor, dynamic: tuple[int, ...] = (0,)):
    """``fn(x)``, compiled where allowed. ``fn``'s identity keys the kernel, so it must be module-level or cached;
    ``dynamic``: the dims of x compiled as symbolic sizes."""
    device_type = x.device.type
    # empty x (the 9B-KV reference pass has no text tokens): nothing to gain, and no graph specialized for size 0
    if torch.compiler.is_compiling() or not x.numel() or unavailable(device_type):
        return fn(x)
    key = (fn, x.device)
    for dim in dynamic:
        torch._dynamo.maybe_mark_dynamic(x, dim)
    start = time.perf_counter()
    try:
        out = compiled(fn, x.device)(x)
    except torch.OutOfMemoryError:
        raise
    # any compile failure: plain torch from now on (an error of fn itself comes again from the plain call)
    except Exception as error:  # noqa: BLE001
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        _decided[device_type] = f"the compiled {fn.__name__} failed ({type(error).__name__}: {first})"
        log.warning("FLUX.2 Klein: fused kernels not used on %s from now on, plain torch instead: %s", device_type,
                    _decided[device_type])
        return fn(x)
    if key not in _proven:
        _proven.add(key)
        log.info("FLUX.2 Klein: %s compiled for %s in %.1f s", fn.__name__, x.device, time.perf_counter() - start)
    return out
