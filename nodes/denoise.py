"""The Denoise node: the Euler denoiser on our model, from a Noise node's noise, a Scheduler's sigmas and Prompt
Encode's conditioning.

Latents are ComfyUI LATENT dicts {"samples": [B, 128, H/16, W/16]} in ComfyUI's FLUX.2 latent space.

KV models (Klein 9B-KV) keep the reference keys/values of the last edit in ``REFERENCE_KV``, keyed by the model and
the reference latents: re-running an edit with a new prompt or seed but the same references skips the reference pass.
The K/V are a model under ComfyUI's model management (``host.Flux2KleinReferenceKV``): counted, offloaded and freed by
ComfyUI like the models themselves.
"""

from __future__ import annotations

import logging

import torch
from comfy_api.latest import io, ui

from ..flux2_core.adapters.lora import AdapterUse
from ..flux2_core.errors import Flux2Error
from ..flux2_core.runtime import cache, memory, parallel
from ..flux2_core.sampling import run
from . import host, types
from .compile import set_compiled
from .noise import DRAWN

log = logging.getLogger("flux2_klein")


class Denoise(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Flux2KleinDenoise", display_name="Klein Denoise (Euler)", search_aliases=types.SEARCH_ALIASES,
            category=f"{types.CATEGORY}/sampling",
            description="Runs the Euler flow-matching sampler. With a negative and cfg != 1: classifier-free "
                        "guidance for base models (distilled Klein ignores cfg, as BFL's and diffusers' pipelines "
                        "do). Reference latents of the positive conditioning are used (for both "
                        "CFG branches); KV models compute their keys/values once and reuse them while the references "
                        "stay the same (a new prompt or seed skips the reference pass). With a latent and "
                        "denoise < 1: image-to-image. A latent with a noise mask (Set Latent Noise Mask, VAE Encode "
                        "(for Inpainting), InpaintModelConditioning) inpaints: the white of the mask is repainted, "
                        "the rest kept, as ComfyUI's own samplers do.",
            inputs=[types.Model.Input("model", tooltip="From Klein Load Model."),
                    io.Conditioning.Input("positive", tooltip="The prompt (and references)."),
                    io.Latent.Input("noise", tooltip="Starting noise (Klein Noise)."),
                    io.Sigmas.Input("sigmas", tooltip="Noise levels, from Klein Scheduler or any scheduler."),
                    io.Float.Input("cfg", default=1.0, min=0.0, max=run.MAX_CFG, step=0.1, round=0.01,
                                   tooltip="Guidance scale. Distilled Klein: 1 (no negative needed; other values are "
                                           "ignored); base: about 4 with a negative (an empty prompt), FLUX 3 Image "
                                           "Klein's base 3.5."),
                    io.Float.Input("denoise", default=1.0, min=0.01, max=1.0, step=0.01,
                                   tooltip="Image-to-image strength: runs the last denoise x steps from the latent "
                                           "noised to that level; 1 starts from pure noise (a noise mask still "
                                           "keeps the latent outside it)."),
                    io.Conditioning.Input("negative", optional=True,
                                          tooltip="Negative prompt for CFG (base models); unused when cfg = 1."),
                    io.Latent.Input("latent", optional=True,
                                    tooltip="Image latent to start from (Klein AE Encode or VAE Encode); with "
                                            "a noise mask, the image to inpaint."),
                    io.Float.Input("cache", default=0.0, min=0.0, max=run.MAX_CACHE, step=0.01,
                                   round=0.001, optional=True,
                                   tooltip="Step cache: reuse the last velocity on steps where the latent has barely "
                                           "moved, skipping model calls. 0 is off; higher skips more, at some cost in "
                                           "detail (it is how much the model's output may be predicted to change "
                                           "and still be reused). For many-step runs (base models, FLUX 3).")],
            outputs=[io.Latent.Output(display_name="latent", tooltip="The denoised latent.")])

    @classmethod
    def validate_inputs(cls, cfg=None, denoise=None, latent=host.UNCONNECTED, cache=0.0):
        # when the prompt is queued, before any model loads: the rules execute applies (see host.validate)
        return host.validate(cls, {"cfg": cfg, "denoise": denoise, "cache": cache},
                             lambda: run.check_settings(denoise, latent is not host.UNCONNECTED, cache))

    @classmethod
    def execute(cls, model: host.Managed, positive, noise, sigmas, cfg: float, denoise: float,
                negative=None, latent=None, cache: float = 0.0) -> io.NodeOutput:
        spread = model.ranks > 1 and model.recipe is not None
        asked = run.latent_run(model.core, model.variant, txt=prompt_embeds(positive),
                           negative=prompt_embeds(negative) if negative is not None else None,
                           references=positive[0][1].get("reference_latents", []),
                           rows=positive[0][1].get(types.META, {}).get("rows", []), noise=noise["samples"],
                           drawn=noise.get(DRAWN) is noise["samples"], masked_noise="noise_mask" in noise,
                           latent=None if latent is None else latent["samples"],
                           noise_mask=None if latent is None else latent.get("noise_mask"),
                           sigmas=sigmas, cfg=cfg, strength=denoise, cache=cache)
        for note in asked.notes:
            log.warning("Klein Denoise: %s", note)
        if spread:
            check_spread(model)                                                      # before followers start
        kv_here = asked.run.plan.reference_kv and not spread  # a parallel run's denoise makes its own split K/V
        kept = kv_here and REFERENCE_KV.holds(model.key, asked.references.tokens.to(model.dtype), asked.references.ids)
        needed = asked.need(model.dtype, ranks=model.ranks if spread else 1, kept_kv=kept)
        device = model.ready(needed)
        memory.check_memory(device, needed, f"denoising {list(asked.noise.shape)} latents", free=lambda where: host.free_memory(model, where),
                            fix="use a smaller size or batch, or fewer or smaller references")
        model.use_adapters(model.core, lambda adapter: adapter.patches)
        set_compiled(model)
        parallel.attach(model.core, spread_over(model) if spread else None)
        try:
            out = asked(device, dtype=model.dtype, hooks=run.Hooks(host.StepReporter(asked.run.plan.steps, device),
                                                                   kept_kv(model, needed) if kv_here else None))
            if spread:
                parallel.sequence_parallel_of(model.core).release()          # the followers' share of the reference K/V
        except BaseException:
            host.close_broken_followers()       # cancelled or failed inside a pass: the next run starts new ones
            raise
        finally:
            parallel.attach(model.core, None)
        if asked.run.cache is not None:
            log.info("Klein Denoise: %s", asked.run.cache_note())
        kv_note = ("reference K/V: reused (no reference pass)" if kept else "reference K/V: computed") if kv_here else ""
        notes = "; ".join(note for note in (*asked.notes, kv_note, f"denoised on {model.ranks} ranks" if spread else "",
                                            asked.run.cache_note()) if note)
        return io.NodeOutput({"samples": out.float().to(host.intermediate_device())},
                             ui=ui.PreviewText(notes) if notes else None)


def spread_over(model: host.Managed):
    """The follower group's SequenceParallel for ``model``, its followers given the model's LoRAs."""
    group = host.followers(model)
    group.set_adapters([AdapterUse(host.resolve("loras", a.file), a.adapter.digest(text_encoder=False), a.strength,
                                   a.merge) for a in model.adapters if a.strength != 0])
    return group.sp


def check_spread(model: host.Managed) -> None:
    """A parallel run's limits, refused before its followers start."""
    parallel.check_world(model.variant.params.num_heads, model.ranks)
    if model.compiled:
        raise Flux2Error("Klein Compile and Klein Parallel do not run together yet: bypass one")


def kept_kv(model: host.Managed, needed: int):
    """The run's K/V source (``conditioning.KVSource``): the references' K/V from ``REFERENCE_KV``, made on a miss
    under ComfyUI's model management and loaded beside the model."""
    def source(ref, ref_ids, make):
        if REFERENCE_KV.holds(model.key, ref, ref_ids):
            log.info("FLUX.2 Klein: reference K/V reused from the previous edit (no reference pass)")
        patcher = REFERENCE_KV.get(model.core, ref, ref_ids, model_key=model.key,
                                   make=lambda: host.manage_reference_kv(make()))
        return host.reference_kv_ready(patcher, model, needed)
    return source


# the last edit's reference K/V, each under ComfyUI's model management (a ModelPatcher of host.Flux2KleinReferenceKV),
# by the model and the exact references (the CLI's cache, kept another way); one: about 2 GiB per 1024^2 reference on
# Klein 9B in bf16, dropped before the next edit's are made, and freed by ComfyUI with the last reference to it
REFERENCE_KV = cache.ReferenceKVCache(max_items=1, max_bytes=None, size=lambda patcher: patcher.model_size())


def prompt_embeds(conditioning) -> torch.Tensor:
    """The embeddings [1 or B, L, C] of a CONDITIONING (the run checks them against the model's text width)."""
    if len(conditioning) > 1:
        log.warning("Klein Denoise uses the first of %d conditioning entries", len(conditioning))
    return conditioning[0][0]
