"""The one rule for the dtype a device computes in, and the dtype a 16-bit file's weights are kept in.

    compute_dtype(device)   bf16 where the device multiplies it fast (NVIDIA from Ampere, Apple GPUs on macOS 14+,
                            Intel GPUs with bf16, CPUs with AMX or AVX-512 BF16 that oneDNN may use and where torch's
                            bf16 attention runs: ``cpu_bf16_off``); fp16 where bf16 is
                            slow but fp16 is not (NVIDIA Volta / Turing: T4, RTX 20xx); float32 otherwise (CPUs
                            without bf16 instructions run a bf16 matmul 5-7x slower than a float32 one; GTX 10xx / 16xx)
    kept_dtype(file, compute)  a 16-bit file's weights stay 16-bit when the compute dtype is wider: cast per layer as it
                            runs (``storage.linear.CastLinear``), half the memory of float32 for the same values
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

# oneDNN (torch's CPU matmuls and convolutions) may be held to an instruction set and the older ones by an environment
# variable; it reads ONEDNN_MAX_CPU_ISA first, then the older name DNNL_MAX_CPU_ISA, the value in any case. The caps
# below which it has no bf16 dot products (bf16 is then several times slower than float32), and those below AVX-512's
# 8-bit dot products (VNNI; AVX2_VNNI names the VEX form, which torch does not report, so it counts as none).
ONEDNN_ISA_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
ONEDNN_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")
ONEDNN_WITHOUT_VNNI = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE")
# torch's own kernels come in builds (what ``torch.backends.cpu.get_cpu_capability()`` names; ATEN_CPU_CAPABILITY picks
# a lower one). On an AMX CPU its bf16 attention packs the operands for AMX with AVX-512 code only, and below that
# build it raises ("pack_vnni2 is only supported when avx512 is supported", torch 2.13) while bf16 matmuls still run.
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
    """The one rule for a transformer's compute dtype, the command line's and the nodes': ``supported`` are the dtypes
    its family runs in (``Family.dtypes``); the host's choice where it makes one among them (ComfyUI's, which honours
    its --bf16-unet, --fp16-unet and --force-fp32), else what the device computes fast (``compute_dtype``, float16 only
    where the family runs in it), else float32."""
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


# the names users write for a compute dtype, as the command line, the engine's loaders and the nodes take them
DTYPE_NAMES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
               "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}
COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def dtype_named(value: torch.dtype | str | None) -> torch.dtype | None:
    """A compute dtype as given (a torch dtype, or a name in ``DTYPE_NAMES`` in any case) -> the torch dtype; None or
    "auto": None (the device's own choice). Anything else is refused with the names."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    if isinstance(value, torch.dtype) and value in COMPUTE_DTYPES:
        return value
    if isinstance(value, str) and value.strip().lower() in DTYPE_NAMES:
        return DTYPE_NAMES[value.strip().lower()]
    raise Flux2Error(f"dtype {value!r} is not a compute dtype: use auto, bfloat16 (bf16), float16 (fp16) or float32 "
                     f"(fp32), as a name or a torch dtype")


def check_model_dtype(dtype: torch.dtype, supported: Sequence[torch.dtype], model: str) -> torch.dtype:
    """A compute dtype asked for by name: refused where the model (``model``: what messages call it) does not run in it
    (``Family.dtypes``), since its activations can overflow there and the picture come out black."""
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
    """(the instruction set oneDNN is held to, upper case; the variable that holds it), or ("", "") where none is.
    ``ATEN_CPU_CAPABILITY`` is not one: it picks the build of torch's own kernels (``CpuFlags.aten``)."""
    for variable in ONEDNN_ISA_VARIABLES:
        if os.environ.get(variable):
            return os.environ[variable].strip().upper(), variable
    return "", ""


def cpu_bf16_off() -> str:
    """Why this CPU computes in float32 rather than bf16, or "" where bf16 is the faster choice that runs. Without bf16
    instructions (or with oneDNN held below them) bf16 matmuls run several times slower than float32 ones. Torch's
    kernel build (ATEN_CPU_CAPABILITY) leaves the matmuls to oneDNN, bf16 ones about 2x faster than float32 at avx2 on
    an AVX-512 BF16 CPU, so it weighs only where bf16 attention cannot run (``ATEN_AVX512``)."""
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
    """A compute dtype asked for by name on the CPU: refused where it cannot run there (``cpu_bf16_attention_fails``),
    before anything is loaded, rather than failing in the first attention."""
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
    """Why this CPU multiplies int8 fast and exactly, or "" where it does not: without 8-bit dot-product instructions
    (VNNI, AMX) torch's integer matmul takes a generic path (on a 2-core AVX2 EPYC: 60x a float32 matmul's time,
    measured), and where oneDNN is held below them its sums are wrong (``cpu_int8_saturates``)."""
    flags = cpu_flags()
    if not flags.vnni or cpu_int8_saturates():
        return ""
    return f"this CPU has {'AMX' if flags.amx else 'VNNI'} instructions"


def cpu_int8_saturates() -> str:
    """Why torch's int8 matmul (``torch._int_mm``) returns wrong sums here, or "" where they are exact. torch gives it
    to oneDNN on CPUs with AVX-512 VNNI (AMX ones have it too) and sums it in a plain exact loop elsewhere; oneDNN held
    below VNNI multiplies with AVX2's 8-bit pair products, which saturate at 16 bits (full-range int8, 64x512 @ 512x64:
    errors up to 90,924 on sums up to 445,214)."""
    isa, variable = onednn_cap()
    if not cpu_flags().vnni or isa not in ONEDNN_WITHOUT_VNNI:
        return ""
    return (f"oneDNN is held to {isa} ({variable}), where its int8 sums overflow 16 bits; unset {variable} or "
            f"set it to AVX512_CORE_VNNI or later")


def kept_dtype(file_dtype: torch.dtype | None, compute: torch.dtype) -> torch.dtype:
    """The dtype a float weight of the file is kept in: the file's own 16-bit dtype where computing needs a wider one
    (cast per layer as it runs), else the compute dtype."""
    return file_dtype if file_dtype in SIXTEEN_BIT and compute.itemsize > file_dtype.itemsize else compute
