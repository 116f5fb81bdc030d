"""Memory: what each stage needs, what a device has free, and the decisions taken from the two.

Models never decide these themselves; callers ask here. Estimates are in bytes; the tests check the measured factors.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import Flux2Error
from ..families import family_of_params
from ..latents import latent_size
from ..models.autoencoder import MIN_TILE
from ..storage.protocol import call_bytes
from ..variants import Variant
from .parallel import world_of

GIB = 1 << 30
STREAM_MARGIN = 512 << 20     # bytes kept free beside streamed weights and activations (fragmentation, workspaces)
ENCODE_MARGIN = 256 << 20     # bytes for one 512-token encode's activations (Qwen3-8B in bf16: well under this)


# --- the probe --------------------------------------------------------------------------------------------------

def free_memory(device) -> int | None:
    """Free plus cached-but-unused on CUDA; on the CPU what the OS can give without swapping. None: unknown, so
    nothing is refused, streamed or tiled."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return int(psutil.virtual_memory().available)
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def module_bytes(module: nn.Module) -> int:
    return sum(t.nbytes for t in (*module.parameters(), *module.buffers()))


# --- the transformer ----------------------------------------------------------------------------------------------

def denoise_memory(params, tokens: int, batch: int, dtype: torch.dtype, ranks: int = 1) -> int:
    """Peak activation bytes for ``batch`` model items (CFG doubles it); with ``ranks`` > 1 one rank's."""
    # upper bound: a rank holds <= tokens / ranks + 1 tokens plus 8 heads-layout tensors [L, H / ranks]
    arch = family_of_params(params).memory(params)
    local = tokens if ranks == 1 else -(-tokens // ranks) + 1
    heads_layout = 0 if ranks == 1 else 8 * tokens * (arch.hidden // ranks) * dtype.itemsize
    return batch * (local * (arch.peak_values * dtype.itemsize + arch.table_bytes) + heads_layout)


def reference_kv_bytes(params, tokens: int, dtype: torch.dtype, ranks: int = 1) -> int:
    """Each block's K and V of the reference tokens (Klein 9B, bf16: 2 GiB for one 1024^2 reference), per rank."""
    arch = family_of_params(params).memory(params)
    return 2 * arch.kv_layers * tokens * (arch.hidden // ranks) * dtype.itemsize


def working_memory(variant: Variant, size: tuple[int, int], dtype: torch.dtype) -> int:
    """One ``size`` = (width, height) image with a full prompt: what loading plans for."""
    tokens = variant.text_encoder.max_length + math.prod(latent_size(size[1], size[0]))
    return denoise_memory(variant.params, tokens, 1, dtype)


def denoiser_memory(model: nn.Module, variant: Variant, batch: int, h: int, w: int, dtype: torch.dtype, *,
                    ref_tokens: int = 0, cfg: bool = False, text_tokens: int | None = None,
                    ranks: int | None = None, new_reference_kv: bool = False) -> int:
    """The one estimate ``generate`` and the Denoise node use: activations, plus the largest quantized layer's
    call, plus the reference K/V a KV model's reference pass makes (``new_reference_kv``)."""
    text = variant.text_encoder.max_length if text_tokens is None else text_tokens
    ranks = world_of(model) if ranks is None else ranks
    kv = reference_kv_bytes(variant.params, ref_tokens, dtype, ranks) if new_reference_kv else 0
    return (denoise_memory(variant.params, text + h * w + ref_tokens, batch * (2 if cfg else 1), dtype, ranks)
            + call_bytes(model, dtype) + kv)


# --- the autoencoder ----------------------------------------------------------------------------------------------

# Peak decode (encode) bytes per output (input) pixel, base channel and element byte: measured 7.7-8.4 (5.1) on CPU,
# rounded up for convolution workspaces.
DECODE_BYTES_PER_PIXEL = 10
ENCODE_BYTES_PER_PIXEL = 9
# [B, HW, 512] activations alive at once in the mid block (measured); fused SDPA keeps it linear in HW.
MID_TENSORS = 8


def mid_bytes(ae, batch: int, h: int, w: int, decoder: bool = True) -> int:
    """[batch,128,h,w] latents: 2h x 2w positions of 512 channels; never tiled."""
    positions = batch * 4 * h * w
    chans = ae.params.decoder_chans if decoder else ae.params.encoder_chans
    return MID_TENSORS * positions * chans[-1] * ae.dtype.itemsize


def decode_bytes(ae, batch: int, h: int, w: int) -> int:
    """Peak extra bytes of a one-piece decode: the upsampling levels dominate."""
    pixels = batch * h * w * ae.pixels_per_latent ** 2
    levels = DECODE_BYTES_PER_PIXEL * pixels * ae.params.decoder_chans[0] * ae.dtype.itemsize
    return max(levels, mid_bytes(ae, batch, h, w))


def encode_bytes(ae, batch: int, height: int, width: int) -> int:
    levels = ENCODE_BYTES_PER_PIXEL * batch * height * width * ae.params.ch * ae.dtype.itemsize
    n = ae.pixels_per_latent
    return max(levels, mid_bytes(ae, batch, height // n, width // n, decoder=False))


def tiled_decode_bytes(ae, batch: int, h: int, w: int, tile: int) -> int:
    """The mid block on the whole latent, then its output and the float32 sums held beside one tile's levels."""
    halo = math.ceil(ae.decoder.halo / 2)
    pixels = h * w * ae.pixels_per_latent ** 2
    held = mid_bytes(ae, batch, h, w) // MID_TENSORS + (batch * ae.params.out_ch + 1) * pixels * 4
    return max(mid_bytes(ae, batch, h, w),
               held + decode_bytes(ae, batch, min(h, tile + 2 * halo), min(w, tile + 2 * halo)))


def least_decode_bytes(ae, h: int, w: int) -> int:
    return min(decode_bytes(ae, 1, h, w), tiled_decode_bytes(ae, 1, h, w, MIN_TILE))


def decode_tile(ae, batch: int, h: int, w: int, free: int | None) -> int | None:
    """None (one piece, exact) when that fits or free memory is unknown, else the largest tile side that fits."""
    if free is None or decode_bytes(ae, batch, h, w) <= free:
        return None
    tile = max(h, w)
    while tile > MIN_TILE and tiled_decode_bytes(ae, batch, h, w, tile) > free:
        tile = max(MIN_TILE, tile * 3 // 4)
    return tile


# --- decisions ----------------------------------------------------------------------------------------------------

def fits(needed: int, available: int | None, what: str, fix: str) -> None:
    if available is not None and needed > available:
        raise Flux2Error(f"{what} needs about {needed / GIB:.1f} GiB of working memory, but only "
                         f"{max(available, 0) / GIB:.1f} GiB are free: {fix}")


def check_memory(device: torch.device, needed: int, what: str, free=None, fix: str | None = None) -> None:
    """``fix`` says what to do about it (by default the CLI's options)."""
    if fix is None:
        fix = "use a smaller size or batch, or fewer references"
        if device.type == "cuda":
            fix += ("; or leave the GPU more room: stream the transformer's blocks (--offload blocks, "
                    "load_models(offload_blocks=True)) or store them in fp8 (--fp8)")
    fits(needed, (free or free_memory)(device), what, fix)


def weight_budget(free: int, activations: int) -> int:
    """Transformer weight bytes that may be on the device at once: the one rule for how much streams."""
    return free - activations - STREAM_MARGIN


def should_stream(choice, device: torch.device, needed: int, weight_bytes, free=None) -> bool:
    """Never on the CPU (there is nowhere to stream from)."""
    if choice not in ("auto", True, False):
        raise Flux2Error(f"offload_blocks must be 'auto', True or False, got {choice!r}")
    if choice is False or device.type == "cpu":
        return False
    available = (free or free_memory)(device) if choice == "auto" else None
    return choice is True or (available is not None and weight_budget(available, needed) < weight_bytes())


def should_offload(choice, encoder, device: torch.device, needed: int, free=None) -> bool:
    """"auto": on CUDA, when the free memory, counted as if the encoder were there, is below ``needed``."""
    if choice not in ("auto", True, False):
        raise Flux2Error(f"offload_encoder must be 'auto', True or False, got {choice!r}")
    if choice != "auto":
        return bool(choice)
    available = (free or free_memory)(device) if device.type == "cuda" else None
    if available is None:
        return False
    if encoder.device != device:
        available -= module_bytes(encoder.model)
    return available < needed


def must_make_room(encoder_model: nn.Module, device: torch.device, free=None) -> bool:
    available = (free or free_memory)(device)
    return available is not None and available < module_bytes(encoder_model) + ENCODE_MARGIN
