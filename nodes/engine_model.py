"""Our transformer as ComfyUI's own FLUX.2 model, so ComfyUI's samplers can drive it (FLUX.2 Klein to MODEL).

ComfyUI samples a ``model_base.BaseModel``: its ``model_sampling`` (FLUX.2 flow matching, shift 2.02), its
``extra_conds`` (the prompt padded to 512 tokens, the reference latents) and its ``apply_model``, which calls the
``diffusion_model`` in the convention of ComfyUI's FLUX.2 model:

    diffusion_model(x [B, 128, h, w], timestep [B] (the sigmas), context [B, L, C], y, guidance,
                    ref_latents (list of [1 or B, 128, h', w']), control, transformer_options, **extra)
        -> velocity [B, 128, h, w]

``KleinModel`` is ComfyUI's FLUX.2 BaseModel (ComfyUI's model of the family, ``HOST_MODELS``) with ``EngineCall`` as
that diffusion model. EngineCall holds the
engine's layers under the engine's own names, which are BFL's and so ComfyUI's (``diffusion_model.`` + the key in
BFL's file): what addresses a FLUX.2 model's weights by name (model management, ComfyUI's LoRA key maps) finds ours. Every FLUX.2 transformer the loader makes lives in a KleinModel, so our Denoise node and ComfyUI's samplers
share one ModelPatcher (the MODEL is a clone of it) and ComfyUI loads the weights once.

``comfy_model`` makes the MODEL: a clone of that ModelPatcher carrying an ``EngineRun`` (the LoRAs of FLUX.2 Klein
LoRA nodes and the compile mode, set before each model call as our Denoise node sets them). What ComfyUI's FLUX.2 model
does and ours does not (its LoRA loaders' weight patches, which it would write into weights it cannot read: fp8 with
scales, int8, GGUF blocks; ControlNets, attention masks, block or attention patches, other reference methods) is
refused with a message rather than ignored. With nodes/host.py, the one module that talks to ComfyUI's internals.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import comfy.model_base
import comfy.patcher_extension
import comfy.supported_models
import torch
from torch import nn

from ..flux2_core.errors import Flux2Error
from ..flux2_core.families import family_of
from ..flux2_core.families.flux2 import FLUX2
from ..flux2_core.runtime import memory
from ..flux2_core.runtime.cache import ReferenceKVCache
from ..flux2_core.sampling import conditioning
from ..flux2_core.sampling.run import references_as_kv
from ..flux2_core.variants import Variant

RUN = "flux2_klein_run"        # our key in transformer_options (and for our wrapper): the MODEL's EngineRun
OTHER_MODEL = "use ComfyUI's own FLUX.2 model for it (Load Diffusion Model)"


@dataclass(eq=False)
class EngineRun:
    """What a MODEL made by FLUX.2 Klein to MODEL runs with, carried to the diffusion model in transformer_options:
    ``prepare`` (called before every model call: applies the Klein LoRA nodes' adapters and the compile mode,
    a no-op once they are set) and the 9B-KV reference K/V of the sampling under way."""

    prepare: Callable[[], None]
    model_key: tuple
    kv: ReferenceKVCache = field(default_factory=lambda: ReferenceKVCache(max_items=1, max_bytes=None))

    def __deepcopy__(self, memo):
        return self          # ModelPatcher.clone deep-copies model_options: this stays one object, never the model


class EngineCall(nn.Module):
    """The engine's transformer called as ComfyUI calls its FLUX.2 model (see the module docstring)."""

    def __init__(self, engine: nn.Module, variant: Variant, dtype: torch.dtype):
        super().__init__()
        self._modules = engine._modules      # the engine's layers under their own names: no "engine." prefix
        object.__setattr__(self, "engine", engine)     # not a child: its layers are ours already
        self.variant, self.dtype = variant, dtype     # ComfyUI's BaseModel.get_dtype reads ``dtype``

    def forward(self, x, timestep, context, y=None, guidance=None, ref_latents=None, control=None,
                transformer_options=None, **kwargs):
        # through ComfyUI's DIFFUSION_MODEL wrappers (EasyCache ...), with the arguments in its FLUX.2 model's order
        transformer_options = {} if transformer_options is None else transformer_options
        wrappers = comfy.patcher_extension.get_all_wrappers(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL,
                                                            transformer_options)
        return comfy.patcher_extension.WrapperExecutor.new_class_executor(self.velocity, self, wrappers).execute(
            x, timestep, context, y, guidance, ref_latents, control, transformer_options, **kwargs)

    def velocity(self, x, timestep, context, y, guidance, ref_latents, control, transformer_options, **kwargs):
        run = transformer_options.get(RUN)
        if run is None:
            raise Flux2Error("this FLUX.2 Klein model was sampled without FLUX.2 Klein to MODEL: connect the model "
                             "through that node")
        refuse_unsupported(control, transformer_options, kwargs)
        run.prepare()
        _, _, h, w = x.shape
        dtype, device = x.dtype, x.device                    # apply_model cast x to our dtype
        pack = conditioning.pack_references(self.variant, list(ref_latents or []), batched=True)
        use_guidance = family_of(self.variant).guidance_embedded(self.variant.params) and guidance is not None
        velocity = conditioning.velocity_for(       # 9B-KV: the references' K/V made once per sampling (run.kv)
            self.engine, context.to(device, dtype), h, w, pack, as_kv=references_as_kv(self.variant, bool(pack)),
            guidance=guidance.to(device, dtype) if use_guidance else None,
            kv_source=lambda ref, ids, make: run.kv.get(self.engine, ref.to(device), ids.to(device),
                                                        model_key=run.model_key, make=make))
        return velocity(x, timestep.to(dtype), None)            # ComfyUI's model call does not give the next sigma


def refuse_unsupported(control, transformer_options: dict, extra: dict) -> None:
    """Flux2Error for what ComfyUI's FLUX.2 model would apply and ours cannot: never a result that silently lacks it."""
    patches = transformer_options.get("patches", {})
    refused = [what for what, present in [
        ("a ControlNet", control is not None),
        ("an attention mask (regional prompting)", extra.get("attention_mask") is not None),
        ("a patch on the model's input (post_input)", bool(patches.get("post_input"))),
        ("a patch replacing FLUX.2 blocks", bool(transformer_options.get("patches_replace", {}).get("dit"))),
        ("an attention override", "optimized_attention_override" in transformer_options),
        ("RoPE options", transformer_options.get("rope_options") is not None),
        (f"the reference method {extra.get('ref_latents_method')!r} (FLUX.2 Klein references use 'index')",
         extra.get("ref_latents_method", "index") != "index"),
    ] if present]
    if refused:
        raise Flux2Error(f"a FLUX.2 Klein engine MODEL does not support {', '.join(refused)}: {OTHER_MODEL}, or "
                         f"leave it out")


def flux2_config(p) -> dict:
    """A FLUX.2 transformer's parameters as ComfyUI's model detection describes them (its ``unet_config``)."""
    return {"image_model": "flux2", "in_channels": p.in_channels, "out_channels": p.in_channels, "patch_size": 1,
            "hidden_size": p.hidden_size, "num_heads": p.num_heads, "depth": p.depth,
            "depth_single_blocks": p.depth_single_blocks, "context_in_dim": p.context_in_dim,
            "axes_dim": list(p.axes_dim), "theta": p.theta, "mlp_ratio": p.mlp_ratio,
            "guidance_embed": p.use_guidance_embed}


@dataclass(frozen=True)
class HostModel:
    """ComfyUI's own model of one of our families: its BaseModel (sampling, conditioning, latent format), its
    supported-model class, and the config its detection would read off the family's files."""

    base: type
    supported: type
    config: Callable[[object], dict]


# the families ComfyUI runs natively, by family name (flux2_core.families); a family without an entry is sampled by
# our Denoise node alone, and FLUX.2 Klein to MODEL refuses it
HOST_MODELS = {FLUX2.name: HostModel(comfy.model_base.Flux2, comfy.supported_models.Flux2, flux2_config)}
HOLDER_NAME = "Flux2KleinTransformer"       # ComfyUI's log names a model by its class: "Requested to load ..."


class KleinModel:
    """Mixed into ComfyUI's BaseModel of the transformer's family (``HOST_MODELS``): its sampling, conditioning and
    latent format, with the engine's transformer as the diffusion model."""

    def __init__(self, engine: nn.Module, variant: Variant, dtype: torch.dtype, device: torch.device):
        host_model = HOST_MODELS[variant.family]
        super().__init__(host_model.supported(host_model.config(variant.params)), device=device,
                         unet_model=lambda **_: EngineCall(engine, variant, dtype))

    def memory_required(self, input_shape, cond_shapes=None):
        """The engine's estimate (memory.denoiser_memory) for ComfyUI's sampler: input_shape is the model batch
        [n, 128, h, w] (ComfyUI doubles it for CFG); cond_shapes["ref_latents"] holds [1, 16, reference tokens] of
        each conditioning that has references: a model call carries the largest."""
        diffusion = self.diffusion_model
        n, _, h, w = input_shape
        ref_tokens = max((math.prod(shape[2:]) for shape in (cond_shapes or {}).get("ref_latents", [])), default=0)
        return memory.denoiser_memory(diffusion.engine, diffusion.variant, n, h, w, diffusion.dtype,
                                      ref_tokens=ref_tokens,
                                      new_reference_kv=references_as_kv(diffusion.variant, ref_tokens > 0))


@functools.cache
def _host_class(family: str) -> type:
    return type(HOLDER_NAME, (KleinModel, HOST_MODELS[family].base), {})


def host_model(engine: nn.Module, variant: Variant, dtype: torch.dtype, device: torch.device) -> nn.Module | None:
    """ComfyUI's own model of the transformer's family around it (so our Denoise node and ComfyUI's samplers share
    one ModelPatcher); None for a family ComfyUI has no model of."""
    if variant.family not in HOST_MODELS:
        return None
    return _host_class(variant.family)(engine, variant, dtype, device)


def comfy_model(patcher, variant: Variant, prepare: Callable[[], None], model_key: tuple):
    """The MODEL for ComfyUI's samplers: a clone of ``patcher`` (a KleinModel's) that runs ``prepare`` before every
    model call; ``model_key`` names the weights as loaded (for the 9B-KV reference K/V). A transformer of a family
    ComfyUI has no model of is refused."""
    if not isinstance(patcher.model, KleinModel):
        title = variant.title or family_of(variant).title
        raise Flux2Error(f"ComfyUI has no model of {title}, so its samplers cannot drive it: sample it with "
                         f"Klein Denoise instead of FLUX.2 Klein to MODEL")
    run = EngineRun(prepare, model_key)
    model = patcher.clone()
    model.model_options.setdefault("transformer_options", {})[RUN] = run
    model.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, RUN, partial(sample, run))
    return model


def sample(run: EngineRun, executor, *args, **kwargs):
    """ComfyUI's OUTER_SAMPLE wrapper: refuse weight patches before the model loads; drop the sampling's 9B-KV
    reference K/V after it."""
    patcher = executor.class_obj.model_patcher
    if patcher.patches:
        raise Flux2Error(f"ComfyUI's LoRA loader (or another weight patch: {len(patcher.patches)} weights) does not "
                         f"apply to a FLUX.2 Klein engine MODEL: put the LoRA on with Klein LoRA before "
                         f"FLUX.2 Klein to MODEL (every LoRA format, on fp8, int8 and GGUF models too)")
    try:
        return executor(*args, **kwargs)
    finally:
        run.kv.clear()
