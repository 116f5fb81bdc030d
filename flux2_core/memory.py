"""Memory: what each stage needs, what a device has free, and the decisions taken from the two.

Models compute; the callers (``pipeline``, the CLI, the nodes) ask here how much a stage needs, compare it with the
free memory (``free_memory`` here, ComfyUI's own count in the nodes) and decide: refuse with a message
(``check_memory``), stream the transformer's blocks (``should_stream`` / ``weight_budget``), let the text encoder
rest on the CPU (``should_offload``), decode in tiles (``decode_tile``).

    estimates   denoise_memory, working_memory, denoiser_memory, reference_kv_bytes (transformer);
                encode_bytes, decode_bytes, tiled_decode_bytes, least_decode_bytes (autoencoder); ENCODE_MARGIN
                (one prompt's encode); storage.protocol.call_bytes (a quantized layer's call)
    probe       free_memory
    decisions   check_memory, weight_budget, should_stream, should_offload, decode_tile
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .autoencoder import MIN_TILE
from .errors import Flux2Error
from .latents import latent_size
from .parallel import world_of
from .storage.protocol import call_bytes
from .variants import TransformerParams, Variant

GIB = 1 << 30
STREAM_MARGIN = 512 << 20     # bytes kept free beside streamed weights and activations (fragmentation, workspaces)
ENCODE_MARGIN = 256 << 20     # bytes for one 512-token encode's activations (Qwen3-8B in bf16: well under this)


# --- the probe --------------------------------------------------------------------------------------------------

def free_memory(device) -> int | None:
    """Bytes a new allocation may still use on ``device``: free plus cached-but-unused on CUDA; on the CPU the
    memory the operating system can give without swapping (psutil where installed, else /proc/meminfo's
    MemAvailable); None where unknown (then nothing is refused, streamed or tiled for want of memory)."""
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
    """The bytes of a module's parameters and buffers, wherever they are."""
    return sum(t.nbytes for t in (*module.parameters(), *module.buffers()))


# --- the transformer ----------------------------------------------------------------------------------------------

def denoise_memory(params: TransformerParams, tokens: int, batch: int, dtype: torch.dtype, ranks: int = 1) -> int:
    """The denoiser's peak activation memory in bytes for ``tokens`` (text, image and reference) per item of the model
    batch (CFG doubles it); with ``ranks`` > 1, that of one rank of a sequence-parallel pass (``parallel.py``).

    The peak is in a single block, as it concatenates [attention out, SwiGLU] for linear2. Per token, with H hidden
    and M = mlp_ratio·H (3H): its linear1 output [L, 3H + 2M] (q, k, v and the MLP input are views of it), the
    concatenation [L, H + M], the SwiGLU [L, M], and about 8 H-wide tensors (x, the double-stream outputs, the
    rotated q and k, the attention out, the modulation's temporaries); beside them the float32 RoPE table
    [L, head_dim/2, 2]. For Klein (M = 3H) that is 24 H-wide values per token, 23.5 measured on CPU
    (tests/test_pipeline.py).

    A rank runs the same on its share of the tokens (text and the rest are split apart, the larger shares first: at
    most tokens / ranks + 1), and holds besides the attention's tensors in the heads layout, every token for
    H / ranks of the width: q, k, v, the output and the all-to-all buffers both ways, counted as 8 such tensors, an
    upper bound (tests/test_parallel.py measures every rank's peak with 2 and 3 ranks below the estimate).
    """
    h, m = params.hidden_size, params.mlp_hidden
    values = (3 * h + 2 * m) + (h + m) + m + 8 * h
    local = tokens if ranks == 1 else -(-tokens // ranks) + 1
    heads_layout = 0 if ranks == 1 else 8 * tokens * (h // ranks) * dtype.itemsize
    return batch * (local * (values * dtype.itemsize + params.head_dim * 4) + heads_layout)


def reference_kv_bytes(params: TransformerParams, tokens: int, dtype: torch.dtype, ranks: int = 1) -> int:
    """The size of ``Flux2Transformer.reference_kv``'s result for ``tokens`` reference tokens: a key and a value
    [1, heads, tokens, head_dim] per block, double and single (Klein 9B, bf16: 2 GiB for one 1024^2 reference of 4096
    tokens); on each of ``ranks`` sequence-parallel ranks, which keep heads / ranks of the heads each, that over
    ``ranks``."""
    return 2 * (params.depth + params.depth_single_blocks) * tokens * (params.hidden_size // ranks) * dtype.itemsize


def working_memory(variant: Variant, size: tuple[int, int], dtype: torch.dtype) -> int:
    """``denoise_memory`` of one ``size`` = (width, height) image with a full prompt: what loading plans for."""
    tokens = variant.text_encoder.max_length + math.prod(latent_size(size[1], size[0]))
    return denoise_memory(variant.params, tokens, 1, dtype)


def denoiser_memory(model: nn.Module, variant: Variant, batch: int, h: int, w: int, dtype: torch.dtype, *,
                    ref_tokens: int = 0, cfg: bool = False, text_tokens: int | None = None,
                    ranks: int | None = None, new_reference_kv: bool = False) -> int:
    """The denoiser's working memory in bytes beside its weights, the one estimate ``generate`` and the Denoise node
    use: ``denoise_memory`` for the text (``text_tokens``, by default the text encoder's 512), image (an h x w latent)
    and reference tokens of each item of the model batch (``batch``, doubled by CFG), plus what the largest quantized
    layer takes while it computes (``storage.protocol.call_bytes``), plus, with ``new_reference_kv``, the reference
    K/V a KV model's reference pass makes (``reference_kv_bytes``). ``ranks``: the processes a sequence-parallel pass
    spreads over (by default those ``model`` is attached to, ``parallel.world_of``); the estimate is then one rank's."""
    text = variant.text_encoder.max_length if text_tokens is None else text_tokens
    ranks = world_of(model) if ranks is None else ranks
    kv = reference_kv_bytes(variant.params, ref_tokens, dtype, ranks) if new_reference_kv else 0
    return (denoise_memory(variant.params, text + h * w + ref_tokens, batch * (2 if cfg else 1), dtype, ranks)
            + call_bytes(model, dtype) + kv)


# --- the autoencoder ----------------------------------------------------------------------------------------------

DECODE_BYTES_PER_PIXEL = 10      # peak decode memory per output pixel per base channel per byte (see decode_bytes)
ENCODE_BYTES_PER_PIXEL = 9       # the same for encode, per input pixel (see encode_bytes)
MID_TENSORS = 8                  # [B, HW, 512] activations alive at once in the mid block (see mid_bytes)


def mid_bytes(ae, batch: int, h: int, w: int, decoder: bool = True) -> int:
    """Peak memory of the decoder's (or the encoder's) mid block of ``ae`` for [batch,128,h,w] latents; it is never
    tiled.

    It works on HW = 2h x 2w positions of 512 channels (the VAE's 8x-down grid). With q, k, v contiguous, SDPA runs
    a fused kernel that never holds the [HW, HW] scores, so the cost is linear: the block's input, the ResnetBlock's
    output, q, k, v, the attention output, ``proj_out`` and the residual sum, ``MID_TENSORS`` x [batch, HW, 512]
    (measured on CPU with the profiler: 7 beside the input at 64x64 positions).
    """
    positions = batch * 4 * h * w
    chans = ae.params.decoder_chans if decoder else ae.params.encoder_chans
    return MID_TENSORS * positions * chans[-1] * ae.dtype.itemsize


def decode_bytes(ae, batch: int, h: int, w: int) -> int:
    """Estimated peak extra memory of decoding [batch,128,h,w] latents in one piece: the larger of the mid block's
    (``mid_bytes``) and the upsampling levels', which run after it.

    The levels dominate: ``DECODE_BYTES_PER_PIXEL`` x pixels x base channels x itemsize, where the factor was measured
    as 7.7-8.4 on CPU (float32, several sizes and widths; 6.1 counting only tensors) and rounded up to leave room for
    convolution workspaces. The mid block needs 20x less (32 values per output pixel against 1280).
    """
    pixels = batch * h * w * ae.pixels_per_latent ** 2
    levels = DECODE_BYTES_PER_PIXEL * pixels * ae.params.decoder_chans[0] * ae.dtype.itemsize
    return max(levels, mid_bytes(ae, batch, h, w))


def encode_bytes(ae, batch: int, height: int, width: int) -> int:
    """Estimated peak extra memory of encoding [batch,3,height,width] images: the larger of the full-resolution levels'
    (``ENCODE_BYTES_PER_PIXEL`` x pixels x base channels x itemsize; 5.1 measured counting only tensors on CPU, with
    the decode's headroom for workspaces) and the mid block's (``mid_bytes``, which runs after them)."""
    levels = ENCODE_BYTES_PER_PIXEL * batch * height * width * ae.params.ch * ae.dtype.itemsize
    n = ae.pixels_per_latent
    return max(levels, mid_bytes(ae, batch, height // n, width // n, decoder=False))


def tiled_decode_bytes(ae, batch: int, h: int, w: int, tile: int) -> int:
    """Estimated peak extra memory of ``AutoEncoder.decode_tiled`` with ``tile``: the mid block on the whole latent
    first, then, while the tiles run, its output [batch,512,2h,2w] and the float32 sums ``out`` [batch,3,H,W] and
    ``weight`` [1,1,H,W] are held beside one tile's levels (tile plus halo on each side)."""
    halo = math.ceil(ae.decoder.halo / 2)
    pixels = h * w * ae.pixels_per_latent ** 2
    held = mid_bytes(ae, batch, h, w) // MID_TENSORS + (batch * ae.params.out_ch + 1) * pixels * 4
    return max(mid_bytes(ae, batch, h, w),
               held + decode_bytes(ae, batch, min(h, tile + 2 * halo), min(w, tile + 2 * halo)))


def least_decode_bytes(ae, h: int, w: int) -> int:
    """The least memory that decoding one [128,h,w] latent can take: in one piece or tiled at the smallest tile,
    whichever is smaller (``decode_tile`` picks tiles when memory is short; the mid block on the whole latent
    stays)."""
    return min(decode_bytes(ae, 1, h, w), tiled_decode_bytes(ae, 1, h, w, MIN_TILE))


def decode_tile(ae, batch: int, h: int, w: int, free: int | None) -> int | None:
    """How to decode [batch,128,h,w] latents with ``free`` bytes: None (in one piece) when ``decode_bytes`` fits or
    the free memory is unknown, else the largest tile side (latent cells) whose ``tiled_decode_bytes`` fit (at least
    ``autoencoder.MIN_TILE``). Tiles normalise with their own GroupNorm statistics, so a tiled picture differs
    slightly: the one-piece decode is kept wherever it fits."""
    if free is None or decode_bytes(ae, batch, h, w) <= free:
        return None
    tile = max(h, w)
    while tile > MIN_TILE and tiled_decode_bytes(ae, batch, h, w, tile) > free:
        tile = max(MIN_TILE, tile * 3 // 4)
    return tile


# --- decisions ----------------------------------------------------------------------------------------------------

def fits(needed: int, available: int | None, what: str, fix: str) -> None:
    """Refuse ``what`` when its estimated ``needed`` bytes exceed the ``available`` ones (None: unknown, allowed)."""
    if available is not None and needed > available:
        raise Flux2Error(f"{what} needs about {needed / GIB:.1f} GiB of working memory, but only "
                         f"{max(available, 0) / GIB:.1f} GiB are free: {fix}")


def check_memory(device: torch.device, needed: int, what: str, free=None, fix: str | None = None) -> None:
    """Refuse ``what`` before it allocates when its ``needed`` bytes exceed the free memory of ``device``
    (``free(device)``; by default ``free_memory``); ``fix`` says what to do about it (by default the CLI's options)."""
    if fix is None:
        fix = "use a smaller size or batch, or fewer references"
        if device.type == "cuda":
            fix += ("; or leave the GPU more room: stream the transformer's blocks (--offload blocks, "
                    "load_models(offload_blocks=True)) or store them in fp8 (--fp8)")
    fits(needed, (free or free_memory)(device), what, fix)


def weight_budget(free: int, activations: int) -> int:
    """Bytes of transformer weights that may be on the device at once: its free memory (counted without the
    transformer) less the denoiser's working memory (``denoiser_memory``) and a margin. The one rule for how much
    streams; ``offload.stream_blocks`` splits it into resident parts, resident blocks and the room for the blocks in
    flight."""
    return free - activations - STREAM_MARGIN


def should_stream(choice, device: torch.device, needed: int, weight_bytes, free=None) -> bool:
    """Whether the transformer's blocks stream (``offload.py``): never on the CPU (there is nowhere to stream from);
    True / False as given; "auto": on CUDA, when its ``weight_bytes()`` exceed ``weight_budget`` of the device's free
    memory (``free(device)`` bytes) and ``needed`` bytes of working memory."""
    if choice not in ("auto", True, False):
        raise Flux2Error(f"offload_blocks must be 'auto', True or False, got {choice!r}")
    if choice is False or device.type == "cpu":
        return False
    available = (free or free_memory)(device) if choice == "auto" else None
    return choice is True or (available is not None and weight_budget(available, needed) < weight_bytes())


def should_offload(choice, encoder, device: torch.device, needed: int, free=None) -> bool:
    """Whether the text encoder (a ``PromptEncoder``) rests on the CPU: ``choice`` True / False as given; "auto": on
    CUDA, when the free memory of ``device`` (``free(device)`` bytes, counted as if the encoder were there) is below
    ``needed``."""
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
    """Whether something else must leave ``device`` while the text encoder visits it to encode: its weights and
    ``ENCODE_MARGIN`` exceed the free memory (``free(device)``; unknown: no)."""
    available = (free or free_memory)(device)
    return available is not None and available < module_bytes(encoder_model) + ENCODE_MARGIN
