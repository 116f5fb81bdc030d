"""BFL's FLUX.2 small decoder: an autoencoder whose decoder is narrower than its encoder, as one file (BFL's
full_encoder_small_decoder.safetensors, a diffusers folder) or as a decoder on its own (small_decoder.safetensors:
the decoder's keys without "decoder.") beside a full autoencoder. Checked against diffusers' AutoencoderKLFlux2 with
``decoder_block_out_channels`` on tiny random weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from flux2_core import weights
from flux2_core.errors import Flux2Error
from flux2_core.runtime import memory
from tests.tiny.autoencoder import (
    TINY_AE_DIFFUSERS_CONFIG,
    bfl_state_dict,
    build_diffusers_autoencoder,
    save_bfl_autoencoder,
    save_diffusers_autoencoder,
)

# the real pair is (128, 256, 512, 512) / (96, 192, 384, 384); here the decoder is half the encoder's width
WIDE = {**TINY_AE_DIFFUSERS_CONFIG, "block_out_channels": (64, 64, 128, 128)}
SMALL = {**WIDE, "decoder_block_out_channels": (32, 32, 64, 64)}
BOUND = 1e-4           # float32 against diffusers, as test_weights.py's autoencoder parity (measured 1e-6 to 1.2e-5)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def diffusers_encode_decode(vae, image):
    """diffusers' latent (normalized, patchified) of ``image`` and its decode of that latent's mean."""
    with torch.no_grad():
        mean = vae.encode(image).latent_dist.mode()
        b, c, h, w = mean.shape
        patched = mean.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, 4 * c, h // 2, w // 2)
        std = torch.sqrt(vae.bn.running_var + vae.config.batch_norm_eps).view(1, -1, 1, 1)
        return (patched - vae.bn.running_mean.view(1, -1, 1, 1)) / std, vae.decode(mean).sample


@pytest.fixture(scope="module")
def image():
    return torch.rand(1, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1


@pytest.mark.parametrize("layout", ["bfl", "diffusers"])
def test_an_autoencoder_with_a_small_decoder_matches_diffusers(tmp_path, image, layout):
    vae = build_diffusers_autoencoder(seed=1, config=SMALL)
    path = (save_bfl_autoencoder(vae, tmp_path / "full_encoder_small_decoder.safetensors") if layout == "bfl"
            else save_diffusers_autoencoder(vae, tmp_path / "vae"))
    ae = weights.load_autoencoder(path, "cpu", torch.float32)
    assert ae.params.encoder_chans == (64, 64, 128, 128) and ae.params.decoder_chans == (32, 32, 64, 64)
    latent, decoded = diffusers_encode_decode(vae, image)
    with torch.no_grad():
        ours = ae.encode(image)
        assert rel(ours, latent) <= BOUND and rel(ae.decode(ours), decoded) <= BOUND


def test_a_decoder_alone_replaces_the_decoder_of_a_full_autoencoder(tmp_path, image):
    full = build_diffusers_autoencoder(seed=2, config=WIDE)
    small = build_diffusers_autoencoder(seed=3, config=SMALL)
    ae_file = save_bfl_autoencoder(full, tmp_path / "flux2-vae.safetensors")
    decoder_only = {k.removeprefix("decoder."): v for k, v in bfl_state_dict(small).items() if k.startswith("decoder.")}
    decoder_file = tmp_path / "small_decoder.safetensors"
    save_file(decoder_only, str(decoder_file))

    ae = weights.load_autoencoder(ae_file, "cpu", torch.float32, decoder=decoder_file)
    assert ae.params.decoder_chans == (32, 32, 64, 64)
    # what diffusers computes with the full autoencoder's encoder and latent statistics and the small decoder
    small.encoder.load_state_dict(full.encoder.state_dict())
    small.quant_conv.load_state_dict(full.quant_conv.state_dict())
    small.bn.load_state_dict(full.bn.state_dict())
    latent, decoded = diffusers_encode_decode(small, image)
    with torch.no_grad():
        ours = ae.encode(image)
        assert rel(ours, latent) <= BOUND and rel(ae.decode(ours), decoded) <= BOUND

    with pytest.raises(Flux2Error, match="decoder on its own .* --decoder small_decoder.safetensors"):
        weights.load_autoencoder(decoder_file, "cpu")
    with pytest.raises(Flux2Error, match="not a FLUX.2 decoder"):
        weights.load_autoencoder(ae_file, "cpu", decoder=write_other(tmp_path))


def write_other(tmp_path):
    """A safetensors file that is no decoder (a LoRA-like pair of tensors)."""
    path = tmp_path / "other.safetensors"
    save_file({"lora_unet_x.lora_down.weight": torch.zeros(4, 8)}, str(path))
    return path


def test_a_decoder_of_another_latent_width_is_refused_with_the_file_named(tmp_path):
    full = build_diffusers_autoencoder(seed=2, config=WIDE)
    other = build_diffusers_autoencoder(seed=3, config={**SMALL, "latent_channels": 16})
    ae_file = save_bfl_autoencoder(full, tmp_path / "flux2-vae.safetensors")
    decoder_file = tmp_path / "small_decoder.safetensors"
    save_file({k.removeprefix("decoder."): v for k, v in bfl_state_dict(other).items() if k.startswith("decoder.")},
              str(decoder_file))
    with pytest.raises(Flux2Error, match="small_decoder.safetensors decodes 16-channel latents but .*flux2-vae"):
        weights.load_autoencoder(ae_file, "cpu", decoder=decoder_file)


def test_memory_estimates_follow_the_smaller_decoder(tmp_path):
    vae = build_diffusers_autoencoder(seed=1, config=SMALL)
    small = weights.load_autoencoder(save_bfl_autoencoder(vae, tmp_path / "small.safetensors"), "cpu")
    wide = weights.load_autoencoder(save_bfl_autoencoder(build_diffusers_autoencoder(seed=1, config=WIDE),
                                                         tmp_path / "wide.safetensors"), "cpu")
    assert memory.decode_bytes(small, 1, 64, 64) * 2 == memory.decode_bytes(wide, 1, 64, 64)   # half the channels
    assert memory.encode_bytes(small, 1, 512, 512) == memory.encode_bytes(wide, 1, 512, 512)   # the same encoder
    assert memory.mid_bytes(small, 1, 8, 8) * 2 == memory.mid_bytes(wide, 1, 8, 8)
    assert memory.mid_bytes(small, 1, 8, 8, decoder=False) == memory.mid_bytes(wide, 1, 8, 8, decoder=False)
    assert dataclasses.replace(small.params, decoder_channels=None) == wide.params


@pytest.mark.parametrize("tile", [None, 5])
def test_a_nan_picture_from_a_decoder_file_names_the_decoder(tmp_path, image, tile):
    """A decoder given on its own (--decoder, the loader's decoder input) that holds NaN: the error names that file,
    not the autoencoder (whose file is fine); an autoencoder's own decoder still names the autoencoder's file."""
    full = build_diffusers_autoencoder(seed=2, config=WIDE)
    ae_file = save_bfl_autoencoder(full, tmp_path / "flux2-vae.safetensors")
    decoder_only = {k.removeprefix("decoder."): v.clone() for k, v in bfl_state_dict(full).items()
                    if k.startswith("decoder.")}
    decoder_only["conv_out.weight"].view(-1)[0] = float("nan")
    decoder_file = tmp_path / "small_decoder.safetensors"
    save_file(decoder_only, str(decoder_file))
    ae = weights.load_autoencoder(ae_file, "cpu", torch.float32, decoder=decoder_file)
    with torch.no_grad():
        latent = ae.encode(image)                         # the encoder is the autoencoder file's, and fine
        with pytest.raises(Flux2Error, match=rf"the decoder's weights \({decoder_file}\) hold NaN/inf .*download "
                                             r"small_decoder.safetensors again") as error:
            ae.decode(latent, tile=tile)
    assert str(ae_file) not in str(error.value) and "autoencoder's weights" not in str(error.value)

    own = {**bfl_state_dict(full), "decoder.conv_out.weight": decoder_only["conv_out.weight"]}
    save_file(own, str(tmp_path / "damaged-vae.safetensors"))
    ae = weights.load_autoencoder(tmp_path / "damaged-vae.safetensors", "cpu", torch.float32)
    with torch.no_grad(), pytest.raises(Flux2Error, match=r"the autoencoder's weights \(.*damaged-vae.safetensors\)"):
        ae.decode(latent, tile=tile)
