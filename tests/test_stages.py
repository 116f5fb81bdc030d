"""The stages as public API (flux2_core.stages, exported by flux2_core): their signatures are pinned, the README's
stage example runs as written, and the stages composed give generate's latents and images bit for bit on tiny
weights: FLUX.2 distilled with a reference, its base with CFG and a negative, image-to-image, FLUX 3 with boxes."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

import flux2_core
from flux2_core import pipeline
from tests.tiny.autoencoder import build_diffusers_autoencoder, save_bfl_autoencoder
from tests.tiny.text_encoder import build_tiny_qwen3, save_comfyui_text_encoder
from tests.tiny.transformer import TINY_TRANSFORMER, random_bfl_transformer_state_dict, save_bfl_transformer

ROOT = Path(__file__).resolve().parents[1]
SIGNATURES = {
    "encode_prompt": "(models, prompt: 'str', negative: 'str | None' = None, boxes=None) -> 'PromptEmbeds'",
    "make_noise": "(models, seed: 'int', width: 'int', height: 'int', batch: 'int' = 1, bfl_cuda_noise: 'bool' = "
                  "False) -> 'Tensor'",
    "schedule": "(models, width: 'int', height: 'int', steps: 'int | None' = None) -> 'list[float]'",
    "encode_references": "(models, images) -> 'ReferencePack'",
    "encode_image": "(models, image, width: 'int | None' = None, height: 'int | None' = None) -> 'Tensor'",
    "denoise": "(models, noise: 'Tensor', embeds: 'PromptEmbeds', sigmas: 'list[float]', *, cfg: 'float | None' = "
               "None, references: 'ReferencePack' = ReferencePack(tokens=None, ids=None, kv=None), start: 'Tensor | "
               "None' = None, strength: 'float' = 1.0, callback=None) -> 'Tensor'",
    "decode": "(models, latents: 'Tensor') -> 'Tensor'",
}
W, H = 64, 48


def test_the_stage_signatures_stay_as_published():
    assert {name: str(inspect.signature(getattr(flux2_core, name))) for name in SIGNATURES} == SIGNATURES
    assert set(SIGNATURES) <= set(flux2_core.__all__)


def picture(seed: int, size=(W, H)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def flux2_models(tmp_path: Path, name: str, encoder: str = "qwen_3_4b.safetensors",
                 ae: str = "flux2-vae.safetensors") -> pipeline.Models:
    return pipeline.load_models(
        save_bfl_transformer(random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=1), tmp_path / name),
        save_comfyui_text_encoder(build_tiny_qwen3(seed=2), tmp_path / encoder),
        save_bfl_autoencoder(build_diffusers_autoencoder(seed=3), tmp_path / ae), device="cpu", dtype=torch.float32)


def same(result: pipeline.Result, latents: torch.Tensor, images: torch.Tensor) -> None:
    assert torch.equal(result.latents, latents.float()) and torch.equal(result.images, images)


def test_the_readme_stage_example_equals_generate(tmp_path, monkeypatch):
    readme = (ROOT / "README.md").read_text()
    (example,) = [block for block in re.findall(r"```python\n(.*?)```", readme, re.DOTALL) if "encode_prompt" in block]
    monkeypatch.chdir(tmp_path)
    flux2_models(tmp_path, "flux-2-klein-4b.safetensors")          # writes the files the example names
    picture(5, (96, 64)).save(tmp_path / "fox.png")                # references: 64 px a side at least
    namespace = {}
    exec(compile(example.replace("1024", str(W)).replace("768", str(H)), "README.md", "exec"), namespace)  # noqa: S102
    models = namespace["models"]
    result = pipeline.generate(models, "the fox in a summer meadow", references=[Image.open("fox.png")], width=W,
                               height=H, seed=2)
    same(result, namespace["latents"], namespace["images"])


def test_cfg_with_a_negative_and_image_to_image_equal_generate(tmp_path):
    models = flux2_models(tmp_path, "flux-2-klein-base-tiny.safetensors")
    assert models.variant.uses_cfg
    prompt, negative, source = "a lighthouse at dusk", "blurry", picture(7)
    sigmas = flux2_core.schedule(models, W, H, steps=3)
    embeds = flux2_core.encode_prompt(models, prompt, negative)
    noise = flux2_core.make_noise(models, 4, W, H, batch=2)
    latents = flux2_core.denoise(models, noise, embeds, sigmas, cfg=3.0)
    same(pipeline.generate(models, prompt, negative=negative, width=W, height=H, steps=3, cfg=3.0, seed=4, batch=2),
         latents, flux2_core.decode(models, latents))

    start = flux2_core.encode_image(models, source, W, H)
    latents = flux2_core.denoise(models, noise[:1], embeds, sigmas, cfg=3.0, start=start, strength=0.6)
    same(pipeline.generate(models, prompt, negative=negative, width=W, height=H, steps=3, cfg=3.0, seed=4,
                           image=source, strength=0.6), latents, flux2_core.decode(models, latents))


def test_flux3_with_boxes_equals_generate(tmp_path):
    from tests.test_flux3 import flux3_files

    _, state, te, ae = flux3_files(tmp_path, flow_map=True)
    transformer = tmp_path / "flux3-image-klein-tiny.safetensors"
    save_file(state, str(transformer))
    models = pipeline.load_models(transformer, te, ae, device="cpu", dtype=torch.float32)
    boxes = [{"desc": "a red kite", "bbox": [0.1, 0.05, 0.6, 0.4]}]
    embeds = flux2_core.encode_prompt(models, "a beach", boxes=boxes)
    noise = flux2_core.make_noise(models, 9, W, H)
    latents = flux2_core.denoise(models, noise, embeds, flux2_core.schedule(models, W, H))
    same(pipeline.generate(models, "a beach", boxes=boxes, width=W, height=H, seed=9), latents,
         flux2_core.decode(models, latents))
    with pytest.raises(flux2_core.Flux2Error, match="boxes"):               # FLUX.2 takes no boxes, as in generate
        flux2_core.encode_prompt(flux2_models(tmp_path, "flux-2-klein-4b.safetensors"), "a beach", boxes=boxes)


def test_cfg_without_a_negative_is_refused_with_what_to_encode(tmp_path):
    """A CFG model's denoise needs the negative's row: embeddings of the prompt alone are refused before any step,
    with the call that makes them; cfg=1 runs unguided."""
    models = flux2_models(tmp_path, "flux-2-klein-base-tiny.safetensors")
    embeds = flux2_core.encode_prompt(models, "a lighthouse")
    noise, sigmas = flux2_core.make_noise(models, 1, W, H), flux2_core.schedule(models, W, H, steps=2)
    with pytest.raises(flux2_core.Flux2Error, match=r'no negative prompt: encode one \(encode_prompt\(models, prompt, ""\)'):
        flux2_core.denoise(models, noise, embeds, sigmas)
    assert flux2_core.denoise(models, noise, embeds, sigmas, cfg=1.0).shape == noise.shape
