"""The FLUX.2 autoencoder against diffusers 0.42.1 ``AutoencoderKLFlux2`` on the same tiny random weights.

The diffusers side does what ``Flux2KleinPipeline`` does: encode = ``vae.encode(x).latent_dist.mode()``, patchify,
``(z - running_mean) / sqrt(running_var + eps)``; decode = ``z * std + mean``, unpatchify, ``vae.decode``.
Ours runs in the device mode's dtype and device (``tests/device.py``), diffusers in float32 on the same device.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from flux2_core.errors import Flux2Error
from flux2_core.models.autoencoder import AutoEncoder, patchify, unpatchify
from flux2_core.variants import FLUX2_AE
from tests.device import DEVICE, DTYPE, to, tolerance
from tests.tiny.autoencoder import TINY_AE_PARAMS, build_diffusers_autoencoder, save_bfl_autoencoder

pytest.importorskip("diffusers")


BOUND = tolerance("autoencoder")


def rel_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max|ours - ref| / max|ref|; the parity bound is BOUND (1e-4 in float32)."""
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    ours, ref = ours.float(), ref.float()
    return ((ours - ref).abs().max() / ref.abs().max()).item()


# diffusers' own patchify and BatchNorm steps, as in pipeline_flux2_klein.py (_patchify_latents, _encode_vae_image,
# and the decode tail of __call__), written out here so the test does not depend on our functions.
def pipeline_patchify(z):
    b, c, h, w = z.shape
    return z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)


def pipeline_unpatchify(z):
    b, c, h, w = z.shape
    return z.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // 4, h * 2, w * 2)


def pipeline_bn(vae):
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    return mean, std


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(diffusers VAE in float32, our AutoEncoder in DTYPE loaded from the BFL-format file of the same weights)."""
    vae = build_diffusers_autoencoder(seed=0)
    path = save_bfl_autoencoder(vae, tmp_path_factory.mktemp("ae") / "ae.safetensors")
    ours = AutoEncoder(TINY_AE_PARAMS).eval()
    ours.load_state_dict(load_file(str(path)), strict=True)
    return vae.to(DEVICE), to(ours)


def test_encode_matches_diffusers(models):
    vae, ours = models
    x = torch.rand(2, 3, 64, 96, generator=torch.Generator().manual_seed(1)).to(DEVICE) * 2 - 1   # non-square, batch 2
    with torch.no_grad():
        mean, std = pipeline_bn(vae)
        ref = (pipeline_patchify(vae.encode(x).latent_dist.mode()) - mean) / std
        got = ours.encode(x)
    assert got.shape == (2, 128, 4, 6) and got.device.type == DEVICE.type
    diff = rel_diff(got, ref)
    print(f"encode: max rel diff {diff:.2e}")
    assert diff <= BOUND


def test_decode_matches_diffusers(models):
    vae, ours = models
    z = torch.randn(2, 128, 4, 6, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with torch.no_grad():
        mean, std = pipeline_bn(vae)
        ref = vae.decode(pipeline_unpatchify(z * std + mean)).sample
        got = ours.decode(z)
    assert got.shape == (2, 3, 64, 96) and got.dtype == DTYPE
    diff = rel_diff(got, ref)
    print(f"decode: max rel diff {diff:.2e}")
    assert diff <= BOUND


def test_patchify_channel_order():
    z = torch.randn(2, 5, 6, 8)
    p = patchify(z)
    assert p.shape == (2, 20, 3, 4)
    # channel c*4 + pi*2 + pj at (i, j) holds pixel (2i+pi, 2j+pj) of channel c
    assert p[1, 3 * 4 + 1 * 2 + 0, 2, 1] == z[1, 3, 2 * 2 + 1, 2 * 1 + 0]
    assert torch.equal(p, pipeline_patchify(z))
    assert torch.equal(unpatchify(p), z)


def test_normalize_formula_and_inverse(models):
    """BatchNorm eval with BFL's eps 1e-4, checked on near-zero variances where the eps dominates (the formula: float32
    on the CPU in every mode)."""
    _, ours = models
    ae = AutoEncoder(TINY_AE_PARAMS).eval()
    ae.load_state_dict(ours.state_dict())
    var = torch.linspace(0.0, 2e-4, 128)
    ae.bn.running_var.copy_(var)
    z = torch.randn(1, 128, 3, 5)
    expected = (z - ae.bn.running_mean.view(1, -1, 1, 1)) / torch.sqrt(var.view(1, -1, 1, 1) + 1e-4)
    assert torch.allclose(ae.normalize(z), expected, rtol=1e-6, atol=1e-6)
    assert torch.allclose(ae.denormalize(ae.normalize(z)), z, atol=1e-5)
    # the model under test, in DTYPE on DEVICE: normalize and denormalize are inverses to its own rounding
    z = z.to(DEVICE)
    assert torch.allclose(ours.denormalize(ours.normalize(z)), z, atol=1e-5)     # both in float32


def test_runs_in_weight_dtype(models):
    _, ours = models
    half = AutoEncoder(TINY_AE_PARAMS).eval().to(DEVICE, torch.bfloat16)
    half.load_state_dict(ours.state_dict())
    x = torch.rand(1, 3, 32, 48, device=DEVICE) * 2 - 1            # float32 input is cast to bf16
    with torch.no_grad():
        z = half.encode(x)
        img = half.decode(z)
    assert z.dtype == torch.float32 and z.shape == (1, 128, 2, 3)
    assert img.dtype == torch.bfloat16 and img.shape == (1, 3, 32, 48)


def test_size_and_channel_errors(models):
    _, ours = models
    with pytest.raises(Flux2Error, match="multiple of 16"):
        ours.encode(torch.zeros(1, 3, 64, 72, device=DEVICE))
    with pytest.raises(Flux2Error, match="RGB"):
        ours.encode(torch.zeros(1, 4, 64, 64, device=DEVICE))
    with pytest.raises(Flux2Error, match="128"):
        ours.decode(torch.zeros(1, 16, 4, 4, device=DEVICE))


def test_real_config_keys_on_meta():
    with torch.device("meta"):
        ae = AutoEncoder(FLUX2_AE)
    sd = ae.state_dict()
    assert len(sd) == 251
    assert round(sum(t.numel() for t in sd.values()) / 1e6, 2) == 84.05
    expected_shapes = {
        "encoder.conv_in.weight": (128, 3, 3, 3),
        "encoder.down.1.block.0.nin_shortcut.weight": (256, 128, 1, 1),
        "encoder.down.2.downsample.conv.weight": (512, 512, 3, 3),
        "encoder.mid.attn_1.q.weight": (512, 512, 1, 1),
        "encoder.conv_out.weight": (64, 512, 3, 3),
        "encoder.quant_conv.weight": (64, 64, 1, 1),
        "decoder.post_quant_conv.weight": (32, 32, 1, 1),
        "decoder.conv_in.weight": (512, 32, 3, 3),
        "decoder.up.0.block.0.nin_shortcut.weight": (128, 256, 1, 1),
        "decoder.up.1.block.2.conv2.weight": (256, 256, 3, 3),
        "decoder.up.3.upsample.conv.weight": (512, 512, 3, 3),
        "decoder.mid.attn_1.proj_out.weight": (512, 512, 1, 1),
        "decoder.conv_out.weight": (3, 128, 3, 3),
        "bn.running_mean": (128,),
        "bn.running_var": (128,),
        "bn.num_batches_tracked": (),
    }
    for key, shape in expected_shapes.items():
        assert tuple(sd[key].shape) == shape, key
    # the key families of ae.safetensors, and nothing else
    assert not any("downsample" in k for k in sd if k.startswith("encoder.down.3."))
    assert not any("upsample" in k for k in sd if k.startswith("decoder.up.0."))
    assert {k for k in sd if "nin_shortcut.weight" in k} == {
        "encoder.down.1.block.0.nin_shortcut.weight", "encoder.down.2.block.0.nin_shortcut.weight",
        "decoder.up.0.block.0.nin_shortcut.weight", "decoder.up.1.block.0.nin_shortcut.weight"}
    assert sum(k.startswith("decoder.up.") and k.endswith("conv1.weight") for k in sd) == 12   # 4 levels x 3

