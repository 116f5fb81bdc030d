"""The FLUX 3 Image Klein transformer, with BFL's parameter names (no Linear has a bias). Tokens come in three modes,
in this order inside each sample: image, references ("image_cond"), prompt ("txt").

    vec[mode] = time_in(t) for the image, time_in(0) for references and text (+ ref_time_in(t_next): flow map only)
    early blocks: each mode through its own blocks, attending within the mode
    single blocks: the sample's joint sequence [image, references, text], each token modulated by its mode
    final_layer on the image tokens -> velocity [B, Limg, 128]

Text rows past ``txt_lengths[b]`` are masked as keys, so a sample's image sees what it would alone. RoPE in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from ...errors import Flux2Error
from ...models.blocks import TIME_EMBED_DIM, LastLayer, MLPEmbedder, Modulation, QKNorm, swiglu, timestep_embedding
from ...models.layers import Layers
from ...models.rope import rope_table
from ...models.run_state import run_state
from ...models.shards import TokenShards, shares
from ...variants import AttentionShape


@dataclass(frozen=True)
class Flux3Params(AttentionShape):
    """FLUX 3 Image Klein's transformer shape: per-mode early blocks, then single blocks over the joint sequence."""
    in_channels: int = 128             # patchified latent channels (the FLUX.2 autoencoder's)
    context_in_dim: int = 20480        # 8 x Qwen3-VL-4B's 2560 (layers 4, 8, ..., 32 stacked per token)
    hidden_size: int = 3072
    num_heads: int = 24
    depth: int = 5                     # early blocks per mode
    depth_single_blocks: int = 28
    mlp_ratio: float = 3.0
    axes_dim: tuple[int, ...] = (32, 32, 32, 32)   # RoPE dims per id axis (t, h, w, l); sums to head_dim
    theta: int = 10000
    flow_map: bool = False             # the distilled model: it is also told the time each step goes to


IMAGE, REFERENCES, TEXT = "image", "image_cond", "txt"    # the modes, in their order inside a sample
IMAGE_ID_SCALE = 0.5          # image and reference positions are (row, col) / 2


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """(1 + scale) · LayerNorm(x) + shift in float32 (as the reference under bf16 autocast), back in x's dtype."""
    out = (1 + scale.float()) * F.layer_norm(x.float(), x.shape[-1:], eps=1e-6) + shift.float()
    return out.to(x.dtype)


def attention(q: Tensor, k: Tensor, v: Tensor, keys: Tensor | None, shards: TokenShards | None = None) -> Tensor:
    """q, k, v [B, heads, l, D] of this rank's tokens; ``keys`` [B, L] bool over every rank's tokens in rank order
    (False: masked) or None -> [B, l, heads·D]. With ``shards`` the ranks trade heads for tokens around it."""
    if shards is not None:
        q, k, v = (shards.heads_from_tokens(x) for x in (q, k, v))
    mask = None if keys is None else keys[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if shards is not None:
        out = shards.tokens_from_heads(out)
    return rearrange(out, "B H L D -> B L (H D)")


class Block(nn.Module):
    """x + gate · (attn_out(attention) + mlp_out(SwiGLU(mlp_in))), both on the same modulated x."""

    def __init__(self, p: Flux3Params, layers: Layers):
        super().__init__()
        self.heads = p.num_heads
        self.q_proj = layers.linear("q_proj", p.hidden_size, p.hidden_size)
        self.k_proj = layers.linear("k_proj", p.hidden_size, p.hidden_size)
        self.v_proj = layers.linear("v_proj", p.hidden_size, p.hidden_size)
        self.mlp_in = layers.linear("mlp_in", p.hidden_size, 2 * p.mlp_hidden)
        self.attn_out = layers.linear("attn_out", p.hidden_size, p.hidden_size)
        self.mlp_out = layers.linear("mlp_out", p.mlp_hidden, p.hidden_size)
        self.norm = QKNorm(p.head_dim)

    def forward(self, x: Tensor, pe: Tensor, mod: tuple[Tensor, Tensor, Tensor], keys: Tensor | None,
                shards: TokenShards | None = None) -> Tensor:
        """x [B, L, H]; pe [B, L, D/2, 2]; mod: shift, scale, gate each [B, 1 or L, H]."""
        shift, scale, gate = mod
        h = modulate(x, shift, scale)
        q, k, v = (rearrange(proj(h), "B L (H D) -> B H L D", H=self.heads)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.norm(q, k, v, pe)
        out = attention(q, k, v, keys, shards)
        return x + gate * (self.attn_out(out) + self.mlp_out(swiglu(self.mlp_in(h))))


@dataclass(frozen=True)
class ModeSplit:
    """A sequence-parallel pass: each mode's tokens split in contiguous runs; a rank holds its [image, refs, text]."""

    ranks: object                          # runtime.parallel.SequenceParallel: group, rank, world
    counts: dict[str, tuple[int, ...]]     # mode -> tokens held by each rank

    def local(self, mode: str, x: Tensor) -> Tensor:
        """x [B, L_mode, ...] -> this rank's run of it."""
        run = self.counts[mode]
        return x.narrow(1, sum(run[:self.ranks.rank]), run[self.ranks.rank])

    def within(self, mode: str) -> TokenShards:
        """The trades of attention inside one mode (the early blocks)."""
        return TokenShards(self.ranks.group, self.ranks.rank, self.counts[mode], (0,) * self.ranks.world)

    def joint(self, modes: list[str]) -> TokenShards:
        """The trades of the single blocks over each rank's [image, references, text] run."""
        held = [sum(self.counts[m][r] for m in modes) for r in range(self.ranks.world)]
        return TokenShards(self.ranks.group, self.ranks.rank, tuple(held), (0,) * self.ranks.world)

    def joint_keys(self, modes: list[str], text: Tensor) -> Tensor:
        """[B, L] joint keys in attention's order (rank by rank, its runs of every mode); ``text`` [B, L_text]."""
        parts, start = [], 0
        for r in range(self.ranks.world):
            content = sum(self.counts[m][r] for m in modes if m != TEXT)
            n = self.counts[TEXT][r]
            parts += [text.new_ones(text.shape[0], content), text[:, start:start + n]]
            start += n
        return torch.cat(parts, dim=1)


def text_keys(txt_lengths: list[int] | None, batch: int, length: int, device) -> Tensor | None:
    """[B, length] True where a sample's text row is real; None when every sample's text fills the batch's."""
    if txt_lengths is None or all(n == length for n in txt_lengths):
        return None
    return torch.arange(length, device=device)[None, :] < torch.tensor(txt_lengths, device=device)[:, None]


class Flux3Transformer(nn.Module):
    """``state_dict()`` keys are exactly those of BFL's export."""

    def __init__(self, params: Flux3Params, layers: Layers | None = None):
        super().__init__()
        p = self.params = params
        layers = layers or Layers()
        content = (IMAGE, REFERENCES)
        self.emb_in = nn.ModuleDict({m: layers.scope("emb_in").linear(m, p.in_channels, p.hidden_size)
                                     for m in content})
        self.txt_in = layers.linear("txt_in", p.context_in_dim, p.hidden_size)
        self.time_in = MLPEmbedder(TIME_EMBED_DIM, p.hidden_size, layers.scope("time_in"))
        if p.flow_map:
            self.ref_time_in = MLPEmbedder(TIME_EMBED_DIM, p.hidden_size, layers.scope("ref_time_in"))
        self.early_stream_modulations = nn.ModuleDict(
            {m: Modulation(p.hidden_size, 3, layers.scope(f"early_stream_modulations.{m}")) for m in (*content, TEXT)})
        self.single_stream_modulations = nn.ModuleDict(
            {m: Modulation(p.hidden_size, 3, layers.scope(f"single_stream_modulations.{m}")) for m in (*content, TEXT)})
        self.content_mode_blocks = nn.ModuleDict(
            {m: nn.ModuleList(Block(p, layers.scope(f"content_mode_blocks.{m}.{i}")) for i in range(p.depth))
             for m in content})
        self.txt_mode_blocks = nn.ModuleList(Block(p, layers.scope(f"txt_mode_blocks.{i}")) for i in range(p.depth))
        self.single_blocks = nn.ModuleList(Block(p, layers.scope(f"single_blocks.{i}"))
                                           for i in range(p.depth_single_blocks))
        self.final_layer = nn.ModuleDict({IMAGE: LastLayer(p.hidden_size, p.in_channels,
                                                           layers.scope(f"final_layer.{IMAGE}"))})

    # what runtime code may ask of any transformer
    def blocks(self) -> list[nn.Module]:
        """The repeated blocks, in the order they run (an early block of each mode in turn, then the single blocks)."""
        early = zip(self.content_mode_blocks[IMAGE], self.content_mode_blocks[REFERENCES], self.txt_mode_blocks)
        return [*(b for trio in early for b in trio), *self.single_blocks]

    @property
    def device(self) -> torch.device:
        return self.txt_in.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype, read from a norm: any linear may be quantized or kept 16-bit, a norm never is."""
        return self.single_blocks[0].norm.query_norm.scale.dtype

    def forward(self, img: Tensor, img_ids: Tensor, timesteps: Tensor, txt: Tensor, txt_ids: Tensor,
                t_next: Tensor | None = None, ref: Tensor | None = None, ref_ids: Tensor | None = None,
                txt_lengths: list[int] | None = None) -> Tensor:
        """img [B, Limg, 128], timesteps [B] in [0, 1], txt [B, Ltxt, context_in_dim], ref [B or 1, Lref, 128], ids
        [B or 1, L, 4]; t_next [B]: the step's target time (flow map only) -> velocity [B, Limg, 128]."""
        self.check_forward(img, img_ids, timesteps, txt, txt_ids, t_next, ref, ref_ids, txt_lengths)
        return self._velocity(img, img_ids, timesteps, txt, txt_ids, t_next, ref, ref_ids, txt_lengths)

    def check_forward(self, img: Tensor, img_ids: Tensor, timesteps: Tensor, txt: Tensor, txt_ids: Tensor,
                      t_next: Tensor | None = None, ref: Tensor | None = None, ref_ids: Tensor | None = None,
                      txt_lengths: list[int] | None = None) -> None:
        p = self.params
        if img.ndim != 3 or img.shape[-1] != p.in_channels:
            raise Flux2Error(f"image tokens must be [B, L, {p.in_channels}], got shape {tuple(img.shape)}")
        if txt.ndim != 3 or txt.shape[-1] != p.context_in_dim:
            raise Flux2Error(f"text embeddings must be [B, L, {p.context_in_dim}] for FLUX 3 Image Klein (Qwen3-VL's "
                             f"hidden states), got shape {tuple(txt.shape)}; was the prompt encoded with its encoder?")
        batch = img.shape[0]
        for name, x in (("img_ids", img_ids), ("txt_ids", txt_ids), ("ref", ref), ("ref_ids", ref_ids)):
            if x is not None and x.shape[0] not in (1, batch):
                raise Flux2Error(f"{name} has batch {x.shape[0]}, the image tokens {batch}: give 1 or {batch}")
        if (ref is None) != (ref_ids is None):
            raise Flux2Error("references need ref and ref_ids together")
        if p.flow_map and t_next is None:
            raise Flux2Error("FLUX 3 Image Klein (distilled) is told the time each step goes to: pass t_next")
        if txt_lengths is not None and (len(txt_lengths) != batch
                                        or not all(0 < n <= txt.shape[1] for n in txt_lengths)):
            raise Flux2Error(f"txt_lengths must give 1..{txt.shape[1]} real text rows for each of the {batch} samples, "
                             f"got {txt_lengths}")

    def _velocity(self, img: Tensor, img_ids: Tensor, timesteps: Tensor, txt: Tensor, txt_ids: Tensor,
                  t_next: Tensor | None, ref: Tensor | None, ref_ids: Tensor | None,
                  txt_lengths: list[int] | None) -> Tensor:
        p, batch, dtype = self.params, img.shape[0], img.dtype
        tokens = {IMAGE: img, TEXT: txt.to(dtype)}
        ids = {IMAGE: img_ids.expand(batch, -1, -1), TEXT: txt_ids.expand(batch, -1, -1)}
        if ref is not None:
            tokens[REFERENCES], ids[REFERENCES] = ref.to(dtype), ref_ids.expand(batch, -1, -1)
        modes = [m for m in (IMAGE, REFERENCES, TEXT) if m in tokens]
        keys = {m: None for m in modes}
        keys[TEXT] = text_keys(txt_lengths, batch, txt.shape[1], img.device)
        split = self._split({m: tokens[m].shape[1] for m in modes})
        if split is not None:                       # this rank's run of each mode; keys stay whole (attention's)
            tokens = {m: split.local(m, t) for m, t in tokens.items()}
            ids = {m: split.local(m, i) for m, i in ids.items()}
        x = {m: (self.txt_in if m == TEXT else self.emb_in[m])(tokens[m]).expand(batch, -1, -1) for m in modes}

        vec = self._vectors(timesteps, t_next, modes, dtype)
        pe = {m: rope_table(ids[m], p.axes_dim, p.theta, torch.float64) for m in modes}
        for d in range(p.depth):
            for m in modes:
                block = self.txt_mode_blocks[d] if m == TEXT else self.content_mode_blocks[m][d]
                x[m] = block(x[m], pe[m], self.early_stream_modulations[m](vec[m]), keys[m],
                             None if split is None else split.within(m))

        lengths = [x[m].shape[1] for m in modes]
        h = torch.cat([x[m] for m in modes], dim=1)
        joint_pe = torch.cat([pe[m] for m in modes], dim=1)
        mods = [self.single_stream_modulations[m](vec[m]) for m in modes]          # per mode: 3 x [B, 1, H]
        mod = tuple(torch.cat([mods[i][j].expand(-1, n, -1) for i, n in enumerate(lengths)], dim=1)
                    for j in range(3))                                             # 3 x [B, L, H]
        joint_keys, shards = None, None if split is None else split.joint(modes)
        if keys[TEXT] is not None:
            joint_keys = (torch.cat([keys[TEXT].new_ones(batch, sum(lengths[:-1])), keys[TEXT]], dim=1)
                          if split is None else split.joint_keys(modes, keys[TEXT]))
        for block in self.single_blocks:
            h = block(h, joint_pe, mod, joint_keys, shards)
        out = self.final_layer[IMAGE](h[:, :lengths[0]], vec[IMAGE])
        return out if split is None else shards.gather(out, list(split.counts[IMAGE]))

    def _split(self, counts: dict[str, int]) -> ModeSplit | None:
        """None in one process; else how each mode's tokens are shared out over the ranks."""
        ranks = run_state(self).sequence_parallel
        if ranks is None:
            return None
        return ModeSplit(ranks, {m: shares(n, ranks.world) for m, n in counts.items()})

    def _vectors(self, timesteps: Tensor, t_next: Tensor | None, modes: list[str], dtype: torch.dtype
                 ) -> dict[str, Tensor]:
        """vec [B, H] per mode. The reference keeps times in bf16, so they are rounded to it in every dtype."""
        def embed(t: Tensor) -> Tensor:
            return timestep_embedding(t.to(torch.bfloat16).float()).to(dtype)

        image = self.time_in(embed(timesteps))
        still = self.time_in(embed(torch.zeros_like(timesteps)))                  # references and text: time 0
        jump = self.ref_time_in(embed(t_next)) if self.params.flow_map else 0
        return {m: (image if m == IMAGE else still) + jump for m in modes}


def image_ids(batch: int, h: int, w: int, device=None) -> Tensor:
    """float32 [batch, h*w, 4] = (0, row/2, col/2, 0), row-major."""
    ids = torch.zeros(h, w, 4, dtype=torch.float32, device=device)
    ids[..., 1] = torch.arange(h, device=device)[:, None] * IMAGE_ID_SCALE
    ids[..., 2] = torch.arange(w, device=device)[None, :] * IMAGE_ID_SCALE
    return ids.reshape(1, h * w, 4).repeat(batch, 1, 1)


def reference_ids(grids: list[tuple[int, int]], device=None) -> Tensor:
    """float32 [1, sum(h*w), 4]: reference i on the l axis at -(1 + i)."""
    if not grids:
        raise Flux2Error("reference_ids needs at least one (h, w) grid; pass no references instead of an empty list")
    parts = []
    for i, (h, w) in enumerate(grids):
        ids = image_ids(1, h, w, device)
        ids[..., 3] = -(1 + i)
        parts.append(ids)
    return torch.cat(parts, dim=1)


def text_ids(batch: int, length: int, device=None) -> Tensor:
    """float32 [batch, length, 4] = (0, 0, 0, position)."""
    ids = torch.zeros(batch, length, 4, dtype=torch.float32, device=device)
    ids[..., 3] = torch.arange(length, device=device)
    return ids
