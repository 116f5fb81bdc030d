"""The FLUX.2 family: Klein 4B / 9B (distilled, base, 9B-KV) and dev, BFL's transformer (``transformer.py``)
on Qwen3 (Klein) or Mistral (dev) prompt embeddings. Its record (``FLUX2``) gathers what its modules hold:
``variants`` (its releases and text encoders), ``files`` (its namings and what quantizes), ``model`` (build, the
velocity on the latent grid, the memory estimate's inputs), ``schedule`` (the empirical-mu shift), ``sampling`` (noise,
latent dtype, references) and ``adapters``."""

from __future__ import annotations

import torch

from ...models import rope
from ..family import Family
from . import adapters, files, model, sampling, schedule, variants
from .transformer import TransformerParams

FLUX2 = Family(name="flux2", params_type=TransformerParams, title="FLUX.2", variants=variants.VARIANTS,
               layouts=files.LAYOUTS, lookalikes=files.LOOKALIKES, gguf_archs=("flux", ""),
               files_hint="flux-2-klein-*.safetensors or .gguf (ComfyUI models/diffusion_models) or a diffusers "
                          "transformer/ folder",
               read_params=files.read_params, build=model.build, quantizable=files.quantizable,
               variant_for=variants.variant_for_params, condition=model.condition, memory=model.memory,
               schedule=schedule.flux2_schedule, schedule_name="flux2", adapters=adapters.ADAPTERS,
               noise=sampling.noise, latent_dtype=sampling.latent_dtype, reference_ids=rope.reference_ids,
               references=sampling.REFERENCES, takes_layout=False,
               dtypes=(torch.bfloat16, torch.float16, torch.float32),
               largest_side=8192,
               guidance_embedded=lambda params: params.use_guidance_embed)          # the nodes' widest; its schedule bounds the area (flux2_schedule)
