"""FLUX.2 Klein to MODEL: a FLUX.2 Klein model handed to ComfyUI's own samplers (the model: nodes/engine_model.py)."""

from __future__ import annotations

from functools import partial

from comfy_api.latest import io

from ..flux2_core.errors import Flux2Error
from . import engine_model, host, types
from .compile import set_compiled


class ToComfyModel(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Flux2KleinToModel", display_name="FLUX.2 Klein to MODEL", category=f"{types.CATEGORY}/sampling",
            description="Hands a FLUX.2 Klein model to ComfyUI's own samplers as a MODEL: KSampler, "
                        "SamplerCustomAdvanced with any sampler, scheduler and guider, EasyCache and the other "
                        "sampling patches. The engine computes every step, with the model's storage (fp8, int8, GGUF), "
                        "the Klein LoRA nodes before this one, and Compile. ComfyUI's samplers run CFG whenever "
                        "cfg is not 1, on guidance-distilled models too (set cfg 1 for those). Put LoRAs on with "
                        "Klein LoRA before this node: ComfyUI's LoRA loaders on this MODEL are refused, as are "
                        "ControlNets and block patches.",
            inputs=[types.Model.Input("model", tooltip="From Klein Load Model (after its LoRA and Compile "
                                                       "nodes).")],
            outputs=[io.Model.Output(display_name="MODEL", tooltip="The same model as ComfyUI's FLUX.2 MODEL.")])

    @classmethod
    def execute(cls, model: host.Managed) -> io.NodeOutput:
        if model.ranks > 1:
            raise Flux2Error("FLUX.2 Klein to MODEL does not take a model spread over several GPUs yet: bypass "
                             "Klein Parallel, or use Klein Denoise")
        return io.NodeOutput(engine_model.comfy_model(model.patcher, model.variant, partial(prepare, model),
                                                         model.key))


def prepare(model: host.Managed) -> None:
    """Before each model call: the model's LoRAs and compile mode (no-ops once set), as the Denoise node sets them."""
    model.use_adapters(model.core, lambda adapter: adapter.patches)
    set_compiled(model)
