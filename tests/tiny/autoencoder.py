"""A tiny random FLUX.2 autoencoder for tests, in diffusers form and in BFL single-file form.

The real AE has block channels (128, 256, 512, 512); the tiny one (32, 32, 64, 64) keeps 4 levels (8x down),
32 latent channels and 32 GroupNorm groups, so every code path and every key of the real model is exercised.

diffusers 0.42.1 cannot read or write the BFL single-file layout of this VAE, so the BFL file is made here from the
diffusers weights with our own rename table (``DIFFUSERS_TO_BFL``), independent of ``flux2_core``.

    vae = build_diffusers_autoencoder()            # AutoencoderKLFlux2, eval mode, float32
    save_bfl_autoencoder(vae, tmp / "ae.safetensors")
    save_diffusers_autoencoder(vae, tmp / "vae")   # a diffusers folder: config.json + weights
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from flux2_core.variants import AutoEncoderParams

TINY_AE_PARAMS = AutoEncoderParams(ch=32, ch_mult=(1, 1, 2, 2))

TINY_AE_DIFFUSERS_CONFIG = {"block_out_channels": (32, 32, 64, 64), "layers_per_block": 2, "latent_channels": 32,
                            "norm_num_groups": 32}

# diffusers key fragment (regex) -> BFL key fragment, applied in order to every key. Decoder up blocks are
# numbered in reverse (diffusers up_blocks.0 is the deepest, BFL up.0 the shallowest); see ``bfl_key``.
DIFFUSERS_TO_BFL = [
    (r"^quant_conv\.", "encoder.quant_conv."),
    (r"^post_quant_conv\.", "decoder.post_quant_conv."),
    (r"\.conv_norm_out\.", ".norm_out."),
    (r"\.down_blocks\.(\d+)\.resnets\.", r".down.\1.block."),
    (r"\.down_blocks\.(\d+)\.downsamplers\.0\.", r".down.\1.downsample."),
    (r"\.up_blocks\.(\d+)\.resnets\.", r".up.\1.block."),
    (r"\.up_blocks\.(\d+)\.upsamplers\.0\.", r".up.\1.upsample."),
    (r"\.conv_shortcut\.", ".nin_shortcut."),
    (r"\.mid_block\.resnets\.0\.", ".mid.block_1."),
    (r"\.mid_block\.resnets\.1\.", ".mid.block_2."),
    (r"\.mid_block\.attentions\.0\.group_norm\.", ".mid.attn_1.norm."),
    (r"\.mid_block\.attentions\.0\.to_q\.", ".mid.attn_1.q."),
    (r"\.mid_block\.attentions\.0\.to_k\.", ".mid.attn_1.k."),
    (r"\.mid_block\.attentions\.0\.to_v\.", ".mid.attn_1.v."),
    (r"\.mid_block\.attentions\.0\.to_out\.0\.", ".mid.attn_1.proj_out."),
]


def build_diffusers_autoencoder(seed: int = 0, config: dict | None = None):
    """A random ``AutoencoderKLFlux2`` (tiny config by default) in eval mode, float32, on CPU.

    Weights are diffusers' default init, with GroupNorm scales/shifts and conv biases perturbed so none is trivial.
    The latent BatchNorm gets running_mean ~ 0.1 N(0,1) and running_var ~ U(0.5, 1.5). The global RNG is untouched.
    """
    from diffusers import AutoencoderKLFlux2

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLFlux2(**(config or TINY_AE_DIFFUSERS_CONFIG))
        with torch.no_grad():
            for name, p in vae.named_parameters():
                if p.ndim == 1 and name.endswith("weight"):      # GroupNorm scales around 1
                    p.add_(0.2 * torch.randn_like(p))
                elif p.ndim == 1:                                  # biases
                    p.add_(0.1 * torch.randn_like(p))
            vae.bn.running_mean.copy_(0.1 * torch.randn_like(vae.bn.running_mean))
            vae.bn.running_var.copy_(0.5 + torch.rand_like(vae.bn.running_var))
            vae.bn.num_batches_tracked.fill_(1000)
    return vae.eval()


def bfl_key(diffusers_key: str, num_levels: int) -> str:
    """The BFL ``ae.safetensors`` name of one diffusers ``AutoencoderKLFlux2`` state-dict key."""
    key = re.sub(r"^decoder\.up_blocks\.(\d+)\.",
                 lambda m: f"decoder.up_blocks.{num_levels - 1 - int(m.group(1))}.", diffusers_key)
    for pattern, replacement in DIFFUSERS_TO_BFL:
        key = re.sub(pattern, replacement, key)
    return key


def bfl_state_dict(vae) -> dict[str, torch.Tensor]:
    """The diffusers VAE's weights renamed to BFL's layout; attention Linear weights become 1x1 conv weights."""
    num_levels = len(vae.config.block_out_channels)
    out = {}
    for key, tensor in vae.state_dict().items():
        new_key = bfl_key(key, num_levels)
        if ".attn_1." in new_key and new_key.endswith("weight") and tensor.ndim == 2:
            tensor = tensor[:, :, None, None]                        # Linear [C,C] -> Conv2d 1x1 [C,C,1,1]
        out[new_key] = tensor.detach().clone().contiguous()
    return out


def save_bfl_autoencoder(vae, path: str | Path) -> Path:
    """Write the VAE as a BFL-format single ``.safetensors`` file (like ``ae.safetensors``); returns the path."""
    path = Path(path)
    save_file(bfl_state_dict(vae), str(path))
    return path


def save_diffusers_autoencoder(vae, folder: str | Path) -> Path:
    """Write the VAE as a diffusers folder (``config.json`` + ``diffusion_pytorch_model.safetensors``)."""
    folder = Path(folder)
    vae.save_pretrained(str(folder), safe_serialization=True)
    return folder
