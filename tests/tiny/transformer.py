"""Tiny FLUX.2 transformers for tests: parameters, random BFL-format weights, and the files users have.

    params = TINY_TRANSFORMER
    sd = random_bfl_transformer_state_dict(params, seed=0)
    save_bfl_transformer(sd, tmp / "flux-2-klein-tiny.safetensors")          # BFL single file
    save_comfyui_transformer(sd, tmp / "comfy.safetensors")                  # "model.diffusion_model." + BFL keys
    ref = diffusers_transformer_from_bfl_file(tmp / "flux-2-klein-tiny.safetensors", params, tmp / "cfg")
    save_diffusers_transformer(ref, tmp / "transformer")                     # diffusers folder (save_pretrained)

The BFL key names and shapes come from ``bfl_transformer_shapes``, written from BFL's checkpoint layout and not from
our module, so tests can check our module against it. diffusers' own single-file converter is the independent key
mapping to its ``Flux2Transformer2DModel``, our numerical oracle.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from flux2_core.families.flux2.transformer import TransformerParams

# Same shape family as the real models (128 latent channels, 4 RoPE axes), small enough to run in milliseconds.
TINY_TRANSFORMER = TransformerParams(in_channels=128, context_in_dim=96, hidden_size=64, num_heads=2, depth=2,
                                     depth_single_blocks=2, mlp_ratio=3.0, axes_dim=(8, 8, 8, 8), theta=2000)

COMFYUI_PREFIX = "model.diffusion_model."
TIME_EMBED_DIM = 256


def bfl_transformer_shapes(params: TransformerParams) -> dict[str, tuple[int, ...]]:
    """Every key of a BFL single-file FLUX.2 transformer with its shape (no biases anywhere)."""
    H, M, D = params.hidden_size, int(params.hidden_size * params.mlp_ratio), params.hidden_size // params.num_heads
    C = params.in_channels
    shapes = {
        "img_in.weight": (H, C),
        "txt_in.weight": (H, params.context_in_dim),
        "time_in.in_layer.weight": (H, TIME_EMBED_DIM),
        "time_in.out_layer.weight": (H, H),
    }
    if params.use_guidance_embed:
        shapes["guidance_in.in_layer.weight"] = (H, TIME_EMBED_DIM)
        shapes["guidance_in.out_layer.weight"] = (H, H)
    shapes["double_stream_modulation_img.lin.weight"] = (6 * H, H)
    shapes["double_stream_modulation_txt.lin.weight"] = (6 * H, H)
    shapes["single_stream_modulation.lin.weight"] = (3 * H, H)
    for n in range(params.depth):
        for stream in ("img", "txt"):
            prefix = f"double_blocks.{n}.{stream}"
            shapes[f"{prefix}_attn.qkv.weight"] = (3 * H, H)
            shapes[f"{prefix}_attn.norm.query_norm.scale"] = (D,)
            shapes[f"{prefix}_attn.norm.key_norm.scale"] = (D,)
            shapes[f"{prefix}_attn.proj.weight"] = (H, H)
            shapes[f"{prefix}_mlp.0.weight"] = (2 * M, H)
            shapes[f"{prefix}_mlp.2.weight"] = (H, M)
    for n in range(params.depth_single_blocks):
        shapes[f"single_blocks.{n}.linear1.weight"] = (3 * H + 2 * M, H)
        shapes[f"single_blocks.{n}.linear2.weight"] = (H, H + M)
        shapes[f"single_blocks.{n}.norm.query_norm.scale"] = (D,)
        shapes[f"single_blocks.{n}.norm.key_norm.scale"] = (D,)
    shapes["final_layer.linear.weight"] = (C, H)
    shapes["final_layer.adaLN_modulation.1.weight"] = (2 * H, H)
    return shapes


def random_bfl_transformer_state_dict(params: TransformerParams = TINY_TRANSFORMER, seed: int = 0,
                                      dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random BFL-format weights: linears N(0, 1/fan_in), RMSNorm scales U(0.5, 1.5) (so they matter)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for key, shape in bfl_transformer_shapes(params).items():
        if key.endswith(".scale"):
            sd[key] = 0.5 + torch.rand(shape, generator=g)
        else:
            sd[key] = torch.randn(shape, generator=g) / shape[1] ** 0.5
    return {k: v.to(dtype) for k, v in sd.items()}


def tiny_forward(model, seed: int = 1, params: TransformerParams = TINY_TRANSFORMER) -> torch.Tensor:
    """One call of a tiny transformer on seeded inputs: a 4 x 4 latent grid (16 tokens) and 8 text tokens at t 0.7."""
    from flux2_core.models import rope

    g = torch.Generator().manual_seed(seed)
    img, txt = torch.randn(1, 16, params.in_channels, generator=g), torch.randn(1, 8, params.context_in_dim, generator=g)
    with torch.no_grad():
        return model(img, rope.image_ids(1, 4, 4), torch.tensor([0.7]), txt, rope.text_ids(1, 8))


def save_bfl_transformer(state_dict: dict[str, torch.Tensor], path: str | Path) -> Path:
    """Write a BFL single file (``flux-2-klein-*.safetensors`` layout)."""
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(path))
    return Path(path)


def save_comfyui_transformer(state_dict: dict[str, torch.Tensor], path: str | Path) -> Path:
    """Write a ComfyUI-style file: BFL keys behind the ``model.diffusion_model.`` prefix."""
    save_file({COMFYUI_PREFIX + k: v.contiguous() for k, v in state_dict.items()}, str(path))
    return Path(path)


def diffusers_transformer_config(params: TransformerParams = TINY_TRANSFORMER) -> dict:
    """The ``Flux2Transformer2DModel`` config (config.json) for these params."""
    return {
        "_class_name": "Flux2Transformer2DModel",
        "patch_size": 1,
        "in_channels": params.in_channels,
        "out_channels": None,
        "num_layers": params.depth,
        "num_single_layers": params.depth_single_blocks,
        "attention_head_dim": params.hidden_size // params.num_heads,
        "num_attention_heads": params.num_heads,
        "joint_attention_dim": params.context_in_dim,
        "timestep_guidance_channels": TIME_EMBED_DIM,
        "mlp_ratio": params.mlp_ratio,
        "axes_dims_rope": list(params.axes_dim),
        "rope_theta": params.theta,
        "eps": 1e-6,
        "guidance_embeds": params.use_guidance_embed,
    }


def write_diffusers_transformer_config(params: TransformerParams, folder: str | Path) -> Path:
    """Write ``folder/config.json`` for ``diffusers_transformer_config(params)``; returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(diffusers_transformer_config(params), indent=2))
    return folder


def diffusers_transformer_from_bfl_file(path: str | Path, params: TransformerParams = TINY_TRANSFORMER,
                                        config_dir: str | Path | None = None):
    """diffusers' ``Flux2Transformer2DModel`` loaded from a BFL single file by diffusers' own converter (offline).

    ``config_dir`` receives the config.json (default: a ``<file stem>-config`` folder beside the file).
    Returns the float32 model in eval mode.
    """
    from diffusers import Flux2Transformer2DModel

    path = Path(path)
    config_dir = write_diffusers_transformer_config(params, config_dir or path.with_name(path.stem + "-config"))
    model = Flux2Transformer2DModel.from_single_file(str(path), config=str(config_dir), local_files_only=True)
    return model.float().eval()


def save_diffusers_transformer(model, folder: str | Path) -> Path:
    """Write a diffusers transformer folder (config.json + diffusion_pytorch_model.safetensors)."""
    model.save_pretrained(str(folder), safe_serialization=True)
    return Path(folder)
