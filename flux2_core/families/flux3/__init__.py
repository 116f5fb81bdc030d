"""The FLUX 3 family: FLUX 3 Image Klein (the distilled "flow map", 16 steps) and its base (50 steps, CFG), BFL's
transformer (``transformer.py``) on Qwen3-VL-4B prompt embeddings, the FLUX.2 autoencoder's latent. Its record
(``FLUX3``) gathers what its modules hold: ``variants``, ``files``, ``model``, ``schedule``, ``sampling`` (noise,
latent dtype, references) and ``adapters``; its prompts may carry layout boxes (``boxes.py``, and through the
prompt upsampler ``upsampler_rows.py``)."""

from __future__ import annotations

import torch

from ..family import Family
from . import adapters, files, model, sampling, schedule, variants
from . import transformer as flux3

FLUX3 = Family(name="flux3", params_type=flux3.Flux3Params, title="FLUX 3 Image Klein", variants=variants.VARIANTS,
               layouts=files.LAYOUTS, lookalikes=(), gguf_archs=("flux3", ""),
               files_hint="flux3-image-klein*.safetensors (ComfyUI models/diffusion_models)",
               read_params=files.read_params, build=model.build, quantizable=files.quantizable,
               variant_for=variants.variant_for, condition=model.condition, memory=model.memory,
               schedule=schedule.flux3_schedule, schedule_name="flux3", adapters=adapters.ADAPTERS,
               noise=sampling.noise, latent_dtype=sampling.latent_dtype, reference_ids=flux3.reference_ids,
               references=sampling.REFERENCES, takes_layout=True,
               dtypes=(torch.bfloat16, torch.float32), largest_side=4096,       # "up to 4K", BFL's model table
               guidance_embedded=lambda params: False)                         # the base guides with CFG
