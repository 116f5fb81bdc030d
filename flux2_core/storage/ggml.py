"""GGML / GGUF quantized weights dequantized in torch: vectorized, on any device, torch.compile friendly.

A GGUF tensor is stored row by row (the last torch dim, in_features of a Linear weight [out, in], is the innermost);
each row is a run of blocks, each block holds `n` values in `bytes` bytes. All multi-byte fields are little-endian;
`d`, `dmin`, `m` are fp16. A value is `d * q` or `d * q + m` (legacy types) or `(d * sc) * q - dmin * mn` (K-quants,
where the 6- or 8-bit `sc` / `mn` belong to a sub-block of 16 or 32 values).

    type   n    bytes  fields in order                                    value
    F32    1    4      f32                                                 x
    F16    1    2      f16                                                 x
    BF16   1    2      bf16 (the high half of an f32)                      x
    Q8_0   32   34     d, qs[32] int8                                      qs * d
    Q4_0   32   18     d, qs[16] (nibbles: lo -> 0..15, hi -> 16..31)      d * (q - 8)
    Q4_1   32   20     d, m, qs[16]                                        d * q + m
    Q5_0   32   22     d, qh[4] (bit i -> value i, 5th bit), qs[16]        d * (q - 16)
    Q5_1   32   24     d, m, qh[4], qs[16]                                 d * q + m
    Q2_K   256  84     scales[16] (lo nibble sc, hi mn), qs[64], d, dmin   (d * sc) * q - dmin * mn   16 x 16
    Q3_K   256  110    hmask[32], qs[64], scales[12] (6-bit), d            (d * (sc - 32)) * q        16 x 16
    Q4_K   256  144    d, dmin, scales[12] (6-bit sc, mn), qs[128]         (d * sc) * q - dmin * mn   8 x 32
    Q5_K   256  176    d, dmin, scales[12], qh[32], qs[128]                (d * sc) * q - dmin * mn   8 x 32
    Q6_K   256  210    ql[128], qh[64], scales[16] int8, d                 (d * sc) * (q - 32)        16 x 16

Bit packing of the K-quants (value index within the block, for 2-bit and 4-bit fields read lowest bits first):

    Q2_K, Q3_K qs   byte h*32 + j, bits 2s..2s+1 -> value h*128 + s*32 + j            (h < 2, s < 4, j < 32)
    Q3_K hmask      byte j, bit b -> value b*32 + j; q = (2-bit q) - 4 where the bit is 0
    Q3_K scales     6-bit sc[i]: lo 4 bits = nibble i%8 of bytes 0..7 (lo nibbles first), hi 2 bits = bits 2(i//4)..
                    of byte 8 + i%4
    Q4_K, Q5_K qs   byte c*32 + j, lo nibble -> value 64c + j, hi nibble -> value 64c + 32 + j      (c < 4)
    Q5_K qh         byte j, bit b -> 5th bit of value b*32 + j
    Q4_K scales     bytes 0..3 = sc[0..3] (6 bits) | hi bits of sc[4..7]; bytes 4..7 the same for mn;
                    bytes 8..11 = lo nibble sc[4..7], hi nibble mn[4..7]
    Q6_K ql         byte h*64 + j, lo nibble -> value h*128 + j, hi nibble -> h*128 + 64 + j     (j < 64)
    Q6_K qh         byte h*32 + j, bits 2s..2s+1 -> bits 4..5 of value h*128 + s*32 + j

Bit-exact with ``gguf.quants.dequantize``: fp16 scales times integers of at most 12 bits are exact in float32, so
the one rounding is adding the min. ``fused=True`` compiles this same code, so it is bit-exact too.
"""

from __future__ import annotations

import functools
import math

import gguf
import torch

from ..errors import Flux2Error
from . import kernels

QType = gguf.GGMLQuantizationType

FLOATS = {QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16}
# The quantized types from the most faithful to the smallest, as the error message lists them.
_BY_QUALITY = (QType.Q8_0, QType.Q6_K, QType.Q5_K, QType.Q5_1, QType.Q5_0, QType.Q4_K, QType.Q4_1, QType.Q4_0,
               QType.Q3_K, QType.Q2_K)
QUANTIZED = frozenset(_BY_QUALITY)
SUPPORTED = QUANTIZED | frozenset(FLOATS)
_SUPPORTED_NAMES = ", ".join(q.name for q in (*_BY_QUALITY, *FLOATS))


def _enum(qtype) -> QType | None:
    try:
        return QType(int(qtype))
    except ValueError:
        return None


def type_name(qtype) -> str:
    """'Q4_K' for a GGMLQuantizationType or its int; 'type 99' for an int gguf does not know."""
    q = _enum(qtype)
    return q.name if q is not None else f"type {int(qtype)}"


def check_supported(qtype, what: str) -> None:
    """Raise Flux2Error unless `qtype` is one this module dequantizes; `what` names the tensor (and its file)."""
    if _enum(qtype) not in SUPPORTED:
        raise Flux2Error(f"{what} is stored as {type_name(qtype)}, which this loader cannot dequantize; supported: "
                         f"{_SUPPORTED_NAMES}. Use a file quantized as one of these (Q8_0, Q6_K, Q5_K or Q4_K keep "
                         f"the most quality).")


def row_bytes(qtype, n: int) -> int:
    """Bytes of one row of n values (any type gguf knows, supported or not)."""
    q = _enum(qtype)
    if q not in gguf.GGML_QUANT_SIZES:
        raise Flux2Error(f"unknown GGML tensor {type_name(qtype)}: its block size is not known; use a file "
                         f"quantized as one of {_SUPPORTED_NAMES}.")
    block, size = gguf.GGML_QUANT_SIZES[q]
    if n % block:
        raise Flux2Error(f"a row of {n} values cannot be stored as {q.name}, whose blocks hold {block} values: "
                         f"the row length must be a multiple of {block}. The file is damaged, or its tensor shape "
                         f"was read wrongly.")
    return n // block * size


# Bit helpers. Blocks are b [n, bytes] uint8; every field comes out with the block as dim 0.

def _from_le(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """b [..., k] little-endian bytes -> [...] of the k-byte float `dtype` with those bits."""
    k = b.shape[-1]
    # Compiled code cannot trace storage_offset, so only aligned eager bytes are viewed; else build a wider int.
    if not torch.compiler.is_compiling() and b.is_contiguous() and b.storage_offset() % k == 0:
        return b.view(dtype).squeeze(-1)
    wide, narrow = (torch.int32, torch.int16) if k == 2 else (torch.int64, torch.int32)
    v = b[..., 0].to(wide)
    for i in range(1, k):
        v = v | (b[..., i].to(wide) << (8 * i))
    v = v - ((v >> (8 * k - 1)) << (8 * k))
    return v.to(narrow).view(dtype)


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of each block, as float32 [n, 1] (numpy's float16 -> float32, exact)."""
    return _from_le(b[:, at:at + 2], torch.float16).float().unsqueeze(-1)


def _fields(x: torch.Tensor, width: int, count: int, dim: int = -2) -> torch.Tensor:
    """The `count` fields of `width` bits in each byte of x [..., k], lowest first, as a new dim:
    [..., count, k] (dim=-2, field-major) or [..., k, count] (dim=-1, byte-major)."""
    shifts = torch.arange(0, width * count, width, dtype=torch.uint8, device=x.device)
    return (x.unsqueeze(dim) >> (shifts[:, None] if dim == -2 else shifts)) & ((1 << width) - 1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """qs [n, 16] -> [n, 32]: the 16 low nibbles, then the 16 high ones."""
    return _fields(qs, 4, 2).reshape(qs.shape[0], 32)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """qh [n, 4] (a little-endian uint32) -> [n, 32] uint8: bit i of the word, shifted to bit 4 (the 5th bit)."""
    return _fields(qh, 1, 8, dim=-1).reshape(qh.shape[0], 32) << 4


# One function per type: blocks b [n, bytes] uint8 -> float32 [n, block values], in gguf's operand order.

def _q8_0(b):
    return b[:, 2:].view(torch.int8).float() * _f16(b, 0)


def _q4_0(b):
    return _f16(b, 0) * (_nibbles(b[:, 2:]).float() - 8)


def _q4_1(b):
    return _f16(b, 0) * _nibbles(b[:, 4:]).float() + _f16(b, 2)


def _q5_0(b):
    q = _nibbles(b[:, 6:]) | _high_bits(b[:, 2:6])
    return _f16(b, 0) * (q.float() - 16)


def _q5_1(b):
    q = _nibbles(b[:, 8:]) | _high_bits(b[:, 4:8])
    return _f16(b, 0) * q.float() + _f16(b, 2)


def _q2_k(b):
    n, scales = b.shape[0], b[:, :16]
    dl = (_f16(b, 80) * (scales & 0xF).float()).unsqueeze(-1)            # [n, 16, 1] per sub-block of 16
    ml = (_f16(b, 82) * (scales >> 4).float()).unsqueeze(-1)
    q = _fields(b[:, 16:80].reshape(n, 2, 32), 2, 4).reshape(n, 16, 16)  # [n, half, shift, 32] -> 16 x 16
    return (dl * q.float() - ml).reshape(n, 256)


def _q3_k_scales(s):
    """s [n, 12] -> the 16 signed 6-bit scales [n, 16] float32."""
    n = s.shape[0]
    lo = _fields(s[:, :8], 4, 2).reshape(n, 16)        # lo nibbles of bytes 0..7, then their hi nibbles
    hi = _fields(s[:, 8:], 2, 4).reshape(n, 16)        # 2-bit fields of bytes 8..11, field-major
    return (lo | (hi << 4)).float() - 32


def _q3_k(b):
    n = b.shape[0]
    dl = (_f16(b, 108) * _q3_k_scales(b[:, 96:108])).unsqueeze(-1)                  # [n, 16, 1]
    ql = _fields(b[:, 32:96].reshape(n, 2, 32), 2, 4).reshape(n, 16, 16)
    hm = _fields(b[:, :32].unsqueeze(1), 1, 8).reshape(n, 16, 16)                   # [n, 1, bit, 32]
    q = ql.to(torch.int16) - ((hm ^ 1) << 2).to(torch.int16)                        # a clear bit subtracts 4
    return (dl * q.float()).reshape(n, 256)


def _k_scale_min(s):
    """s [n, 12] -> (sc, mn), each the 8 unsigned 6-bit values [n, 8] float32 of Q4_K / Q5_K."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo & 0x3F, (hi & 0xF) | ((lo >> 2) & 0x30)], dim=-1)
    mn = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def _k_nibbles(qs):
    """qs [n, 128] -> [n, 8, 32]: per 32 bytes, the low nibbles then the high ones."""
    n = qs.shape[0]
    return _fields(qs.reshape(n, 4, 32), 4, 2).reshape(n, 8, 32)


def _k_affine(b, q):
    """Q4_K / Q5_K: (d * sc) * q - dmin * mn per sub-block of 32; q [n, 8, 32] uint8."""
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (_f16(b, 0) * sc).unsqueeze(-1)
    ml = (_f16(b, 2) * mn).unsqueeze(-1)
    return (dl * q.float() - ml).reshape(b.shape[0], 256)


def _q4_k(b):
    return _k_affine(b, _k_nibbles(b[:, 16:144]))


def _q5_k(b):
    n = b.shape[0]
    qh = _fields(b[:, 16:48].unsqueeze(1), 1, 8).reshape(n, 8, 32)        # bit k of byte j -> sub-block k
    return _k_affine(b, _k_nibbles(b[:, 48:176]) | (qh << 4))


def _q6_k(b):
    n = b.shape[0]
    dl = (_f16(b, 208) * b[:, 192:208].view(torch.int8).float()).unsqueeze(-1)    # [n, 16, 1]
    ql = _fields(b[:, :128].reshape(n, 2, 64), 4, 2).reshape(n, 256)               # [n, half, nibble, 64]
    qh = _fields(b[:, 128:192].reshape(n, 2, 32), 2, 4).reshape(n, 256)            # [n, half, shift, 32]
    q = (ql | (qh << 4)).float() - 32
    return (dl * q.reshape(n, 16, 16)).reshape(n, 256)


_BLOCKS = {QType.Q8_0: _q8_0, QType.Q4_0: _q4_0, QType.Q4_1: _q4_1, QType.Q5_0: _q5_0, QType.Q5_1: _q5_1,
           QType.Q2_K: _q2_k, QType.Q3_K: _q3_k, QType.Q4_K: _q4_k, QType.Q5_K: _q5_k, QType.Q6_K: _q6_k}


# On the CPU the fused kernel wins only once the plain ops' float32 temporaries leave the cache: Q8_0 measured
# 1.3-2.5x slower up to 6M values, 0.4-0.5x from 9.4M (Klein 4B's smallest quantized layer). GPUs fuse at any size.
CPU_FUSED_MIN_VALUES = 1 << 23


@functools.cache
def blocks_kernel(qtype: QType, dtype: torch.dtype):
    """blocks [n, bytes] uint8 -> [n, block] in `dtype`, for ``kernels.call`` to compile (n symbolic)."""
    blocks = _BLOCKS[qtype]

    def dequantize_blocks(b: torch.Tensor) -> torch.Tensor:
        return blocks(b).to(dtype)

    dequantize_blocks.__name__ = f"dequantize_{qtype.name}_{str(dtype).removeprefix('torch.')}"
    return dequantize_blocks


def dequantize(data: torch.Tensor, qtype, shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
               fused: bool = False) -> torch.Tensor:
    """Raw bytes (uint8/int8, right total) -> values of `shape` in `dtype`; may share memory with `data`.
    F32/F16/BF16 also take float values. ``fused`` uses the compiled kernel where ``kernels`` allows it."""
    q = _enum(qtype)
    shape = tuple(shape)
    check_supported(qtype, f"a tensor of shape {list(shape)}")
    if not shape:
        raise Flux2Error("dequantize needs the tensor's shape with at least one dim (got ()); pass e.g. (n,).")
    if q in FLOATS and data.is_floating_point():
        if data.numel() != math.prod(shape):
            raise Flux2Error(f"a {q.name} tensor of shape {list(shape)} has {math.prod(shape)} values, but "
                             f"{data.numel()} were given; pass the whole tensor (or whole rows, with their count).")
        return data.reshape(shape).float().to(dtype)
    if data.dtype not in (torch.uint8, torch.int8):
        raise Flux2Error(f"a {q.name} tensor's data must be its raw bytes as uint8, not {data.dtype}; "
                         f"read the file's tensor data as uint8.")
    nbytes = math.prod(shape[:-1]) * row_bytes(q, shape[-1])
    if data.numel() != nbytes:
        raise Flux2Error(f"a {q.name} tensor of shape {list(shape)} takes {nbytes} bytes, but {data.numel()} were "
                         f"given; pass the whole tensor's data (or whole rows with their row count in `shape`).")
    b = data.view(torch.uint8).reshape(-1, gguf.GGML_QUANT_SIZES[q][1])
    if q in FLOATS:
        return _from_le(b, FLOATS[q]).float().reshape(shape).to(dtype)
    if fused and (b.device.type != "cpu" or math.prod(shape) >= CPU_FUSED_MIN_VALUES):
        return kernels.call(blocks_kernel(q, dtype), b).reshape(shape)
    return _BLOCKS[q](b).reshape(shape).to(dtype)
