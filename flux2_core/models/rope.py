"""Token positions and rotary embeddings (RoPE). Every token has an int64 id (t, h, w, l):

    text token l         (0,  0, 0, l)
    image token (h, w)   (0,  h, w, 0)      row-major: token k is (k // w, k % w)
    reference i (h, w)   (10·(i+1), h, w, 0)

Axis ``a`` rotates ``axes_dim[a] / 2`` pairs of adjacent channels (2j, 2j+1) by ``pos · theta^(-2j/axes_dim[a])``,
computed in float32.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor

from ..errors import Flux2Error

REFERENCE_T_STEP = 10   # reference i (0-based) sits at t = 10·(i+1)


def text_ids(batch: int, length: int, device=None) -> Tensor:
    """int64 [batch, length, 4]."""
    ids = torch.zeros(length, 4, dtype=torch.int64, device=device)
    ids[:, 3] = torch.arange(length, device=device)
    return ids.repeat(batch, 1, 1)


def image_ids(batch: int, h: int, w: int, t: int = 0, device=None) -> Tensor:
    """int64 [batch, h*w, 4], row-major."""
    ids = torch.zeros(h, w, 4, dtype=torch.int64, device=device)
    ids[..., 0] = t
    ids[..., 1] = torch.arange(h, device=device)[:, None]
    ids[..., 2] = torch.arange(w, device=device)[None, :]
    return ids.reshape(1, h * w, 4).repeat(batch, 1, 1)


def reference_ids(grids: list[tuple[int, int]], device=None) -> Tensor:
    """int64 [1, sum(h*w), 4], the references concatenated in order."""
    if not grids:
        raise Flux2Error("reference_ids needs at least one (h, w) grid; pass no references instead of an empty list")
    parts = [image_ids(1, h, w, t=REFERENCE_T_STEP * (i + 1), device=device) for i, (h, w) in enumerate(grids)]
    return torch.cat(parts, dim=1)


def pack(latent: Tensor) -> Tensor:
    """[B, C, h, w] -> [B, h*w, C], row-major as ``image_ids``."""
    if latent.ndim != 4:
        raise Flux2Error(f"pack expects a latent [B, C, h, w], got shape {tuple(latent.shape)}")
    return rearrange(latent, "b c h w -> b (h w) c")


def unpack(tokens: Tensor, h: int, w: int) -> Tensor:
    if tokens.ndim != 3 or tokens.shape[1] != h * w:
        raise Flux2Error(f"unpack expects tokens [B, {h}*{w}={h * w}, C], got shape {tuple(tokens.shape)}")
    return rearrange(tokens, "b (h w) c -> b c h w", h=h, w=w)


def rope_table(ids: Tensor, axes_dim: tuple[int, ...], theta: float, angles_dtype: torch.dtype = torch.float32
               ) -> Tensor:
    """ids [B, L, n_axes] -> float32 [B, L, head_dim/2, 2] (cos, sin), pairs axis after axis. ``angles_dtype``:
    float32 for FLUX.2, float64 for FLUX 3 (positions reach 4096)."""
    if ids.shape[-1] != len(axes_dim):
        raise Flux2Error(f"position ids have {ids.shape[-1]} axes but the model's RoPE has {len(axes_dim)} "
                         f"(axes_dim {tuple(axes_dim)}); build ids with flux2_core.models.rope")
    where = ids.device if angles_dtype == torch.float32 or ids.device.type != "mps" else torch.device("cpu")
    angles = []
    for axis, dim in enumerate(axes_dim):
        omega = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=angles_dtype, device=where) / dim)         # [dim/2]
        angles.append(ids[..., axis].to(where, angles_dtype)[..., None] * omega)                       # [B, L, dim/2]
    angles = torch.cat(angles, dim=-1)                                                                  # [B, L, D/2]
    return torch.stack([angles.cos(), angles.sin()], dim=-1).to(ids.device, torch.float32)


def rotate(x: Tensor, table: Tensor) -> Tensor:
    """x [B, H, L, D] by table [B, L, D/2, 2], in float32, cast back. A complex multiply is one eager pass (about
    10x faster than the real form); inductor has no complex codegen, so compiled code takes ``rotate_real``.
    """
    if torch.compiler.is_compiling():
        return rotate_real(x, table)
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))      # [B, H, L, D/2] complex
    rotated = pairs * torch.view_as_complex(table)[:, None]              # table: [B, 1, L, D/2] complex
    return torch.view_as_real(rotated).flatten(-2).to(x.dtype)


def rotate_real(x: Tensor, table: Tensor) -> Tensor:
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)                 # each [B, H, L, D/2]
    cos, sin = table[:, None].unbind(-1)                                 # each [B, 1, L, D/2]
    return torch.stack([cos * x0 - sin * x1, sin * x0 + cos * x1], dim=-1).flatten(-2).to(x.dtype)


def apply_rope(q: Tensor, k: Tensor, table: Tensor) -> tuple[Tensor, Tensor]:
    return rotate(q, table), rotate(k, table)
