"""FLUX.2's transformer files: BFL's and diffusers' namings (``FROM_DIFFUSERS``, also what adapters in diffusers'
names are read by), the files often taken for one, the architecture read from a file's shapes, and the linears a
quantized storage may hold."""

from __future__ import annotations

from ...errors import Flux2Error
from ...key_tables import Layout, same_names, table_recipes
from ..family import ShapeReader
from .transformer import TransformerParams

# the blocks and the shared modulations: over 95% of the weights; the embedders and the final layer stay float (they
# are small, and the model reads nothing from them)
QUANTIZABLE = ("double_blocks.", "single_blocks.", "double_stream_modulation", "single_stream_modulation")


def quantizable(name: str) -> bool:
    return name.startswith(QUANTIZABLE)


def read_params(file: ShapeReader) -> TransformerParams:
    """The architecture from the shapes of a file's tensors; RoPE axes and theta from a diffusers config.json when
    there is one (a file does not record them otherwise: BFL's are 4 equal axes, theta 2000)."""
    hidden, in_channels = file.shape("img_in.weight")
    head_dim = file.shape("double_blocks.0.img_attn.norm.query_norm.scale")[0]
    mlp_hidden = file.shape("double_blocks.0.img_mlp.2.weight")[1]
    axes = tuple(file.config("axes_dims_rope", "ints", None) or (head_dim // 4,) * 4)
    try:
        return TransformerParams(
            in_channels=in_channels, context_in_dim=file.shape("txt_in.weight")[1], hidden_size=hidden,
            num_heads=hidden // head_dim, depth=file.count("double_blocks.{}.img_attn.qkv.weight"),
            depth_single_blocks=file.count("single_blocks.{}.linear1.weight"), mlp_ratio=mlp_hidden / hidden,
            axes_dim=axes, theta=int(file.config("rope_theta", "number", 2000)),
            use_guidance_embed=file.has("guidance_in.in_layer.weight"))
    except ValueError as e:
        raise Flux2Error(f"{file.where}: the architecture read from the file is inconsistent ({e}); pass params= "
                         f"explicitly") from None


# our (BFL's) keys <- diffusers' (a tuple of sources is concatenated along dim 0: diffusers splits q, k, v)
FROM_DIFFUSERS = [
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

# BFL's names (its single files, ComfyUI's behind their prefix, GGUFs) and diffusers' transformer/ folders
LAYOUTS = (Layout("BFL", "double_stream_modulation_img.lin.weight", same_names),
           Layout("diffusers", "double_stream_modulation_img.linear.weight",
                  lambda keys: table_recipes(FROM_DIFFUSERS, SWAPPED_FROM_DIFFUSERS)))
# files users take for a FLUX.2 Klein transformer: a key only they hold, and what to tell them
FLUX1 = "a FLUX.1 transformer; FLUX.2 Klein needs its own flux-2-klein-*.safetensors"
LOOKALIKES = (("double_blocks.0.img_mod.lin.weight", FLUX1), ("transformer_blocks.0.norm1.linear.weight", FLUX1))
