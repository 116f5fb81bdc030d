"""The plan of a denoise, the one set of rules the CLI, ``pipeline.generate`` and the Denoise node follow before
anything runs: sigmas checked and, for image-to-image, trimmed to the strength's tail; ``euler.guidance_for`` says
whether CFG runs; ``references_as_kv`` how the references enter the model. Callers then call ``euler.denoise`` with
it."""

from __future__ import annotations

from dataclasses import dataclass

from .euler import Guidance, guidance_for
from .schedules import check_sigmas, check_strength, truncate_for_strength


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
    """The one rule for how references (an inpainting source among them) enter the model. A KV edition (Klein 9B-KV)
    runs them once through the blocks at t = 0 and attends to their cached K/V at every step; every other variant
    joins their tokens to the image's in every pass. Asked by the plan, and by ComfyUI's samplers' model calls and
    memory estimate, which have no plan."""
    return bool(references) and variant.use_kv_cache


def plan_denoise(variant, sigmas, cfg: float, *, strength: float = 1.0, image: bool = False,
                 negative: bool = True, references: bool = False) -> DenoisePlan:
    """``sigmas``: a full schedule; ``image``: a start latent is given (a ``strength`` below 1 needs one);
    ``negative``: a negative prompt is at hand; ``references``: reference tokens go in. Flux2Error for settings that
    cannot run."""
    sigmas = check_sigmas(sigmas)
    strength = check_strength(strength, image)
    if strength < 1:
        sigmas = truncate_for_strength(sigmas, strength)
    return DenoisePlan(sigmas, guidance_for(variant, cfg, negative), strength, references_as_kv(variant, references))
