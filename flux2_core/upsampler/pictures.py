"""How the prompt upsampler sees an edit's pictures: its own sizes, not the image model's.

It was trained on pictures over white, on a 32-px grid, within a pixel budget that shrinks as more pictures come
(one: 1024², two: 724², more: 512² each), JPEG-compressed at quality 92. Its vision tower then cuts them into patches.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from ..errors import Flux2Error
from ..user_json import read_json_file

GRID = 32
MAX_PICTURES = 10
MAX_ASPECT = 200
JPEG_QUALITY = 92
DOWNLOAD_AGAIN = "download the upsampler's Hugging Face folder again"      # the fix for a damaged file in it


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


# --- the vision tower's input -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PatchSettings:
    """The picture processor's settings (preprocessor_config.json of a Qwen-VL folder)."""

    patch_size: int = 16
    temporal_patch_size: int = 2               # a still picture is its own two frames
    merge_size: int = 2                        # merge x merge patches become one token
    min_pixels: int = 65536
    max_pixels: int = 16777216
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale: float = 1 / 255
    resample: int = Image.Resampling.BICUBIC

    @classmethod
    def read(cls, folder: Path) -> PatchSettings:
        path = folder / "preprocessor_config.json"
        if not path.is_file():
            raise Flux2Error(f"{folder} has no preprocessor_config.json (how its vision tower cuts pictures); "
                             "download the whole upsampler folder")
        config = read_json_file(path, dict, DOWNLOAD_AGAIN, "the prompt upsampler's preprocessor_config.json")
        size = config.get("size") or {}
        defaults = cls()
        return cls(patch_size=config.get("patch_size", defaults.patch_size),
                   temporal_patch_size=config.get("temporal_patch_size", defaults.temporal_patch_size),
                   merge_size=config.get("merge_size", defaults.merge_size),
                   min_pixels=config.get("min_pixels") or size.get("shortest_edge", defaults.min_pixels),
                   max_pixels=config.get("max_pixels") or size.get("longest_edge", defaults.max_pixels),
                   mean=tuple(config.get("image_mean", defaults.mean)), std=tuple(config.get("image_std", defaults.std)),
                   rescale=config.get("rescale_factor", defaults.rescale),
                   resample=config.get("resample", defaults.resample))


def tower_size(height: int, width: int, s: PatchSettings) -> tuple[int, int]:
    """(height, width) on the grid of merged patches, within the pixel bounds, the aspect kept as well as it can be."""
    grid = s.patch_size * s.merge_size
    h, w = round(height / grid) * grid, round(width / grid) * grid
    if h * w > s.max_pixels:
        shrink = math.sqrt(height * width / s.max_pixels)
        h, w = (max(grid, math.floor(side / shrink / grid) * grid) for side in (height, width))
    elif h * w < s.min_pixels:
        grow = math.sqrt(s.min_pixels / (height * width))
        h, w = (math.ceil(side * grow / grid) * grid for side in (height, width))
    return h, w


def picture_patches(image: Image.Image, s: PatchSettings) -> tuple[np.ndarray, tuple[int, int, int]]:
    """-> patches [rows * cols, 3 * frames * patch * patch] (float32), (1, rows, cols) in patches.

    Patches come merge-group by merge-group (each merge x merge block of neighbours together, as the tower merges
    them), each flattened channel, frame, row, column; the picture repeats as both frames."""
    height, width = tower_size(image.height, image.width, s)
    if (width, height) != image.size:
        image = image.resize((width, height), s.resample)
    pixels = (np.asarray(image.convert("RGB")).astype(np.float64) * s.rescale).astype(np.float32)
    pixels = (pixels - np.array(s.mean, np.float32)) / np.array(s.std, np.float32)          # [H, W, 3]
    p, m = s.patch_size, s.merge_size
    rows, cols = height // p, width // p
    blocks = pixels.transpose(2, 0, 1).reshape(3, rows // m, m, p, cols // m, m, p)
    blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)                   # [rows/m, cols/m, m, m, 3, p, p]
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], s.temporal_patch_size, p, p))
    return frames.reshape(rows * cols, 3 * s.temporal_patch_size * p * p), (1, rows, cols)
