"""Small eager computations run as one compiled kernel each: torch.compile of a plain torch function, which inductor
turns into one Triton kernel on CUDA (one C++ loop nest on the CPU). The plain function stays the definition and the
fallback; the compiled one computes the same values (the tests compare them bit for bit on the CPU).

    call(fn, x, dynamic=(0,))   fn(x), run as its compiled kernel where fused kernels are on for x's device

Used for what runs at every layer call outside a compiled block: the GGUF blocks' dequantization (``ggml.py``, one
function per type and dtype) and the fp8 activation quantization (``quant.py``). A compiled block (``compile.py``)
needs none of it: inductor fuses the same plain ops there itself, so inside a compiled region ``fn`` runs plain.

Where: on CUDA where Triton is installed (inductor's code generator for GPUs), and on the CPU (inductor writes C++;
it needs a C++ compiler at run time), both by default; a caller may ask for less (``ggml`` takes the CPU's only for
large weights, where it measured faster). ``FLUX2_NO_FUSED=1`` in the environment turns it off. The
log says once per device type whether they are used and why not; each kernel logs its first compile and its time.
Should a kernel fail (no C++ compiler, a Triton error, a recompile past dynamo's limit), that call and every later
one on the device type run plain torch, with a warning that says why.

Cost, bounded: the first call of each function on a device compiles it, with the ``dynamic`` dims symbolic so
that every layer size reuses one graph (two where a dynamic dim is 1: dynamo specializes size 1). On the CPU of this
project's machine that took about 10 s for the first kernel of a process (inductor starting) and about 1 s for each
further one; inductor caches them on disk, so a later process mostly loads them.
"""

from __future__ import annotations

import logging
import os
import time
import types
from collections.abc import Callable

import torch

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
    """Forget the decisions and compiled kernels so far (for tests, or when FLUX2_NO_FUSED changed)."""
    _decided.clear()
    _compiled.clear()
    _proven.clear()


def own_code(fn: Callable, name: str) -> Callable:
    """``fn`` under a new code object named ``name``. Dynamo keeps its compiled graphs, and its recompile limit (8),
    per code object: functions made by one ``def`` (closures over a type or dtype) share theirs, and so would count
    against one limit, and dynamo has been seen to reuse one closure's graph for another."""
    names = {"co_name": name, **({"co_qualname": name} if hasattr(fn.__code__, "co_qualname") else {})}  # 3.11+
    code = fn.__code__.replace(**names)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def eager_numerics() -> dict[str, bool]:
    """Inductor options that make its GPU code round as eager CUDA does, where this torch has them: float32 division
    correctly rounded (Triton's ``/`` is an approximation within 2 ulp) and subnormals kept (not flushed to zero).
    The kernels here are memory-bound, so exact division costs nothing measurable; the CPU's C++ is exact anyway."""
    from torch._inductor import config

    numerics = getattr(config, "eager_numerics", None)
    return {f"eager_numerics.{name}": True for name in ("division_rounding", "disable_ftz") if hasattr(numerics, name)}


def compiled(fn: Callable, device: torch.device) -> Callable:
    """The compiled twin of ``fn`` for ``device`` (made once, compiled at its first call). One per device, not per
    device type: dynamo guards on the device index, so GPUs sharing one code object would share its recompile limit."""
    key = (fn, device)
    if key not in _compiled:
        name = f"{fn.__name__}_{device.type}{'' if device.index is None else device.index}"
        _compiled[key] = torch.compile(own_code(fn, name), fullgraph=True, options=eager_numerics())
    return _compiled[key]


def call(fn: Callable[[torch.Tensor], object], x: torch.Tensor, dynamic: tuple[int, ...] = (0,)):
    """``fn(x)``, as one compiled kernel where fused kernels are on for x's device (``unavailable``), eagerly.

    ``fn`` must be a module-level or cached function (its identity keys the compiled kernel), taking one tensor and
    computing only from it; ``dynamic`` lists the dims of x that vary between calls (compiled as symbolic sizes)."""
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
    # no C++ compiler, a Triton or inductor error, a recompile past dynamo's limit: plain torch from now on (an error
    # of fn itself comes again from the plain call)
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
