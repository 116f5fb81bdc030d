"""Reference images: decoding, the reference implementation's preprocessing, then AE encoding into reference tokens.

Decoding (``open_image`` for a file, then ``as_pil`` for every image however given, the init image too):
  * a file of more than MAX_IMAGE_PIXELS (8192 x 8192) is refused before its pixels are decoded; one that cannot be
    decoded (missing, cut short, corrupt, not an image) is a Flux2Error naming it;
  * the EXIF orientation is applied (``ImageOps.exif_transpose``, as diffusers' ``load_image`` does), so a photo
    taken sideways is used upright; EXIF that cannot be read is ignored (the pixels are used as stored);
  * 16-bit greyscale (PIL modes I;16, I;16L, I;16B, I;16N, and I, taken as 0..65535) becomes 8-bit as
    round(v / 257), where PIL's convert would clip it to 0..255; 16-bit RGB(A) PNGs PIL itself opens as 8-bit RGB(A)
    by their high byte (v >> 8, within 1 of v / 257);
  * everything else converts as BFL and diffusers convert it, ``convert("RGB")``: alpha is dropped, not composited
    (a transparent pixel keeps the colour stored under it; premultiplied La / RGBa are first unpremultiplied),
    P takes its palette, CMYK / YCbCr / LAB / HSV go through PIL's conversions;
  * 32-bit float images (PIL mode F, float TIFFs) are refused: they have no fixed range, and PIL's clip to 0..255
    would turn a 0..1 image black.

Preprocessing (BFL ``encode_image_refs``), per image:
  1. convert to RGB (above);
  2. refuse a side below 64 px or an aspect ratio above 8;
  3. if larger than the pixel cap (2024^2 for a single reference, 1024^2 each when there are several), scale by
     s = sqrt(cap / (w*h)) to (int(w*s), int(h*s)) with LANCZOS;
  4. centre-crop (no resize) each side down to a multiple of 16.

Each image is then encoded on its own (posterior mean, patchified, normalised) and packed to tokens; reference i
(0-based) gets position ids with t = 10 * (i + 1) on its own (h, w) grid. There is no limit on the count.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image, ImageOps

from . import rope
from .errors import Flux2Error
from .latents import PIXELS_PER_LATENT

MAX_IMAGE_PIXELS = 8192 * 8192          # 67 megapixels: decoded, 200 MB of RGB; references are used at <= 2024^2
SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N", "I")
MIN_SIDE = 64
MAX_ASPECT = 8
SINGLE_REFERENCE_PIXELS = 2024 * 2024   # "2024" as in the reference code, not 2048
MULTI_REFERENCE_PIXELS = 1024 * 1024    # per image, when there are two or more


def open_image(path) -> Image.Image:
    """An image file as an upright RGB image (see the module docstring)."""
    try:
        with Image.open(path) as image:
            w, h = image.size
            if w * h > MAX_IMAGE_PIXELS:
                raise _too_large(path, f"{w}x{h}, {w * h:,} pixels")
            return as_pil(image, f"image {path}")
    except FileNotFoundError:
        raise Flux2Error(f"image {path}: no such file") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:   # PIL's own limit, set lower
        raise _too_large(path, str(e)) from None
    except Flux2Error:
        raise
    except Exception as e:  # noqa: BLE001 (Pillow raises many types on bad files; its own fuzzers catch Exception)
        raise Flux2Error(f"image {path} could not be read ({type(e).__name__}: {e}); pass a PNG, JPEG or WebP "
                         f"file: if it is one, it is damaged or cut short, save or download it again") from None


def _too_large(path, detail: str) -> Flux2Error:
    return Flux2Error(f"image {path} is too large ({detail}): an input image may have at most "
                      f"{MAX_IMAGE_PIXELS:,} pixels (8192 x 8192); scale it down")


def as_pil(image, name: str = "an image") -> Image.Image:
    """An upright RGB image from a PIL image or a uint8 array HxW or HxWxC (C = 1 to 4); see the module docstring."""
    image = _pil(image, name)
    try:
        image.load()                # a lazily opened file decodes here
    except Exception as e:  # noqa: BLE001 (Pillow raises many types on bad data; its own fuzzers catch Exception)
        raise Flux2Error(f"{name} could not be decoded ({type(e).__name__}: {e}); it is damaged or cut short: "
                         f"save or download it again") from None
    return _to_rgb(_upright(image))


def _pil(image, name: str) -> Image.Image:
    if isinstance(image, Image.Image):
        return image
    if isinstance(image, np.ndarray) and image.dtype == np.uint8 and (image.ndim == 2 or (
            image.ndim == 3 and 1 <= image.shape[2] <= 4)):
        return Image.fromarray(image[..., 0] if image.ndim == 3 and image.shape[2] == 1 else image)
    if isinstance(image, np.ndarray):
        raise Flux2Error(f"{name} must be a PIL image or a uint8 HxWxC array (C = 1 to 4), got a {image.dtype} "
                         f"array of shape {list(image.shape)}")
    raise Flux2Error(f"{name} must be a PIL image or a uint8 HxWxC array (C = 1 to 4), got {type(image).__name__}")


def _upright(image: Image.Image) -> Image.Image:
    """The image turned as its EXIF orientation says; EXIF that cannot be read is ignored (the pixels are valid, the
    orientation only a hint)."""
    try:
        return ImageOps.exif_transpose(image)
    except Exception:  # noqa: BLE001 (malformed EXIF: Pillow raises many types)
        return image


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "F":           # no fixed range: PIL would clip to 0..255, and a 0..1 image would come out black
        raise Flux2Error("32-bit floating-point images (a float TIFF, PIL mode F) have no fixed value range, so they "
                         "cannot be read as colours reliably: save the image as an 8- or 16-bit PNG")
    if image.mode in SIXTEEN_BIT:
        values = np.asarray(image).astype(np.int64).clip(0, 65535)
        # round(v / 257) in integers: v / 257 = 255 v / 65535 is never a half, so rounding up at .5 is exact
        image = Image.fromarray(((values * 255 + 32767) // 65535).astype(np.uint8))
    elif image.mode == "La":        # premultiplied: PIL converts it only to LA (unpremultiplied)
        image = image.convert("LA")
    return image.convert("RGB")


def check_reference(image: Image.Image, index: int = 0) -> None:
    w, h = image.size
    if min(w, h) < MIN_SIDE:
        raise Flux2Error(f"reference image {index + 1} is {w}x{h}; both sides must be at least {MIN_SIDE} px: "
                         f"use a larger image or upscale it")
    if max(w, h) > MAX_ASPECT * min(w, h):
        raise Flux2Error(f"reference image {index + 1} is {w}x{h}, an aspect ratio of {max(w, h) / min(w, h):.1f}; "
                         f"at most {MAX_ASPECT}:1 is supported: crop it closer to square")


def cap_pixels(image: Image.Image, max_pixels: int) -> Image.Image:
    """Downscale (LANCZOS, int() floors) to at most about ``max_pixels``; smaller images are left alone."""
    w, h = image.size
    if w * h <= max_pixels:
        return image
    s = math.sqrt(max_pixels / (w * h))
    return image.resize((int(w * s), int(h * s)), Image.Resampling.LANCZOS)


def grid_size(width: int, height: int, name: str) -> tuple[int, int]:
    """(width, height) of an image named ``name`` cropped to the 16-pixel latent grid: the one rule for every input
    picture (image to edit, mask, reference; CLI and nodes). One smaller than a grid cell is refused: nothing of it
    would be left."""
    n = PIXELS_PER_LATENT
    if width < n or height < n:
        raise Flux2Error(f"{name} is {width}x{height} pixels, smaller than one {n}x{n} cell of the model's grid, so "
                         f"nothing of it would be used: it must be at least {n}x{n} pixels (use a larger picture)")
    return width // n * n, height // n * n


def grid_crop(width: int, height: int, name: str) -> tuple[int, int, int, int]:
    """(left, top, width, height) of the centre of a ``width`` x ``height`` picture on the 16-pixel grid: what every
    picture keeps (``grid_size``), and where a mask of its size is cut to stay on the same pixels."""
    new_w, new_h = grid_size(width, height, name)
    return (width - new_w) // 2, (height - new_h) // 2, new_w, new_h


def center_crop_16(image: Image.Image, name: str = "the image") -> Image.Image:
    """``image`` centre-cropped to multiples of 16 (``grid_crop``)."""
    left, top, w, h = grid_crop(*image.size, name)
    return image.crop((left, top, left + w, top + h))


def pixel_cap(count: int) -> int:
    """The pixel cap of each reference when there are ``count`` of them (BFL: 2024^2 alone, 1024^2 each otherwise)."""
    return SINGLE_REFERENCE_PIXELS if count == 1 else MULTI_REFERENCE_PIXELS


def prepare_reference(image: Image.Image, cap: int, index: int = 0) -> Image.Image:
    """One RGB reference (number ``index``, for messages) checked, scaled down to ``cap`` pixels, centre-cropped to
    multiples of 16: steps 2-4 of the module docstring."""
    check_reference(image, index)
    return center_crop_16(cap_pixels(image, cap), f"reference image {index + 1}")


def prepare_references(images, count: int | None = None) -> list[Image.Image]:
    """BFL's preprocessing of a list of reference images (see the module docstring), each capped as one of ``count``
    references (by default as many as there are images; inpainting adds the source image as one more)."""
    images = [as_pil(im, f"reference image {i + 1}") for i, im in enumerate(images)]
    for i, im in enumerate(images):
        check_reference(im, i)              # every image checked before any is scaled
    cap = pixel_cap(len(images) if count is None else count)
    return [prepare_reference(im, cap, i) for i, im in enumerate(images)]


def image_to_tensor(image: Image.Image) -> torch.Tensor:
    """RGB PIL image -> float32 [1, 3, H, W] in [-1, 1]."""
    x = torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1).float() / 255
    return (x * 2 - 1)[None]


@torch.no_grad()
def encode_references(ae, images, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Preprocess and encode reference images into tokens for the transformer.

    Returns tokens [1, Lref, 128] in ``dtype`` (the transformer's compute dtype) and int64 ids [1, Lref, 4],
    with Lref = sum over references of (h/16)*(w/16), on the AE's device (the AE runs in its own dtype).
    """
    tokens, ids = reference_tokens(reference_latents(ae, images))
    return tokens.to(dtype or tokens.dtype), ids


def reference_latents(ae, images, count: int | None = None) -> list[torch.Tensor]:
    """Reference images preprocessed (``prepare_references``) and encoded: each [1, 128, h/16, w/16]."""
    return [ae.encode(image_to_tensor(im)) for im in prepare_references(images, count)]


def reference_tokens(latents: list[torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Reference latents (each [n, 128, h, w], every item one reference, in order) -> tokens [1, Lref, 128] and int64
    ids [1, Lref, 4] on the tokens' device, reference i on its own grid at t = 10 * (i + 1); (None, None) for none."""
    items = [z[i:i + 1] for z in latents for i in range(z.shape[0])]
    if not items:
        return None, None
    tokens = torch.cat([rope.pack(z) for z in items], dim=1)
    return tokens, rope.reference_ids([tuple(z.shape[-2:]) for z in items], device=tokens.device)


def batched_reference_tokens(latents: list[torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """ComfyUI's ``ref_latents`` as its samplers batch them (each [1 or B, 128, h, w]: reference i of batch item b is
    ``latents[i][b]``) -> tokens [1 or B, Lref, 128] and int64 ids [1, Lref, 4], reference i at t = 10 * (i + 1) as
    in ``reference_tokens``; (None, None) for none."""
    if not latents:
        return None, None
    batch = max(z.shape[0] for z in latents)
    if any(z.shape[0] not in (1, batch) for z in latents):
        raise Flux2Error(f"reference latents of batches {[z.shape[0] for z in latents]} cannot go together: each must "
                         f"hold one latent or one per image of the batch")
    tokens = torch.cat([rope.pack(z).expand(batch, -1, -1) for z in latents], dim=1)
    return tokens, rope.reference_ids([tuple(z.shape[-2:]) for z in latents], device=tokens.device)
