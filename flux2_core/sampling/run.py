"""The denoise in one place: its plan (the rules every caller follows before anything runs), the prepared run every
engine sampler calls, and the run asked for in latents as a node graph asks for it.

    run = prepare_run(model, variant, sigmas, cfg, strength=..., image=True, references=True, cache=threshold)
    need = run.need(batch, h, w, dtype, text_tokens=..., ref_tokens=..., new_kv=...)   # bytes beside the weights
    latents = run(noise, txt, negative, references=pack, start=latent, inpaint=blend, hooks=Hooks(callback=...))

A run in latents (``latent_run``) is checked into a ``LatentRun``; inpainting there blends before each model call, as
ComfyUI's own samplers do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..errors import Flux2Error
from ..families import ReferenceCount, family_of
from ..families.flux3.boxes import check_rows
from ..latents import LATENT_CHANNELS, PIXELS_PER_LATENT
from ..runtime import memory
from ..variants import Variant
from ..weights import check_embeddings_fit
from . import inpaint
from .conditioning import NO_REFERENCES, KVSource, ReferencePack, pack_references
from .euler import MAX_CFG, Guidance, Inpaint, Step, add_noise, denoise, guidance_for
from .schedules import check_sigmas, check_strength, truncate_for_strength
from .step_cache import MAX_THRESHOLD as MAX_CACHE
from .step_cache import StepCache, check_threshold

__all__ = ["MAX_CACHE", "MAX_CFG", "DenoisePlan", "DenoiseRun", "Hooks", "LatentRun", "check_inputs",
           "check_settings", "latent_run", "plan_denoise", "prepare_run", "references_as_kv"]


# --- the plan ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DenoisePlan:
    sigmas: list[float]         # the noise levels the Euler loop runs through (the tail, for image-to-image)
    guidance: Guidance          # CFG or not, the scale, FLUX.2-dev's embedded value, the note for the user
    strength: float             # the denoise strength (1: from pure noise)
    reference_kv: bool = False  # the references enter as K/V made once (``references_as_kv``), not as joined tokens

    @property
    def steps(self) -> int:
        return len(self.sigmas) - 1


def references_as_kv(variant, references: bool) -> bool:
    """The one rule for how references enter the model: a KV edition runs them once at t = 0 and attends to their
    cached K/V at every step; other variants join their tokens to the image's in every pass."""
    return bool(references) and variant.use_kv_cache


def plan_denoise(variant, sigmas, cfg: float, *, strength: float = 1.0, image: bool = False,
                 negative: bool = True, references: bool = False) -> DenoisePlan:
    """``sigmas``: a full schedule; ``image``: a start latent is given (strength below 1 needs one). Raises
    Flux2Error for settings that cannot run."""
    sigmas = check_sigmas(sigmas)
    strength = check_strength(strength, image)
    if strength < 1:
        sigmas = truncate_for_strength(sigmas, strength)
    return DenoisePlan(sigmas, guidance_for(variant, cfg, negative), strength, references_as_kv(variant, references))


# --- the run ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Hooks:
    """``callback(Step)`` after every step (it may raise to interrupt); ``kv_source``: the host's reference K/V cache."""
    callback: Callable[[Step], None] | None = None
    kv_source: KVSource | None = None


NO_HOOKS = Hooks()


@dataclass
class DenoiseRun:
    """A denoise prepared and checked before anything runs: call it with the inputs to get the latents."""

    model: nn.Module
    variant: Variant
    plan: DenoisePlan
    cache: StepCache | None     # the step cache of this run (None: every step runs the model)

    @property
    def cfg(self) -> bool:
        return self.plan.guidance.cfg

    @property
    def sigmas(self) -> list[float]:
        return self.plan.sigmas

    def need(self, batch: int, h: int, w: int, dtype: torch.dtype, *, text_tokens: int, ref_tokens: int = 0,
             new_kv: bool = True, ranks: int | None = None) -> int:
        """Bytes the denoise needs beside the weights; ``new_kv``: the reference K/V is made, not found cached."""
        return memory.denoiser_memory(self.model, self.variant, batch, h, w, dtype, ref_tokens=ref_tokens,
                                      cfg=self.cfg, text_tokens=text_tokens, ranks=ranks,
                                      new_reference_kv=self.plan.reference_kv and new_kv)

    def cache_note(self) -> str:
        """What the step cache did (after the run): "" without one."""
        return self.cache.report().line() if self.cache is not None else ""

    def __call__(self, noise: Tensor, txt: Tensor, negative: Tensor | None = None, *,
                 references: ReferencePack = NO_REFERENCES, start: Tensor | None = None, inpaint: Inpaint | None = None,
                 hooks: Hooks = NO_HOOKS, dtype: torch.dtype | None = None) -> Tensor:
        """noise [B, 128, h, w]; ``start`` [1 or B, 128, h, w], noised to the first sigma; txt / negative
        [1 or B, L, C]. Returns the latents, on noise's device."""
        x = noise if start is None else add_noise(start.to(noise), noise, self.sigmas[0])
        rule = self.plan.guidance
        return denoise(self.model, x, self.sigmas, txt, negative_txt=negative if rule.cfg else None, cfg=rule.scale,
                       ref=references.tokens, ref_ids=references.ids, ref_kv=references.kv,
                       kv=self.plan.reference_kv, guidance=rule.embedded, inpaint=inpaint,
                       callback=hooks.callback, dtype=dtype, cache=self.cache, kv_source=hooks.kv_source)


def prepare_run(model: nn.Module, variant: Variant, sigmas, cfg: float, *, strength: float = 1.0,
                image: bool = False, negative: bool = True, references: bool = False,
                cache: float = 0.0) -> DenoiseRun:
    """The checked plan (``plan_denoise``) and its step cache (``cache``: the threshold, 0 off)."""
    plan = plan_denoise(variant, sigmas, cfg, strength=strength, image=image, negative=negative,
                        references=references)
    return DenoiseRun(model, variant, plan, StepCache(cache) if check_threshold(cache) > 0 else None)


# --- a run asked for in latents ----------------------------------------------------------------------------


def check_settings(strength: float, image: bool, cache: float) -> None:
    """A denoise's settings checked before anything loads (a node's validation): strength and cache threshold."""
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

    def __call__(self, device: torch.device, *, dtype: torch.dtype, hooks: Hooks = NO_HOOKS) -> Tensor:
        return self.run(self.noise.to(device), self.txt, self.negative, references=self.references,
                        start=self.start.to(device), inpaint=self.inpaint, hooks=hooks, dtype=dtype)


def latent_run(model, variant: Variant, *, txt: Tensor, negative: Tensor | None, references: list[Tensor],
               rows: list[dict], noise: Tensor, drawn: bool, latent: Tensor | None, noise_mask: Tensor | None,
               sigmas, cfg: float, strength: float, cache: float = 0.0, masked_noise: bool = False) -> LatentRun:
    """``references``: latents [1, 128, h, w], taken by both CFG branches; ``drawn``: ``noise`` is a seed's raw
    draw, which the family reads its own way; ``latent``: the image-to-image start [1 or B, 128, h, w] and
    ``noise_mask`` its pixel-sized mask (1 = repaint); ``masked_noise``: the noise came with a mask."""
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
    """Every tensor the run is handed, checked before any model call; a refusal names the input, the shapes found
    and wanted, and where such an input comes from."""
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
