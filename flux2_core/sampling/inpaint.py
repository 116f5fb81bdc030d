"""Inpainting and outpainting: repaint where a mask says so, keep the source everywhere else.

Masks: 1 (white) = repaint, 0 = keep, grey blends. ``latent_mask`` reaches the [H/16, W/16] grid by bilinear
interpolation, as diffusers and ComfyUI's ``noise_mask`` do: it reads each cell's centre pixels, so a thin stroke may
reach no cell.

keep(x, sigma) = m * x + (1 - m) * ((1 - sigma) * x0 + sigma * eps), by one of two conventions:
* AFTER_STEP (``pipeline.generate``, as diffusers): x <- keep(x, sigma') after each step, so where m = 0 the result
  is exactly the source latent; the source is also reference image 1.
* BEFORE_MODEL (the Denoise node, as ComfyUI's ``KSamplerX0Inpaint``): the model sees keep(x, sigma) and its clean
  estimate is clamped to x0 outside the mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from ..checks import parse_number
from ..errors import Flux2Error
from .euler import Velocity, add_noise
from .references import MAX_IMAGE_PIXELS, as_pil, center_crop_16, decoded, grid_crop

AFTER_STEP = "after_step"        # diffusers: blend after each step, at the next sigma
BEFORE_MODEL = "before_model"    # ComfyUI: blend before each model call, at the current sigma
CELL = 16                        # pixels per latent cell (8x AE downscale x 2x2 patch)


# --- masks ------------------------------------------------------------------------------------------------------

@dataclass
class Canvas:

    image: Image.Image              # RGB: the source at (left, top), grey elsewhere
    mask: Image.Image               # "L": 255 where the canvas is new, 0 over the source, a ramp ``feather`` px wide
    box: tuple[int, int, int, int]  # where the source lies: (left, top, right, bottom) pixels


OUTPAINT_FILL = (128, 128, 128)     # what the new area starts as (ComfyUI's Pad Image for Outpainting fills grey too)
DEFAULT_FEATHER = 32                # pixels of the source the repainted area fades into


def check_outpaint(image: bool, mask: bool) -> None:
    if not image:
        raise Flux2Error("outpainting expands an image: give the image to expand (--image)")
    if mask:
        raise Flux2Error("outpainting makes its own mask (the added area): leave --mask out, or inpaint with --mask "
                         "and no --expand")


def parse_expand(text: str) -> tuple[int, int, int, int]:
    """"LEFT,TOP,RIGHT,BOTTOM" pixels -> each rounded up to the 16-pixel grid."""
    parts = text.split(",")
    if len(parts) != 4:
        raise Flux2Error(f"expand must be four whole numbers of pixels LEFT,TOP,RIGHT,BOTTOM (e.g. 0,0,256,0), got "
                         f"{text!r}")
    widest = math.isqrt(MAX_IMAGE_PIXELS)            # a side beyond it makes a canvas no input may be
    sides = tuple(-(-parse_number(part, f"expand's {name} pixels", 0, widest, whole=True) // CELL) * CELL
                  for part, name in zip(parts, ("LEFT", "TOP", "RIGHT", "BOTTOM")))
    if not any(sides):
        raise Flux2Error("expand adds nothing (0,0,0,0): give the pixels to add on at least one side")
    return sides


def expand_canvas(image: Image.Image, sides: tuple[int, int, int, int], feather: int = DEFAULT_FEATHER,
                  max_pixels: int | None = None, check: Callable[[int, int], None] | None = None) -> Canvas:
    """``sides`` = (left, top, right, bottom), multiples of 16. The mask fades into the source over ``feather`` pixels
    so the seam is repainted too. ``check(width, height)`` vets the canvas size before it is made."""
    image = center_crop_16(as_pil(image, "the image to expand").convert("RGB"), "the image to expand")
    left, top, right, bottom = sides
    width, height = image.width + left + right, image.height + top + bottom
    if max_pixels is not None and width * height > max_pixels:
        raise Flux2Error(f"expanding {image.width}x{image.height} by {left},{top},{right},{bottom} makes a "
                         f"{width}x{height} canvas, {width * height / 1e6:.1f} megapixels, over the "
                         f"{max_pixels / 1e6:.1f} this allows: expand less, or shrink the image first")
    if check is not None:
        check(width, height)
    canvas = Image.new("RGB", (width, height), OUTPAINT_FILL)
    canvas.paste(image, (left, top))
    inside = np.full((height, width), np.inf, dtype=np.float32)   # pixels into the source from the nearest grown side
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    edges = [(left, xs - left + 0.5), (top, ys - top + 0.5), (right, left + image.width - xs - 0.5),
             (bottom, top + image.height - ys - 0.5)]
    for grown, distance in edges:
        if grown:
            inside = np.minimum(inside, distance)
    ramp = np.clip(1 - inside / feather, 0, 1) if feather > 0 else (inside <= 0).astype(np.float32)
    box = (left, top, left + image.width, top + image.height)
    outside = np.ones((height, width), dtype=bool)
    outside[box[1]:box[3], box[0]:box[2]] = False
    mask = np.where(outside, 1.0, ramp)
    return Canvas(canvas, Image.fromarray(np.round(mask * 255).astype(np.uint8), "L"), box)


@dataclass(frozen=True)
class MaskReading:
    levels: Image.Image              # "L", 255 = repaint
    note: str = ""                   # said where the reading is not the plain grey one


# "grey": white = repaint; "alpha": transparent = repaint (ComfyUI's mask editor); "auto": grey without transparency,
# else only where both readings agree (white strokes on a transparent layer read opposite ways).
MASK_READINGS = ("auto", "alpha", "grey")
SLIVER = 0.005                       # the share of pixels two readings may disagree on and still be one mask
CHOOSE = ("choose how to read it: alpha (transparent = repaint, as ComfyUI's mask editor) or grey (white = repaint): "
          "--mask-reading on the command line, mask_reading= in Python")


def mask_levels(mask, name: str = "the mask", reading: str = "auto") -> MaskReading:
    """A mask picture as "L" levels, 255 = repaint, read as ``reading`` says (``MASK_READINGS``)."""
    if reading not in MASK_READINGS:
        raise Flux2Error(f"the mask reading {reading!r} is not one of {', '.join(MASK_READINGS)}")
    picture = decoded(mask, name)
    if picture.mode in ("La", "RGBa"):              # premultiplied: PIL converts these only to their plain modes
        picture = picture.convert(picture.mode.upper())
    grey, by_alpha = as_pil(picture, name).convert("L"), None
    if "A" in picture.getbands() or "transparency" in picture.info:
        alpha = picture.convert("RGBA").getchannel("A")
        if alpha.getextrema()[0] < 255:
            by_alpha = Image.eval(alpha, lambda v: 255 - v)
    if reading == "grey" or (reading == "auto" and by_alpha is None):
        return MaskReading(grey, "" if by_alpha is None else f"{name} was read by its grey levels (white = repaint); "
                                                            f"its transparency was not read")
    if by_alpha is None:
        raise Flux2Error(f"{name} has no transparency to read it by (the alpha reading): read it by its grey levels "
                         f"(grey or auto), or save it with the areas to repaint transparent")
    said = f"{name} was read by its transparency: the transparent areas are repainted, the opaque ones kept"
    if reading == "alpha":
        return MaskReading(by_alpha, said)
    a, g = (np.asarray(levels) >= 128 for levels in (by_alpha, grey))
    differ = float((a != g).mean())
    if differ <= SLIVER:
        return MaskReading(by_alpha, f"{said} (its grey levels say the same)")
    raise Flux2Error(f"{name} reads two ways: by its transparency it repaints {a.mean():.0%} of the picture, by its "
                     f"grey levels {g.mean():.0%}, and they disagree on {differ:.0%} of it; {CHOOSE}")


def mask_tensor(image: Image.Image) -> Tensor:
    """-> float32 [1, 1, H, W]: the grey level ("L", as PIL converts colour) / 255."""
    grey = np.asarray(image.convert("L"), dtype=np.float32) / 255
    return torch.from_numpy(grey)[None, None]


def check_source(mask: bool, image: bool) -> None:
    if mask and not image:
        raise Flux2Error("a mask needs the image it masks: give the image to inpaint with it (the CLI's --image; the "
                         "Denoise node's latent input, where ComfyUI's Set Latent Noise Mask puts the mask)")


def check_mask_size(mask_size: tuple[int, int], image_size: tuple[int, int], what: str = "the image") -> str:
    """Sizes (width, height). The same shape (within one latent cell) is resized, with a note; another shape is
    refused, as stretching it would repaint the wrong place."""
    (mw, mh), (w, h) = mask_size, image_size
    if (mw, mh) == (w, h):
        return ""
    # scaled to the image's height, the mask's width is off by |mw * h / mh - w|: over one cell is another shape
    if abs(mw * h - w * mh) > CELL * min(mw, mh):
        raise Flux2Error(f"the mask is {mw}x{mh} (WxH) but {what} is {w}x{h}, another shape: make the mask from the "
                         f"image itself (the same size; white = repaint, black = keep)")
    return f"the mask is {mw}x{mh} (WxH), {what} {w}x{h}: the mask was resized to fit it"


def image_mask(mask, image: Image.Image, size: tuple[int, int], reading: str = "auto") -> tuple[Tensor, list[str]]:
    """-> (float32 [1, 1, H, W] at ``size``, notes): fitted, cropped and resized as the source image is."""
    reading = mask_levels(mask, reading=reading)
    mask, notes = reading.levels, [reading.note] if reading.note else []
    resized = check_mask_size(mask.size, image.size)
    if resized:
        mask = mask.resize(image.size, Image.Resampling.BILINEAR)
        notes.append(resized)
    mask = center_crop_16(mask.convert("L"), "the mask")
    if mask.size != size:
        mask = mask.resize(size, Image.Resampling.BILINEAR)
    return mask_tensor(mask), notes


def latent_mask(mask: Tensor, batch: int, h: int, w: int) -> tuple[Tensor, str]:
    """``mask`` [n, 1, H, W], [n, H, W] or [H, W], n 1 or ``batch``, in [0, 1] -> ([1 or batch, 1, h, w], note or "").
    At the image's pixel size, its pre-crop size, or already h x w."""
    if mask.ndim not in (2, 3, 4) or (mask.ndim == 4 and mask.shape[1] != 1):
        raise Flux2Error(f"a mask must be [H, W], [B, H, W] or [B, 1, H, W], got {list(mask.shape)}")
    mask = mask.reshape(-1, 1, *mask.shape[-2:]).float()
    if mask.shape[0] not in (1, batch):
        raise Flux2Error(f"there are {mask.shape[0]} masks for a batch of {batch}: give one mask (used for every "
                         f"image) or one per image")
    if not bool(((mask >= 0) & (mask <= 1)).all()):             # also refuses NaN
        raise Flux2Error("a mask's values must be in [0, 1] (1 = repaint, 0 = keep); this one has values outside "
                         "(or NaN): use a greyscale mask image or ComfyUI's MASK type")
    size = (mask.shape[-1], mask.shape[-2])
    if size != (w, h) and min(size) >= CELL and grid_crop(*size, "the mask")[2:] == (CELL * w, CELL * h):
        # the picture's size before its crop to the grid: crop the mask alike, so it stays on the same pixels
        left, top, width, height = grid_crop(*size, "the mask")
        mask, size = mask[..., top:top + height, left:left + width], (width, height)
    # an empty mask cannot be misplaced (ComfyUI's Load Image gives a 64 x 64 one for an image without alpha)
    fit = size == (w, h) or not bool(mask.any())
    note = "" if fit else check_mask_size(size, (CELL * w, CELL * h), "the latent's image")
    return F.interpolate(mask, size=(h, w), mode="bilinear"), note


def mask_note(pixels: Tensor, on_grid: Tensor) -> str:
    """pixels [n, 1, H, W], ``on_grid`` its ``latent_mask``; "" unless it repaints nothing."""
    if not bool(pixels.any()):
        return ("the mask is empty (all black): nothing is repainted, the result is the source image (image-to-image "
                "that changes nothing); paint the area to repaint white")
    if not bool(on_grid.any()):
        return ("the mask's white areas fall between the centres of the 16-pixel latent cells, so nothing is "
                "repainted: paint a larger area (at least 16 pixels across)")
    return ""


# --- blending in the sampler ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Inpaint:
    """source x0 [1 or B, 128, h, w], noise eps [B, 128, h, w], mask [1 or B, 1, h, w] (1 = repaint)."""

    source: Tensor
    noise: Tensor
    mask: Tensor
    blend: str = AFTER_STEP

    def __post_init__(self):
        if self.blend not in (AFTER_STEP, BEFORE_MODEL):
            raise Flux2Error(f"blend must be {AFTER_STEP!r} or {BEFORE_MODEL!r}, got {self.blend!r}")

    def to(self, device, dtype) -> Inpaint:
        return Inpaint(*(t.to(device, dtype) for t in (self.source, self.noise, self.mask)), self.blend)

    def keep(self, x: Tensor, sigma: float) -> Tensor:
        return self.mask * x + (1 - self.mask) * add_noise(self.source, self.noise, sigma)

    def velocity(self, velocity: Velocity, x: Tensor, t: Tensor, t_next: Tensor, sigma: float) -> Tensor:
        """BEFORE_MODEL: the model's clean estimate clamped to the source, as a velocity from x."""
        if self.blend == AFTER_STEP:
            return velocity(x, t, t_next)
        x_in = self.keep(x, sigma)
        clean = self.mask * (x_in - sigma * velocity(x_in, t, t_next)) + (1 - self.mask) * self.source
        return (x - clean) / sigma

    def after_step(self, x: Tensor, sigma_next: float) -> Tensor:
        return self.keep(x, sigma_next) if self.blend == AFTER_STEP else x
