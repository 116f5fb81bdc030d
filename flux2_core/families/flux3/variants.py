"""FLUX 3 Image Klein's releases: the distilled "flow map" (16 steps, no CFG) and the base (50 steps, CFG 3.5 as the
reference pipeline's default), both on Qwen3-VL-4B's text tower in its chat template, each prompt padded to its own
multiple of 80 tokens; and which release a file is."""

from __future__ import annotations

from dataclasses import replace

from ...prompt_padding import ToMultiple
from ...variants import TextEncoderSpec, Variant
from .. import registry
from .transformer import Flux3Params

# Qwen3-VL's chat template for one user turn with the generation prompt (it has no thinking block)
QWEN3_VL_TEMPLATE = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"

# a file that says nothing of which model it is is not read as Qwen3-VL (``unmarked``): Qwen3-4B has its shapes, and
# a Qwen3-VL file says what it is (its tower's names, its config, its GGUF architecture, ComfyUI's name)
QWEN3_VL_4B = TextEncoderSpec("qwen3-vl-4b", 2560, (4, 8, 12, 16, 20, 24, 28, 32), 4096, QWEN3_VL_TEMPLATE,
                              ToMultiple(80, pad_position=1), "qwen3-vl", "Qwen3-VL-4B-Instruct", "FLUX 3 Image Klein",
                              files=("qwen3vl_4b.safetensors", "qwen3vl_4b_int8_convrot.safetensors"),
                              gguf_stem="Qwen3-VL-4B-Instruct", rope_theta=5_000_000.0, unmarked=False,
                              loadable=True)

FLUX3_KLEIN = Flux3Params(flow_map=True)
FLUX3_KLEIN_BASE = Flux3Params()

DISTILLED = Variant("flux3-klein", FLUX3_KLEIN, QWEN3_VL_4B, 16, 1.0, True, title="FLUX 3 Image Klein",
                    family="flux3", files=("flux3-image-klein.safetensors", "flux3-image-klein-int8-convrot.safetensors",
                                           "flux3-image-klein-bf16.safetensors"))
BASE = Variant("flux3-klein-base", FLUX3_KLEIN_BASE, QWEN3_VL_4B, 50, 3.5, False, title="FLUX 3 Image Klein Base",
               family="flux3", files=("flux3-image-klein-base.safetensors",
                                      "flux3-image-klein-base-int8-convrot.safetensors",
                                      "flux3-image-klein-base-bf16.safetensors"))
VARIANTS = (DISTILLED, BASE)


def variant_for(params: Flux3Params, hint: str = "") -> Variant:
    """The flow map is the distilled model, the rest the base: the file says which (as the registry holds them, which
    tests may give other sizes). Other sizes get a custom variant with the defaults of their edition."""
    template = registry.VARIANTS[(DISTILLED if params.flow_map else BASE).name]
    if params == template.params:
        return template
    layers = QWEN3_VL_4B.output_layers
    encoder = replace(QWEN3_VL_4B, name="custom", hidden_size=params.context_in_dim // len(layers))
    return replace(template, name="custom", params=params, text_encoder=encoder, files=(), title="")
