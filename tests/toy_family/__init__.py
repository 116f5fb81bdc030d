"""A toy third model family, laid out as a family package is (its record here; ``model``, ``variants``,
``schedule``, ``sampling`` beside it), to show that the code around a model (generate, the Euler loop and CFG, the
plan, the memory estimate, quantized storage, the text encoder's padding, the schedule, the noise, K/V-style
references) holds no FLUX.2 assumption. Tests register it
with ``families.register(TOY)`` and remove it with ``families.unregister``."""

from __future__ import annotations

import torch

from flux2_core.families import AdapterNaming, Family, ReferenceFit
from flux2_core.key_tables import Layout, same_names
from flux2_core.models import rope

from .model import ToyModel, ToyParams, condition, memory, read_params
from .sampling import latent_dtype, toy_noise
from .schedule import toy_schedule
from .variants import TOY_VARIANT, variant_for

__all__ = ["TOY", "TOY_VARIANT", "ToyModel", "ToyParams"]

TOY = Family(name="toy", params_type=ToyParams, title="Toy", variants=(TOY_VARIANT,),
             layouts=(Layout("toy", "toy_in.weight", same_names),), lookalikes=(), gguf_archs=(),
             files_hint="toy.safetensors", read_params=read_params,
             build=ToyModel, quantizable=lambda name: name == "toy_out", variant_for=variant_for,
             condition=condition, memory=memory, schedule=toy_schedule, schedule_name="toy",
             adapters=AdapterNaming(groups=(("toy layers", "toy_"),), models={16: "the toy"}, lookalikes=(),
                                    other_depths=(), shape_hint=lambda module, found, hidden: ""),
             noise=toy_noise, latent_dtype=latent_dtype,
             reference_ids=rope.reference_ids, references=ReferenceFit(
                 single_pixels=1024 * 1024, multi_pixels=1024 * 1024, min_side=64, max_aspect=8.0, max_count=None,
                 padded=False, max_side=0, pad_min=0),
             takes_layout=False,
               dtypes=(torch.bfloat16, torch.float16, torch.float32), largest_side=2048,
               guidance_embedded=lambda params: False)
