"""The pieces every family's flow transformer is made of: the timestep embedding, LayerNorm modulation, SwiGLU, RMS
and q/k norms with RoPE, the modulation and embedding MLPs, the last layer. Each family's network (families/<name>/)
composes them into its blocks; nothing here is one family's own.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import kitchen
from .layers import Layers
from .rope import apply_rope

TIME_EMBED_DIM = 256


def timestep_embedding(t: Tensor, dim: int = TIME_EMBED_DIM, max_period: float = 10000.0) -> Tensor:
    """sigmas [B] -> [B, dim] as [cos | sin]. 1000·t is computed in t's own dtype, as BFL does: with bf16 sigmas the
    model sees bf16(1000·bf16(t)).
    """
    t = 1000 * t
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(t.dtype)


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """(1 + scale) · LayerNorm(x) + shift, LayerNorm without affine, eps 1e-6."""
    if x.numel() and kitchen.fused(x, "adaln"):        # its CUDA kernel cannot launch on no tokens (KV's text)
        return kitchen.adaln(x, shift, scale)
    return (1 + scale) * F.layer_norm(x, x.shape[-1:], eps=1e-6) + shift


def swiglu(x: Tensor) -> Tensor:
    gate, value = x.chunk(2, dim=-1)
    return F.silu(gate) * value


class RMSNorm(nn.Module):
    """Computed in float32, cast back, then multiplied by ``scale``."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        rrms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + 1e-6)
        return (xf * rrms).to(x.dtype) * self.scale


class QKNorm(nn.Module):
    """Per-head RMSNorm of q and k, then RoPE: both per token, so this runs on each stream of a double block before the
    joint concatenation, and one module so that a compiled block fuses them.
    """

    def __init__(self, head_dim: int):
        super().__init__()
        self.query_norm = RMSNorm(head_dim)
        self.key_norm = RMSNorm(head_dim)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, pe: Tensor) -> tuple[Tensor, Tensor]:
        """q, k, v [B, heads, L, D], pe [B, L, D/2, 2] -> q, k in v's dtype."""
        if q.numel() and kitchen.fused(q, "rms_rope"):  # scales where q is (a host may keep small norms offloaded)
            return kitchen.rms_rope(q, k, self.query_norm.scale.to(q.device), self.key_norm.scale.to(q.device), pe,
                                    v.dtype)
        return apply_rope(self.query_norm(q).to(v.dtype), self.key_norm(k).to(v.dtype), pe)


class Modulation(nn.Module):
    """Lin(H, n·H) on silu(vec): n chunks [B, 1, H] (shift, scale, gate, ...)."""

    def __init__(self, hidden: int, n: int, layers: Layers):
        super().__init__()
        self.n = n
        self.lin = layers.linear("lin", hidden, n * hidden, per_item=True)

    def forward(self, vec: Tensor) -> tuple[Tensor, ...]:
        return self.lin(F.silu(vec))[:, None, :].chunk(self.n, dim=-1)


class MLPEmbedder(nn.Module):
    def __init__(self, in_dim: int, hidden: int, layers: Layers):
        super().__init__()
        self.in_layer = layers.linear("in_layer", in_dim, hidden, per_item=True)
        self.out_layer = layers.linear("out_layer", hidden, hidden, per_item=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.out_layer(F.silu(self.in_layer(x)))


class LastLayer(nn.Module):
    def __init__(self, hidden: int, out_channels: int, layers: Layers):
        super().__init__()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), layers.linear("adaLN_modulation.1", hidden, 2 * hidden,
                                                                       per_item=True))
        self.linear = layers.linear("linear", hidden, out_channels)

    def forward(self, x: Tensor, vec: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(vec)[:, None, :].chunk(2, dim=-1)   # order: shift, then scale
        return self.linear(modulate(x, shift, scale))
