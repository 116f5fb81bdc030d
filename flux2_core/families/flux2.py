"""The FLUX.2 family's record: Klein 4B / 9B (distilled, base, 9B-KV) and dev, BFL's transformer
(``models/transformer.py``) on Qwen3 (Klein) or Mistral (dev) prompt embeddings."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from ..errors import Flux2Error
from ..models import rope
from ..models.layers import Layers
from ..models.transformer import Flux2Transformer, ReferenceKV
from ..variants import TransformerParams, variant_for_params
from .family import Family, MemoryInputs, ShapeReader

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


def condition(model: Flux2Transformer, txt: Tensor, h: int, w: int, *, ref: Tensor | None = None,
              ref_ids: Tensor | None = None, ref_kv: ReferenceKV | None = None,
              guidance: Tensor | None = None) -> Callable[[Tensor, Tensor, Tensor | None], Tensor]:
    """The model's velocity on the latent grid for one conditioning: txt [n, L, C] at ids (0, 0, 0, l); the latent
    [n, 128, h, w] packed to h*w tokens at (0, row, col, 0); references joined after the image (``ref`` [1 or n, Lref,
    128] at ``ref_ids``) or attended through their cached K/V (``ref_kv``); FLUX.2-dev's ``guidance`` [n]. FLUX.2
    reads the current time alone (``t_next`` is not used)."""
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


FLUX2 = Family(name="flux2", params_type=TransformerParams, title="FLUX.2", marker="double_stream_modulation_img.lin.weight",
               read_params=read_params, build=build, quantizable=quantizable, variant_for=variant_for_params,
               condition=condition, memory=memory, schedule="flux2")
