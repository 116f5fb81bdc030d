"""The toy's one release and its text encoder: the demo's small Qwen3 in a template of the toy's own, each prompt
padded alone to a multiple of 16 tokens."""

from __future__ import annotations

from dataclasses import replace

from flux2_core.prompt_padding import ToMultiple
from flux2_core.variants import TextEncoderSpec, Variant

from .model import ToyParams

TEMPLATE = "<|im_start|>user\n{prompt}<|im_end|>\n"
PADDING = ToMultiple(16)
TEXT = TextEncoderSpec("toy-text", 32, (9, 18, 27), 512, TEMPLATE, PADDING, "qwen3", "Qwen3", "Toy", files=(),
                       gguf_stem="", rope_theta=1_000_000.0, unmarked=True, loadable=True)
TOY_VARIANT = Variant("toy", ToyParams(), TEXT, default_steps=3, default_cfg=1.0, guidance_distilled=False,
                      use_kv_cache=True, title="Toy", family="toy")


def variant_for(params: ToyParams, hint: str) -> Variant:
    if params == TOY_VARIANT.params:
        return TOY_VARIANT
    return replace(TOY_VARIANT, params=params, text_encoder=replace(TEXT, hidden_size=params.context_in_dim // 3))
