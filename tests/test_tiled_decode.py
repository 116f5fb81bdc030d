"""Tiled AE decode: the tiling itself is exact (halo covers the convolutions' reach, the blend is a convex
combination), the one approximation is per-tile GroupNorm statistics, and ``memory.decode_tile`` picks tiles (and a
batch too large for one piece is decoded one image at a time) only when the estimated memory does not fit."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from torch import nn

from flux2_core.errors import Flux2Error
from flux2_core.models.autoencoder import AutoEncoder, tile_spans
from flux2_core.runtime import memory
from flux2_core.variants import FLUX2_AE
from tests.device import STAGES, unit_roundoff
from tests.tiny.autoencoder import TINY_AE_PARAMS, bfl_state_dict, build_diffusers_autoencoder


@pytest.fixture(scope="module")
def ae():
    """FLUX.2's decoder layout at 32 base channels (halo 13 decoder cells = 7 latent cells)."""
    model = AutoEncoder(TINY_AE_PARAMS)
    model.load_state_dict(bfl_state_dict(build_diffusers_autoencoder(seed=0)))
    return model.eval()


@pytest.fixture(scope="module")
def short_ae():
    """One ResnetBlock fewer per level: halo 9 decoder cells = 5 latent cells, so tiles cut small latents cheaply."""
    model = AutoEncoder(replace(TINY_AE_PARAMS, num_res_blocks=1))
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        for name, p in model.named_parameters():
            if p.ndim == 1:                                         # GroupNorm scales and shifts, conv biases
                p.add_(0.2 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def z():
    return torch.randn(1, 128, 22, 6, generator=torch.Generator().manual_seed(0))   # 352 x 96 px


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_halo_covers_the_reach_of_the_convolutions(ae):
    """One output pixel's gradient w.r.t. the decoder's latent input is zero beyond ``halo`` cells (GroupNorm off)."""
    decoder = ae.decoder
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(nn.GroupNorm, "forward", lambda self, x: x)      # statistics would couple every position
        h = torch.randn(1, 64, 40, 40, requires_grad=True)
        decoder.upsample(h)[0, :, 8 * 20 + 7, 8 * 20 + 7].sum().backward()
    rows, cols = (h.grad.abs().sum(dim=(0, 1)) > 0).nonzero(as_tuple=True)
    reach = max(20 - rows.min().item(), rows.max().item() - 20, 20 - cols.min().item(), cols.max().item() - 20)
    assert reach <= decoder.halo == 13                               # 12.25 cells for FLUX.2's decoder layout


def test_tiling_is_exact_without_groupnorm_statistics(short_ae, z):
    """With GroupNorm reduced to its affine part the decoder is local, so tiles + halo + blend must give the full decode
    up to float32 rounding of differently sized convolutions: each side within the decoder's depth of roundings
    (tests/device.py) of the exact value. Seen up to 1.3e-6 (the kernels oneDNN picks differ between runs and CPUs)."""
    bound = 2 * STAGES["autoencoder"] * unit_roundoff(torch.float32)          # 2.4e-6
    assert short_ae.decoder.halo == 9
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setattr(nn.GroupNorm, "forward",
                   lambda self, x: x * self.weight[None, :, None, None] + self.bias[None, :, None, None])
        for latent in (z, z.transpose(2, 3)):
            full = short_ae.decode(latent)
            for tile, overlap in [(6, 2), (5, 0)]:                   # 5 and 5 tiles along the long side
                assert rel(short_ae.decode_tiled(latent, tile, overlap), full) <= bound


def test_tiled_decode_is_close_to_full_decode(ae):
    """The real decoder: each tile (with its halo) normalises with its own GroupNorm statistics, which deviate from
    the whole image's by sampling noise, the more so the smaller the tile. On this tiny AE (one channel per group, the
    noisiest case; the real AE has 4 to 16) with a 20 x 12 latent the measured difference is 8.2% of max|full| for
    8-cell tiles and 2.6% for 12-cell tiles (other layouts: 2.5% to 11%); 15% bounds it with margin, and bigger tiles
    must be closer. A tile covering the latent is the full decode, bit for bit."""
    z = torch.randn(1, 128, 20, 12, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = ae.decode(z)
        small, large = rel(ae.decode_tiled(z, 8, 2), full), rel(ae.decode_tiled(z, 12, 4), full)
        assert 0 < large < small <= 0.15
        assert torch.equal(ae.decode_tiled(z, 20), full)


def test_decode_tiles_only_when_memory_is_short(ae, z):
    with torch.no_grad():
        full = ae.decode(z)
        free = memory.free_memory(ae.device)
        assert memory.decode_tile(ae, 1, 22, 6, free) is None                 # plenty of memory here: one piece
        assert memory.decode_tile(ae, 1, 22, 6, None) is None                 # unknown: one piece

        one = memory.decode_bytes(ae, 1, 22, 6)
        tile = memory.decode_tile(ae, 1, 22, 6, one // 2)
        assert 8 <= tile < 22
        assert memory.decode_bytes(ae, 1, min(22, tile + 14), 6) <= one // 2 or tile == 8   # it fits, or the minimum
        assert torch.equal(ae.decode(z, tile), ae.decode_tiled(z, tile))

        pair = torch.cat([z, z.flip(-1)])                             # two images fit one at a time, not together
        assert memory.decode_tile(ae, 2, 22, 6, int(1.5 * one)) is not None
        tiles = [memory.decode_tile(ae, 1, 22, 6, int(1.5 * one)) for _ in pair]
        decoded = torch.cat([ae.decode(image[None], t) for image, t in zip(pair, tiles)])
        assert torch.equal(decoded, torch.cat([full, ae.decode(z.flip(-1))]))


def test_decode_bytes_scales_with_pixels_channels_and_dtype(ae):
    assert memory.decode_bytes(ae, 2, 16, 16) == 2 * memory.decode_bytes(ae, 1, 16, 16) == 8 * memory.decode_bytes(ae, 1, 8, 8)
    with torch.device("meta"):
        real = AutoEncoder(FLUX2_AE).to(torch.bfloat16)
    # FLUX.2's AE (128 base channels) in bf16 at 1024^2: about 2.7 GB (a published figure for its decode: 2.9 GB peak).
    assert 2.5e9 < memory.decode_bytes(real, 1, 64, 64) < 3.0e9
    assert memory.decode_bytes(real, 1, 64, 64) == 2 * memory.decode_bytes(ae, 1, 64, 64)    # 4x the channels, half the bytes


def test_tile_spans_cover_with_overlap():
    assert tile_spans(10, 16, 4) == [(0, 10)]
    for n, tile, overlap in [(24, 8, 2), (100, 64, 8), (37, 9, 3)]:
        spans = tile_spans(n, tile, overlap)
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(b - a == tile for a, b in spans)
        assert all(prev[1] - nxt[0] >= overlap for prev, nxt in itertools.pairwise(spans))


def test_bad_tile_arguments(ae, z):
    with pytest.raises(Flux2Error, match="overlap < tile"):
        ae.decode_tiled(z, tile=4, overlap=4)
