"""Input images and references: decoding, BFL's reference preprocessing, AE encoding into reference tokens.

Decoding: EXIF orientation applied (as diffusers' ``load_image``); 16-bit greyscale becomes round(v / 257) where PIL
would clip; then ``convert("RGB")`` as BFL and diffusers do, so alpha is dropped, not composited (parity).

Preprocessing follows the family's ``ReferenceFit`` (FLUX.2: BFL's ``encode_image_refs``).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image, ImageOps

from ..errors import Flux2Error
from ..families import ReferenceCount, ReferenceFit
from ..latents import PIXELS_PER_LATENT
from ..models import rope

MAX_IMAGE_PIXELS = 8192 * 8192          # 67 megapixels: decoded, 200 MB of RGB; references are used at <= 2024^2
SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N", "I")


def open_image(path) -> Image.Image:
    """A picture file as RGB: bounded, decoded, upright, 16-bit scaled."""
    return _to_rgb(open_picture(path))


def open_picture(path) -> Image.Image:
    """A picture file bounded, decoded and upright, in its own mode (so a mask keeps its transparency)."""
    try:
        with Image.open(path) as image:
            w, h = image.size
            if w * h > MAX_IMAGE_PIXELS:
                raise _too_large(path, f"{w}x{h}, {w * h:,} pixels")
            return decoded(image, f"image {path}")
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
    """From a PIL image or a uint8 array HxW or HxWxC (C = 1 to 4), as RGB."""
    return _to_rgb(decoded(image, name))


def decoded(image, name: str = "an image") -> Image.Image:
    """A PIL image or a uint8 array HxW or HxWxC (C = 1 to 4) decoded and upright, in its own mode."""
    image = _pil(image, name)
    try:
        image.load()                # a lazily opened file decodes here
    except Exception as e:  # noqa: BLE001 (Pillow raises many types on bad data; its own fuzzers catch Exception)
        raise Flux2Error(f"{name} could not be decoded ({type(e).__name__}: {e}); it is damaged or cut short: "
                         f"save or download it again") from None
    return _upright(image)


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
    """EXIF that cannot be read is ignored: the pixels are valid, the orientation only a hint."""
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


def check_reference(image: Image.Image, index: int, fit: ReferenceFit) -> None:
    w, h = image.size
    if min(w, h) < fit.min_side:
        raise Flux2Error(f"reference image {index + 1} is {w}x{h}; both sides must be at least {fit.min_side} px: "
                         f"use a larger image or upscale it")
    if fit.max_aspect is not None and max(w, h) > fit.max_aspect * min(w, h):
        raise Flux2Error(f"reference image {index + 1} is {w}x{h}, an aspect ratio of {max(w, h) / min(w, h):.1f}; "
                         f"at most {fit.max_aspect:g}:1 is supported: crop it closer to square")


def cap_pixels(image: Image.Image, max_pixels: int) -> Image.Image:
    """LANCZOS, int() floors, as BFL; smaller images are left alone."""
    w, h = image.size
    if w * h <= max_pixels:
        return image
    s = math.sqrt(max_pixels / (w * h))
    return image.resize((int(w * s), int(h * s)), Image.Resampling.LANCZOS)


def grid_size(width: int, height: int, name: str) -> tuple[int, int]:
    """The one rule for every input picture (image to edit, mask, reference; CLI and nodes)."""
    n = PIXELS_PER_LATENT
    if width < n or height < n:
        raise Flux2Error(f"{name} is {width}x{height} pixels, smaller than one {n}x{n} cell of the model's grid, so "
                         f"nothing of it would be used: it must be at least {n}x{n} pixels (use a larger picture)")
    return width // n * n, height // n * n


def grid_crop(width: int, height: int, name: str) -> tuple[int, int, int, int]:
    """(left, top, width, height): also where a mask of the picture's size is cut to stay on the same pixels."""
    new_w, new_h = grid_size(width, height, name)
    return (width - new_w) // 2, (height - new_h) // 2, new_w, new_h


def center_crop_16(image: Image.Image, name: str = "the image") -> Image.Image:
    left, top, w, h = grid_crop(*image.size, name)
    return image.crop((left, top, left + w, top + h))


def pixel_cap(count: int, fit: ReferenceFit) -> int:
    """The pixels one of ``count`` references is capped at (FLUX.2: 2024^2 alone, 1024^2 each otherwise)."""
    return fit.single_pixels if count == 1 else fit.multi_pixels


def prepare_reference(image: Image.Image, cap: int, index: int, fit: ReferenceFit) -> Image.Image:
    check_reference(image, index, fit)
    return center_crop_16(cap_pixels(image, cap), f"reference image {index + 1}")


def prepare_references(images, count: ReferenceCount | None, fit: ReferenceFit,
                       model: str = "this model") -> list[Image.Image]:
    """``count``: the images plus any inpainted picture (default: the images alone)."""
    images = [as_pil(im, f"reference image {i + 1}") for i, im in enumerate(images)]
    count = count or ReferenceCount(len(images))
    check_count(count, fit, model)
    for i, im in enumerate(images):
        check_reference(im, i, fit)              # every image checked before any is scaled
    return [prepare_one(im, count.total, i, fit) for i, im in enumerate(images)]


def check_count(count: ReferenceCount, fit: ReferenceFit, model: str = "this model") -> None:
    """The family's limit on references (``ReferenceFit.max_count``), the picture being inpainted included."""
    if fit.max_count is None or count.total <= fit.max_count:
        return
    over = count.total - fit.max_count
    inpainted = (", and the picture being inpainted counts as one (inpainting gives it to the model as reference 1)"
                 if count.inpainted else "")
    raise Flux2Error(f"{model} takes at most {fit.max_count} reference images{inpainted}: got {count.describe()}; "
                     f"leave out {over} reference picture{'' if over == 1 else 's'} (or combine several into one picture)")


def prepare_one(image: Image.Image, count: int, index: int, fit: ReferenceFit) -> Image.Image:
    """Reference ``index`` of ``count``: padded where the family pads a lone one, else capped and cropped to 16 px."""
    if fit.padded and count == 1:
        check_reference(image, index, fit)
        return padded_reference(image, fit)[0]
    return prepare_reference(image, pixel_cap(count, fit), index, fit)


def reference_canvas(width: int, height: int, fit: ReferenceFit) -> tuple[tuple[int, int], tuple[int, int]]:
    """(fitted size, 16-px canvas) of a lone reference; the scale shrinks until the rounded-up canvas fits."""
    n = PIXELS_PER_LATENT
    scale = min(1.0, math.sqrt(fit.single_pixels / (width * height)), fit.max_side / max(width, height))
    while True:
        fitted = (max(1, round(width * scale)), max(1, round(height * scale)))
        canvas = tuple(min(fit.max_side, max(fit.pad_min, -(-v // n) * n)) for v in fitted)
        if canvas[0] * canvas[1] <= fit.single_pixels:
            return fitted, canvas
        scale *= 0.995


def padded_box(size: tuple[int, int], fit: ReferenceFit) -> tuple[int, int, int, int] | None:
    """(left, top, right, bottom) of a lone reference of ``size`` on its padded canvas; None where it fills it."""
    (fw, fh), (w, h) = reference_canvas(*size, fit)
    if (w, h) == (fw, fh):
        return None
    left, top = (w - fw) // 2, (h - fh) // 2
    return left, top, left + fw, top + fh


def canvas_crop(images, count: ReferenceCount, fit: ReferenceFit, sized: bool) -> tuple[int, int, int, int] | None:
    """The box a lone padded reference's picture is cropped back to; None where nothing is cropped."""
    if not fit.padded or count.pictures != 1 or count.inpainted or sized:
        return None
    return padded_box(as_pil(images[0]).size, fit)


def padded_reference(image: Image.Image, fit: ReferenceFit) -> tuple[Image.Image, tuple[int, int, int, int] | None]:
    """A lone reference fitted and centred on its canvas, border reflected -> (canvas, the picture's box on it)."""
    fitted, (w, h) = reference_canvas(image.width, image.height, fit)
    box = padded_box(image.size, fit)
    if fitted != image.size:
        image = image.resize(fitted, Image.Resampling.LANCZOS)
    if box is None:
        return image, None
    left, top, right, bottom = box
    padding = ((top, h - bottom), (left, w - right), (0, 0))
    mode = "reflect" if min(image.size) > PIXELS_PER_LATENT else "symmetric"
    return Image.fromarray(np.pad(np.asarray(image), padding, mode=mode)), box


def image_to_tensor(image: Image.Image) -> torch.Tensor:
    """-> float32 [1, 3, H, W] in [-1, 1]."""
    x = torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1).float() / 255
    return (x * 2 - 1)[None]


@torch.no_grad()
def encode_references(ae, images, dtype: torch.dtype | None, *, ids, fit: ReferenceFit
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> tokens [1, Lref, 128] in ``dtype`` and ids [1, Lref, 4], Lref = sum of (h/16)*(w/16), on the AE's device."""
    tokens, ids = reference_tokens(reference_latents(ae, images, None, fit), ids)
    return tokens.to(dtype or tokens.dtype), ids


def reference_latents(ae, images, count: ReferenceCount | None, fit: ReferenceFit) -> list[torch.Tensor]:
    """Each [1, 128, h/16, w/16]."""
    return [ae.encode(image_to_tensor(im)) for im in prepare_references(images, count, fit)]


def reference_tokens(latents: list[torch.Tensor], ids) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """latents each [n, 128, h, w], every item one reference -> tokens [1, Lref, 128], ids [1, Lref, 4]."""
    items = [z[i:i + 1] for z in latents for i in range(z.shape[0])]
    if not items:
        return None, None
    tokens = torch.cat([rope.pack(z) for z in items], dim=1)
    return tokens, ids([tuple(z.shape[-2:]) for z in items], device=tokens.device)


def batched_reference_tokens(latents: list[torch.Tensor], ids) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """ComfyUI's ``ref_latents``, each [1 or B, 128, h, w] -> tokens [1 or B, Lref, 128], ids [1, Lref, 4]."""
    if not latents:
        return None, None
    batch = max(z.shape[0] for z in latents)
    if any(z.shape[0] not in (1, batch) for z in latents):
        raise Flux2Error(f"reference latents of batches {[z.shape[0] for z in latents]} cannot go together: each must "
                         f"hold one latent or one per image of the batch")
    tokens = torch.cat([rope.pack(z).expand(batch, -1, -1) for z in latents], dim=1)
    return tokens, ids([tuple(z.shape[-2:]) for z in latents], device=tokens.device)
