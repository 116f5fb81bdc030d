"""FLUX.2 Klein on a compact PyTorch engine: the public API.

    from flux2_core import generate, load_models

    models = load_models("flux-2-klein-4b.safetensors", "qwen_3_4b.safetensors", "flux2-vae.safetensors")
    result = generate(models, "a red fox in the snow", width=1024, height=768, seed=1)
    result.images          # uint8 [1, 768, 1024, 3]

The stages, one per node, compose into what ``generate`` does (``stages.py``): ``encode_prompt``, ``make_noise``,
``schedule``, ``encode_references``, ``encode_image``, ``denoise``, ``decode``.

Names are imported when first used, so ``import flux2_core`` (and ``python -m flux2_core --help``) stays quick.
"""

from __future__ import annotations

import importlib

# public name -> the module that holds it
API = {
    "load_models": "pipeline", "generate": "pipeline",
    "encode_prompt": "stages", "make_noise": "stages", "schedule": "stages", "encode_references": "stages",
    "encode_image": "stages", "denoise": "stages", "decode": "stages", "Models": "pipeline", "Result": "pipeline",
    "apply_adapters": "pipeline", "optimize_transformer": "pipeline",
    "load_transformer": "weights", "load_text_encoder": "weights", "load_autoencoder": "weights",
    "PromptUpsampler": "upsampler.model", "Flux2Error": "errors", "VARIANTS": "families", "BatchClient": "app.batch", "BatchJob": "app.batch_jobs",
}
__all__ = ["VARIANTS", "BatchClient", "BatchJob", "Flux2Error", "Models", "PromptUpsampler", "Result", "apply_adapters",
           "decode", "denoise", "encode_image", "encode_prompt", "encode_references", "generate", "load_autoencoder",
           "load_models", "load_text_encoder", "load_transformer", "make_noise", "optimize_transformer", "schedule"]


def __getattr__(name: str):
    if name not in API:
        raise AttributeError(f"module 'flux2_core' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{API[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *API})
