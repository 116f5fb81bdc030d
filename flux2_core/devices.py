"""The one rule for the dtype a device computes in, and the dtype a 16-bit file's weights are kept in.

bf16 where the device multiplies it fast, fp16 where only fp16 is (Volta / Turing), else float32: a CPU without bf16
instructions runs a bf16 matmul 5-7x slower. A 16-bit file stays 16-bit under a wider compute dtype.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .errors import Flux2Error

SIXTEEN_BIT = (torch.bfloat16, torch.float16)
# NVIDIA Turing cards without fp16 tensor cores, whose fp16 results ComfyUI also refuses (black images)
NO_FP16 = ("1660", "1650", "1630", "T500", "T550", "T600", "MX550", "MX450", "CMP 30HX", "T2000", "T1000", "T1200")

# oneDNN can be capped to an instruction set by env var; the caps below bf16 dot products, and below AVX-512 VNNI
# (torch does not report AVX2_VNNI, so it counts as none)
ONEDNN_ISA_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
ONEDNN_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")
ONEDNN_WITHOUT_VNNI = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE")
# on an AMX CPU, bf16 attention below torch's AVX-512 kernel build raises ("pack_vnni2 is only supported ...")
ATEN_AVX512 = "AVX512"


@dataclass(frozen=True)
class CpuFlags:
    """The CPU instructions the rules below weigh, as torch reads them."""
    amx: bool                      # AMX tiles: bf16 and int8 dot products (Intel Sapphire Rapids on)
    avx512_bf16: bool              # AVX-512 BF16 (AMD Zen 4 / 5, Intel Cooper Lake on)
    vnni: bool                     # AVX-512 VNNI, 8-bit dot products: torch then gives int8 matmuls to oneDNN
    aten: str                      # the build of torch's own kernels in use: AVX512, AVX2 or DEFAULT on x86


def cpu_flags() -> CpuFlags:
    """The one place the CPU's instructions, and the build of torch's kernels that uses them, are read."""
    amx = torch.cpu._is_amx_tile_supported()
    return CpuFlags(amx, torch.cpu._is_avx512_bf16_supported(), amx or torch.cpu._is_vnni_supported(),
                    torch.backends.cpu.get_cpu_capability())


@dataclass(frozen=True)
class ComputeDtype:
    dtype: torch.dtype
    why: str                       # for the log and the PNG metadata

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def compute_dtype(device: torch.device | str, fp16: bool = True) -> ComputeDtype:
    """``fp16``: the model is safe in float16 (FLUX.2's transformer is, with its clamps; a text encoder may not be)."""
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda(device, fp16)
    if device.type == "mps":
        new = torch.backends.mps.is_macos_or_newer(14, 0)
        if new or fp16:
            return ComputeDtype(torch.bfloat16 if new else torch.float16, f"Apple GPU on macOS {'14+' if new else '< 14'}")
    if device.type == "xpu" and torch.xpu.is_bf16_supported():
        return ComputeDtype(torch.bfloat16, "Intel GPU with bf16")
    if device.type == "cpu":
        off = cpu_bf16_off()
        return ComputeDtype(torch.float32, off) if off else ComputeDtype(torch.bfloat16, cpu_bf16())
    return ComputeDtype(torch.float32, f"{device.type} device")


def model_dtype(device: torch.device | str, supported: Sequence[torch.dtype],
                host: torch.dtype | None = None) -> ComputeDtype:
    """A transformer's compute dtype: the host's choice where ``supported``, else what the device computes fast."""
    blocked = (cpu_bf16_attention_fails() if host == torch.bfloat16 and torch.device(device).type == "cpu"
               else "")
    if host is not None and host in supported and not blocked:
        return ComputeDtype(host, "the host's choice")
    pick = compute_dtype(device)
    if pick.dtype in supported:
        return pick
    second = compute_dtype(device, fp16=False)
    return ComputeDtype(second.dtype if second.dtype in supported else torch.float32,
                        f"{pick.why}, but this model does not run in {pick.name}")


# the names users write for a compute dtype
DTYPE_NAMES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
               "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}
COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def dtype_named(value: torch.dtype | str | None) -> torch.dtype | None:
    """A torch dtype or a ``DTYPE_NAMES`` name (any case) -> the torch dtype; None or "auto": None (device's choice)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    if isinstance(value, torch.dtype) and value in COMPUTE_DTYPES:
        return value
    if isinstance(value, str) and value.strip().lower() in DTYPE_NAMES:
        return DTYPE_NAMES[value.strip().lower()]
    raise Flux2Error(f"dtype {value!r} is not a compute dtype: use auto, bfloat16 (bf16), float16 (fp16) or float32 "
                     f"(fp32), as a name or a torch dtype")


def check_model_dtype(dtype: torch.dtype, supported: Sequence[torch.dtype], model: str) -> torch.dtype:
    """A compute dtype asked for by name, refused where activations can overflow (black pictures)."""
    if dtype not in supported:
        names = " or ".join(str(d).removeprefix("torch.") for d in supported)
        raise Flux2Error(f"{model} runs in {names}, not in {str(dtype).removeprefix('torch.')}: pick {names}, or auto "
                         f"(the fastest of them on this device)")
    return dtype


def _cuda(device: torch.device, fp16: bool) -> ComputeDtype:
    props = torch.cuda.get_device_properties(device)
    card = f"{props.name} (compute capability {props.major}.{props.minor})"
    if torch.version.hip:
        return ComputeDtype(torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16, f"AMD GPU {card}")
    if props.major >= 8:
        return ComputeDtype(torch.bfloat16, f"{card} runs bf16 fast")
    if props.major == 7 and fp16 and not any(name in props.name for name in NO_FP16):
        return ComputeDtype(torch.float16, f"{card} runs fp16 fast but not bf16")
    return ComputeDtype(torch.float32, f"{card} runs neither bf16 nor fp16 fast")


def onednn_cap() -> tuple[str, str]:
    """(the instruction set oneDNN is held to, upper case; the variable that holds it), or ("", "") where none is."""
    for variable in ONEDNN_ISA_VARIABLES:
        if os.environ.get(variable):
            return os.environ[variable].strip().upper(), variable
    return "", ""


def cpu_bf16_off() -> str:
    """Why this CPU computes in float32 rather than bf16, or "" where bf16 is the faster choice that runs. A lowered
    ATEN_CPU_CAPABILITY leaves matmuls to oneDNN (bf16 still ~2x faster), so it counts only where attention fails."""
    flags = cpu_flags()
    if not (flags.amx or flags.avx512_bf16):
        return "this CPU has no bf16 instructions (AMX or AVX-512 BF16): bf16 would run several times slower than float32"
    isa, variable = onednn_cap()
    if isa in ONEDNN_WITHOUT_BF16:
        return (f"oneDNN is held to {isa} ({variable}), below this CPU's bf16 instructions: bf16 would run several "
                f"times slower than float32")
    blocked = cpu_bf16_attention_fails()
    return f"{blocked}, so bf16 cannot run" if blocked else ""


def cpu_bf16_attention_fails() -> str:
    """Why torch's bf16 attention raises on this CPU, or "" where it runs (``ATEN_AVX512``)."""
    flags = cpu_flags()
    if not flags.amx or flags.aten == ATEN_AVX512:
        return ""
    return (f"torch's bf16 attention on an AMX CPU needs its AVX-512 kernels, and it runs its {flags.aten} ones "
            f"(ATEN_CPU_CAPABILITY picks them)")


def check_cpu_dtype(dtype: torch.dtype) -> torch.dtype:
    """A compute dtype asked for by name on the CPU: refused before anything loads where it cannot run there."""
    blocked = cpu_bf16_attention_fails() if dtype == torch.bfloat16 else ""
    if blocked:
        raise Flux2Error(f"bfloat16 cannot run on this CPU: {blocked}. Unset ATEN_CPU_CAPABILITY (or set it to "
                         f"avx512), or compute in float32 (--dtype float32, or auto)")
    return dtype


def cpu_bf16() -> str:
    """Why this CPU computes bf16 fast, or "" where it does not (``cpu_bf16_off``)."""
    if cpu_bf16_off():
        return ""
    return f"this CPU has {'AMX' if cpu_flags().amx else 'AVX-512 BF16'} instructions"


def cpu_int8() -> str:
    """Why this CPU multiplies int8 fast and exactly, or "": without VNNI / AMX the integer matmul measured 60x slower
    than float32."""
    flags = cpu_flags()
    if not flags.vnni or cpu_int8_saturates():
        return ""
    return f"this CPU has {'AMX' if flags.amx else 'VNNI'} instructions"


def cpu_int8_saturates() -> str:
    """Why ``torch._int_mm`` returns wrong sums here, or "" where they are exact: on a VNNI CPU torch hands it to
    oneDNN, which held below VNNI uses AVX2's 8-bit pair products that saturate at 16 bits."""
    isa, variable = onednn_cap()
    if not cpu_flags().vnni or isa not in ONEDNN_WITHOUT_VNNI:
        return ""
    return (f"oneDNN is held to {isa} ({variable}), where its int8 sums overflow 16 bits; unset {variable} or "
            f"set it to AVX512_CORE_VNNI or later")


def kept_dtype(file_dtype: torch.dtype | None, compute: torch.dtype) -> torch.dtype:
    """The file's own 16-bit dtype where the compute dtype is wider (cast per layer as it runs), else compute."""
    return file_dtype if file_dtype in SIXTEEN_BIT and compute.itemsize > file_dtype.itemsize else compute


def pin_vector_width() -> None:
    """Before a CPU compile: names inductor's vector width (the one it picks anyway) so its cache keys kernels by it.
    ATEN_CPU_CAPABILITY changes the instructions a kernel is built for but not the key, so a kernel cached by a run
    with another setting came back as a C++ error, wrong values or a crash."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    if config.cpp.simdlen is None:
        width = pick_vec_isa().bit_width()          # 0: no vector instructions (ATEN_CPU_CAPABILITY=default)
        if width:
            config.cpp.simdlen = width
