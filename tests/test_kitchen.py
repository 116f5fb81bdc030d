"""comfy-kitchen's fused kernels (flux2_core/kitchen.py) against the plain torch path: the q/k RMSNorm + RoPE and the
modulation per layer and in a whole transformer forward, run here through comfy-kitchen's eager backend (its
reference for the GPU kernels); where they are not used (the CPU, no package, a compiled block) the plain path runs
and the log says once why."""

from __future__ import annotations

import logging

import pytest
import torch

from flux2_core import kitchen
from flux2_core.families.flux2.transformer import Flux2Transformer
from flux2_core.models import rope
from flux2_core.models.blocks import QKNorm, modulate
from tests import machine as machines
from tests.tiny.transformer import TINY_TRANSFORMER, random_bfl_transformer_state_dict

pytestmark = pytest.mark.skipif(kitchen.ck is None, reason=f"comfy-kitchen is not importable: {kitchen.MISSING}")

# bf16 keeps 8 significant bits: one rounding of a value v is off by at most 2^-8·|v|. The plain path rounds the
# norm's output, then its product with the scale, then the rotation; the fused one rounds the scaled norm once, then
# the rotation: within 4 roundings of the largest value a rotation mixes (measured: 2.2 at most)
BF16_ROUNDINGS = 4 * 2.0 ** -8


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """Send the fused ops to comfy-kitchen on the CPU too, through its eager backend."""
    monkeypatch.setattr(kitchen, "_fusing", lambda op, device_type: True)
    with kitchen.ck.use_backend("eager"):
        yield


def qk_inputs(dtype, heads=3, length=20, dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, heads, length, dim, generator=g).to(dtype) * 3 for _ in range(3))
    ids = torch.cat([rope.text_ids(2, 4), rope.image_ids(2, 4, 4)], dim=1)
    table = rope.rope_table(ids, (8, 8, 8, 8), 2000.0)
    norm = QKNorm(dim).to(dtype)
    with torch.no_grad():
        norm.query_norm.scale.copy_(torch.rand(dim, generator=g) + 0.5)
        norm.key_norm.scale.copy_(torch.rand(dim, generator=g) + 0.5)
    return norm, q, k, v, table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_rope_computes_the_plain_qk_norm_and_rotation(dtype, monkeypatch):
    norm, q, k, v, table = qk_inputs(dtype)
    plain = norm(q, k, v, table)
    monkeypatch.setattr(kitchen, "_fusing", lambda op, device_type: True)
    with kitchen.ck.use_backend("eager"):
        fused = norm(q, k, v, table)
    for got, want in zip(fused, plain):
        assert got.dtype == dtype and got.shape == want.shape
        tolerance = 1e-6 if dtype == torch.float32 else BF16_ROUNDINGS
        largest = want.float().abs().amax(dim=-1, keepdim=True)              # per head and token
        assert ((got.float() - want.float()).abs() <= tolerance * largest).all()
        assert not torch.equal(got, q) and not torch.equal(got, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_modulation_is_the_plain_one(dtype, fused_on_cpu):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 24, 64, generator=g) * 4).to(dtype)
    shift, scale = (torch.randn(2, 1, 64, generator=g).to(dtype) for _ in range(2))
    got = modulate(x, shift, scale)
    want = (1 + scale) * torch.nn.functional.layer_norm(x, x.shape[-1:], eps=1e-6) + shift
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)     # the same operations in the same dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_transformer_forward_with_the_fused_kernels_equals_the_plain_one(dtype, monkeypatch):
    """float32: within 1e-5 relative (measured 1.7e-7); bf16: within 2% (measured 0.45%: a random tiny model amplifies
    each rounding over 4 blocks)."""
    model = Flux2Transformer(TINY_TRANSFORMER)
    model.load_state_dict(random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=0))
    model = model.to(dtype).eval()
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(2, 16, 128, generator=g).to(dtype), rope.image_ids(2, 4, 4), torch.tensor([0.7, 0.7]),
            torch.randn(2, 6, TINY_TRANSFORMER.context_in_dim, generator=g).to(dtype), rope.text_ids(2, 6))
    with torch.no_grad():
        plain = model(*args).float()
        monkeypatch.setattr(kitchen, "_fusing", lambda op, device_type: True)
        with kitchen.ck.use_backend("eager"):
            fused = model(*args).float()
    error = ((fused - plain).norm() / plain.norm()).item()
    assert error < (1e-5 if dtype == torch.float32 else 0.02), error


def test_on_the_cpu_the_plain_path_runs_and_the_log_says_why_once(caplog, fresh_kitchen):
    norm, q, k, v, table = qk_inputs(torch.float32)
    with caplog.at_level(logging.INFO, logger="flux2_klein"):
        assert not kitchen.fused(q, "rms_rope")
        plain = norm(q, k, v, table)
        norm(q, k, v, table)
    lines = [r.getMessage() for r in caplog.records if "rms_rope" in r.getMessage()]
    assert lines == [("FLUX.2 Klein: rms_rope runs in plain torch on cpu: comfy-kitchen's kernels are for GPUs (its "
                      "CPU code is the same torch ops)")]
    assert torch.equal(plain[0], rope.apply_rope(norm.query_norm(q), norm.key_norm(k), table)[0])


def test_without_comfy_kitchen_nothing_is_fused(no_kitchen, caplog):
    with caplog.at_level(logging.INFO, logger="flux2_klein"):
        assert not kitchen.fused(torch.zeros(1, device="meta"), "adaln")
    assert "adaln runs in plain torch: comfy-kitchen is not importable" in caplog.text


def test_flux2_no_kitchen_turns_every_kitchen_path_off(monkeypatch, caplog, fresh_kitchen, machine):
    from flux2_core.storage.int8 import Int8Linear, use_int8_matmul

    machine.set(machines.ZEN4)              # a CPU whose int8 matmul would run: the variable is the reason

    monkeypatch.setenv("FLUX2_NO_KITCHEN", "1")
    monkeypatch.setattr(kitchen, "gpu_backends", lambda op: ["cuda"])      # as if a GPU backend were there
    with caplog.at_level(logging.INFO, logger="flux2_klein"):
        assert not kitchen.fused(torch.zeros(1, device="meta"), "rms_rope")
        on, note = use_int8_matmul(torch.nn.Sequential(Int8Linear(2048, 8)), "auto", torch.device("cpu"),
                                   torch.float32)
    assert on is False and "turned off (FLUX2_NO_KITCHEN is set)" in note
    assert "rms_rope runs in plain torch: turned off (FLUX2_NO_KITCHEN is set)" in caplog.text


def test_no_tokens_take_the_plain_path(monkeypatch):
    """A stream with no tokens (the 9B-KV reference pass has no text) never reaches the fused kernels, whose CUDA
    launch fails on empty tensors (seen on an H200)."""
    monkeypatch.setattr(kitchen, "_fusing", lambda op, device_type: True)
    monkeypatch.setattr(kitchen, "adaln", lambda *a: pytest.fail("adaln called on no tokens"))
    monkeypatch.setattr(kitchen, "rms_rope", lambda *a: pytest.fail("rms_rope called on no tokens"))
    x, shift, scale = torch.zeros(1, 0, 64), torch.zeros(1, 1, 64), torch.zeros(1, 1, 64)
    assert modulate(x, shift, scale).shape == (1, 0, 64)
    norm, q, k, v, table = qk_inputs(torch.float32, length=0)
    assert norm(q, k, v, table[:, :0])[0].shape == (2, 3, 0, 32)
