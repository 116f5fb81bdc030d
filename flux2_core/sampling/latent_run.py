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
from ..latents import LATENT_CHANNELS, PIXELS_PER_LATENT
from ..variants import Variant
from ..weights import check_embeddings_fit
from . import inpaint
from .boxes import check_rows
from .conditioning import KVSource, ReferencePack, pack_references
from .euler import MAX_CFG, Step
from .references import ReferenceCount
from .run import DenoiseRun, prepare_run
from .schedules import check_strength
from .step_cache import MAX_THRESHOLD as MAX_CACHE
from .step_cache import check_threshold

__all__ = ["MAX_CACHE", "MAX_CFG", "LatentRun", "check_inputs", "check_settings", "latent_run"]


def check_settings(strength: float, image: bool, cache: float) -> None:
    """A denoise's settings checked before anything loads (a node's validation): the strength (below 1 only with a
    start latent, ``image``) and the step cache's threshold; the bounds of cfg and the cache are MAX_CFG, MAX_CACHE."""
    check_strength(strength, image)
    check_threshold(cache)


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
    check_inputs(noise=noise, txt=txt, negative=negative, references=references, latent=latent,
                 noise_mask=noise_mask)
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


# where each input of the run comes from in a graph, for the refusals: what to connect instead
SOURCES = {"noise": "the noise comes from Klein Noise (a FLUX.2-family latent: a video model's or FLUX.1's does not "
                    "fit)",
           "txt": "the prompt comes from Klein Prompt Encode (or ComfyUI's text encode on the model's text encoder)",
           "negative": "the negative prompt comes from Klein Prompt Encode, as the positive one",
           "reference": "reference latents come from Klein Reference Image, or ComfyUI's VAE Encode with the FLUX.2 "
                        "autoencoder (FLUX.1's makes 16 channels)",
           "latent": "the start latent comes from Klein AE Encode, or ComfyUI's VAE Encode with the FLUX.2 autoencoder",
           "mask": "the mask comes from ComfyUI's Set Latent Noise Mask (a MASK of the picture's size)"}
LATENT = f"[batch, {LATENT_CHANNELS}, height/16, width/16]"


def _refuse(what: str, tensor, wanted: str, source: str) -> Flux2Error:
    found = f"shape {list(tensor.shape)}" if isinstance(tensor, Tensor) else f"a {type(tensor).__name__}"
    return Flux2Error(f"{what} is {found}, but the run takes {wanted}: {SOURCES[source]}")


def _latent(what: str, tensor, source: str, batch: int | None = None) -> None:
    """A latent [B, 128, h, w] with something in it and only finite values (B = ``batch`` where given)."""
    if (not isinstance(tensor, Tensor) or tensor.ndim != 4 or tensor.shape[1] != LATENT_CHANNELS
            or 0 in tensor.shape or (batch is not None and tensor.shape[0] != batch)):
        raise _refuse(what, tensor, LATENT.replace("batch", str(batch)) if batch is not None else LATENT, source)
    if not bool(torch.isfinite(tensor).all()):
        raise Flux2Error(f"{what} holds NaN or infinite values: {SOURCES[source]}, and what made it went wrong")


def check_inputs(*, noise, txt, negative, references, latent, noise_mask) -> None:
    """Every tensor the run is handed, checked before any model call: rank, channels, batch, size and finiteness; a
    refusal names the input, the shape found, the shape wanted and where such an input comes from."""
    _latent("the noise latent", noise, "noise")
    batch = noise.shape[0]
    prompts = [("the prompt embeddings", txt, "txt")]
    if negative is not None:
        prompts.append(("the negative prompt embeddings", negative, "negative"))
    for what, embeds, source in prompts:
        if not isinstance(embeds, Tensor) or embeds.ndim != 3 or 0 in embeds.shape:
            raise _refuse(what, embeds, "[batch, tokens, width]", source)
        if embeds.shape[0] not in (1, batch):
            raise Flux2Error(f"{what} hold {embeds.shape[0]} prompts, but the noise {batch} latents: one prompt for "
                             f"every latent, or as many prompts as latents ({SOURCES[source]}; the noise's "
                             f"batch_size is Klein Noise's)")
        if not bool(torch.isfinite(embeds).all()):
            raise Flux2Error(f"{what} hold NaN or infinite values: {SOURCES[source]}")
    for i, reference in enumerate(references):
        _latent(f"reference latent {i + 1}", reference, "reference", batch=1)
    if latent is not None:
        _latent("the start latent", latent, "latent")
    if noise_mask is not None and (not isinstance(noise_mask, Tensor) or noise_mask.numel() == 0
                                   or noise_mask.ndim not in (2, 3, 4)):
        raise _refuse("the noise mask", noise_mask, "[H, W], [B, H, W] or [B, 1, H, W] with something in it", "mask")


def image_latent(latent: Tensor, noise: Tensor) -> Tensor:
    """The image-to-image start latent, checked against the noise and broadcast over its batch."""
    if latent.shape[1:] != noise.shape[1:] or latent.shape[0] not in (1, noise.shape[0]):
        raise Flux2Error(f"the latent {list(latent.shape)} does not fit the noise {list(noise.shape)}: connect the "
                         f"latent to the noise node's latent input (same size), and make the noise batch the latent's "
                         f"batch or use a single latent")
    return latent.to(noise).expand_as(noise)
