"""Tiny random models for ``--demo``: the whole pipeline in a second or two with no weight files. Same architectures,
much smaller (the Qwen3 keeps 27 layers and the full vocabulary; the tokenizer is real); weights from a fixed seed,
so every run gives the same noise-like pictures.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..families import VARIANTS
from ..families.flux2.transformer import Flux2Transformer, TransformerParams
from ..families.flux2.variants import QWEN3_4B
from ..models.autoencoder import AutoEncoder
from ..models.qwen3 import Qwen3, Qwen3Params
from ..models.text_encoder import build_qwen3_encoder
from ..pipeline import Models
from ..variants import AutoEncoderParams, Variant

DEMO_TEXT_WIDTH = 32
DEMO_TEXT = replace(QWEN3_4B, name="demo", hidden_size=DEMO_TEXT_WIDTH)
DEMO_TRANSFORMER = TransformerParams(context_in_dim=DEMO_TEXT.width, hidden_size=64, num_heads=2, depth=2,
                                     depth_single_blocks=2, axes_dim=(8, 8, 8, 8))
DEMO_AUTOENCODER = AutoEncoderParams(ch=32, ch_mult=(1, 1, 2, 2))
DEMO_QWEN3 = {"vocab_size": 151936, "hidden_size": DEMO_TEXT_WIDTH, "intermediate_size": 64, "num_hidden_layers": 27,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 1_000_000.0,
              "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "tie_word_embeddings": True}
DEMO_SEED = 2026
DEMO_VARIANT = "klein-4b"      # whose sampling defaults --demo takes without --variant (its model is FLUX.2's)


def random_weights(shapes: dict[str, torch.Size], generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Matrices and conv kernels N(0, 1/fan_in); norm scales around 1; biases and BatchNorm stats small."""
    out = {}
    for key, shape in shapes.items():
        if key.endswith("num_batches_tracked"):
            out[key] = torch.zeros(shape, dtype=torch.int64)
        elif key.endswith("running_var"):
            out[key] = 0.5 + torch.rand(shape, generator=generator)
        elif len(shape) >= 2:
            out[key] = torch.randn(shape, generator=generator) / shape[1:].numel() ** 0.5
        elif key.endswith(("bias", "running_mean")):
            out[key] = 0.1 * torch.randn(shape, generator=generator)
        else:   # RMSNorm / GroupNorm scales
            out[key] = 1 + 0.1 * torch.randn(shape, generator=generator)
    return out


def _shapes(module: torch.nn.Module) -> dict[str, torch.Size]:
    return {k: v.shape for k, v in module.state_dict().items()}


def demo_transformer(device="cpu", generator: torch.Generator | None = None) -> Flux2Transformer:
    """Its weights are the first drawn from the demo's seed (``generator``: to draw them from and go on)."""
    g = generator or torch.Generator().manual_seed(DEMO_SEED)
    with torch.device("meta"):
        transformer = Flux2Transformer(DEMO_TRANSFORMER)
    transformer.load_state_dict(random_weights(_shapes(transformer), g), assign=True)
    return transformer.to(device).eval()


def demo_models(variant: str | None = None, device="cpu") -> Models:
    """``variant`` picks the sampling defaults (steps, CFG, KV) of that family."""
    from ..weights import default_device_dtype

    device, _ = default_device_dtype(device, torch.float32)      # an unusable device: a Flux2Error, not a traceback
    g = torch.Generator().manual_seed(DEMO_SEED)
    transformer = demo_transformer(device, g)
    with torch.device("meta"):
        ae = AutoEncoder(DEMO_AUTOENCODER)
        qwen_params = Qwen3Params.from_config(DEMO_QWEN3)
        qwen = Qwen3(qwen_params, qwen_params.num_layers)
    ae.load_state_dict(random_weights(_shapes(ae), g), assign=True)
    encoder = build_qwen3_encoder(random_weights(_shapes(qwen), g), config=qwen_params, device=device,
                                  dtype=torch.float32, spec=DEMO_TEXT)
    return Models(transformer, demo_variant(variant), ae.to(device).eval(), encoder)


def demo_variant(variant: str | None = None) -> Variant:
    chosen = VARIANTS[variant or DEMO_VARIANT]
    return replace(chosen, name=f"demo ({chosen.name} defaults)", params=DEMO_TRANSFORMER, files=(),
                   text_encoder=DEMO_TEXT)
