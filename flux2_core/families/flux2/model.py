"""FLUX.2's model as the code around it sees it: BFL's transformer built, a latent batch and one conditioning made its
velocity, and the inputs of its memory estimate."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from ...errors import Flux2Error
from ...models import rope
from ...models.layers import Layers
from ...models.reference_kv import ReferenceKV
from ..family import MemoryInputs
from .transformer import Flux2Transformer, TransformerParams


def build(params: TransformerParams, layers: Layers) -> Flux2Transformer:
    return Flux2Transformer(params, layers)


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
