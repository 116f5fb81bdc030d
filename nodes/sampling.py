"""Sampling: noise, the schedule (SIGMAS), the Euler denoiser, and the opt-in compile of its model.

Latents are ComfyUI LATENT dicts {"samples": [B, 128, H/16, W/16]} in ComfyUI's FLUX.2 latent space.

KV models (Klein 9B-KV) keep the reference keys/values of the last edit in ``REFERENCE_KV``, keyed by the model and
the reference latents: re-running an edit with a new prompt or seed but the same references skips the reference pass.
The K/V are a model under ComfyUI's model management (``host.Flux2KleinReferenceKV``): counted, offloaded and freed by
ComfyUI like the models themselves.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
from comfy_api.latest import io, ui

from ..flux2_core import latents
from ..flux2_core.adapters.lora import AdapterUse
from ..flux2_core.errors import Flux2Error
from ..flux2_core.families import family_of
from ..flux2_core.runtime import cache, memory, parallel
from ..flux2_core.runtime import compile as compiling
from ..flux2_core.sampling import euler, schedules, step_cache
from ..flux2_core.sampling.latent_run import latent_run
from . import host, types

log = logging.getLogger("flux2_klein")
SIZE = {"default": 1024, "min": 16, "max": 8192, "step": 16}


class Noise(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Flux2KleinNoise", display_name="Klein Noise", search_aliases=types.SEARCH_ALIASES,
            category=f"{types.CATEGORY}/sampling",
            description="Gaussian starting noise for an image of width x height. Item i of a batch is drawn with "
                        "seed + i on the CPU, so it equals a single image made with that seed, on any device. A model "
                        "whose reference reads its noise another way (FLUX 3 Image Klein: in token order) reads this "
                        "draw that way in the Denoise node, so a seed gives the picture the command line gives.",
            inputs=[io.Int.Input("seed", default=0, min=0, max=2**53 - 1, control_after_generate=True,
                                 tooltip="Random seed; item i of the batch uses seed + i."),
                    io.Int.Input("width", **SIZE, tooltip="Image width in pixels (a multiple of 16)."),
                    io.Int.Input("height", **SIZE, tooltip="Image height in pixels (a multiple of 16)."),
                    io.Int.Input("batch_size", default=1, min=1, max=64, tooltip="Images to make at once."),
                    io.Latent.Input("latent", optional=True,
                                    tooltip="Take width and height from this latent instead (image-to-image).")],
            outputs=[io.Latent.Output(display_name="noise", tooltip="LATENT noise [batch, 128, height/16, width/16].")])

    @classmethod
    def validate_inputs(cls, width=None, height=None, latent=host.UNCONNECTED):
        # when the prompt is queued, before any node runs (see host.validate)
        return host.validate(cls, {"width": width, "height": height},
                             lambda: latent is not host.UNCONNECTED or latents.latent_size(height, width))

    @classmethod
    def execute(cls, seed: int, width: int, height: int, batch_size: int, latent=None) -> io.NodeOutput:
        if latent is not None:
            height, width = (latents.PIXELS_PER_LATENT * n for n in latent["samples"].shape[-2:])
        noise = euler.make_noise(batch_size, height, width, seed, device=host.intermediate_device())
        return io.NodeOutput({"samples": noise, DRAWN: noise})


class Scheduler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Flux2KleinScheduler", display_name="Klein Scheduler", search_aliases=types.SEARCH_ALIASES,
            category=f"{types.CATEGORY}/sampling",
            description=f"The noise levels (SIGMAS) of each step, from 1 to 0. {schedules.MODELS_OWN}: the schedule of "
                        "the connected model's family (connect the model: FLUX.2 Klein's or FLUX 3 Image Klein's); "
                        "flux2: FLUX.2's, shifted by an empirical mu that depends on the image size and the step "
                        "count; flux3: FLUX 3 Image Klein's; linear: evenly spaced; power: (1 - i/steps) ** rho. The "
                        "image size comes from the latent (connect the noise), or from width and height sockets where "
                        "no latent is connected.",
            inputs=[io.Int.Input("steps", default=4, min=1, max=200,
                                 tooltip="Denoising steps: 4 for distilled FLUX.2 Klein, 16 for distilled FLUX 3 "
                                         "Image Klein, about 50 for the base models (the loader shows its "
                                         "model's)."),
                    io.Combo.Input("schedule", options=list(schedules.SCHEDULES), default=schedules.MODELS_OWN,
                                   tooltip=f"Which schedule (see above); {schedules.MODELS_OWN} needs the model "
                                           "connected."),
                    io.Float.Input("rho", default=2.0, min=0.1, max=10.0, step=0.1,
                                   tooltip="Exponent of the power schedule (1 = linear); the others ignore it."),
                    io.Latent.Input("latent", optional=True,
                                    tooltip="The image size comes from this latent: connect the noise."),
                    # sockets, not widgets: the size is set once, on the noise; these serve graphs without a latent
                    io.Int.Input("width", **SIZE, optional=True, force_input=True,
                                 tooltip="Image width in pixels, where no latent is connected."),
                    io.Int.Input("height", **SIZE, optional=True, force_input=True,
                                 tooltip="Image height in pixels, where no latent is connected."),
                    # last: a saved workflow's links name an input by its position
                    types.Model.Input("model", optional=True,
                                      tooltip=f"The model the sigmas are for: {schedules.MODELS_OWN} is its family's "
                                              "schedule (the other schedules ignore it).")],
            outputs=[io.Sigmas.Output(display_name="sigmas", tooltip="steps + 1 noise levels, 1 ... 0.")])

    @classmethod
    def validate_inputs(cls, steps=None, schedule=None, rho=None, latent=host.UNCONNECTED, width=host.UNCONNECTED,
                        height=host.UNCONNECTED, model=host.UNCONNECTED):
        # the schedule itself is made at queue time too: a size whose flux2 schedule breaks is refused there; the
        # model's own waits for the model (a link: which family it is shows only when the graph runs)
        if latent is host.UNCONNECTED and host.UNCONNECTED in (width, height):
            return "connect the latent (the noise), or give both width and height"
        sizes = {} if latent is not host.UNCONNECTED else {"width": width, "height": height}

        def made_here():
            schedules.check_model_for(schedule, model is not host.UNCONNECTED)
            if latent is host.UNCONNECTED and schedule != schedules.MODELS_OWN:
                schedules.named_schedule(schedule, steps, math.prod(latents.latent_size(height, width)), rho)
        return host.validate(cls, {"steps": steps, "schedule": schedule, "rho": rho} | sizes, made_here)

    @classmethod
    def execute(cls, steps: int, schedule: str, rho: float, latent=None, width: int | None = None,
                height: int | None = None, model: host.Managed | None = None) -> io.NodeOutput:
        h, w = latent["samples"].shape[-2:] if latent is not None else latents.latent_size(height, width)
        family = family_of(model.variant) if model is not None else None
        return io.NodeOutput(torch.tensor(schedules.named_schedule(schedule, steps, h * w, rho, family),
                                          dtype=torch.float32))


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
                    io.Float.Input("cfg", default=1.0, min=0.0, max=euler.MAX_CFG, step=0.1, round=0.01,
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
                    io.Float.Input("cache", default=0.0, min=0.0, max=step_cache.MAX_THRESHOLD, step=0.01,
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
                             lambda: (schedules.check_strength(denoise, latent is not host.UNCONNECTED),
                                      step_cache.check_threshold(cache)))

    @classmethod
    def execute(cls, model: host.Managed, positive, noise, sigmas, cfg: float, denoise: float,
                negative=None, latent=None, cache: float = 0.0) -> io.NodeOutput:
        spread = model.ranks > 1 and model.recipe is not None
        asked = latent_run(model.core, model.variant, txt=prompt_embeds(positive),
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
        memory.check_memory(device, needed, f"denoising {list(asked.noise.shape)} latents", free=host.free_memory,
                            fix="use a smaller size or batch, or fewer or smaller references")
        model.use_adapters(model.core, lambda adapter: adapter.patches)
        set_compiled(model)
        parallel.attach(model.core, spread_over(model) if spread else None)
        try:
            out = asked(device, dtype=model.dtype, callback=host.StepReporter(asked.run.plan.steps, device),
                        kv_source=kept_kv(model, needed) if kv_here else None)
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


class Compile(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Flux2KleinCompile", display_name="Klein Compile", search_aliases=types.SEARCH_ALIASES,
            category=f"{types.CATEGORY}/sampling",
            description="Runs the model's transformer blocks through torch.compile in the denoiser. The first run at "
                        "a new image size, batch or reference count compiles (about a minute on a GPU, longer on a "
                        "CPU); later steps, prompts and seeds reuse it and run faster. Needs a working Triton (GPU) or "
                        "C++ compiler (CPU).",
            inputs=[types.Model.Input("model", tooltip="From Klein Load Model.")],
            outputs=[types.Model.Output(display_name="model", tooltip="The same model, marked to run compiled.")])

    @classmethod
    def execute(cls, model: host.Managed) -> io.NodeOutput:
        return io.NodeOutput(dataclasses.replace(model, compiled=True))


def spread_over(model: host.Managed):
    """The follower group's SequenceParallel for ``model``, its followers given the model's LoRAs."""
    group = host.followers(model)
    group.set_adapters([AdapterUse(host.resolve("loras", a.file), a.adapter.digest(text_encoder=False), a.strength,
                                   a.merge) for a in model.adapters if a.strength != 0])
    return group.sp


def set_compiled(model: host.Managed) -> None:
    """Compile the blocks when this model came through the Compile node, else run them eagerly: the transformer is
    shared by every branch that uses the loader's output, so each denoiser sets the mode it needs. A model ComfyUI
    loaded only partially streams weights inside the blocks' calls, which breaks a full graph: it is compiled in
    pieces (fullgraph=False) rather than failing."""
    fullgraph = not host.partially_loaded(model)
    if model.compiled and not compiling.is_compiled(model.core, fullgraph=fullgraph):
        compiling.compile_blocks(model.core, fullgraph=fullgraph)
    elif not model.compiled and compiling.is_compiled(model.core):
        compiling.uncompile_blocks(model.core)


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


DRAWN = "flux2_klein_drawn"   # our key beside a Noise node's samples: the very tensor it drew (the seed's draw)


def prompt_embeds(conditioning) -> torch.Tensor:
    """The embeddings [1 or B, L, C] of a CONDITIONING (the run checks them against the model's text width)."""
    if len(conditioning) > 1:
        log.warning("Klein Denoise uses the first of %d conditioning entries", len(conditioning))
    return conditioning[0][0]

