"""fp8 weight storage: Linear weights kept as float8 (e4m3) with a float32 scale, computed in the activations' dtype.

    w ≈ float(w8) · scale          w8 [out, in] float8_e4m3fn; scale [out] (per row, BFL's fp8 files) or [] (per tensor,
                                   ComfyUI's scaled fp8 files)

Because the scale belongs to an output row, it is applied to the *output*: ``y = (x @ w8ᵀ) · scale``. The cast of
e4m3 to bf16 / fp32 is exact, so the only rounding beyond the matmul is one float32 multiply per output, written in
place. The weight is cast to the compute dtype for each call and never kept so: weights take 1 byte per value instead
of 2 (bf16), and Klein 4B's blocks shrink from about 7.5 GB to 3.8 GB.

On CUDA with ``fp8_matmul=True`` the matmul itself runs in fp8 (``torch._scaled_mm``, Hopper / Ada and newer): the
activations are quantized per token on the fly (one fused kernel, ``kernels.py``; FLUX2_NO_FUSED=1 for the plain
ops), which is faster and changes results slightly. ``use_fp8_matmul`` turns it on where the GPU supports it (the
CLI's --fp8-matmul, the model loader node).

    quantize_transformer(model)                    # a loaded bf16 Flux2Transformer -> fp8 block weights, in place
    load_transformer(path, fp8=None)               # weights/loading.py: an fp8 file's layers stay fp8, with the file's scales
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from . import kernels
from .errors import Flux2Error
from .linear import item_by_item, linear
from .storage.protocol import StoredLinear, census, stored_linears

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max          # 448
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_fp8(weight: Tensor, per_row: bool = True) -> tuple[Tensor, Tensor]:
    """weight [out, in] -> (w8 [out, in] float8_e4m3fn, float32 scale [out] or []) with max|w8| = 448 per row/tensor."""
    w = weight.detach().float()
    amax = torch.linalg.vector_norm(w, float("inf"), dim=1 if per_row else None)     # max |w|, no |w| copy
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    w = w / (scale[:, None] if per_row else scale)                 # one float32 temporary (weights can be large)
    return w.clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_fp8(w8: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The float weight [out, in] that (w8, scale) stands for."""
    scale = scale.float()
    return (w8.float() * (scale[:, None] if scale.ndim == 1 else scale)).to(dtype)


class Fp8Linear(nn.Module, StoredLinear):
    """A bias-free Linear whose weight is stored in fp8 with a per-row or per-tensor float32 scale.

    State-dict keys are ``weight`` (fp8) and ``weight_scale`` (float32), as in BFL's fp8 checkpoints. Adapters run as
    branches beside it unless a merge is asked for (then the merged weight is quantized again, with a new scale).
    """

    kind = "fp8"
    merges_adapters = False

    def __init__(self, in_features: int, out_features: int, per_row: bool = True, fp8_matmul: bool = False,
                 device=None, item_by_item: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.fp8_matmul = in_features, out_features, fp8_matmul
        self.item_by_item = item_by_item          # one batch item at a time, as linear.VectorLinear (batch invariance)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features if per_row else (), device=device))

    @classmethod
    def like(cls, linear: nn.Linear, per_row: bool = True, fp8_matmul: bool = False) -> Fp8Linear:
        """An Fp8Linear of ``linear``'s size, device and kind (per-item vector layers stay per item), weights unset."""
        if linear.bias is not None:
            raise Flux2Error("Fp8Linear has no bias; FLUX.2 transformer linears have none")
        return cls(linear.in_features, linear.out_features, per_row, fp8_matmul, device=linear.weight.device,
                   item_by_item=getattr(linear, "item_by_item", False))

    @classmethod
    def from_linear(cls, linear: nn.Linear, per_row: bool = True, fp8_matmul: bool = False) -> Fp8Linear:
        out = cls.like(linear, per_row, fp8_matmul)
        out.weight, out.weight_scale = quantize_fp8(linear.weight, per_row)
        return out

    def forward(self, x: Tensor) -> Tensor:
        """x [..., in] -> [..., out] in x's dtype."""
        return item_by_item(self.matmul, x) if self.item_by_item else self.matmul(x)

    def matmul(self, x: Tensor) -> Tensor:
        if self.fp8_matmul and _scaled_mm_ok(x, self.weight):
            return _fp8_matmul(x, self.weight, self.weight_scale)
        y = linear(x, self.weight.to(x.dtype))                    # the e4m3 -> bf16/fp32 cast is exact
        # per output: multiplied in float32, stored in place. A 0-d (per-tensor) scale is expanded to a vector first:
        # a 0-d float32 operand does not promote a bf16 tensor, so CUDA would round the scale to bf16 before the
        # multiply (the CPU kernel happens to keep it in float32)
        return y.mul_(self.weight_scale.expand(y.shape[-1]))

    def float_weight(self, dtype: torch.dtype = torch.float32, device=None) -> Tensor:
        device = device or self.weight.device
        return dequantize_fp8(self.weight.to(device), self.weight_scale.to(device), dtype)

    def stored_tensors(self) -> tuple[Tensor, ...]:
        return self.weight, self.weight_scale

    def write_weight(self, weight: Tensor) -> None:
        w8, scale = quantize_fp8(weight, per_row=self.weight_scale.ndim == 1)
        self.weight.copy_(w8)
        self.weight_scale.copy_(scale)

    def call_bytes(self, dtype: torch.dtype) -> int:
        """The weight cast to the compute dtype for the matmul (none with fp8 matmul, which reads the fp8 weight)."""
        return 0 if self.fp8_matmul else self.in_features * self.out_features * dtype.itemsize

    def extra_repr(self) -> str:
        kind = "per-row" if self.weight_scale.ndim else "per-tensor"
        return f"in={self.in_features}, out={self.out_features}, {self.weight.dtype}, {kind} scale"


def _on_cuda(x: Tensor) -> bool:
    return x.is_cuda


def _scaled_mm_ok(x: Tensor, w8: Tensor) -> bool:
    """torch._scaled_mm needs CUDA, 16-aligned sizes and e4m3 weights; we also ask for bf16 activations.

    Its output is then bf16, which every cuBLAS with fp8 support writes; fp16 output is missing from some versions
    (an error at run time, not a fallback). fp16 and fp32 activations take the dequantizing path instead of running
    in bf16 and casting back: that would round the activations to bf16's 8-bit mantissa, coarser than what the user
    picked fp16 (11 bits) or fp32 for, and the dequantizing path is exact in the weights.
    """
    return (_on_cuda(x) and hasattr(torch, "_scaled_mm") and w8.dtype == FP8 and x.dtype == torch.bfloat16
            and x.shape[-1] % 16 == 0 and w8.shape[0] % 16 == 0)


def quantize_rows(rows: Tensor) -> tuple[Tensor, Tensor]:
    """Activations rows [M, K] -> (x8 [M, K] e4m3, float32 scale [M, 1]) with max|x8| = 448 per row (token).

    As a chain of torch ops that is five kernels reading or writing [M, K] (|x|, the row max, the division, the clamp,
    the cast) with a float32 temporary; ``kernels.call`` compiles it into one (the row max, then the quantized row)
    that reads x and writes x8 only, computing the same values (x / scale in float32, as here). The scale is the row
    max times 1/448, not over 448: inductor turns a division by a constant into that product on GPUs, so writing it
    so keeps the plain and compiled scales equal to the bit (they differ from max/448 by one rounding at most)."""
    x_scale = (rows.abs().amax(dim=1, keepdim=True).float() * (1 / FP8_MAX)).clamp(min=1e-12)
    return (rows / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), x_scale


def _fp8_matmul(x: Tensor, w8: Tensor, w_scale: Tensor) -> Tensor:
    """fp8 x fp8 matmul of bf16 x [..., K]: x quantized per token (row-wise scales; one fused kernel where
    ``kernels`` has them on), w8 [N, K] with row-wise (or broadcast) scales. Returns bf16 [..., N]."""
    rows = x.reshape(-1, x.shape[-1])                                          # [M, K]
    # M (tokens) and K (a layer's inputs: a few per model) symbolic: one compiled graph for every layer and size
    x8, x_scale = kernels.call(quantize_rows, rows, dynamic=(0, 1))
    w_scale = w_scale.float().expand(w8.shape[0])[None, :].contiguous()        # [1, N]
    y = torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16,
                         use_fast_accum=True)
    return y.reshape(*x.shape[:-1], w8.shape[0])


FP8_MATMUL_CAPABILITY = (8, 9)     # Ada (sm_89), Hopper (sm_90) and newer have fp8 tensor cores


def fp8_matmul_unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why fp8 matmul (``torch._scaled_mm``) cannot run for a model on ``device`` computing in ``dtype``; None if it can."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"fp8 matmul needs an NVIDIA GPU; this model runs on {device.type}"
    if not hasattr(torch, "_scaled_mm"):
        return f"this torch ({torch.__version__}) has no torch._scaled_mm"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MATMUL_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (f"fp8 matmul needs compute capability 8.9 or newer (Ada, Hopper, Blackwell); {name} is "
                f"{capability[0]}.{capability[1]}")
    if dtype != torch.bfloat16:
        return f"fp8 matmul writes bfloat16; this model computes in {str(dtype).removeprefix('torch.')}"
    failure = scaled_mm_failure(str(device))
    if failure:
        return (f"torch._scaled_mm with per-row scales fails on {torch.cuda.get_device_name(device)} with this torch "
                f"({torch.__version__}): {failure}")
    return None


@functools.cache
def scaled_mm_failure(device: str) -> str | None:
    """Run one tiny fp8 matmul as ``Fp8Linear`` runs them; its error (first line), or None when it works. Some torch
    releases lack per-row scales on some GPUs that have fp8 tensor cores (sm_89 before 2025, sm_100/120 in some)."""
    try:
        _fp8_matmul(torch.ones(16, 16, device=device, dtype=torch.bfloat16),
                    torch.ones(16, 16, device=device).to(FP8), torch.ones(16, device=device))
        torch.cuda.synchronize(device)
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return None


def use_fp8_matmul(model: nn.Module, choice, device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """Turn fp8 matmul on or off for the model's fp8 layers: ``choice`` "auto" (on where the GPU supports it), True
    (refused with the reason where it cannot run) or False. Returns (on, a note for the user: "" without fp8 layers).

    The weights stay what they are either way; fp8 matmul also quantizes the activations per token, which is faster
    on fp8 tensor cores and changes results slightly (about 1e-2 relative per layer)."""
    if choice not in ("auto", True, False):
        raise Flux2Error(f"fp8 matmul must be 'auto', True or False, got {choice!r}")
    layers = [m for _, m in stored_linears(model) if m.kind == "fp8"]
    if choice is True and not layers:
        raise Flux2Error("fp8 matmul needs fp8 weights: load an fp8 file, or store the blocks in fp8 (--fp8)")
    if not layers:
        return False, ""                     # nothing to decide: the device is not even asked
    reason = fp8_matmul_unsupported(device, dtype) if choice is not False else None
    if choice is True and reason:
        raise Flux2Error(f"cannot use fp8 matmul: {reason}; leave it on auto to compute fp8 weights in {dtype}")
    on = choice is True or (choice == "auto" and reason is None)
    for layer in layers:
        layer.fp8_matmul = on
    name = str(dtype).removeprefix("torch.")
    return on, ("fp8 matmul: on" if on else
                f"fp8 matmul: off ({reason or 'turned off'}); the fp8 weights compute in {name}")


def in_blocks(name: str) -> bool:
    """The default choice of layers to quantize: the blocks and the shared modulations (over 95% of the weights).

    The embedders (img_in, txt_in, time_in) and the final layer stay in the compute dtype.
    """
    return name.startswith(("double_blocks.", "single_blocks.", "double_stream_modulation", "single_stream_modulation"))


def quantize_transformer(model: nn.Module, per_row: bool = True, fp8_matmul: bool = False) -> list[str]:
    """Replace the block layers (``in_blocks``) a loaded model keeps in float by ``Fp8Linear`` in place. Returns
    their names.

    Do this after moving the model to its device and compute dtype (a later ``model.to(dtype)`` would cast the fp8
    weights too, as they are floating-point buffers).
    """
    names = [n for n, m in stored_linears(model) if m.kind == "float" and in_blocks(n)]
    for name in names:
        model.set_submodule(name, Fp8Linear.from_linear(model.get_submodule(name), per_row, fp8_matmul))
    return names


def count_fp8(model: nn.Module) -> int:
    """How many of the model's layers store their weights in fp8."""
    return census(model).get("fp8", 0)
