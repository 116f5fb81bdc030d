"""A denoise asked for in latents, as a node graph asks for it (the Denoise node): prompt embeddings already made,
reference latents, the noise and an optional start latent with its inpainting mask. Read and checked into one
``DenoiseRun`` with its inputs; the host then supplies memory, progress and caches and calls it.

The rules are the command line's (``run.prepare_run``): the same plan, guidance, references' route and step cache;
inpainting blends before each model call, as ComfyUI's own samplers do (``inpaint.BEFORE_MODEL``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import Flux2Error
from ..families import family_of
from ..latents import PIXELS_PER_LATENT
from ..variants import Variant
from ..weights import check_embeddings_fit
from . import inpaint
from .boxes import check_rows
from .conditioning import KVSource, ReferencePack, pack_references
from .euler import Step
from .references import ReferenceCount
from .run import DenoiseRun, prepare_run


@dataclass
class LatentRun:
    run: DenoiseRun
    noise: Tensor                      # [B, 128, h, w], as the model's family reads it
    start: Tensor                      # the start latent [B, 128, h, w] (zeros from pure noise)
    txt: Tensor                        # [1 or B, L, C]
    negative: Tensor | None            # read only where CFG runs
    references: ReferencePack
    inpaint: inpaint.Inpaint | None
    notes: list[str] = field(default_factory=list)   # for the user: guidance not applied as given, the mask's

    def need(self, dtype: torch.dtype, *, ranks: int = 1, kept_kv: bool = False) -> int:
        """The bytes the denoise needs beside the weights; ``kept_kv``: a KV edition's K/V found in the host's cache."""
        batch, _, h, w = self.noise.shape
        return self.run.need(batch, h, w, dtype, text_tokens=self.txt.shape[1], ref_tokens=self.references.count,
                             new_kv=not kept_kv, ranks=ranks)

    def __call__(self, device: torch.device, *, dtype: torch.dtype, kv_source: KVSource | None = None,
                 callback: Callable[[Step], None] | None = None) -> Tensor:
        return self.run(self.noise.to(device), self.txt, self.negative, references=self.references,
                        start=self.start.to(device), inpaint=self.inpaint, kv_source=kv_source, callback=callback,
                        dtype=dtype)


def latent_run(model, variant: Variant, *, txt: Tensor, negative: Tensor | None, references: list[Tensor],
               rows: list[dict], noise: Tensor, drawn: bool, latent: Tensor | None, noise_mask: Tensor | None,
               sigmas, cfg: float, strength: float, cache: float = 0.0, masked_noise: bool = False) -> LatentRun:
    """``references``: reference latents [1, 128, h, w] (of the positive prompt: both CFG branches take them);
    ``rows``: the layout rows the prompt carries, checked against them; ``drawn``: ``noise`` is a seed's draw as
    drawn, which the family then reads its own way (else it is taken as given); ``latent``: the image-to-image start
    ([1 or B, 128, h, w]) and ``noise_mask`` its pixel-sized mask (1 = repaint); ``masked_noise``: the noise came with
    a mask (a masked latent given as the noise), which needs the latent it masks."""
    family_of(variant).check_size(*(side * PIXELS_PER_LATENT for side in noise.shape[-1:-3:-1]))
    check_rows(rows, ReferenceCount(len(references)),
               "the layout (FLUX 3 Klein Layout's boxes, or the table the prompt ends in)")
    pack = pack_references(variant, references)
    run = prepare_run(model, variant, sigmas, cfg, strength=strength, image=latent is not None,
                      negative=negative is not None, references=bool(pack), cache=cache)
    for embeds in (txt, negative if run.cfg else None):        # the negative is read only where CFG runs
        if embeds is not None:
            check_embeddings_fit(variant, embeds)
    inpaint.check_source(masked_noise, latent is not None)
    if drawn:
        noise = family_of(variant).noise(noise)
    start = torch.zeros_like(noise) if latent is None else image_latent(latent, noise)
    blend, notes = None, [run.plan.guidance.note]
    if noise_mask is not None:
        batch, _, h, w = noise.shape
        mask, note = inpaint.latent_mask(noise_mask, batch, h, w)
        blend = inpaint.Inpaint(start, noise, mask, inpaint.BEFORE_MODEL)
        notes += [note, inpaint.mask_note(noise_mask, mask)]
    return LatentRun(run, noise, start, txt, negative, pack, blend, [note for note in notes if note])


def image_latent(latent: Tensor, noise: Tensor) -> Tensor:
    """The image-to-image start latent, checked against the noise and broadcast over its batch."""
    if latent.shape[1:] != noise.shape[1:] or latent.shape[0] not in (1, noise.shape[0]):
        raise Flux2Error(f"the latent {list(latent.shape)} does not fit the noise {list(noise.shape)}: connect the "
                         f"latent to the noise node's latent input (same size), and make the noise batch the latent's "
                         f"batch or use a single latent")
    return latent.to(noise).expand_as(noise)
