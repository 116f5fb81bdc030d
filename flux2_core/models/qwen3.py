"""Qwen3 as far as FLUX.2 reads it: the embedding and the first decoder layers, returning hidden states (deeper
layers, the final norm and the LM head are not built). Names are Hugging Face's.

Attention is causal with grouped K/V heads and masks padding as keys only (pad rows are computed: FLUX.2 sees all
512). RMSNorms run in float32 and cast back before the weight multiplies, as Qwen3 was trained.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import Flux2Error
from .layers import Layers


@dataclass(frozen=True)
class Qwen3Params:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int              # decoder layers in the file (the model builds only those FLUX.2 reads)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6

    @classmethod
    def from_config(cls, config) -> Qwen3Params:
        """Also from a transformers Qwen3Config; the first value Qwen3 cannot have is a Flux2Error."""
        text = config.get("text_config") if isinstance(config, dict) else getattr(config, "text_config", None)
        if text is not None:                                   # Qwen3-VL: the text tower's own config
            config = text
        get = config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
        rope = get("rope_parameters") or get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise Flux2Error(f"rope_parameters must be an object, got {rope!r}")
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise Flux2Error(f"RoPE scaling {rope.get('rope_type', rope.get('type'))!r} is not the plain RoPE of "
                             "Qwen3's and Qwen3-VL's stock configs")
        heads, theta = get("num_attention_heads"), get("rope_theta")
        theta = rope.get("rope_theta", 1_000_000.0) if theta is None else theta      # transformers 5 nests it
        values = {"vocab_size": get("vocab_size"), "hidden_size": get("hidden_size"),
                  "intermediate_size": get("intermediate_size"), "num_layers": get("num_hidden_layers"),
                  "num_heads": heads, "num_kv_heads": get("num_key_value_heads", heads),
                  "head_dim": get("head_dim") or _div(get("hidden_size"), heads),
                  "rope_theta": theta,
                  "rms_norm_eps": get("rms_norm_eps", 1e-6)}
        for key, value in values.items():
            whole = key not in ("rope_theta", "rms_norm_eps")
            if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)) or not value > 0:
                raise Flux2Error(f"{key} must be a positive {'whole number' if whole else 'number'}, got {value!r}")
        if values["num_heads"] % values["num_kv_heads"]:
            raise Flux2Error(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads "
                             f"({values['num_kv_heads']})")
        if get("attention_bias", False) or get("hidden_act", "silu") != "silu":
            raise Flux2Error("attention biases or an activation other than silu: this is not a Qwen3 config")
        return cls(**values)

    @classmethod
    def from_state_dict(cls, sd: dict[str, Tensor], rope_theta: float = 1_000_000.0) -> Qwen3Params:
        """For files without config.json: head_dim is q_norm's length; rope_theta, which no shape reveals, is given."""
        head_dim = sd["layers.0.self_attn.q_norm.weight"].shape[0]
        return cls(vocab_size=sd["embed_tokens.weight"].shape[0], hidden_size=sd["embed_tokens.weight"].shape[1],
                   intermediate_size=sd["layers.0.mlp.gate_proj.weight"].shape[0],
                   num_layers=1 + max(int(k.split(".")[1]) for k in sd if k.startswith("layers.")),
                   num_heads=sd["layers.0.self_attn.q_proj.weight"].shape[0] // head_dim,
                   num_kv_heads=sd["layers.0.self_attn.k_proj.weight"].shape[0] // head_dim, head_dim=head_dim,
                   rope_theta=rope_theta)


def _div(a, b):
    return a // b if isinstance(a, int) and isinstance(b, int) and b > 0 else None


class RMSNorm(nn.Module):

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """positions [B, L] -> cos, sin [B, 1, L, head_dim], each half repeated for rotate-half."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    angles = positions.float()[..., None] * inv_freq                     # [B, L, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)[:, None]                # [B, 1, L, head_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, L, D] -> x cos + (-x2, x1) sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, p: Qwen3Params, layers: Layers):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = p.num_heads, p.num_kv_heads, p.head_dim
        self.q_proj = layers.linear("q_proj", p.hidden_size, p.num_heads * p.head_dim)
        self.k_proj = layers.linear("k_proj", p.hidden_size, p.num_kv_heads * p.head_dim)
        self.v_proj = layers.linear("v_proj", p.hidden_size, p.num_kv_heads * p.head_dim)
        self.o_proj = layers.linear("o_proj", p.num_heads * p.head_dim, p.hidden_size)
        self.q_norm, self.k_norm = RMSNorm(p.head_dim, p.rms_norm_eps), RMSNorm(p.head_dim, p.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        """x [B, L, hidden], mask [B, 1, L, L] (True: may attend) -> [B, L, hidden]."""
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.heads, self.head_dim)).transpose(1, 2)       # [B, H, L, D]
        k = self.k_norm(self.k_proj(x).view(b, n, self.kv_heads, self.head_dim)).transpose(1, 2)    # [B, Hkv, L, D]
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, p: Qwen3Params, layers: Layers):
        super().__init__()
        self.gate_proj = layers.linear("gate_proj", p.hidden_size, p.intermediate_size)
        self.up_proj = layers.linear("up_proj", p.hidden_size, p.intermediate_size)
        self.down_proj = layers.linear("down_proj", p.intermediate_size, p.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, p: Qwen3Params, layers: Layers):
        super().__init__()
        self.input_layernorm = RMSNorm(p.hidden_size, p.rms_norm_eps)
        self.self_attn = Attention(p, layers.scope("self_attn"))
        self.post_attention_layernorm = RMSNorm(p.hidden_size, p.rms_norm_eps)
        self.mlp = MLP(p, layers.scope("mlp"))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3(nn.Module):
    """No final norm: FLUX.2 reads raw layer outputs. ``dtype``: what a GGUF embedding's lookups return."""

    def __init__(self, p: Qwen3Params, num_layers: int, layers: Layers | None = None,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        if p.num_layers < num_layers:

            raise Flux2Error(f"the text encoder has {p.num_layers} layers; {num_layers} are asked for")
        layers = layers or Layers()
        self.params = p
        self.embed_tokens = layers.embedding("embed_tokens", p.vocab_size, p.hidden_size, dtype)
        self.layers = nn.ModuleList(DecoderLayer(p, layers.scope(f"layers.{i}")) for i in range(num_layers))

    def forward(self, ids: Tensor, mask: Tensor, outputs: tuple[int, ...], positions: Tensor | None = None
                ) -> list[Tensor]:
        """ids, mask [B, L] (1 for tokens), positions [B, L] -> the hidden states after decoder layers ``outputs``
        (from 1), each [B, L, hidden]."""
        x = self.embed_tokens(ids)
        n = ids.shape[1]
        if positions is None:
            positions = torch.arange(n, device=ids.device).expand_as(ids)
        cos, sin = rope_cos_sin(positions, self.params.head_dim, self.params.rope_theta, x.dtype)
        causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
        allowed = causal & mask.bool()[:, None, None, :]                     # [B, 1, L, L]: padding only as keys
        kept = {}
        for k, layer in enumerate(self.layers[:max(outputs)], start=1):
            x = layer(x, cos, sin, allowed)
            if k in outputs:
                kept[k] = x
        return [kept[k] for k in outputs]
