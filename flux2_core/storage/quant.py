"""fp8 weights: float8 e4m3 [out, in] with a float32 scale [out] (BFL's files) or [] (ComfyUI's scaled fp8), computed
as ``y = (x @ w8ᵀ) · scale``. The e4m3 cast is exact; Klein 4B's blocks shrink from 7.5 GB to 3.8 GB. ``fp8_matmul``
(CUDA, sm_89+) multiplies in fp8 with activations quantized per token: faster, results change slightly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..errors import Flux2Error
from . import kernels
from .linear import item_by_item, linear
from .protocol import FLOAT_KINDS, StoredLinear, census, stored_linears
from .request import LayerRequest, LayerStorage
from .stored_format import FP8_E4M3, SCALE, StoredFormat, StoredTensor

# in weight files, beside a quantized layer's weight: the keys of its scales (fp8, nvfp4, ComfyUI's comfy_quant)
SCALE_SUFFIXES = (".weight_scale", ".scale_weight", ".weight_scale_inv")
# keys beside the weights that are not weights (``scaled_fp8``: the marker of ComfyUI's older fp8 files)
DROPPED_SUFFIXES = (".input_scale", ".scale_input", ".comfy_quant", ".weight_scale_2", "scaled_fp8") + SCALE_SUFFIXES

FP8 = torch.float8_e4m3fn
# device types whose torch._scaled_mm an fp8 layer calls (the CPU has one too, exact but slow: the tests add "cpu")
FP8_MATMUL_DEVICES = frozenset({"cuda"})
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
    scale = scale.float()
    return (w8.float() * (scale[:, None] if scale.ndim == 1 else scale)).to(dtype)


class Fp8Linear(nn.Module, StoredLinear):
    """Keys ``weight`` (fp8) and ``weight_scale`` (float32), as BFL's fp8 files; a merge quantizes again."""

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
        """Weights unset; per-item vector layers stay per item."""
        if linear.bias is not None:
            raise Flux2Error("Fp8Linear has no bias; FLUX.2 transformer linears have none")
        return cls(linear.in_features, linear.out_features, per_row, fp8_matmul, device=linear.weight.device,
                   item_by_item=getattr(linear, "item_by_item", False))

    @classmethod
    def from_linear(cls, linear: nn.Linear, per_row: bool = True, fp8_matmul: bool = False) -> Fp8Linear:
        out = cls.like(linear, per_row, fp8_matmul)
        out.weight, out.weight_scale = quantize_fp8(linear.weight, per_row)
        return out

    def read_from(self, file) -> dict[str, Tensor]:
        weight, scale = file.fp8()                 # the file's own float8 values, or quantized per row as read
        return {"weight": weight, "weight_scale": scale}

    def forward(self, x: Tensor) -> Tensor:
        return item_by_item(self.matmul, x) if self.item_by_item else self.matmul(x)

    def matmul(self, x: Tensor) -> Tensor:
        if self.fp8_matmul and _scaled_mm_ok(x, self.weight):
            return _fp8_matmul(x, self.weight, self.weight_scale)
        y = linear(x, self.weight.to(x.dtype))                    # the e4m3 -> bf16/fp32 cast is exact
        # A 0-d scale is expanded first: a 0-d float32 operand does not promote bf16, so CUDA would round it to bf16
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
        return 0 if self.fp8_matmul else self.in_features * self.out_features * dtype.itemsize

    def extra_repr(self) -> str:
        kind = "per-row" if self.weight_scale.ndim else "per-tensor"
        return f"in={self.in_features}, out={self.out_features}, {self.weight.dtype}, {kind} scale"


def fp8_matmuls(model: nn.Module, device: torch.device, dtype: torch.dtype, asked: dict) -> dict:
    """The fp8 formats' ``StoredFormat.matmul``: ``use_fp8_matmul`` with the fp8 option asked."""
    on, note = use_fp8_matmul(model, asked.get("fp8", "auto"), device, dtype)
    return {Fp8Linear.kind: (on, note)} if note else {}


def _fp8_format(names: tuple[str, ...], weight: tuple[str, ...], dtype: torch.dtype) -> StoredFormat:
    """Float8 weights with a per-tensor or per-row scale, held by the loader's fp8 choice."""
    return StoredFormat("fp8", names, Fp8Linear, {"weight": StoredTensor(weight)} | {
        s.removeprefix("."): SCALE for s in SCALE_SUFFIXES}, dtype, fp8_choice=True, matmul=fp8_matmuls)


# ComfyUI's scaled fp8 (per tensor) and the converter's per-row fp8: one layout, a scale of one value or one a row
FP8_E4M3_FORMAT = _fp8_format(("float8_e4m3fn", "float8_e4m3fn_rowwise"), FP8_E4M3, torch.float8_e4m3fn)
FP8_E5M2_FORMAT = _fp8_format(("float8_e5m2",), ("F8_E5M2", "U8"), torch.float8_e5m2)


def _picks_fp8(request: LayerRequest, name: str) -> bool:
    """The layers the file stores in fp8; with fp8=True every quantizable one too; none with fp8=False."""
    fp8 = request.ask.fp8
    return fp8 is not False and (request.file.stores_fp8(name + ".weight") or bool(fp8 and request.quantizable(name)))


FP8_STORAGE = LayerStorage("fp8", _picks_fp8, lambda i, o, per_item, _: Fp8Linear(i, o, item_by_item=per_item),
                           keeps=lambda request, name: request.file.stores_fp8(name + ".weight"))


def _scaled_mm_ok(x: Tensor, w8: Tensor) -> bool:
    """CUDA, 16-aligned sizes, e4m3 weights, bf16 activations: every fp8 cuBLAS writes bf16 (fp16 fails on some)."""
    return (x.device.type in FP8_MATMUL_DEVICES and hasattr(torch, "_scaled_mm") and w8.dtype == FP8
            and x.dtype == torch.bfloat16 and x.shape[-1] % 16 == 0 and w8.shape[0] % 16 == 0)


def quantize_rows(rows: Tensor) -> tuple[Tensor, Tensor]:
    """rows [M, K] -> (x8 [M, K] e4m3, float32 scale [M, 1]), max|x8| = 448 per row (token)."""
    # times 1/448: inductor turns a division by a constant into that product, so eager and compiled agree to the bit
    x_scale = (rows.abs().amax(dim=1, keepdim=True).float() * (1 / FP8_MAX)).clamp(min=1e-12)
    return (rows / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), x_scale


def _fp8_matmul(x: Tensor, w8: Tensor, w_scale: Tensor) -> Tensor:
    """bf16 x [..., K], w8 [N, K] with row-wise (or broadcast) scales -> bf16 [..., N]; x quantized per token."""
    rows = x.reshape(-1, x.shape[-1])                                          # [M, K]
    # M (tokens) and K (a layer's inputs: a few per model) symbolic: one compiled graph for every layer and size
    x8, x_scale = kernels.call(quantize_rows, rows, dynamic=(0, 1))
    w_scale = w_scale.float().expand(w8.shape[0])[None, :].contiguous()        # [1, N]
    y = torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16,
                         use_fast_accum=True)
    return y.reshape(*x.shape[:-1], w8.shape[0])


FP8_MATMUL_CAPABILITY = (8, 9)     # Ada (sm_89), Hopper (sm_90) and newer have fp8 tensor cores


def fp8_matmul_unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why fp8 matmul cannot run on ``device`` computing in ``dtype``; None if it can."""
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
    """One tiny fp8 matmul's first error line, or None: some torch releases lack per-row scales on some GPUs."""
    try:
        _fp8_matmul(torch.ones(16, 16, device=device, dtype=torch.bfloat16),
                    torch.ones(16, 16, device=device).to(FP8), torch.ones(16, device=device))
        torch.cuda.synchronize(device)
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return None


def use_fp8_matmul(model: nn.Module, choice, device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """``choice``: "auto" (on where the GPU supports it), True (Flux2Error where it cannot) or False. Returns (on, a
    note for the user, "" without fp8 layers). Results change by about 1e-2 relative per layer."""
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


def quantize_transformer(model: nn.Module, chosen: Callable[[str], bool], per_row: bool = True,
                         fp8_matmul: bool = False) -> list[str]:
    """The float layers ``chosen(name)`` picks (its family's ``quantizable``) -> ``Fp8Linear`` in place; their names.
    After the model's move to its dtype: a later ``model.to(dtype)`` would cast the fp8 buffers too."""
    names = [n for n, m in stored_linears(model) if m.kind in FLOAT_KINDS and chosen(n)]
    for name in names:
        model.set_submodule(name, Fp8Linear.from_linear(model.get_submodule(name), per_row, fp8_matmul))
    return names


def count_fp8(model: nn.Module) -> int:
    return census(model).get("fp8", 0)
