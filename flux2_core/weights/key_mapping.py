"""Key mapping: which naming a checkpoint uses and, for each of our (BFL's) keys, the recipe that builds it from the
file's keys. The autoencoder's and text encoder's tables are here; transformer layouts are in each family."""

from __future__ import annotations

import re
from collections.abc import Callable

from .. import families
from ..errors import Flux2Error
from ..key_tables import Layout, Recipe, table_recipes
from .tensors import Checkpoint

# --- layouts: which naming the file uses, behind which prefix, and what a file is when it is not what we want ---

def find_layout(ckpt: Checkpoint, layouts: list[Layout], what: str, loader: str) -> tuple[Layout, str]:
    """The layout whose signature key the checkpoint has, and the prefix in front of it ("" when none)."""
    for layout in layouts:
        prefixes = [k[: -len(layout.signature)] for k in ckpt.tensors if k.endswith(layout.signature)]
        prefixes = [p for p in prefixes if p == "" or p.endswith(".")]
        if prefixes:
            return layout, min(prefixes, key=len)
    raise Flux2Error(f"{ckpt.path} is not {what}: it looks like {describe(ckpt)}. {loader}")


def describe(ckpt: Checkpoint) -> str:
    """A short description of what a checkpoint holds, from its keys (for error messages)."""
    keys = set(ckpt.tensors)

    def has(suffix: str) -> str | None:
        return next((k for k in keys if k.endswith(suffix)), None)

    if not keys:
        return "an empty file (no tensors)"
    if is_prompt_upsampler(ckpt):
        return PROMPT_UPSAMPLER
    if any("lora" in k.lower() for k in keys):
        return "a LoRA (its keys mention lora); load it as a LoRA on top of a model, not as a model"
    for family in families.FAMILIES.values():      # a transformer of a family we run
        if any(has(layout.signature) for layout in family.layouts):
            return f"a {family.title} transformer (diffusion model)"
    for family in families.FAMILIES.values():      # one that is often taken for it
        for signature, what in family.lookalikes:
            if has(signature):
                return what
    if has("decoder.conv_in.weight"):
        if has("bn.running_mean"):
            return "a FLUX.2 autoencoder (VAE)"
        return "an autoencoder without FLUX.2's latent BatchNorm (a FLUX.1 or Stable Diffusion VAE)"
    q_norm, q_proj = has("layers.0.self_attn.q_norm.weight"), has("layers.0.self_attn.q_proj.weight")
    if q_proj:
        hidden = ckpt.tensors[q_proj].shape[-1]
        if q_norm:
            return f"{qwen3_name(hidden)} text encoder (hidden size {hidden})"
        if has("layers.0.self_attn.k_proj.bias"):
            return f"a Qwen2.5 text encoder (hidden size {hidden})"
        return f"a {'Mistral' if hidden == 5120 else 'Llama/Mistral-style'} text encoder (hidden size {hidden})"
    if has("text_model.encoder.layers.0.mlp.fc1.weight"):
        return "a CLIP text encoder"
    if has("encoder.block.0.layer.0.SelfAttention.k.weight"):
        return "a T5 text encoder"
    if has("input_blocks.0.0.weight"):
        return "a Stable Diffusion UNet"
    return f"an unrecognised checkpoint (keys such as {', '.join(sorted(keys)[:3])})"


# the single-file prompt upsampler ComfyUI ships in text_encoders/, which ours does not read
PROMPT_UPSAMPLER = ("FLUX 3 Image Klein's prompt upsampler as ComfyUI ships it (one Qwen3.5 file for ComfyUI's own "
                    "TextGenerate node), not a text encoder or a diffusion model: --upsample and the Prompt Upsampler "
                    "node run the upsampler from its Hugging Face folder (config.json, system_prompts.json, the "
                    "weights, the tokenizer and preprocessor_config.json) in models/prompt_upsamplers/")


def is_prompt_upsampler(ckpt: Checkpoint) -> bool:
    """By its name or its layers: the upsampler is a Qwen3.5 (``linear_attn.A_log``), which no FLUX model reads."""
    named = "prompt_upsampler" in ckpt.path.name.lower()        # not any "upsampler" (latent or ESRGAN upscalers)
    return named or any(k.endswith("linear_attn.A_log") for k in ckpt.tensors)


def qwen3_name(hidden: int) -> str:
    names = {1024: "a Qwen3-0.6B", 2048: "a Qwen3-1.7B", 2560: "a Qwen3-4B", 4096: "a Qwen3-8B", 5120: "a Qwen3-14B"}
    return names.get(hidden, "a Qwen3")


# --- key mapping tables: our (BFL) key <- the file's key(s) (placeholders: key_tables.PLACEHOLDERS) -------------


# diffusers numbers decoder levels from the deepest (up_blocks.0), BFL from the shallowest (up.0): {r} = levels-1-i.
# Attention q/k/v/out are 1x1 convs [C,C,1,1] in BFL and Linears [C,C] in diffusers; shapes are fitted on load.
AUTOENCODER_FROM_DIFFUSERS = [
    ("encoder.quant_conv.{p}", "quant_conv.{p}"),
    ("decoder.post_quant_conv.{p}", "post_quant_conv.{p}"),
    ("{e}.conv_in.{p}", "{e}.conv_in.{p}"),
    ("{e}.conv_out.{p}", "{e}.conv_out.{p}"),
    ("{e}.norm_out.{p}", "{e}.conv_norm_out.{p}"),
    ("encoder.down.{i}.block.{j}.{m}.{p}", "encoder.down_blocks.{i}.resnets.{j}.{m}.{p}"),
    ("encoder.down.{i}.block.{j}.nin_shortcut.{p}", "encoder.down_blocks.{i}.resnets.{j}.conv_shortcut.{p}"),
    ("encoder.down.{i}.downsample.conv.{p}", "encoder.down_blocks.{i}.downsamplers.0.conv.{p}"),
    ("decoder.up.{i}.block.{j}.{m}.{p}", "decoder.up_blocks.{r}.resnets.{j}.{m}.{p}"),
    ("decoder.up.{i}.block.{j}.nin_shortcut.{p}", "decoder.up_blocks.{r}.resnets.{j}.conv_shortcut.{p}"),
    ("decoder.up.{i}.upsample.conv.{p}", "decoder.up_blocks.{r}.upsamplers.0.conv.{p}"),
    ("{e}.mid.block_1.{m}.{p}", "{e}.mid_block.resnets.0.{m}.{p}"),
    ("{e}.mid.block_2.{m}.{p}", "{e}.mid_block.resnets.1.{m}.{p}"),
    ("{e}.mid.attn_1.norm.{p}", "{e}.mid_block.attentions.0.group_norm.{p}"),
    ("{e}.mid.attn_1.q.{p}", "{e}.mid_block.attentions.0.to_q.{p}"),
    ("{e}.mid.attn_1.k.{p}", "{e}.mid_block.attentions.0.to_k.{p}"),
    ("{e}.mid.attn_1.v.{p}", "{e}.mid_block.attentions.0.to_v.{p}"),
    ("{e}.mid.attn_1.proj_out.{p}", "{e}.mid_block.attentions.0.to_out.0.{p}"),
    ("bn.{b}", "bn.{b}"),
]


def bfl_autoencoder_recipes(keys: set[str]) -> Callable[[str], Recipe]:
    """BFL names; VAEs saved by ComfyUI keep the two 1x1 quant convs at the top level (``quant_conv.*``)."""
    top = {"encoder.quant_conv.": "quant_conv.", "decoder.post_quant_conv.": "post_quant_conv."}

    def recipe(key: str) -> Recipe:
        for ours, theirs in top.items():
            if key.startswith(ours) and theirs + key[len(ours):] in keys:
                return Recipe((theirs + key[len(ours):],))
        return Recipe((key,))
    return recipe


def diffusers_autoencoder_recipes(keys: set[str]) -> Callable[[str], Recipe]:
    levels = len({m.group(1) for k in keys if (m := re.match(r"decoder\.up_blocks\.(\d+)\.", k))})
    return table_recipes(AUTOENCODER_FROM_DIFFUSERS, levels=levels)


# llama.cpp's names for a Qwen3 -> Hugging Face's (q/k unpermuted: llama.cpp permutes only "llama")
QWEN3_FROM_LLAMA_CPP = [
    ("embed_tokens.weight", "token_embd.weight"),
    ("norm.weight", "output_norm.weight"),
    ("layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight"),
    ("layers.{i}.post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight"),
    ("layers.{i}.self_attn.q_proj.weight", "blk.{i}.attn_q.weight"),
    ("layers.{i}.self_attn.k_proj.weight", "blk.{i}.attn_k.weight"),
    ("layers.{i}.self_attn.v_proj.weight", "blk.{i}.attn_v.weight"),
    ("layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight"),
    ("layers.{i}.self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight"),
    ("layers.{i}.self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight"),
    ("layers.{i}.mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight"),
    ("layers.{i}.mlp.up_proj.weight", "blk.{i}.ffn_up.weight"),
    ("layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight"),
]


AUTOENCODER_LAYOUTS = [
    Layout("BFL", "encoder.down.0.block.0.conv1.weight", bfl_autoencoder_recipes),
    Layout("diffusers", "encoder.down_blocks.0.resnets.0.conv1.weight", diffusers_autoencoder_recipes),
]
OPTIONAL_KEYS = {"bn.num_batches_tracked"}       # not every AE file has it; it is unused, so 0 is fine
