"""Noise and the Euler sampler: one loop (``euler``) over a velocity function that ``denoise`` builds for every case.

Dtypes follow the reference: each step ``x + (sigma_next - sigma) * v`` runs in the compute dtype, the step size from
the float32 schedule.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from .. import checks
from ..errors import Flux2Error
from ..families import NoiseReading, family_of_params
from ..latents import LATENT_CHANNELS, latent_size
from ..models.reference_kv import ReferenceKV
from ..models.text_encoder import stack_rows
from ..runtime import memory
from .conditioning import KVSource, ReferencePack, Velocity, velocity_for
from .step_cache import StepCache

MAX_CFG = 100.0          # as ComfyUI's CFGGuider and KSampler


# --- noise ------------------------------------------------------------------------------------------------------

def make_noise(batch: int, height: int, width: int, seed: int, *, device="cpu", dtype=torch.float32,
               bfl_cuda_noise: bool = False, reading: NoiseReading | None = None) -> Tensor:
    """[batch, 128, height/16, width/16]; item i uses seed + i. Drawn on a CPU generator in float32 (the same on
    every device), then read by the family's ``reading``; ``bfl_cuda_noise`` draws bf16 on ``device`` as BFL's CLI.
    """
    h, w = latent_size(height, width)
    check_seed(seed, batch)
    # a batch that cannot fit is refused before drawing
    values = batch * LATENT_CHANNELS * h * w
    for where in {torch.device("cpu" if not bfl_cuda_noise else device), torch.device(device)}:
        memory.fits(values * 4, memory.free_memory(where), f"noise for {batch} x {width}x{height} on {where}",
                    "use a smaller size or batch")
    gen_device, gen_dtype = (device, torch.bfloat16) if bfl_cuda_noise else ("cpu", torch.float32)
    items = [torch.randn((1, LATENT_CHANNELS, h, w), dtype=gen_dtype, device=gen_device,
                         generator=torch.Generator(gen_device).manual_seed(seed + i)) for i in range(batch)]
    noise = torch.cat(items)
    if reading is not None:
        noise = reading(noise)
    return noise.to(device=device, dtype=dtype)


def check_seed(seed: int, batch: int = 1) -> None:
    """Item i draws with seed + i, and torch's generators take seeds below 2^63 here."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise Flux2Error(f"batch must be a whole number >= 1, got {batch!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed + batch - 1 < 2 ** 63:
        raise Flux2Error(f"seed must be a whole number in [0, 2^63 - batch] (batch {batch}), got {seed!r}")


def add_noise(latent: Tensor, noise: Tensor, sigma: float) -> Tensor:
    """The flow-matching forward process (the image-to-image start point)."""
    return (1 - sigma) * latent + sigma * noise


# --- the Euler loop ---------------------------------------------------------------------------------------------

@dataclass
class Step:

    index: int
    total: int
    sigma: float          # the noise level the step started from
    sigma_next: float     # ... and went to
    x: Tensor             # latent [B, 128, h, w] at sigma_next
    denoised: Tensor      # the model's clean-latent estimate at this step, x_start - sigma * v (for previews)



class Inpaint(Protocol):
    """What the loop asks of ``inpaint.Inpaint`` (a protocol: inpaint.py imports this module)."""

    def to(self, device, dtype) -> Inpaint: ...

    def velocity(self, velocity: Velocity, x: Tensor, t: Tensor, t_next: Tensor, sigma: float) -> Tensor: ...

    def after_step(self, x: Tensor, sigma_next: float) -> Tensor: ...


def euler(velocity: Velocity, x: Tensor, sigmas: list[float], callback: Callable[[Step], None] | None = None,
          inpaint: Inpaint | None = None) -> Tensor:
    """x [B, 128, h, w] in the compute dtype. ``callback(Step)`` may raise to interrupt."""
    total = len(sigmas) - 1
    for i, (sigma, sigma_next) in enumerate(itertools.pairwise(sigmas)):
        t, t_next = (torch.full((x.shape[0],), s, dtype=x.dtype, device=x.device) for s in (sigma, sigma_next))
        v = velocity(x, t, t_next) if inpaint is None else inpaint.velocity(velocity, x, t, t_next, sigma)
        x_next = x + (sigma_next - sigma) * v
        if inpaint is not None:
            x_next = inpaint.after_step(x_next, sigma_next)
        if callback is not None:
            callback(Step(i, total, sigma, sigma_next, x_next, x - sigma * v))
        x = x_next
    return x


# --- guidance ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Guidance:

    scale: float                  # the scale as given (checked)
    cfg: bool                     # classifier-free guidance: a negative pass beside the prompt's at every step
    embedded: float | None        # FLUX.2-dev: the value fed to the guidance embedding (no CFG)
    note: str = ""                # for the user, when the scale is not applied as given ("" otherwise)


def check_cfg(cfg: float, name: str = "cfg") -> float:
    return checks.number(name, cfg, 0.0, MAX_CFG, hint="1 turns guidance off; base models use about 4")


def guidance_for(variant, cfg: float, negative: bool = True) -> Guidance:
    """The one rule for the guidance scale. FLUX.2-dev: the guidance embedding's value. Distilled Klein: one pass,
    another cfg ignored with a note. Base Klein: CFG whenever cfg != 1, as BFL and ComfyUI (unguided without a
    negative).
    """
    scale = check_cfg(cfg)
    if family_of_params(variant.params).guidance_embedded(variant.params):
        return Guidance(scale, False, scale)
    if variant.guidance_distilled:
        note = "" if scale == 1 else (f"cfg {scale:g} is ignored: {variant.name} is guidance-distilled (one pass per "
                                      f"step, no CFG); set cfg to 1")
        return Guidance(scale, False, None, note)
    if math.isclose(scale, 1.0):
        return Guidance(scale, False, None)
    if not negative:
        return Guidance(scale, False, None, f"cfg {scale:g} is not applied: {variant.name} guides with a negative "
                                            f"prompt (usually an empty one), and none is connected; running unguided")
    return Guidance(scale, True, None)


# --- the denoise ----------------------------------------------------------------------------------------------------

def denoise(model, x: Tensor, sigmas: list[float], txt: Tensor, *, negative_txt: Tensor | None = None,
            cfg: float = 1.0, ref: Tensor | None = None, ref_ids: Tensor | None = None,
            ref_kv: ReferenceKV | None = None, kv: bool = False, guidance: float | None = None,
            inpaint: Inpaint | None = None, callback: Callable[[Step], None] | None = None,
            dtype: torch.dtype | None = None, cache: StepCache | None = None,
            kv_source: KVSource | None = None) -> Tensor:
    """x [B, 128, h, w] at sigmas[0], returned in the family's ``latent_dtype``. txt [1 or B, Ltxt, C]. With
    negative_txt: CFG v = v_neg + cfg * (v_txt - v_neg), both halves in one forward of batch 2B. ref [1 or B, Lref,
    128] with ref_ids [1, Lref, 4]; with kv=True their K/V are computed once and reused. Raises on NaN / inf.
    """
    if negative_txt is not None:
        check_cfg(cfg)
    if guidance is not None:
        check_cfg(guidance, "guidance")
    batch, _, h, w = x.shape
    dtype, device = dtype or x.dtype, x.device
    x = x.to(family_of_params(model.params).latent_dtype(dtype))
    sides = 1 if negative_txt is None else 2             # the model batch is [neg..., pos...] with CFG
    n = sides * batch
    if ref is not None and ref_kv is not None:
        raise Flux2Error("give references either as tokens (ref, ref_ids) or as a KV cache (ref_kv), not both")
    if ref is not None and ref.shape[0] > 1 and not kv:   # [B, Lref, 128]: each item's own, for both CFG halves
        ref = ref.repeat(sides, 1, 1)

    prompts = [txt] if negative_txt is None else [negative_txt, txt]
    txt, txt_lengths = stack_rows([p.expand(batch, *p.shape[1:]) for p in prompts])      # [n, Ltxt, C]
    txt = txt.to(device, dtype)
    guidance_vec = None if guidance is None else torch.full((n,), guidance, dtype=x.dtype, device=device)
    model_velocity = velocity_for(model, txt, h, w, ReferencePack(ref, ref_ids, ref_kv), as_kv=kv,
                                  guidance=guidance_vec, txt_lengths=txt_lengths, kv_source=kv_source)

    def velocity(x: Tensor, t: Tensor, t_next: Tensor) -> Tensor:
        v = model_velocity(x.to(dtype).repeat(sides, 1, 1, 1), t.repeat(sides), t_next.repeat(sides))
        v = v.to(x.dtype)                                                    # [n, 128, h, w]
        if sides == 2:
            v_neg, v_pos = v.chunk(2)
            v = v_neg + cfg * (v_pos - v_neg)
        return v

    if inpaint is not None:
        inpaint = inpaint.to(device, x.dtype)
    step_velocity = velocity if cache is None else cache.wrap(velocity, len(sigmas) - 1)
    with torch.no_grad():
        out = euler(step_velocity, x, sigmas, callback, inpaint)
    causes = [*checks.dtype_cause(dtype, "the transformer"),
              ("the transformer's weights hold NaN/inf (a damaged or wrongly converted file: download it again, "
               "or remove a LoRA that holds NaN)")]
    if sides == 2:
        causes.append(f"the guidance scale cfg {cfg:g} pushed the latent out of range: lower it (base models use "
                      f"about 4)")
    causes.append("the start latent, noise, prompt embeddings or reference latents already held NaN/inf")
    return checks.finite(out, "the denoised latents", causes)
