"""The latent grid FLUX.2 works on: one cell per 16 x 16 pixels (the AE's 8x downscale, then a 2 x 2 patch), 128
channels (32 AE channels x 2 x 2)."""

from __future__ import annotations

from .errors import Flux2Error

LATENT_CHANNELS = 128
PIXELS_PER_LATENT = 16


def latent_size(height: int, width: int) -> tuple[int, int]:
    """(h, w) of the latent grid for an image of height x width pixels; both must be multiples of 16."""
    for name, value in (("height", height), ("width", width)):
        if isinstance(value, bool) or not isinstance(value, int) or value < PIXELS_PER_LATENT:
            raise Flux2Error(f"{name} must be a whole number of pixels >= {PIXELS_PER_LATENT}, got {value!r}")
    if height % PIXELS_PER_LATENT or width % PIXELS_PER_LATENT:
        n = PIXELS_PER_LATENT
        nearest = [max((side + n // 2) // n * n, n) for side in (width, height)]     # in integers: any size exact
        raise Flux2Error(f"image size {width}x{height} (WxH) is not a multiple of {n}; "
                         f"use e.g. {nearest[0]}x{nearest[1]}")
    return height // PIXELS_PER_LATENT, width // PIXELS_PER_LATENT
