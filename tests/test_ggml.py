"""GGML / GGUF dequantization (flux2_core/storage/ggml.py) against gguf's own numpy reference, ``gguf.quants.dequantize``:
equal to the bit in float32 for every supported type, and the reference rounded once in bf16; through the plain torch
ops and through the fused kernel (``fused=True``: the same code compiled, flux2_core/storage/kernels.py), including blocks
whose fp16 scales are extreme (the largest, the smallest normal and subnormal, zero, negative).

The legacy types and the float types are quantized from random floats by ``gguf.quants.quantize``, so their bytes
are what a converter writes. gguf cannot quantize the K-quants: their blocks are random bytes with the fp16 scales
overwritten by small finite values (random fp16 bits would hold infs and NaNs). Dequantization runs on the device
mode's device (``tests/device.py``); the reference is computed on the CPU."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from flux2_core.errors import Flux2Error
from flux2_core.storage.ggml import (
    QUANTIZED,
    SUPPORTED,
    blocks_kernel,
    check_supported,
    dequantize,
    row_bytes,
    type_name,
)
from tests.device import DEVICE
from tests.fused import fused_any_size, fused_on, graphs, ran_fused  # noqa: F401 (fixtures)

QT = gguf.GGMLQuantizationType
FROM_FLOATS = [QT.Q8_0, QT.Q5_0, QT.Q5_1, QT.Q4_0, QT.Q4_1, QT.BF16, QT.F16, QT.F32]
K_QUANTS = [QT.Q6_K, QT.Q5_K, QT.Q4_K, QT.Q3_K, QT.Q2_K]
# Byte offsets of the fp16 fields in a K-quant block: d (and dmin, which must stay >= 0 to be realistic).
K_SCALES = {QT.Q6_K: (208, None), QT.Q5_K: (0, 2), QT.Q4_K: (0, 2), QT.Q3_K: (108, None), QT.Q2_K: (80, 82)}


def honest_bytes(qtype, shape, seed: int = 0) -> np.ndarray:
    """A random float32 array of `shape` as gguf quantizes it: uint8 [rows, row_bytes]."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return quants.quantize(x, qtype).view(np.uint8)       # F32 / F16 come back as floats: their bytes


def k_quant_bytes(qtype, shape, seed: int = 0) -> np.ndarray:
    """Random blocks whose fp16 d is uniform in [-0.01, 0.01] and dmin in [0, 0.01]: uint8 [rows, row_bytes]."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // block, size), dtype=np.uint8)
    d_at, dmin_at = K_SCALES[qtype]
    for at, low in ((d_at, -0.01), (dmin_at, 0.0)):
        if at is not None:
            blocks[..., at:at + 2] = rng.uniform(low, 0.01, (*blocks.shape[:-1], 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(*shape[:-1], -1)


def make_bytes(qtype, shape, seed: int = 0) -> np.ndarray:
    return (k_quant_bytes if qtype in K_QUANTS else honest_bytes)(qtype, shape, seed)


# fp16 scale fields of every quantized type (d, then m / dmin where the type has one) and extreme values for them:
# the largest fp16, the smallest normal and subnormal, zeros, and negatives (dmin and m are meant to be >= 0, but a
# dequantizer must not care)
SCALE_FIELDS = {QT.Q8_0: (0,), QT.Q4_0: (0,), QT.Q5_0: (0,), QT.Q4_1: (0, 2), QT.Q5_1: (0, 2),
                **{q: tuple(at for at in K_SCALES[q] if at is not None) for q in K_QUANTS}}
EXTREME_SCALES = np.array([65504.0, -65504.0, 2.0 ** -14, 2.0 ** -24, -(2.0 ** -24), 0.0, -0.0, 1.0, -3.5,
                           0.0078125], dtype=np.float16)


def extreme_bytes(qtype, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random blocks (every bit pattern of the integer fields is valid) whose fp16 scales cycle through
    EXTREME_SCALES, each field of a block from another place of the cycle: uint8 [rows, row_bytes]."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for i, at in enumerate(SCALE_FIELDS[qtype]):
        cycle = np.roll(EXTREME_SCALES, 3 * i)
        blocks[:, at:at + 2] = np.resize(cycle, len(blocks)).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def ours(raw: np.ndarray, qtype, shape, dtype=torch.float32, fused=False) -> torch.Tensor:
    return dequantize(torch.from_numpy(raw).to(DEVICE), qtype, shape, dtype, fused=fused).cpu()


def reference(raw: np.ndarray, qtype) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(raw, qtype).copy())


@pytest.mark.parametrize("qtype", FROM_FLOATS + K_QUANTS, ids=type_name)
def test_matches_gguf_exactly(qtype):
    raw = make_bytes(qtype, (8, 512))
    ref = reference(raw, qtype)
    out = ours(raw, qtype, (8, 512))
    assert out.dtype == torch.float32 and out.shape == (8, 512)
    assert torch.isfinite(ref).all()
    assert torch.equal(out, ref)
    assert torch.equal(ours(raw, qtype, (8, 512), torch.bfloat16), ref.to(torch.bfloat16))


@pytest.mark.parametrize("qtype", sorted(QUANTIZED), ids=type_name)
def test_extreme_scales_match_gguf_exactly(qtype):
    raw = extreme_bytes(qtype, 4, 2560)
    ref = reference(raw, qtype)
    assert torch.isfinite(ref).all() and (ref.abs() > 1e5).any() and (ref.abs() < 1e-6).any()
    assert torch.equal(ours(raw, qtype, (4, 2560)), ref)
    assert torch.equal(ours(raw, qtype, (4, 2560), torch.bfloat16), ref.to(torch.bfloat16))


def fused_matches_gguf(qtype, dtype) -> None:
    """The fused kernel (compiled on the device mode's device) over layers of three sizes, honest and extreme
    blocks: gguf's values to the bit, rounded once to ``dtype``; one graph for all of them."""
    before = graphs()
    for rows, cols, raw in [(8, 512, make_bytes(qtype, (8, 512))), (3, 2560, extreme_bytes(qtype, 3, 2560)),
                            (40, 768, make_bytes(qtype, (40, 768), seed=1))]:
        out = ours(raw, qtype, (rows, cols), dtype, fused=True)
        assert out.dtype == dtype and out.shape == (rows, cols)
        assert torch.equal(out, reference(raw, qtype).to(dtype)), (rows, cols)
    assert ran_fused(blocks_kernel(qtype, dtype), DEVICE)
    assert graphs() - before == 1


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q8_0], ids=type_name)
@pytest.mark.usefixtures("fused_any_size")
def test_fused_kernel_matches_gguf_exactly(qtype):
    fused_matches_gguf(qtype, torch.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("qtype", sorted(QUANTIZED), ids=type_name)
@pytest.mark.usefixtures("fused_any_size")
def test_fused_kernel_of_every_type_and_dtype_matches_gguf_exactly(qtype, dtype):
    fused_matches_gguf(qtype, dtype)


@pytest.mark.usefixtures("fused_on")
def test_fused_kernel_runs_where_asked_and_on_the_cpu_for_large_tensors_only(monkeypatch):
    """One-off dequantizations (loading, lookups: fused=False) run the plain ops, and so do tensors under
    CPU_FUSED_MIN_VALUES on the CPU, where the scalar C++ kernel loses to the vectorized ops while they stay in cache;
    GPUs take every size. The values are gguf's either way."""
    from flux2_core.storage import ggml, kernels

    assert ggml.CPU_FUSED_MIN_VALUES <= 3072 * 3072 < 2 * ggml.CPU_FUSED_MIN_VALUES    # Klein's smallest layer
    calls = []
    monkeypatch.setattr(kernels, "call", lambda fn, b, **k: calls.append(fn) or fn(b))
    monkeypatch.setattr(ggml, "CPU_FUSED_MIN_VALUES", 4096)
    raw, small = make_bytes(QT.Q4_K, (16, 256)), make_bytes(QT.Q4_K, (15, 256))
    assert torch.equal(ours(raw, QT.Q4_K, (16, 256)), reference(raw, QT.Q4_K))                     # not asked
    assert torch.equal(ours(small, QT.Q4_K, (15, 256), fused=True), reference(small, QT.Q4_K))    # 3840 values
    assert len(calls) == (0 if DEVICE.type == "cpu" else 1)
    assert torch.equal(ours(raw, QT.Q4_K, (16, 256), fused=True), reference(raw, QT.Q4_K))        # 4096 values
    assert calls[-1] is blocks_kernel(QT.Q4_K, torch.float32)


def test_every_supported_type_is_tested():
    assert set(FROM_FLOATS + K_QUANTS) == SUPPORTED
    assert QUANTIZED == SUPPORTED - {QT.F32, QT.F16, QT.BF16}


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16], ids=type_name)
def test_float_types_take_their_values_too(qtype):
    raw = honest_bytes(qtype, (4, 64))
    values = reference(raw, qtype).to({QT.F32: torch.float32, QT.F16: torch.float16, QT.BF16: torch.bfloat16}[qtype])
    assert torch.equal(dequantize(values.to(DEVICE), qtype, (4, 64)).cpu(), reference(raw, qtype))


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q5_1, QT.Q4_K, QT.Q6_K, QT.BF16], ids=type_name)
def test_a_subset_of_rows_dequantizes_to_those_rows(qtype):
    """Embedding lookups dequantize only the rows of the tokens: data[idx] with shape (len(idx), cols)."""
    raw = torch.from_numpy(make_bytes(qtype, (16, 256))).to(DEVICE)
    idx = torch.tensor([5, 0, 5, 15, 2], device=DEVICE)
    whole = dequantize(raw, qtype, (16, 256))
    assert torch.equal(dequantize(raw[idx], qtype, (5, 256)), whole[idx])


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q5_0, QT.Q3_K, QT.Q2_K, QT.F16], ids=type_name)
@pytest.mark.parametrize("shape", [(3, 256), (512,), (2, 3, 256)], ids=str)
def test_odd_shapes(qtype, shape):
    raw = make_bytes(qtype, shape)
    out = ours(raw.reshape(-1), qtype, shape)          # any byte shape with the right total
    assert out.shape == shape
    assert torch.equal(out, reference(raw, qtype).reshape(shape))


def test_int8_bytes_are_read_as_bytes():
    raw = make_bytes(QT.Q5_K, (2, 256))
    signed = torch.from_numpy(raw.view(np.int8)).to(DEVICE)
    assert torch.equal(dequantize(signed, QT.Q5_K, (2, 256)).cpu(), reference(raw, QT.Q5_K))


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q6_K, QT.F32], ids=type_name)
def test_bytes_at_an_odd_offset(qtype):
    """A tensor's bytes inside a larger buffer (a file read whole) need not be aligned to its fp16 / f32 fields."""
    raw = make_bytes(qtype, (2, 256))
    buffer = torch.zeros(raw.size + 1, dtype=torch.uint8, device=DEVICE)
    buffer[1:] = torch.from_numpy(raw.reshape(-1)).to(DEVICE)
    assert torch.equal(dequantize(buffer[1:], qtype, (2, 256)).cpu(), reference(raw, qtype))


@pytest.mark.parametrize("qtype", [QT.IQ4_XS, QT.Q8_K, QT.TQ2_0, QT.MXFP4, 99], ids=str)
def test_unsupported_types_raise(qtype):
    name = type_name(qtype)
    with pytest.raises(Flux2Error, match=f"tensor blocks.0.w in model.gguf is stored as {name}, .*supported: Q8_0"):
        check_supported(qtype, "tensor blocks.0.w in model.gguf")
    with pytest.raises(Flux2Error, match=f"stored as {name}"):
        dequantize(torch.zeros(4, 256, dtype=torch.uint8), qtype, (4, 256))


def test_type_names():
    assert type_name(QT.Q4_K) == type_name(12) == "Q4_K"
    assert type_name(99) == "type 99"
    check_supported(12, "x")                            # ints work as well as the enum


def test_row_bytes():
    assert row_bytes(QT.Q4_K, 3072) == 12 * 144
    assert row_bytes(QT.Q8_0, 64) == 68
    assert row_bytes(QT.BF16, 3) == 6
    assert row_bytes(QT.IQ4_XS, 256) == 136             # known, though not dequantized here
    with pytest.raises(Flux2Error, match="multiple of 256"):
        row_bytes(QT.Q6_K, 300)
    with pytest.raises(Flux2Error, match="multiple of 32"):
        dequantize(torch.zeros(1, 40, dtype=torch.uint8), QT.Q8_0, (1, 40))
    with pytest.raises(Flux2Error, match="type 99"):
        row_bytes(99, 256)


def test_wrong_byte_count_raises():
    with pytest.raises(Flux2Error, match="takes 288 bytes, but 144 were given"):
        dequantize(torch.zeros(1, 144, dtype=torch.uint8), QT.Q4_K, (2, 256))
    with pytest.raises(Flux2Error, match="raw bytes as uint8"):
        dequantize(torch.zeros(1, 72, dtype=torch.int16), QT.Q4_K, (1, 256))


@pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="torch.compile is not supported here")
def test_compiles_to_one_graph():
    """One type under torch.compile (a few seconds of inductor on 2 CPU cores): no graph breaks, the same bits."""
    raw = make_bytes(QT.Q4_K, (4, 256))
    fn = torch.compile(dequantize, fullgraph=True)
    out = fn(torch.from_numpy(raw).to(DEVICE), QT.Q4_K, (4, 256)).cpu()
    assert torch.equal(out, reference(raw, QT.Q4_K))
