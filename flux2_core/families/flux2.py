"""The FLUX.2 family's record: Klein 4B / 9B (distilled, base, 9B-KV) and dev, BFL's transformer
(``models/transformer.py``) on Qwen3 (Klein) or Mistral (dev) prompt embeddings."""

from __future__ import annotations

import re
from collections.abc import Callable

from torch import Tensor

from ..errors import Flux2Error
from ..key_tables import Layout, same_names, table_recipes
from ..models import rope
from ..models.layers import Layers
from ..models.transformer import Flux2Transformer, ReferenceKV
from ..variants import TransformerParams, variant_for_params
from .family import AdapterNaming, Family, MemoryInputs, ShapeReader

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


def build(params: TransformerParams, layers: Layers) -> Flux2Transformer:
    return Flux2Transformer(params, layers)


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


def condition(model: Flux2Transformer, txt: Tensor, h: int, w: int, *, ref: Tensor | None = None,
              ref_ids: Tensor | None = None, ref_kv: ReferenceKV | None = None,
              guidance: Tensor | None = None, txt_lengths: list[int] | None = None
              ) -> Callable[[Tensor, Tensor, Tensor | None], Tensor]:
    """The model's velocity on the latent grid for one conditioning: txt [n, L, C] at ids (0, 0, 0, l); the latent
    [n, 128, h, w] packed to h*w tokens at (0, row, col, 0); references joined after the image (``ref`` [1 or n, Lref,
    128] at ``ref_ids``) or attended through their cached K/V (``ref_kv``); FLUX.2-dev's ``guidance`` [n]. FLUX.2
    reads the current time alone (``t_next`` is not used). Its prompts are all one length (512 tokens)."""
    if txt_lengths is not None:
        raise Flux2Error("FLUX.2 takes prompt embeddings of one length (512 tokens each): encode every prompt of a "
                         "batch with the FLUX.2 text encoder")
    ids: dict[int, tuple[Tensor, Tensor]] = {}          # by batch: (image ids, text ids), made once

    def velocity(x: Tensor, t: Tensor, t_next: Tensor | None) -> Tensor:
        n = x.shape[0]
        if n not in ids:
            ids[n] = rope.image_ids(n, h, w, device=x.device), rope.text_ids(n, txt.shape[1], device=x.device)
        img_ids, txt_ids = ids[n]
        v = model(rope.pack(x), img_ids, t, txt, txt_ids, guidance=guidance, ref=ref, ref_ids=ref_ids, ref_kv=ref_kv)
        return rope.unpack(v, h, w)                                          # [n, h*w, 128] -> [n, 128, h, w]
    return velocity


def memory(params: TransformerParams) -> MemoryInputs:
    """The peak is inside one single block: per token, with H hidden and M = mlp_ratio·H, linear1's output 3H + 2M,
    the concat H + M, the SwiGLU M, about 8 H-wide tensors, and the float32 RoPE table [head_dim/2, 2]. For Klein
    24 H-wide values per token, 23.5 measured on CPU (tests/test_pipeline.py). Every double and single block keeps a
    reference's K/V in the KV edition."""
    h, m = params.hidden_size, params.mlp_hidden
    return MemoryInputs(peak_values=(3 * h + 2 * m) + (h + m) + m + 8 * h, table_bytes=params.head_dim * 4, hidden=h,
                        kv_layers=params.depth + params.depth_single_blocks)


# LoRAs: a FLUX.1 adapter's names (checked on keys that matched none of ours); FLUX.1's MLP is 4 x hidden, FLUX.2's 3 x
FLUX1_ADAPTER = re.compile(r"(?:img|txt)_mod[._]lin(?:$|[._])|single_blocks[._]\d+[._]modulation[._]lin|norm1(?:_context)?"
                           r"[._]linear|single_transformer_blocks[._]\d+[._](?:proj_mlp|norm[._]linear)|ff(?:_context)?"
                           r"[._]net[._]|distilled_guidance_layer")


def adapter_shape_hint(module: str, found: tuple[int, int], hidden: int) -> str:
    if module.endswith((".linear1", "_mlp.0")) and found[0] in (7 * hidden, 4 * hidden):
        return " Its MLP width is FLUX.1's (4x hidden): this is a FLUX.1 LoRA, which does not fit FLUX.2."
    return ""


ADAPTERS = AdapterNaming(groups=(("double blocks", "double_blocks."), ("single blocks", "single_blocks.")),
                         models={3072: "Klein 4B", 4096: "Klein 9B", 6144: "FLUX.2 dev"},
                         lookalikes=((FLUX1_ADAPTER, "FLUX.1"),),
                         other_depths=(("FLUX.1", {"double blocks": 19, "single blocks": 38}),),
                         shape_hint=adapter_shape_hint)

FLUX2 = Family(name="flux2", params_type=TransformerParams, title="FLUX.2", layouts=LAYOUTS, lookalikes=LOOKALIKES,
               gguf_archs=("flux", ""),
               files_hint="flux-2-klein-*.safetensors or .gguf (ComfyUI models/diffusion_models) or a diffusers "
                          "transformer/ folder",
               read_params=read_params, build=build, quantizable=quantizable, variant_for=variant_for_params,
               condition=condition, memory=memory, schedule="flux2", adapters=ADAPTERS)
