"""The FLUX 3 family's record: FLUX 3 Image Klein (the distilled "flow map", 16 steps) and its base (50 steps, CFG),
BFL's transformer (``models/flux3.py``) on Qwen3-VL-4B prompt embeddings, the FLUX.2 autoencoder's latent."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

from ..errors import Flux2Error
from ..key_tables import Layout, same_names
from ..models import flux3, rope
from ..variants import QWEN3_VL_4B, VARIANTS, Flux3Params, TextEncoderSpec, Variant
from .family import AdapterNaming, Family, MemoryInputs, NoiseDraw, ReferenceFit, ShapeReader

# every block and modulation; the input embedders, time embedders and the final layer stay float (small, and every
# token's scale comes from them)
QUANTIZABLE = ("content_mode_blocks.", "txt_mode_blocks.", "single_blocks.", "early_stream_modulations.",
               "single_stream_modulations.")


def quantizable(name: str) -> bool:
    return name.startswith(QUANTIZABLE)


def read_params(file: ShapeReader) -> Flux3Params:
    """The architecture from the shapes; RoPE axes and theta are the reference's (a file does not record them)."""
    hidden, in_channels = file.shape("emb_in.image.weight")
    head_dim = file.shape("single_blocks.0.norm.query_norm.scale")[0]
    mlp_hidden = file.shape("single_blocks.0.mlp_out.weight")[1]
    try:
        return Flux3Params(in_channels=in_channels, context_in_dim=file.shape("txt_in.weight")[1], hidden_size=hidden,
                           num_heads=hidden // head_dim, depth=file.count("txt_mode_blocks.{}.q_proj.weight"),
                           depth_single_blocks=file.count("single_blocks.{}.q_proj.weight"),
                           mlp_ratio=mlp_hidden / hidden, axes_dim=(head_dim // 4,) * 4,
                           flow_map=file.has("ref_time_in.in_layer.weight"))
    except ValueError as e:
        raise Flux2Error(f"{file.where}: the architecture read from the file is inconsistent ({e})") from None


def variant_for(params: Flux3Params, hint: str = "") -> Variant:
    """The flow map is the distilled model, the rest the base: the file says which. Other sizes (tests) get a custom
    variant with the defaults of their edition."""
    template = VARIANTS["flux3-klein" if params.flow_map else "flux3-klein-base"]
    if params == template.params:
        return template
    layers = QWEN3_VL_4B.output_layers
    encoder: TextEncoderSpec = replace(QWEN3_VL_4B, name="custom", hidden_size=params.context_in_dim // len(layers))
    return replace(template, name="custom", params=params, text_encoder=encoder, files=(), title="")


def condition(model: flux3.Flux3Transformer, txt: Tensor, h: int, w: int, *, ref: Tensor | None = None,
              ref_ids: Tensor | None = None, ref_kv=None, guidance: Tensor | None = None,
              txt_lengths: list[int] | None = None) -> Callable[[Tensor, Tensor, Tensor | None], Tensor]:
    """The velocity on the latent grid: the latent [n, 128, h, w] packed to h*w tokens, each sample's own text
    (``txt_lengths``), references at ``ref_ids`` (``reference_ids``); the flow map is also given t_next. The reference
    hands its model the prompt embeddings and reference latents in bf16 (what its encoders give), so they are rounded
    through bf16 here in every compute dtype."""
    txt = txt.to(torch.bfloat16).to(txt.dtype)
    ref = None if ref is None else ref.to(torch.bfloat16).to(ref.dtype)
    if ref_kv is not None:
        raise Flux2Error("FLUX 3 Image Klein has no KV edition: give its references as tokens")
    if guidance is not None:
        raise Flux2Error("FLUX 3 Image Klein has no guidance embedding: the base model guides with CFG")
    ids: dict[int, tuple[Tensor, Tensor]] = {}

    def velocity(x: Tensor, t: Tensor, t_next: Tensor | None) -> Tensor:
        n = x.shape[0]
        if n not in ids:
            ids[n] = flux3.image_ids(1, h, w, x.device), flux3.text_ids(1, txt.shape[1], x.device)
        img_ids, txt_ids = ids[n]
        v = model(rope.pack(x), img_ids, t, txt, txt_ids, t_next=t_next if model.params.flow_map else None,
                  ref=ref, ref_ids=ref_ids, txt_lengths=txt_lengths)
        return rope.unpack(v, h, w)
    return velocity


def memory(params: Flux3Params) -> MemoryInputs:
    """Inside one block, per token with H hidden and M = mlp_ratio·H: the modulated x, q, k, v, the attention out
    (5H), mlp_in's 2M and its SwiGLU M, the two outputs (2H), the residual and the per-token modulation of the single
    blocks (4H), and the float64-built RoPE table kept as float32 [head_dim/2, 2]."""
    h, m = params.hidden_size, params.mlp_hidden
    return MemoryInputs(peak_values=5 * h + 3 * m + 2 * h + 4 * h, table_bytes=params.head_dim * 4, hidden=h,
                        kv_layers=0)


# one reference: fitted to 4 MP and 4096 px a side, reflect-padded to its 16-px canvas (64 px at least); several: each
# at most 1 MP, centre-cropped to 16 px; at most 10
REFERENCES = ReferenceFit(single_pixels=4 * 1024 * 1024, multi_pixels=1024 * 1024, min_side=1, max_aspect=None,
                          max_count=10, padded=True, max_side=4096, pad_min=64)

ADAPTERS = AdapterNaming(groups=(("early blocks", "content_mode_blocks."), ("text blocks", "txt_mode_blocks."),
                                 ("single blocks", "single_blocks.")),
                         models={3072: "FLUX 3 Image Klein"}, lookalikes=(), other_depths=(),
                         shape_hint=lambda module, found, hidden: "")

FLUX3 = Family(name="flux3", params_type=Flux3Params, title="FLUX 3 Image Klein",
               layouts=(Layout("BFL", "early_stream_modulations.txt.lin.weight", same_names),),
               lookalikes=(), gguf_archs=("flux3", ""),
               files_hint="flux3-image-klein*.safetensors (ComfyUI models/diffusion_models)",
               read_params=read_params, build=lambda params, layers: flux3.Flux3Transformer(params, layers),
               quantizable=quantizable, variant_for=variant_for, condition=condition, memory=memory,
               schedule="flux3", adapters=ADAPTERS,
               noise=NoiseDraw(token_major=True, bf16=True), latent_dtype=lambda compute: torch.float32,
               reference_ids=flux3.reference_ids, references=REFERENCES, boxes=True)
