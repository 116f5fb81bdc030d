"""The AE mid block's attention: q, k, v reach SDPA contiguous (so the fused kernels run and the [HW, HW] scores are
never held), it still computes softmax(q kᵀ / sqrt(C)) v, and the memory estimates cover the measured peaks."""

from __future__ import annotations

import pytest
import torch

from flux2_core.models.autoencoder import AttnBlock, AutoEncoder, MidBlock
from flux2_core.runtime import memory
from flux2_core.runtime.memory import MID_TENSORS
from flux2_core.variants import FLUX2_AE
from tests.memory import peak_bytes
from tests.tiny.autoencoder import TINY_AE_PARAMS, bfl_state_dict, build_diffusers_autoencoder


@pytest.fixture(scope="module")
def ae():
    model = AutoEncoder(TINY_AE_PARAMS)
    model.load_state_dict(bfl_state_dict(build_diffusers_autoencoder(seed=0)))
    return model.eval()


def attn_block(ch: int = 64) -> AttnBlock:
    torch.manual_seed(0)
    return AttnBlock(ch, 32).eval()


def reference_attention(block: AttnBlock, x: torch.Tensor) -> torch.Tensor:
    """The block written out in float64 with an explicit score matrix: x + proj_out(softmax(q kᵀ/sqrt(C)) v)."""
    b, c, hh, ww = x.shape
    block = block.double()
    try:
        h = block.norm(x.double())
        q, k, v = (conv(h).reshape(b, c, hh * ww).transpose(1, 2) for conv in (block.q, block.k, block.v))
        out = torch.softmax(q @ k.transpose(1, 2) / c ** 0.5, dim=-1) @ v            # [B, HW, C]
        return x.double() + block.proj_out(out.transpose(1, 2).reshape(b, c, hh, ww))
    finally:
        block.float()


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_sdpa_gets_contiguous_q_k_v(monkeypatch, layout):
    """Channels-first inputs (CUDA's layout) used to reach SDPA with a channel stride of HW, which rules out the fused
    kernels; whatever the input layout, q, k, v must be contiguous [B, 1, HW, C]."""
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, *args, **kwargs):
        seen.append([(t.shape, t.stride(), t.is_contiguous()) for t in (q, k, v)])
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    block = attn_block()
    x = torch.randn(2, 64, 6, 5).contiguous(memory_format=layout)
    with torch.no_grad():
        got = block(x)
    assert len(seen) == 1
    for shape, stride, contiguous in seen[0]:
        assert shape == (2, 1, 30, 64)
        assert contiguous and stride == (30 * 64, 30 * 64, 64, 1)
    assert (got.double() - reference_attention(block, x)).abs().max() < 1e-5 * got.abs().max()


def test_attention_never_holds_the_score_matrix():
    """On a channels-first input, the whole block's peak stays far below one [HW, HW] float32 score matrix (the math
    kernel the old strides forced allocated several of them: scores, softmax, a mask of -inf rows)."""
    block = attn_block()
    x = torch.randn(1, 64, 48, 48)                                       # HW = 2304 positions
    scores = (48 * 48) ** 2 * 4                                          # 21 MB
    with torch.no_grad():
        peak = peak_bytes(lambda: block(x))
    assert peak < scores / 4, peak
    assert peak >= 5 * x.nbytes                                          # q, k, v, out, proj_out at least


def test_mid_bytes_covers_the_measured_mid_block():
    """The real mid block width (512 channels) at 64x64 positions, channels-first as on CUDA: the profiler's peak
    (input excluded: it exists before the call) is at most ``mid_bytes`` and more than half of it."""
    with torch.device("meta"):
        real = AutoEncoder(FLUX2_AE)                                     # 512 mid-block channels
    torch.manual_seed(0)
    mid = MidBlock(512, 32).eval()
    x = torch.randn(1, 512, 64, 64)
    with torch.no_grad():
        peak = peak_bytes(lambda: mid(x))
    estimate = memory.mid_bytes(real, 1, 32, 32)                                 # latent 32x32 -> 64x64 positions
    assert estimate == MID_TENSORS * x.nbytes
    assert estimate / 2 < peak + x.nbytes <= estimate, (peak, estimate)


def test_encode_and_decode_estimates_cover_the_measured_peaks(ae):
    """Tensor peaks measured with the profiler (tiny AE, float32) against the estimates; the estimates leave room for
    convolution workspaces the profiler does not see, so they are above the tensor peak, but by less than 2.5x."""
    x = torch.rand(1, 3, 256, 128) * 2 - 1
    z = torch.randn(1, 128, 16, 8)
    with torch.no_grad():
        encode = peak_bytes(lambda: ae.encode(x))
        decode = peak_bytes(lambda: ae.decode(z))
    assert encode <= memory.encode_bytes(ae, 1, 256, 128) < 2.5 * encode, (encode, memory.encode_bytes(ae, 1, 256, 128))
    assert decode <= memory.decode_bytes(ae, 1, 16, 8) < 2.5 * decode, (decode, memory.decode_bytes(ae, 1, 16, 8))
