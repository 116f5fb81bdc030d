"""Klein LoRA: a LoRA / LoKr / LoHa / DoRA file from ComfyUI's loras folder, on our model, chainable.

The node only reads the file and says what it matched; the Denoise node applies the chain (flux2_core.adapters.patching:
merged into full-precision weights, run beside fp8 ones) and restores the weights for models without it.
"""

from __future__ import annotations

import dataclasses
import logging

from comfy_api.latest import io, ui

from ..flux2_core.adapters import lora
from . import host, types

log = logging.getLogger("flux2_klein")


class LoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Flux2KleinLoRA", display_name="Klein LoRA", search_aliases=types.SEARCH_ALIASES,
            category=f"{types.CATEGORY}/loaders",
            description="Applies a LoRA (also LoKr, LoHa, DoRA) made for the loaded model (FLUX.2 Klein or FLUX 3 "
                        "Image Klein): ai-toolkit, kohya/musubi, "
                        "diffusers/PEFT, ComfyUI and LyCORIS files. Chain several for a stack. The node shows how "
                        "many tensors matched per block group and the keys that matched nothing (all of them in "
                        "ComfyUI's log).",
            inputs=[types.Model.Input("model", tooltip="From Klein Load Model (or another LoRA node)."),
                    io.Combo.Input("lora_name", options=host.model_choices("loras"),
                                   tooltip="A .safetensors adapter under models/loras."),
                    io.Float.Input("strength", default=1.0, min=-10.0, max=10.0, step=0.01,
                                   tooltip="How strongly it applies: 0 leaves the model exactly as it was, 1 as "
                                           "trained, negative values push the other way."),
                    io.Boolean.Input("merge_into_fp8", default=False, optional=True,
                                     tooltip="fp8 models: merge the LoRA into the fp8 weights (quantized again: no cost "
                                             "per step, one more fp8 rounding) instead of running it beside them. "
                                             "Full-precision weights always take it merged."),
                    types.TextEncoder.Input("text_encoder", optional=True,
                                            tooltip="Connect it for LoRAs that also train the text encoder: their "
                                                    "text-encoder layers then apply too (through this node's "
                                                    "text_encoder output).")],
            outputs=[types.Model.Output(display_name="model", tooltip="The model with this LoRA after the others."),
                     types.TextEncoder.Output(display_name="text_encoder",
                                              tooltip="The text encoder with this LoRA's text-encoder layers (only "
                                                      "when one is connected to the input).")])

    @classmethod
    def validate_inputs(cls, strength=None):
        return host.validate(cls, {"strength": strength})       # a NaN strength would make every weight NaN

    @classmethod
    def execute(cls, model: host.Managed, lora_name: str, strength: float, merge_into_fp8: bool = False,
                text_encoder=None) -> io.NodeOutput:
        shapes = None if text_encoder is None else {k: v.shape for k, v in text_encoder.core.model.state_dict().items()}
        adapter = lora.read_adapter(host.resolve("loras", lora_name), model.variant.params, shapes, name=lora_name)
        info = f"{adapter.report.summary()} (strength {strength:g})"
        if adapter.text_encoder_patches and text_encoder is None:
            info += (f"; its {len(adapter.text_encoder_patches)} text-encoder modules are not applied: connect the "
                     "text encoder to this node and encode the prompt with its text_encoder output")
        log.info("Klein LoRA %s", info)
        if adapter.report.unmatched:
            log.warning("Klein LoRA %s: keys that matched nothing: %s", lora_name, ", ".join(
                f"{key} ({why})" for key, why in adapter.report.unmatched.items()))
        entry = lora.AdapterUse(lora_name, adapter.digest(), strength, merge_into_fp8, adapter)
        chained = dataclasses.replace(model, adapters=(*model.adapters, entry))
        encoder = None if text_encoder is None else dataclasses.replace(text_encoder,
                                                                        adapters=(*text_encoder.adapters, entry))
        return io.NodeOutput(chained, encoder, ui=ui.PreviewText(info))
