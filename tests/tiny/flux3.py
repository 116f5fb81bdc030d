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

from flux2_core.families.flux3.transformer import Flux3Params

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


# --- the text encoder: a tiny Qwen3-VL text tower ---------------------------------------------------------------------

# Qwen3-VL-4B's text tower at 32 wide: every layer FLUX 3 reads (4, 8, ..., 32) and no more, the real vocabulary size
# (so every token id is valid), its attention shape (GQA, q/k RMSNorm) and RoPE base
TINY_QWEN3_VL_TEXT = {
    "vocab_size": 151936, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 32,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 5_000_000.0,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "tie_word_embeddings": True,
}


def save_tiny_qwen3_vl(folder, seed: int = 0):
    """A Hugging Face Qwen3-VL folder holding only a tiny random text tower: config.json (its ``text_config``),
    tokenizer.json (Qwen's vocabulary) and model.safetensors under ``model.language_model.``. Returns the folder."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from flux2_core.models.tokenizer import builtin_tokenizer
    from tests.tiny.text_encoder import build_tiny_qwen3

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = build_tiny_qwen3(seed, TINY_QWEN3_VL_TEXT)
    state = {"model.language_model." + k.removeprefix("model."): v.contiguous()
             for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(folder / "model.safetensors"))
    text = {**TINY_QWEN3_VL_TEXT, "model_type": "qwen3_vl_text",
            "rope_scaling": {"mrope_interleaved": True, "mrope_section": [8, 4, 4], "rope_type": "default"}}
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_vl", "text_config": text}))
    (folder / "tokenizer.json").write_text(builtin_tokenizer().backend.to_str())
    return folder


@contextlib.contextmanager
def mlx_pipeline(params, state, te, ae):
    """flux3-mlx's Pipeline with every part in float32 (its loaders would cast the DiT to bf16), sized like the tiny
    files; ``pipe.latents`` collects the final latent tokens [h*w, 128] of each picture it decodes."""
    import mlx.core as mx
    from flux3_mlx import autoencoder, pipeline
    from flux3_mlx.text_encoder import TextEncoder

    from tests.tiny.autoencoder import TINY_AE_PARAMS

    saved = autoencoder.CH, autoencoder.CH_MULT
    try:
        autoencoder.CH, autoencoder.CH_MULT = TINY_AE_PARAMS.ch, TINY_AE_PARAMS.ch_mult
        with flux3_mlx_at(params) as dit:
            pipe = pipeline.Pipeline.__new__(pipeline.Pipeline)
            pipe.root = pipe.te_root = te
            pipe.low_memory = False
            pipe._te = TextEncoder(str(te), dtype=mx.float32)
            pipe._dit = mlx_dit(dit, params, state)
            pipe.vae = autoencoder.load_autoencoder(str(ae))
            decode, pipe.latents = pipe.vae.decode, []
            pipe.vae.decode = lambda tokens, h, w: pipe.latents.append(to_torch(tokens)) or decode(tokens, h, w)
            yield pipe
    finally:
        autoencoder.CH, autoencoder.CH_MULT = saved


def our_models(params, state, te, ae):
    """Our pipeline's models from a tiny FLUX 3 state, a Qwen3-VL folder and an autoencoder file, in float32."""
    from flux2_core import weights
    from flux2_core.families.flux3 import FLUX3
    from flux2_core.families.flux3.transformer import Flux3Transformer
    from flux2_core.pipeline import Models

    model = Flux3Transformer(params).eval()
    model.load_state_dict(state)
    variant = FLUX3.variant_for(params, "")
    encoder = weights.load_text_encoder(te, "cpu", torch.float32, spec=variant.text_encoder)
    return Models(model, variant, weights.load_autoencoder(ae, "cpu", torch.float32), encoder)
