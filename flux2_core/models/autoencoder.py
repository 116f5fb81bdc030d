"""The FLUX.2 autoencoder: pixels [B,3,H,W] in [-1,1] <-> latents [B,128,H/16,W/16] (a VAE 8x down, patchified 2x2,
BatchNorm-normalised by hand in eval form). Names follow BFL's ``ae.safetensors``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ..checks import dtype_cause, finite
from ..errors import Flux2Error
from ..variants import AutoEncoderParams


def swish(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)


def group_norm(channels: int, groups: int) -> nn.GroupNorm:
    return nn.GroupNorm(groups, channels, eps=1e-6, affine=True)


def conv_layout(x: torch.Tensor) -> torch.Tensor:
    """Channels-last on CPU (oneDNN's native layout: decode 1.3x faster) and for 16-bit CUDA (tensor-core layout)."""
    fast = x.is_cpu or (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16))
    return x.contiguous(memory_format=torch.channels_last) if fast and x.ndim == 4 else x


def patchify(z: torch.Tensor) -> torch.Tensor:
    """[B,C,H,W] -> [B,4C,H/2,W/2]; output channel = c*4 + pi*2 + pj for the pixel (2i+pi, 2j+pj)."""
    return rearrange(z, "b c (h pi) (w pj) -> b (c pi pj) h w", pi=2, pj=2)


def unpatchify(z: torch.Tensor) -> torch.Tensor:
    return rearrange(z, "b (c pi pj) h w -> b c (h pi) (w pj)", pi=2, pj=2)


# Building blocks -----------------------------------------------------------------------------------------------------

class ResnetBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, groups: int):
        super().__init__()
        self.norm1 = group_norm(in_ch, groups)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.norm2 = group_norm(out_ch, groups)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(swish(self.norm1(x)))
        h = self.conv2(swish(self.norm2(h)))
        skip = x if self.nin_shortcut is None else self.nin_shortcut(x)
        return skip + h


class AttnBlock(nn.Module):
    """Single-head self-attention over the H*W positions, with 1x1 convs for q, k, v and the output."""

    def __init__(self, ch: int, groups: int):
        super().__init__()
        self.norm = group_norm(ch, groups)
        self.q = nn.Conv2d(ch, ch, 1)
        self.k = nn.Conv2d(ch, ch, 1)
        self.v = nn.Conv2d(ch, ch, 1)
        self.proj_out = nn.Conv2d(ch, ch, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, _, height, width = x.shape
        h = self.norm(x)
        # SDPA's fused kernels need channel stride 1, else the math kernel makes [B,1,HW,HW] scores (16 GiB at 2048^2)
        q, k, v = (rearrange(conv(h), "b c h w -> b 1 (h w) c").contiguous() for conv in (self.q, self.k, self.v))
        h = F.scaled_dot_product_attention(q, k, v)                      # [B,1,HW,C]
        h = rearrange(h, "b 1 (h w) c -> b c h w", h=height, w=width)
        return x + self.proj_out(h)


class Downsample(nn.Module):
    """Halve H and W: zero-pad right and bottom by one, then a 3x3 conv with stride 2 and no padding."""

    def __init__(self, ch: int):
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    """Double H and W: nearest-neighbour repeat, then a 3x3 conv."""

    def __init__(self, ch: int):
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class MidBlock(nn.Module):
    """ResnetBlock, AttnBlock, ResnetBlock at the lowest resolution."""

    def __init__(self, ch: int, groups: int):
        super().__init__()
        self.block_1 = ResnetBlock(ch, ch, groups)
        self.attn_1 = AttnBlock(ch, groups)
        self.block_2 = ResnetBlock(ch, ch, groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_2(self.attn_1(self.block_1(x)))


class Level(nn.Module):
    """An absent resampler is an ``nn.Identity``: no weights, so no state-dict keys."""

    def __init__(self, in_ch: int, out_ch: int, n_blocks: int, groups: int, resample: str | None):
        super().__init__()
        self.block = nn.ModuleList(
            [ResnetBlock(in_ch if i == 0 else out_ch, out_ch, groups) for i in range(n_blocks)])
        self.downsample = Downsample(out_ch) if resample == "down" else nn.Identity()
        self.upsample = Upsample(out_ch) if resample == "up" else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.block:
            x = block(x)
        return self.upsample(self.downsample(x))


# Encoder and decoder -------------------------------------------------------------------------------------------------

class Encoder(nn.Module):
    """[B,3,H,W] -> moments [B,2*z,H/8,W/8] (mean, then log-variance)."""

    def __init__(self, p: AutoEncoderParams):
        super().__init__()
        chans = p.encoder_chans                                          # 128, 256, 512, 512
        last = len(chans) - 1
        self.conv_in = nn.Conv2d(p.in_channels, p.ch, 3, padding=1)
        self.down = nn.ModuleList([
            Level(p.ch if i == 0 else chans[i - 1], chans[i], p.num_res_blocks, p.num_groups,
                  resample="down" if i < last else None)
            for i in range(len(chans))])
        self.mid = MidBlock(chans[-1], p.num_groups)
        self.norm_out = group_norm(chans[-1], p.num_groups)
        self.conv_out = nn.Conv2d(chans[-1], 2 * p.z_channels, 3, padding=1)
        self.quant_conv = nn.Conv2d(2 * p.z_channels, 2 * p.z_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for level in self.down:
            h = level(h)
        h = self.mid(h)
        h = self.conv_out(swish(self.norm_out(h)))
        return self.quant_conv(h)


class Decoder(nn.Module):
    """z [B,z,h,w] -> image [B,3,8h,8w]. Levels run from the deepest (``up[-1]``) to ``up[0]``."""

    def __init__(self, p: AutoEncoderParams):
        super().__init__()
        chans = p.decoder_chans                                          # 128, 256, 512, 512 (small: 96, ..., 384)
        last = len(chans) - 1
        self.post_quant_conv = nn.Conv2d(p.z_channels, p.z_channels, 1)
        self.conv_in = nn.Conv2d(p.z_channels, chans[-1], 3, padding=1)
        self.mid = MidBlock(chans[-1], p.num_groups)
        # level i takes level i+1's channels (or the mid block's) and upsamples unless it is level 0
        self.up = nn.ModuleList([
            Level(chans[i + 1] if i < last else chans[-1], chans[i], p.num_res_blocks + 1, p.num_groups,
                  resample="up" if i > 0 else None)
            for i in range(len(chans))])
        self.norm_out = group_norm(chans[0], p.num_groups)
        self.conv_out = nn.Conv2d(chans[0], p.out_ch, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.upsample(self.head(z))

    def head(self, z: torch.Tensor) -> torch.Tensor:
        """z [B,z,h,w] -> [B,512,h,w]: the mid block's attention sees every position, so it is never tiled."""
        return self.mid(self.conv_in(self.post_quant_conv(z)))

    def upsample(self, h: torch.Tensor) -> torch.Tensor:
        """[B,512,h,w] -> [B,3,8h,8w]: only convolutions and GroupNorms, so it tiles."""
        for level in reversed(self.up):
            h = level(h)
        return self.conv_out(swish(self.norm_out(h)))

    @property
    def halo(self) -> int:
        """How far one output pixel sees, in ``upsample``'s input cells rounded up (a 3x3 conv at 2^k x: 2^-k)."""
        reach, levels = 0.0, len(self.up)
        for k, level in enumerate(reversed(self.up)):              # k = 0 at the latent resolution
            reach += 2 * len(level.block) / 2 ** k
            if isinstance(level.upsample, Upsample):
                reach += 1 / 2 ** (k + 1)
        reach += 1 / 2 ** (levels - 1)                                # conv_out at full resolution
        return math.ceil(reach)


# Memory and tiles ----------------------------------------------------------------------------------------------------

DEFAULT_TILE = 64                # latent cells = 1024 px
MIN_TILE = 8                     # latent cells = 128 px


def tile_spans(n: int, tile: int, overlap: int) -> list[tuple[int, int]]:
    """Spans of ``tile`` over 0..n evenly spaced, neighbours overlapping >= overlap."""
    if n <= tile:
        return [(0, n)]
    count = math.ceil((n - overlap) / (tile - overlap))
    starts = [round(i * (n - tile) / (count - 1)) for i in range(count)]
    return [(s, s + tile) for s in starts]


def _ramp(start: int, end: int, n: int, fade: int, scale: int) -> torch.Tensor:
    """One tile's blend weights along one axis: linear fades where it borders another tile; never 0."""
    weights = torch.ones((end - start) * scale)
    fade = min(fade, len(weights))
    if fade == 0:
        return weights
    up = (torch.arange(fade) + 0.5) / fade
    if start > 0:
        weights[:fade] = torch.minimum(weights[:fade], up)
    if end < n:
        weights[-fade:] = torch.minimum(weights[-fade:], up.flip(0))
    return weights


# The autoencoder -----------------------------------------------------------------------------------------------------

@dataclass
class WeightFiles:
    autoencoder: str | None = None
    decoder: str | None = None            # a separate decoder file that replaced the autoencoder's decoder


class AutoEncoder(nn.Module):
    """Convolutions run in the weights' dtype; the latent BatchNorm in float32, so latents come back float32."""

    def __init__(self, params: AutoEncoderParams):
        super().__init__()
        self.params = params
        self.encoder = Encoder(params)
        self.decoder = Decoder(params)
        self.bn = nn.BatchNorm2d(4 * params.z_channels, eps=params.bn_eps, affine=False, track_running_stats=True)
        # set by the loader, so a NaN message names the right file
        self.files = WeightFiles()

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.conv_in.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.encoder.conv_in.weight.device

    @property
    def pixels_per_latent(self) -> int:
        return 2 * self.params.downscale

    @property
    def latent_channels(self) -> int:
        return 4 * self.params.z_channels

    # latent BatchNorm (eval form, float32) -------------------------------------------------------------------------

    def _bn_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = self.bn.running_mean.float().to(like.device).view(1, -1, 1, 1)
        std = torch.sqrt(self.bn.running_var.float().to(like.device) + self.params.bn_eps).view(1, -1, 1, 1)
        return mean, std

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        mean, std = self._bn_stats(z)
        return (z.float() - mean) / std

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        mean, std = self._bn_stats(z)
        return z.float() * std + mean

    # encode / decode ----------------------------------------------------------------------------------------------

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[B,3,H,W] in [-1,1], sides multiples of 16 -> [B,128,H/16,W/16] float32; both checked for NaN / inf."""
        self._check_image(x)
        finite(x, "the image to encode", ["it came from a node or file that produced NaN/inf pixels"])
        moments = self.encoder(conv_layout(x.to(self.device, self.dtype)))   # [B,64,H/8,W/8]
        mean = moments[:, : self.params.z_channels]                     # posterior mean; log-variance unused
        return finite(self.normalize(patchify(mean)), "the encoded latents",                   # [B,128,H/16,W/16]
                      self._causes(self.files.autoencoder))

    def decode(self, z: torch.Tensor, tile: int | None = None) -> torch.Tensor:
        """[B,128,h,w] -> [B,3,16h,16w] in the weights' dtype, roughly [-1,1] (not clamped); ``tile``: cells a tile."""
        self._check_latent(z)
        finite(z, "the latents to decode", [("the sampler that made them produced NaN/inf (its model's weights, an "
                                             "extreme cfg, or float16 overflow in it)")])
        causes = self._causes(self.files.decoder or self.files.autoencoder, self.files.decoder is not None)
        if tile is not None:
            return finite(self.decode_tiled(z, tile), "the decoded images", causes)
        z = unpatchify(self.denormalize(z.to(self.device)))             # [B,32,2h,2w]
        return finite(self.decoder(conv_layout(z.to(self.dtype))), "the decoded images", causes)

    def _causes(self, file: str | None, decoder: bool = False) -> list[str]:
        """``decoder``: the weights come from a separate decoder file (``--decoder``)."""
        part = "the decoder" if decoder else "the autoencoder"
        again = Path(file).name if file else "small_decoder.safetensors" if decoder else "flux2-vae.safetensors"
        return [*dtype_cause(self.dtype, part), (f"{part}'s weights{f' ({file})' if file else ''} hold NaN/inf (a "
                f"damaged or wrongly converted file: download {again} again)")]

    # tiled decode -------------------------------------------------------------------------------------------------

    def decode_tiled(self, z: torch.Tensor, tile: int | None = None, overlap: int = 4) -> torch.Tensor:
        """The mid block sees the whole latent; the levels run per tile with a halo, cross-faded over ``overlap``
        cells. Per-tile GroupNorm statistics make it inexact."""
        self._check_latent(z)
        tile = tile or DEFAULT_TILE
        if tile < 1 or overlap < 0 or overlap >= tile:
            raise Flux2Error(f"decode_tiled needs tile >= 1 and 0 <= overlap < tile (latent cells), got tile={tile}, "
                             f"overlap={overlap}")
        batch, _, h, w = z.shape
        scale, halo = self.pixels_per_latent, math.ceil(self.decoder.halo / 2)   # halo in z cells (2 decoder cells)
        z = unpatchify(self.denormalize(z.to(self.device))).to(self.dtype)        # [B,32,2h,2w]
        mid = self.decoder.head(conv_layout(z))                                  # [B,512,2h,2w]

        out = torch.zeros(batch, self.params.out_ch, h * scale, w * scale, device=self.device)
        weight = torch.zeros(1, 1, h * scale, w * scale, device=self.device)
        for y0, y1 in tile_spans(h, tile, overlap):
            for x0, x1 in tile_spans(w, tile, overlap):
                ya, yb, xa, xb = max(0, y0 - halo), min(h, y1 + halo), max(0, x0 - halo), min(w, x1 + halo)
                pixels = self.decoder.upsample(mid[:, :, 2 * ya:2 * yb, 2 * xa:2 * xb])   # tile + halo
                pixels = pixels[:, :, (y0 - ya) * scale:(y1 - ya) * scale, (x0 - xa) * scale:(x1 - xa) * scale]
                ramp = (_ramp(y0, y1, h, overlap * scale, scale)[:, None] *
                        _ramp(x0, x1, w, overlap * scale, scale)[None, :]).to(self.device)
                out[:, :, y0 * scale:y1 * scale, x0 * scale:x1 * scale] += pixels.float() * ramp
                weight[:, :, y0 * scale:y1 * scale, x0 * scale:x1 * scale] += ramp
        return (out / weight).to(self.dtype)

    # input checks -------------------------------------------------------------------------------------------------

    def _check_image(self, x: torch.Tensor) -> None:
        if x.ndim != 4 or x.shape[1] != self.params.in_channels:
            raise Flux2Error(f"the autoencoder takes images shaped [batch, {self.params.in_channels}, height, width] "
                             f"(RGB, channels first), got {list(x.shape)}; drop any alpha channel and convert "
                             f"grey images to RGB first")
        n = self.pixels_per_latent
        height, width = x.shape[-2:]
        if height % n or width % n:
            raise Flux2Error(f"image size {width}x{height} (WxH) is not a multiple of {n}: the autoencoder needs both "
                             f"sides divisible by {n}; resize or crop to e.g. {width // n * n}x{height // n * n}")
        if height < n or width < n:
            raise Flux2Error(f"image size {width}x{height} (WxH) is too small: both sides must be at least {n} pixels")

    def _check_latent(self, z: torch.Tensor) -> None:
        if z.ndim != 4 or z.shape[1] != self.latent_channels:
            raise Flux2Error(f"the autoencoder decodes FLUX.2 latents shaped [batch, {self.latent_channels}, "
                             f"height/16, width/16], got {list(z.shape)}; latents from other models "
                             f"(e.g. FLUX.1 with 16 channels) cannot be decoded by the FLUX.2 autoencoder")
