"""What a generate call asks for (prompt and boxes, references, picture to edit and mask, size, schedule,
strength), read and checked before any model runs.

Defaults are the reference's: a missing size comes from the picture to edit, else the first reference, else 1024
(sizes not a multiple of 16 are an error, never snapped). An inpainted picture goes in as reference 1, as diffusers'.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from PIL import Image
from torch import Tensor

from ..errors import Flux2Error
from ..families import FAMILIES, Family, ReferenceCount, family_of
from ..families.flux3.boxes import Box, check_rows, clamp_notes, read_boxes, rows_read, table_at_end, with_boxes
from ..latents import LATENT_CHANNELS, latent_size
from ..variants import Variant
from . import inpaint
from .references import as_pil, canvas_crop, center_crop_16, prepare_references
from .schedules import check_strength

DEFAULT_SIZE = 1024


@dataclass
class Request:
    text: str                           # the prompt as the model reads it (with its layout rows)
    layout: list[Box]                   # the layout boxes given (FLUX 3)
    references: list[Image.Image]       # the reference pictures, prepared as the family sizes them
    init: Image.Image | None            # the picture to edit or inpaint, cropped to the 16-px grid
    width: int
    height: int
    sigmas: list[float]                 # the full schedule (the run trims it to the strength)
    strength: float
    mask: Tensor | None = None          # inpainting: the mask on the latent grid [1, 1, h, w] (1 = repaint)
    crop: tuple[int, int, int, int] | None = None   # a padded reference's own box in the picture made at its canvas
    notes: list[str] = field(default_factory=list)

    @property
    def grid(self) -> tuple[int, int]:
        """(h, w) of the latent."""
        return latent_size(self.height, self.width)

    @property
    def masked(self) -> bool:
        return self.mask is not None

    @property
    def reference_count(self) -> ReferenceCount:
        return ReferenceCount(len(self.references), inpainted=self.masked)

    def checked_noise(self, noise: Tensor, batch: int) -> None:
        """An explicit noise [batch, 128, h, w] checked against the size asked for."""
        h, w = self.grid
        if tuple(noise.shape) != (batch, LATENT_CHANNELS, h, w):
            raise Flux2Error(f"noise must be [{batch}, {LATENT_CHANNELS}, {h}, {w}] for batch {batch} at "
                             f"{self.width}x{self.height}, got {list(noise.shape)}")

    @property
    def reference_tokens(self) -> int:
        """The tokens the references take in the model (the inpainted picture's among them)."""
        h, w = self.grid
        return sum(math.prod(latent_size(im.height, im.width)) for im in self.references) + (h * w if self.masked
                                                                                            else 0)


def read_request(variant: Variant, prompt: str, *, references=(), width: int | None = None,
                 height: int | None = None, steps: int | None = None, sigmas: list[float] | None = None,
                 image=None, strength: float = 1.0, mask=None, boxes=None, batch: int = 1,
                 say: Callable[[str], None] = lambda note: None, mask_reading: str = "auto") -> Request:
    """Everything that can be refused, refused (``Flux2Error``) before any model runs; ``say`` gets each note."""
    if not isinstance(prompt, str):
        raise Flux2Error(f"prompt must be a string, got {type(prompt).__name__}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise Flux2Error(f"batch must be a whole number >= 1, got {batch!r}")
    masked = mask is not None
    inpaint.check_source(masked, image is not None)
    family = family_of(variant)
    layout = read_boxes(boxes or [])
    text = boxed_prompt(prompt, layout, family, variant.title or family.title)
    count = ReferenceCount(len(references), inpainted=masked)
    check_rows(rows_read(prompt, layout), count, "the boxes")    # each row's "from" names a reference given
    fit = family.references
    refs = prepare_references(references, count, fit, family.title) if references else []
    crop = canvas_crop(references, count, fit, sized=image is not None or width is not None or height is not None)
    source = as_pil(image) if image is not None else None
    init = center_crop_16(source.convert("RGB"), "the image to edit") if source is not None else None
    strength = check_strength(strength, init is not None)           # before the sizes, which read the image
    base = (init or refs[0]).size if init or refs else (DEFAULT_SIZE, DEFAULT_SIZE)
    width, height = (base[0] if width is None else width), (base[1] if height is None else height)
    h, w = latent_size(height, width)
    if sigmas is None:
        sigmas = family.schedule(variant.default_steps if steps is None else steps, h * w)
    family.check_size(width, height)
    request = Request(text, layout, refs, init, width, height, sigmas, strength, crop=crop, notes=clamp_notes(layout))
    if masked:
        pixels, notes = inpaint.image_mask(mask, source, (width, height), mask_reading)
        request.mask = inpaint.latent_mask(pixels, batch, h, w)[0]
        request.notes += [*notes, inpaint.mask_note(pixels, request.mask)]
    request.notes = [note for note in request.notes if note]
    for note in request.notes:
        say(note)
    return request


def check_layout(boxes: list[Box], family: Family, model: str) -> None:
    """Boxes for a family that reads none are refused: its prompt would carry text it was never trained on."""
    if boxes and not family.takes_layout:
        takers = " and ".join(f.title for f in FAMILIES.values() if f.takes_layout)
        raise Flux2Error(f"{model} takes no layout: boxes are for {takers}; leave the boxes out, or describe where "
                         f"things go in the prompt")


def boxed_prompt(prompt: str, boxes: list[Box], family: Family, model: str) -> str:
    """The prompt with the boxes, refused where the family reads none."""
    check_layout(boxes, family, model)
    if boxes and table_at_end(prompt) is not None:
        raise Flux2Error("the prompt already ends in a box table (the prompt upsampler's answer carries the boxes it "
                         "was given): give the boxes once, to the upsampler or here")
    return with_boxes(prompt, boxes)
