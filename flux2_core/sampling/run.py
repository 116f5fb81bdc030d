"""One denoise run, what the engine's own samplers run: ``pipeline.generate``, ``stages.denoise`` and the Denoise
node (the MODEL for ComfyUI's samplers runs their loop instead, on ``conditioning.velocity_for``). A request becomes
one prepared run, then runs with the caller's hooks:

    run = prepare_run(model, variant, sigmas, cfg, strength=..., image=True, references=True, cache=threshold)
    need = run.need(batch, h, w, dtype, text_tokens=..., ref_tokens=..., new_kv=...)   # bytes beside the weights
    latents = run(noise, txt, negative, references=pack, start=latent, inpaint=blend, kv_source=..., callback=...)

The plan (``plan.py``: sigmas, guidance, the references' route), the memory need and the step cache are decided here
once, the route of the references into the model in ``conditioning.py``; the host supplies memory, progress,
interrupts and caches as hooks (``kv_source``, ``callback``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..runtime import memory
from ..variants import Variant
from .conditioning import NO_REFERENCES, KVSource, ReferencePack
from .euler import Inpaint, Step, add_noise, denoise
from .plan import DenoisePlan, plan_denoise
from .step_cache import StepCache, check_threshold


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
        """The bytes its denoise needs beside the weights (``memory.denoiser_memory``); ``new_kv``: a KV edition's
        reference pass makes the K/V (not found in a cache)."""
        return memory.denoiser_memory(self.model, self.variant, batch, h, w, dtype, ref_tokens=ref_tokens,
                                      cfg=self.cfg, text_tokens=text_tokens, ranks=ranks,
                                      new_reference_kv=self.plan.reference_kv and new_kv)

    def cache_note(self) -> str:
        """What the step cache did (after the run): "" without one."""
        return self.cache.report().line() if self.cache is not None else ""

    def __call__(self, noise: Tensor, txt: Tensor, negative: Tensor | None = None, *,
                 references: ReferencePack = NO_REFERENCES, start: Tensor | None = None, inpaint: Inpaint | None = None,
                 kv_source: KVSource | None = None, callback: Callable[[Step], None] | None = None,
                 dtype: torch.dtype | None = None) -> Tensor:
        """noise [B, 128, h, w]; ``start``: the image-to-image latent [1 or B, 128, h, w], noised to the first sigma;
        txt / negative [1 or B, L, C] (the negative is read only where CFG runs). The latents, on noise's device."""
        x = noise if start is None else add_noise(start.to(noise), noise, self.sigmas[0])
        rule = self.plan.guidance
        return denoise(self.model, x, self.sigmas, txt, negative_txt=negative if rule.cfg else None, cfg=rule.scale,
                       ref=references.tokens, ref_ids=references.ids, ref_kv=references.kv,
                       kv=self.plan.reference_kv, guidance=rule.embedded, inpaint=inpaint,
                       callback=callback, dtype=dtype, cache=self.cache, kv_source=kv_source)


def prepare_run(model: nn.Module, variant: Variant, sigmas, cfg: float, *, strength: float = 1.0,
                image: bool = False, negative: bool = True, references: bool = False,
                cache: float = 0.0) -> DenoiseRun:
    """The run of a request: the plan (``plan_denoise``: every setting checked), its step cache (``cache``: the
    threshold, 0 off). ``image``: a start latent is given; ``negative``: a negative prompt is at hand; ``references``:
    references (an inpainting source among them) go in."""
    plan = plan_denoise(variant, sigmas, cfg, strength=strength, image=image, negative=negative,
                        references=references)
    return DenoiseRun(model, variant, plan, StepCache(cache) if check_threshold(cache) > 0 else None)
