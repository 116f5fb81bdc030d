"""How the prompt upsampler sees an edit's pictures: its own sizes, not the image model's.

It was trained on pictures over white, on a 32-px grid, within a pixel budget that shrinks as more pictures come
(one: 1024², two: 724², more: 512² each), JPEG-compressed at quality 92. Its vision tower then cuts them into patches.
"""

from __future__ import annotations

import io
import math

from PIL import Image, ImageOps

from ..errors import Flux2Error

GRID = 32
MAX_PICTURES = 10
MAX_ASPECT = 200
JPEG_QUALITY = 92


def pixel_budget(count: int) -> int:
    return {1: 1024 * 1024, 2: 724 * 724}.get(count, 512 * 512)


def picture_size(width: int, height: int, count: int) -> tuple[int, int]:
    """(width, height) one of ``count`` pictures is given at: the nearest 32-px grid size, shrunk into the budget."""
    if max(width, height) > MAX_ASPECT * min(width, height):
        raise Flux2Error(f"a {width}x{height} picture is over {MAX_ASPECT}:1; the prompt upsampler takes at most "
                         f"{MAX_ASPECT}:1, so crop it")
    budget = pixel_budget(count)

    def down(value: float) -> int:
        return max(GRID, math.floor(value / GRID) * GRID)

    w, h = (max(GRID, round(side / GRID) * GRID) for side in (width, height))
    if w * h > budget:
        shrink = math.sqrt(width * height / budget)
        w, h = down(width / shrink), down(height / shrink)
    if w * h > budget:                           # the 32-px floor of a thin side can still overflow: cut the long one
        if w == GRID:
            h = down(budget / w)
        else:
            w = down(budget / h)
    return w, h


def prepare_picture(image: Image.Image, count: int) -> Image.Image:
    """One of ``count`` pictures as the upsampler reads it: upright, over white, resized (Lanczos), through JPEG."""
    image = ImageOps.exif_transpose(image)
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    image = image.convert("RGB")
    size = picture_size(image.width, image.height, count)
    if image.size != size:
        image = image.resize(size, Image.Resampling.LANCZOS)
    encoded = io.BytesIO()
    image.save(encoded, format="JPEG", quality=JPEG_QUALITY)
    with Image.open(io.BytesIO(encoded.getvalue())) as decoded:
        return decoded.convert("RGB")
