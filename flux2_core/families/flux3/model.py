"""FLUX 3 Image Klein's model as the code around it sees it: BFL's transformer built, a latent batch and one
conditioning made its velocity (prompt and reference tokens rounded through bf16, the flow map given t_next), and the
inputs of its memory estimate."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ...errors import Flux2Error
from ...models import rope
from ...models.layers import Layers
from ..family import MemoryInputs
from . import transformer as flux3


def build(params: flux3.Flux3Params, layers: Layers) -> flux3.Flux3Transformer:
    return flux3.Flux3Transformer(params, layers)


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


def memory(params: flux3.Flux3Params) -> MemoryInputs:
    """Inside one block, per token with H hidden and M = mlp_ratio·H: the modulated x, q, k, v, the attention out
    (5H), mlp_in's 2M and its SwiGLU M, the two outputs (2H), the residual and the per-token modulation of the single
    blocks (4H), and the float64-built RoPE table kept as float32 [head_dim/2, 2]."""
    h, m = params.hidden_size, params.mlp_hidden
    return MemoryInputs(peak_values=5 * h + 3 * m + 2 * h + 4 * h, table_bytes=params.head_dim * 4, hidden=h,
                        kv_layers=0)
