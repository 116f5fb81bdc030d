"""A tiny random prompt upsampler folder, as BFL's release lays it out: a Qwen3.5 vision-language model (config.json,
model.safetensors), Qwen's tokenizer with a small chat template, the picture processor's settings and
system_prompts.json.

Random weights would ramble for the whole 3584-token budget, so they are shaped to end soon: the residual stream
carries a large constant in its first channel, which no layer reads (each layer's norm zeroes it) and the final norm
turns into a bias favouring a few words and the end-of-turn token. Which of them comes when still depends on every
layer, so two implementations only agree when they compute the same model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FAVOURED = ("Ġfox", "Ġsnow", "Ġred", "Ġtree", "Ġsky", "Ġriver", "Ġhouse", "Ġcat")
SYSTEM_PROMPTS = {"t2i": "Describe the picture to draw.", "i2i": "Describe the edited picture.",
                  "t2i_bbox": "Describe the picture and keep the boxes.", "i2i_bbox": "Describe the edit, keep the boxes."}
# a chat template in Qwen's form: pictures as <|vision_start|><|image_pad|><|vision_end|>, an empty thought when
# thinking is off
CHAT_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n"
    "{%- if m.content is string -%}{{ m.content }}{%- else -%}{%- for c in m.content -%}"
    "{%- if c.type == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>{%- else -%}{{ c.text }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{%- endif -%}")


def save_tiny_upsampler(folder, seed: int = 0, favour_prompt_end: bool = False) -> Path:
    """``favour_prompt_end``: the prompt's last token ("\\n\\n", after the empty thought) is the likeliest first word
    unless the presence penalty counts it, so a text-to-image answer shows whether it does (an edit, without the
    penalty, would repeat it forever)."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from flux2_core.models.tokenizer import build_qwen3_tokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_qwen3_tokenizer()
    token = tokenizer.convert_tokens_to_ids
    text = {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"], "eos_token_id": token("<|im_end|>"),
            "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.25, "rope_type": "default",
                                "mrope_section": [1, 1, 0], "mrope_interleaved": True}}
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "num_position_embeddings": 64, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2}
    config = Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=token("<|image_pad|>"),
                           video_token_id=token("<|video_pad|>"), vision_start_token_id=token("<|vision_start|>"),
                           vision_end_token_id=token("<|vision_end|>"), tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(config)
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() > 1:
                weight.normal_(0, 0.2)
    model.save_pretrained(folder)

    state = load_file(str(folder / "model.safetensors"))
    prefix = "model.language_model."
    state[prefix + "embed_tokens.weight"][:, 0] = 40.0
    for key, value in state.items():
        if key.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")):
            value[0] = -1.0                                    # Qwen3.5's norms scale by 1 + weight
    state[prefix + "norm.weight"][:] = 9.0
    state[prefix + "norm.weight"][0] = 1 / 8 - 1
    head = state["lm_head.weight"]
    head[:, 1:] = torch.randn(head[:, 1:].shape, generator=torch.Generator().manual_seed(seed + 1)) * 0.1
    head[:, 0] = 0.0
    head[[token(word) for word in FAVOURED] + [token("<|im_end|>")], 0] = 1.0
    if favour_prompt_end:
        head[token("ĊĊ"), 0] = 1.6
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})

    tokenizer.save_pretrained(folder)                          # (a shared object: its template is not touched)
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    pictures = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                        image_std=[0.5] * 3, min_pixels=32 * 32, max_pixels=1024 * 1024)
    pictures.save_pretrained(folder)
    (folder / "system_prompts.json").write_text(json.dumps(SYSTEM_PROMPTS))
    return folder
