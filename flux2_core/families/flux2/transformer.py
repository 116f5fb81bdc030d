"""The FLUX.2 flow transformer, with BFL's single-file parameter names (no Linear has a bias; attention has no mask).

    vec = time_in(sigma) (+ guidance_in for FLUX.2-dev); three shared modulations on silu(vec)
    double blocks: separate img / txt weights, joint attention over [txt, img]
    single blocks: one parallel attention + MLP block over cat(txt, img) -> final_layer -> velocity [B, Limg, 128]

References are extra image tokens (t = 10, 20, ...), either joint (appended after the image) or KV (9B-KV: run
alone at t = 0 once, their k, v kept per block). Both equal BFL's, as reference tokens only attend to themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from ...errors import Flux2Error
from ...models.blocks import (
    TIME_EMBED_DIM,
    LastLayer,
    MLPEmbedder,
    Modulation,
    QKNorm,
    modulate,
    swiglu,
    timestep_embedding,
)
from ...models.layers import Layers
from ...models.reference_kv import ReferenceKV
from ...models.rope import rope_table
from ...models.run_state import run_state
from ...models.shards import TokenShards
from ...variants import AttentionShape


@dataclass(frozen=True)
class TransformerParams(AttentionShape):
    """FLUX.2's transformer (the defaults are Klein 4B's)."""
    in_channels: int = 128             # patchified latent channels (32 AE channels x 2 x 2)
    context_in_dim: int = 7680         # 3 x text-encoder hidden size (layers 9, 18, 27 concatenated)
    hidden_size: int = 3072
    num_heads: int = 24
    depth: int = 5                     # double-stream blocks
    depth_single_blocks: int = 20
    mlp_ratio: float = 3.0
    axes_dim: tuple[int, ...] = (32, 32, 32, 32)   # RoPE dims per id axis (t, h, w, l); sums to head_dim
    theta: int = 2000
    use_guidance_embed: bool = False   # FLUX.2-dev only


FP16_MAX = torch.finfo(torch.float16).max


def fp16_bounded(x: Tensor) -> Tensor:
    """float16 residual streams can overflow to inf on some prompts; clamped at the same three places as ComfyUI.
    A NaN stays NaN, so the NaN guard still stops a broken run. Other dtypes pass untouched."""
    return x.clamp(-FP16_MAX, FP16_MAX) if x.dtype == torch.float16 else x


def attention(q: Tensor, k: Tensor, v: Tensor, n_txt: int, ref_kv: tuple[Tensor, Tensor] | None = None,
              shards: TokenShards | None = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """q, k, v [B, heads, L, head_dim], q and k normed and rotated; ref_kv [B or 1, heads, Lref, head_dim] goes
    between txt and the rest. Returns [B, L, heads*head_dim] and the (k, v) without ref_kv's.
    """
    if shards is not None:
        q, k, v = (shards.heads_from_tokens(x) for x in (q, k, v))
    keys, values = k, v
    if ref_kv is not None:
        k_ref, v_ref = (x.expand(q.shape[0], -1, -1, -1) for x in ref_kv)
        keys = torch.cat([k[:, :, :n_txt], k_ref, k[:, :, n_txt:]], dim=2)
        values = torch.cat([v[:, :, :n_txt], v_ref, v[:, :, n_txt:]], dim=2)
    out = F.scaled_dot_product_attention(q, keys, values)
    if shards is not None:
        out = shards.tokens_from_heads(out)
    return rearrange(out, "B H L D -> B L (H D)"), (k, v)


def split_heads(qkv: Tensor, norm: QKNorm, heads: int, pe: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """[B, L, 3·heads·D] (all q | all k | all v) -> q, k (normed, rotated), v, each [B, heads, L, D]."""
    q, k, v = rearrange(qkv, "B L (K H D) -> K B H L D", K=3, H=heads)
    q, k = norm(q, k, v, pe)
    return q, k, v


class SelfAttention(nn.Module):

    def __init__(self, hidden: int, heads: int, layers: Layers):
        super().__init__()
        self.heads = heads
        self.qkv = layers.linear("qkv", hidden, 3 * hidden)
        self.norm = QKNorm(hidden // heads)
        self.proj = layers.linear("proj", hidden, hidden)

    def qkv_heads(self, x: Tensor, pe: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return split_heads(self.qkv(x), self.norm, self.heads, pe)


class SwiGLU(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return swiglu(x)


def mlp(hidden: int, mlp_hidden: int, layers: Layers) -> nn.Sequential:
    """Lin(H, 2M) -> SwiGLU -> Lin(M, H); the Sequential indices give BFL's keys ``.0`` and ``.2``."""
    return nn.Sequential(layers.linear("0", hidden, 2 * mlp_hidden), SwiGLU(),
                         layers.linear("2", mlp_hidden, hidden))


def _stream_update(x: Tensor, attn_out: Tensor, attn: SelfAttention, mlp: nn.Module, mod: tuple[Tensor, ...]) -> Tensor:
    _, _, gate1, shift2, scale2, gate2 = mod
    x = x + gate1 * attn.proj(attn_out)
    return x + gate2 * mlp(modulate(x, shift2, scale2))


class DoubleStreamBlock(nn.Module):
    def __init__(self, p: TransformerParams, layers: Layers):
        super().__init__()
        self.img_attn = SelfAttention(p.hidden_size, p.num_heads, layers.scope("img_attn"))
        self.img_mlp = mlp(p.hidden_size, p.mlp_hidden, layers.scope("img_mlp"))
        self.txt_attn = SelfAttention(p.hidden_size, p.num_heads, layers.scope("txt_attn"))
        self.txt_mlp = mlp(p.hidden_size, p.mlp_hidden, layers.scope("txt_mlp"))

    def forward(self, img: Tensor, txt: Tensor, pe: Tensor, mod_img: tuple[Tensor, ...], mod_txt: tuple[Tensor, ...],
                ref_kv: tuple[Tensor, Tensor] | None = None, shards: TokenShards | None = None
                ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
        """img [B, Limg, H], txt [B, Ltxt, H], pe for [txt, img]."""
        n_txt = txt.shape[1]
        img_q, img_k, img_v = self.img_attn.qkv_heads(modulate(img, mod_img[0], mod_img[1]), pe[:, n_txt:])
        txt_q, txt_k, txt_v = self.txt_attn.qkv_heads(modulate(txt, mod_txt[0], mod_txt[1]), pe[:, :n_txt])
        q, k, v = (torch.cat(pair, dim=2) for pair in [(txt_q, img_q), (txt_k, img_k), (txt_v, img_v)])

        out, kv = attention(q, k, v, n_txt, ref_kv, shards)

        img = _stream_update(img, out[:, n_txt:], self.img_attn, self.img_mlp, mod_img)
        txt = fp16_bounded(_stream_update(txt, out[:, :n_txt], self.txt_attn, self.txt_mlp, mod_txt))
        return img, txt, kv


class SingleStreamBlock(nn.Module):
    """linear1 -> (q, k, v | MLP in); linear2 on cat(attention out, SwiGLU(MLP in))."""

    def __init__(self, p: TransformerParams, layers: Layers):
        super().__init__()
        self.heads = p.num_heads
        self.split = [3 * p.hidden_size, 2 * p.mlp_hidden]
        self.linear1 = layers.linear("linear1", p.hidden_size, sum(self.split))
        self.linear2 = layers.linear("linear2", p.hidden_size + p.mlp_hidden, p.hidden_size)
        self.norm = QKNorm(p.head_dim)

    def forward(self, x: Tensor, pe: Tensor, mod: tuple[Tensor, ...], n_txt: int,
                ref_kv: tuple[Tensor, Tensor] | None = None, shards: TokenShards | None = None
                ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x [B, Ltxt + Limg, H] = cat(txt, img)."""
        shift, scale, gate = mod
        qkv, mlp_in = torch.split(self.linear1(modulate(x, shift, scale)), self.split, dim=-1)
        q, k, v = split_heads(qkv, self.norm, self.heads, pe)

        out, kv = attention(q, k, v, n_txt, ref_kv, shards)

        x = fp16_bounded(x + gate * self.linear2(torch.cat([out, swiglu(mlp_in)], dim=-1)))
        return x, kv


def _batched(x: Tensor, batch: int, name: str) -> Tensor:
    """[1 or batch, ...] -> [batch, ...]."""
    if x.shape[0] not in (1, batch):
        raise Flux2Error(f"{name} has batch {x.shape[0]} but the image tokens have batch {batch}; "
                         f"pass batch 1 (shared) or {batch}")
    return x.expand(batch, *x.shape[1:])


class Flux2Transformer(nn.Module):
    """``state_dict()`` keys are exactly those of BFL's single-file checkpoints."""

    def __init__(self, params: TransformerParams, layers: Layers | None = None):
        super().__init__()
        p = self.params = params
        layers = layers or Layers()
        self.img_in = layers.linear("img_in", p.in_channels, p.hidden_size)
        self.txt_in = layers.linear("txt_in", p.context_in_dim, p.hidden_size)
        self.time_in = MLPEmbedder(TIME_EMBED_DIM, p.hidden_size, layers.scope("time_in"))
        if p.use_guidance_embed:
            self.guidance_in = MLPEmbedder(TIME_EMBED_DIM, p.hidden_size, layers.scope("guidance_in"))
        self.double_stream_modulation_img = Modulation(p.hidden_size, 6, layers.scope("double_stream_modulation_img"))
        self.double_stream_modulation_txt = Modulation(p.hidden_size, 6, layers.scope("double_stream_modulation_txt"))
        self.single_stream_modulation = Modulation(p.hidden_size, 3, layers.scope("single_stream_modulation"))
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(p, layers.scope(f"double_blocks.{i}"))
                                           for i in range(p.depth))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(p, layers.scope(f"single_blocks.{i}"))
                                           for i in range(p.depth_single_blocks))
        self.final_layer = LastLayer(p.hidden_size, p.in_channels, layers.scope("final_layer"))

    def blocks(self) -> list[nn.Module]:
        """The repeated blocks, in the order they run."""
        return [*self.double_blocks, *self.single_blocks]

    @property
    def device(self) -> torch.device:
        return self.img_in.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: a norm's, since any linear may be quantized."""
        return self.single_blocks[0].norm.query_norm.scale.dtype

    def forward(self, img: Tensor, img_ids: Tensor, timesteps: Tensor, txt: Tensor, txt_ids: Tensor,
                guidance: Tensor | None = None, ref: Tensor | None = None, ref_ids: Tensor | None = None,
                ref_kv: ReferenceKV | None = None) -> Tensor:
        """img [B, Limg, in_channels], img_ids [B, Limg, 4]; timesteps [B] sigmas in [0, 1]; txt [B, Ltxt,
        context_in_dim], txt_ids [B, Ltxt, 4]; guidance [B] (dev only). Returns the velocity [B, Limg, in_channels].
        """
        self.check_forward(img, img_ids, timesteps, txt, txt_ids, guidance, ref, ref_ids, ref_kv)
        return self._velocity(img, img_ids, timesteps, txt, txt_ids, guidance, ref, ref_ids, ref_kv)

    @torch.no_grad()
    def reference_kv(self, ref: Tensor, ref_ids: Tensor) -> ReferenceKV:
        """The references alone at t = 0 with no text; ref [B, Lref, in_channels], usually B = 1."""
        self.check_reference_kv(ref, ref_ids)
        return self._reference_kv(ref, ref_ids)

    # also run by a sequence-parallel driver before it announces the call to the other ranks
    def check_forward(self, img: Tensor, img_ids: Tensor, timesteps: Tensor, txt: Tensor, txt_ids: Tensor,
                      guidance: Tensor | None = None, ref: Tensor | None = None, ref_ids: Tensor | None = None,
                      ref_kv: ReferenceKV | None = None) -> None:
        self._check_tokens(img, txt)
        batch = img.shape[0]
        for name, x in (("img_ids", img_ids), ("txt_ids", txt_ids), ("ref", ref), ("ref_ids", ref_ids)):
            if x is not None:
                _batched(x, batch, name)
        if ref is not None and (ref_ids is None or ref_kv is not None):
            raise Flux2Error("joint references need ref and ref_ids together, and no ref_kv; "
                             "for the KV scheme pass only ref_kv=model.reference_kv(ref, ref_ids)")
        if ref_kv is not None:
            self._check_cache(ref_kv, batch)
        if self.params.use_guidance_embed and guidance is None:
            raise Flux2Error("this model has a guidance embedding (FLUX.2-dev): pass guidance, e.g. 4.0 per item")

    def check_reference_kv(self, ref: Tensor, ref_ids: Tensor) -> None:
        self._check_tokens(ref, None)
        _batched(ref_ids, ref.shape[0], "ref_ids")

    def _velocity(self, img: Tensor, img_ids: Tensor, timesteps: Tensor, txt: Tensor, txt_ids: Tensor,
                  guidance: Tensor | None, ref: Tensor | None, ref_ids: Tensor | None,
                  ref_kv: ReferenceKV | None) -> Tensor:
        batch, n_img = img.shape[:2]
        img_ids, txt_ids = _batched(img_ids, batch, "img_ids"), _batched(txt_ids, batch, "txt_ids")
        if ref is not None:
            img = torch.cat([img, _batched(ref, batch, "ref")], dim=1)
            img_ids = torch.cat([img_ids, _batched(ref_ids, batch, "ref_ids")], dim=1)
        vec = self._vector(timesteps, guidance, img.dtype)
        shards = self._shards(txt.shape[1], img.shape[1])
        if shards is None:
            out = self._run_blocks(img, img_ids, txt, txt_ids, vec, ref_kv)
            return self.final_layer(out[:, :n_img], vec)
        txt, txt_ids = shards.local_txt(txt), shards.local_txt(txt_ids)
        img, img_ids = shards.local_rest(img), shards.local_rest(img_ids)
        out = self._run_blocks(img, img_ids, txt, txt_ids, vec, ref_kv, shards=shards)
        mine = shards.image_shares(n_img)
        return shards.gather(self.final_layer(out[:, :mine[shards.rank]], vec), mine)

    def _reference_kv(self, ref: Tensor, ref_ids: Tensor) -> ReferenceKV:
        batch = ref.shape[0]
        ref_ids = _batched(ref_ids, batch, "ref_ids")
        no_txt = ref.new_zeros(batch, 0, self.params.context_in_dim)
        no_txt_ids = ref_ids.new_zeros(batch, 0, ref_ids.shape[-1])
        vec = self._vector(ref.new_zeros(batch), None, ref.dtype)
        shards = self._shards(0, ref.shape[1])
        if shards is not None:
            ref, ref_ids = shards.local_rest(ref), shards.local_rest(ref_ids)
        kv = []
        self._run_blocks(ref, ref_ids, no_txt, no_txt_ids, vec, kv_out=kv, shards=shards)
        return ReferenceKV(kv, ref.shape[1] if shards is None else sum(shards.rest))

    def _shards(self, n_txt: int, n_rest: int) -> TokenShards | None:
        """This rank's token split under sequence parallelism, else None."""
        ranks = run_state(self).sequence_parallel
        return None if ranks is None else ranks.shards(n_txt, n_rest)

    def _vector(self, timesteps: Tensor, guidance: Tensor | None, dtype: torch.dtype) -> Tensor:
        """vec [B, H]."""
        vec = self.time_in(timestep_embedding(timesteps).to(dtype))
        if self.params.use_guidance_embed:
            vec = vec + self.guidance_in(timestep_embedding(guidance).to(dtype))
        return vec

    def _run_blocks(self, img: Tensor, img_ids: Tensor, txt: Tensor, txt_ids: Tensor, vec: Tensor,
                    ref_kv: ReferenceKV | None = None, kv_out: list | None = None,
                    shards: TokenShards | None = None) -> Tensor:
        """Returns the image tokens [B, Limg, H]. kv_out gets copies: a single block's v views its 9x larger linear1."""
        mod_img = self.double_stream_modulation_img(vec)
        mod_txt = self.double_stream_modulation_txt(vec)
        mod_single = self.single_stream_modulation(vec)
        img, txt = self.img_in(img), self.txt_in(txt)
        pe = rope_table(torch.cat([txt_ids, img_ids], dim=1), self.params.axes_dim, self.params.theta)
        cached = ref_kv.blocks if ref_kv is not None else [None] * (len(self.double_blocks) + len(self.single_blocks))
        n_txt = txt.shape[1]

        # drop each block's (k, v) at once, or its linear1 output stays alive beside the next (a quarter of the peak)
        for block, block_kv in zip(self.double_blocks, cached):
            img, txt, kv = block(img, txt, pe, mod_img, mod_txt, block_kv, shards)
            if kv_out is not None:
                kv_out.append((kv[0].clone(), kv[1].clone()))
            del kv

        x = torch.cat([txt, fp16_bounded(img)], dim=1)
        for block, block_kv in zip(self.single_blocks, cached[len(self.double_blocks):]):
            x, kv = block(x, pe, mod_single, n_txt, block_kv, shards)
            if kv_out is not None:
                kv_out.append((kv[0].clone(), kv[1].clone()))
            del kv
        return x[:, n_txt:]

    def _check_tokens(self, img: Tensor, txt: Tensor | None):
        p = self.params
        if img.ndim != 3 or img.shape[-1] != p.in_channels:
            raise Flux2Error(f"image tokens must be [B, L, {p.in_channels}] (rope.pack of a [B, {p.in_channels}, h, w] "
                             f"latent), got shape {tuple(img.shape)}")
        if txt is not None and (txt.ndim != 3 or txt.shape[-1] != p.context_in_dim):
            raise Flux2Error(f"text embeddings must be [B, L, {p.context_in_dim}] for this model, got shape "
                             f"{tuple(txt.shape)}; was the prompt encoded with the matching text encoder?")

    def _check_cache(self, ref_kv: ReferenceKV, batch: int):
        n_blocks = len(self.double_blocks) + len(self.single_blocks)
        if len(ref_kv.blocks) != n_blocks:
            raise Flux2Error(f"the reference KV cache has {len(ref_kv.blocks)} blocks but this model has {n_blocks}; "
                             "it was made by another model: rebuild it with this model's reference_kv")
        if ref_kv.batch not in (1, batch):
            raise Flux2Error(f"the reference KV cache has batch {ref_kv.batch} but the image tokens have batch "
                             f"{batch}; build it from batch-1 references to share it")
        ranks = run_state(self).sequence_parallel
        heads = self.params.num_heads // (1 if ranks is None else ranks.world)
        if ref_kv.blocks[0][0].shape[1] != heads:
            raise Flux2Error(f"the reference KV cache holds {ref_kv.blocks[0][0].shape[1]} heads but this model "
                             f"attends with {heads} here{' (sequence-parallel)' if ranks else ''}: it was made before "
                             f"the model was spread over ranks or gathered back; rebuild it with this model's "
                             f"reference_kv")
