"""Key mapping: which naming a checkpoint uses (BFL, diffusers, ComfyUI prefixes) and, for each of our keys (BFL's),
the recipe that builds it from the file's keys: a rename, a fused q/k/v concat, a halves swap, a reversed level."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import Flux2Error
from .tensors import Checkpoint

# ---------------------------------------------------------------------------------------------------------------
# 1. layouts: which naming the file uses, behind which prefix, and what a file is when it is not what we want
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Recipe:
    """Where one of our keys comes from: file keys (concatenated along dim 0 when several: fused q/k/v)."""
    sources: tuple[str, ...]
    swap_halves: bool = False          # diffusers' final-layer modulation is (scale, shift), BFL's (shift, scale)


@dataclass(frozen=True)
class Layout:
    name: str                                              # e.g. "BFL", "diffusers"
    signature: str                                         # a key only this layout has (after the prefix)
    recipes: Callable[[set[str]], Callable[[str], Recipe]]  # file keys -> (our key -> recipe)
    ours: Callable[[str], str | None] = lambda key: key    # a file key -> our key it is (None: none), for loaders
                                                           # that take what the file has (the text encoder)


def same_names(keys: set[str]) -> Callable[[str], Recipe]:
    return lambda key: Recipe((key,))


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
    if any("lora" in k.lower() for k in keys):
        return "a LoRA (its keys mention lora); load it as a LoRA on top of a model, not as a model"
    if has("double_stream_modulation_img.lin.weight") or has("double_stream_modulation_img.linear.weight"):
        return "a FLUX.2 transformer (diffusion model)"
    if has("double_blocks.0.img_mod.lin.weight") or has("transformer_blocks.0.norm1.linear.weight"):
        return "a FLUX.1 transformer; FLUX.2 Klein needs its own flux-2-klein-*.safetensors"
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


def qwen3_name(hidden: int) -> str:
    names = {1024: "a Qwen3-0.6B", 2048: "a Qwen3-1.7B", 2560: "a Qwen3-4B", 4096: "a Qwen3-8B", 5120: "a Qwen3-14B"}
    return names.get(hidden, "a Qwen3")


# ---------------------------------------------------------------------------------------------------------------
# 2. key mapping tables: our (BFL) key <- the file's key(s)
# ---------------------------------------------------------------------------------------------------------------
# Placeholders: {i} {j} block indices, {r} the reversed decoder level, {p} weight|bias, {e} encoder|decoder,
# {m} a resnet layer, {b} a BatchNorm buffer. A tuple of sources is concatenated along dim 0.

PLACEHOLDERS = {"i": r"\d+", "j": r"\d+", "p": "weight|bias", "e": "encoder|decoder",
                "m": "norm1|conv1|norm2|conv2", "b": "running_mean|running_var|num_batches_tracked"}

TRANSFORMER_FROM_DIFFUSERS = [
    ("img_in.weight", "x_embedder.weight"),
    ("txt_in.weight", "context_embedder.weight"),
    ("time_in.in_layer.weight", "time_guidance_embed.timestep_embedder.linear_1.weight"),
    ("time_in.out_layer.weight", "time_guidance_embed.timestep_embedder.linear_2.weight"),
    ("guidance_in.in_layer.weight", "time_guidance_embed.guidance_embedder.linear_1.weight"),
    ("guidance_in.out_layer.weight", "time_guidance_embed.guidance_embedder.linear_2.weight"),
    ("double_stream_modulation_img.lin.weight", "double_stream_modulation_img.linear.weight"),
    ("double_stream_modulation_txt.lin.weight", "double_stream_modulation_txt.linear.weight"),
    ("single_stream_modulation.lin.weight", "single_stream_modulation.linear.weight"),
    ("double_blocks.{i}.img_attn.qkv.weight", ("transformer_blocks.{i}.attn.to_q.weight",
                                               "transformer_blocks.{i}.attn.to_k.weight",
                                               "transformer_blocks.{i}.attn.to_v.weight")),
    ("double_blocks.{i}.txt_attn.qkv.weight", ("transformer_blocks.{i}.attn.add_q_proj.weight",
                                               "transformer_blocks.{i}.attn.add_k_proj.weight",
                                               "transformer_blocks.{i}.attn.add_v_proj.weight")),
    ("double_blocks.{i}.img_attn.norm.query_norm.scale", "transformer_blocks.{i}.attn.norm_q.weight"),
    ("double_blocks.{i}.img_attn.norm.key_norm.scale", "transformer_blocks.{i}.attn.norm_k.weight"),
    ("double_blocks.{i}.txt_attn.norm.query_norm.scale", "transformer_blocks.{i}.attn.norm_added_q.weight"),
    ("double_blocks.{i}.txt_attn.norm.key_norm.scale", "transformer_blocks.{i}.attn.norm_added_k.weight"),
    ("double_blocks.{i}.img_attn.proj.weight", "transformer_blocks.{i}.attn.to_out.0.weight"),
    ("double_blocks.{i}.txt_attn.proj.weight", "transformer_blocks.{i}.attn.to_add_out.weight"),
    ("double_blocks.{i}.img_mlp.0.weight", "transformer_blocks.{i}.ff.linear_in.weight"),
    ("double_blocks.{i}.img_mlp.2.weight", "transformer_blocks.{i}.ff.linear_out.weight"),
    ("double_blocks.{i}.txt_mlp.0.weight", "transformer_blocks.{i}.ff_context.linear_in.weight"),
    ("double_blocks.{i}.txt_mlp.2.weight", "transformer_blocks.{i}.ff_context.linear_out.weight"),
    ("single_blocks.{i}.linear1.weight", "single_transformer_blocks.{i}.attn.to_qkv_mlp_proj.weight"),
    ("single_blocks.{i}.linear2.weight", "single_transformer_blocks.{i}.attn.to_out.weight"),
    ("single_blocks.{i}.norm.query_norm.scale", "single_transformer_blocks.{i}.attn.norm_q.weight"),
    ("single_blocks.{i}.norm.key_norm.scale", "single_transformer_blocks.{i}.attn.norm_k.weight"),
    ("final_layer.linear.weight", "proj_out.weight"),
    ("final_layer.adaLN_modulation.1.weight", "norm_out.linear.weight"),      # halves swapped
]
SWAPPED_FROM_DIFFUSERS = {"final_layer.adaLN_modulation.1.weight"}

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


def _template_regex(template: str) -> re.Pattern:
    pattern = re.escape(template)
    for name, alternatives in PLACEHOLDERS.items():
        pattern = pattern.replace(re.escape("{" + name + "}"), f"(?P<{name}>{alternatives})")
    return re.compile(pattern)


def table_recipes(table: list, swapped: set[str] = frozenset(), levels: int = 0) -> Callable[[str], Recipe]:
    """our key -> Recipe, from a table of (our template, file template or tuple of them)."""
    compiled = [(_template_regex(ours), theirs) for ours, theirs in table]

    def recipe(key: str) -> Recipe:
        for pattern, theirs in compiled:
            match = pattern.fullmatch(key)
            if match:
                fields = match.groupdict()
                if "i" in fields:
                    fields["r"] = str(levels - 1 - int(fields["i"]))
                sources = (theirs,) if isinstance(theirs, str) else theirs
                return Recipe(tuple(s.format(**fields) for s in sources), key in swapped)
        raise KeyError(f"no mapping for {key!r}")       # a missing table row: a bug here, not bad input
    return recipe


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


# llama.cpp's names for a Qwen3 (GGUF text encoders) -> Hugging Face's. Qwen3's q/k are stored unpermuted (llama.cpp
# permutes q/k only for the "llama" architecture).
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


def table_names(table: list) -> Callable[[str], str | None]:
    """file key -> our key, from a table of one-to-one (our template, file template) rows; None for other keys."""
    compiled = [(_template_regex(theirs), ours) for ours, theirs in table]

    def ours(key: str) -> str | None:
        for pattern, template in compiled:
            match = pattern.fullmatch(key)
            if match:
                return template.format(**match.groupdict())
        return None
    return ours


TRANSFORMER_LAYOUTS = [
    Layout("BFL", "double_stream_modulation_img.lin.weight", same_names),
    Layout("diffusers", "double_stream_modulation_img.linear.weight",
           lambda keys: table_recipes(TRANSFORMER_FROM_DIFFUSERS, SWAPPED_FROM_DIFFUSERS)),
]
AUTOENCODER_LAYOUTS = [
    Layout("BFL", "encoder.down.0.block.0.conv1.weight", bfl_autoencoder_recipes),
    Layout("diffusers", "encoder.down_blocks.0.resnets.0.conv1.weight", diffusers_autoencoder_recipes),
]
OPTIONAL_KEYS = {"bn.num_batches_tracked"}       # not every AE file has it; it is unused, so 0 is fine
