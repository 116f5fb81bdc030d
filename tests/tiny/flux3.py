"""Tiny FLUX 3 Image Klein transformers for tests, and flux3-mlx (on mlx-cpu) built at the same size as the oracle.

    params = TINY_FLUX3                                   # or tiny_flux3(flow_map=False)
    state = random_flux3_state_dict(params, seed=0)       # BFL's names, shapes read off the oracle's own module
    with flux3_mlx_at(params) as dit_module:              # flux3_mlx.dit sized like params, float32 compute
        oracle = mlx_dit(dit_module, params, state)

The key names and shapes come from flux3-mlx's ``DiT`` (BFL's export names), not from our module, so a test of our
module against them checks our names too.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import numpy as np
import torch

from flux2_core.variants import Flux3Params

TINY_FLUX3 = Flux3Params(in_channels=128, context_in_dim=64, hidden_size=64, num_heads=2, depth=2,
                         depth_single_blocks=2, mlp_ratio=3.0, axes_dim=(8, 8, 8, 8), flow_map=True)


def tiny_flux3(flow_map: bool = True) -> Flux3Params:
    return replace(TINY_FLUX3, flow_map=flow_map)


@contextlib.contextmanager
def flux3_mlx_at(params: Flux3Params):
    """flux3_mlx.dit's module constants set to ``params`` and float32 compute, restored afterwards."""
    import mlx.core as mx
    from flux3_mlx import dit

    names = ("HIDDEN", "HEADS", "HEAD_DIM", "DEPTH", "DEPTH_SINGLE", "AXES_DIM", "MLP_RATIO", "THETA", "IN_CHANNELS")
    saved = {n: getattr(dit, n) for n in names}
    dtype = dit.COMPUTE_DTYPE
    try:
        dit.HIDDEN, dit.HEADS, dit.HEAD_DIM = params.hidden_size, params.num_heads, params.head_dim
        dit.DEPTH, dit.DEPTH_SINGLE, dit.AXES_DIM = params.depth, params.depth_single_blocks, tuple(params.axes_dim)
        dit.MLP_RATIO, dit.THETA = params.mlp_ratio, params.theta
        dit.IN_CHANNELS = {"image": params.in_channels, "image_cond": params.in_channels, "text": params.context_in_dim}
        dit.set_compute_dtype(mx.float32)
        yield dit
    finally:
        for n, v in saved.items():
            setattr(dit, n, v)
        dit.set_compute_dtype(dtype)


def oracle_shapes(params: Flux3Params) -> dict[str, tuple[int, ...]]:
    """Every parameter of flux3-mlx's DiT at this size, by name, with the torch [out, in] shape."""
    from mlx.utils import tree_flatten

    with flux3_mlx_at(params) as dit:
        model = dit.DiT(flow_map=params.flow_map)
        return {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}


def random_flux3_state_dict(params: Flux3Params, seed: int = 0) -> dict[str, torch.Tensor]:
    """Linears ~ N(0, 1/in); norm scales 1 + N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in sorted(oracle_shapes(params).items()):
        if name.endswith(".scale"):
            state[name] = 1 + 0.1 * torch.randn(shape, generator=g)
        else:
            state[name] = torch.randn(shape, generator=g) / shape[1] ** 0.5
    return state


def mlx_dit(dit, params: Flux3Params, state: dict[str, torch.Tensor]):
    """flux3-mlx's DiT holding ``state`` (inside ``flux3_mlx_at``)."""
    import mlx.core as mx

    model = dit.DiT(flow_map=params.flow_map)
    model.load_weights([(k, mx.array(v.numpy())) for k, v in state.items()], strict=True)
    return model


def to_mlx(x: torch.Tensor):
    import mlx.core as mx

    return mx.array(x.detach().float().numpy())


def to_torch(x) -> torch.Tensor:
    return torch.from_numpy(np.array(x))
