"""End to end, prompt to uint8 image, against diffusers 0.42.1 Flux2KleinPipeline (distilled and base) and
Flux2KleinKVPipeline on the same tiny random Qwen3, transformer and VAE, fed the same noise: final float32 latents
within 1e-4 relative, uint8 images within one level (diffusers rounds, the reference truncates).

Ours runs as ``load_models`` sets it up, in the device mode's dtype and device (``tests/device.py``: transformer and
text encoder in DTYPE, AE in float32); diffusers runs in float32 on the same device, with the bounds of the mode."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from flux2_core import pipeline
from flux2_core.errors import Flux2Error
from flux2_core.families import VARIANTS
from flux2_core.families.flux2 import FLUX2
from flux2_core.families.flux2.transformer import Flux2Transformer, TransformerParams
from flux2_core.families.flux2.variants import QWEN3_4B
from flux2_core.models import rope
from flux2_core.models.autoencoder import AutoEncoder
from flux2_core.models.text_encoder import build_qwen3_encoder
from flux2_core.models.tokenizer import build_qwen3_tokenizer
from flux2_core.pipeline import Models, generate
from flux2_core.runtime import memory
from flux2_core.runtime.cache import PromptCache, ReferenceKVCache
from flux2_core.sampling.euler import make_noise
from flux2_core.sampling.references import image_to_tensor
from flux2_core.stages import to_uint8
from tests.device import DEVICE, DTYPE, assert_close, image_levels, relative_error, to, tolerance
from tests.tiny.autoencoder import TINY_AE_PARAMS, bfl_state_dict, build_diffusers_autoencoder, save_bfl_autoencoder
from tests.tiny.text_encoder import build_tiny_qwen3, comfyui_state_dict, save_comfyui_text_encoder
from tests.tiny.transformer import (
    TINY_TRANSFORMER,
    diffusers_transformer_from_bfl_file,
    random_bfl_transformer_state_dict,
    save_bfl_transformer,
)

PROMPT = "A cat holding a sign that says hello world"
FAMILIES = {"distilled": "klein-4b", "base": "klein-base-4b", "kv": "klein-9b-kv"}


def tiny_variant(family):
    """The registry entry of the family (defaults, CFG, KV) with the tiny architecture."""
    return replace(VARIANTS[FAMILIES[family]], name=f"tiny-{family}", params=TINY_TRANSFORMER, files=())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline")
    sd = random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=3)
    transformer = Flux2Transformer(TINY_TRANSFORMER)
    transformer.load_state_dict(sd)
    vae = build_diffusers_autoencoder(seed=4)
    ae = AutoEncoder(TINY_AE_PARAMS)
    ae.load_state_dict(bfl_state_dict(vae))
    te = build_tiny_qwen3(seed=5)
    encoder = build_qwen3_encoder(comfyui_state_dict(te), config=te.config, device=DEVICE, dtype=DTYPE, spec=QWEN3_4B)
    prompts = PromptCache()          # shared: each distinct prompt is encoded once (the tiny Qwen3 is the slow part)
    transformer, ae = to(transformer).eval(), ae.to(DEVICE).eval()
    ours = {family: Models(transformer, tiny_variant(family), ae, encoder, prompt_cache=prompts)
            for family in FAMILIES}
    theirs = {"transformer": diffusers_transformer_from_bfl_file(save_bfl_transformer(sd, tmp / "t.safetensors"),
                                                                 TINY_TRANSFORMER, tmp / "cfg").to(DEVICE),
              "vae": vae.to(DEVICE), "text_encoder": te.to(DEVICE), "tokenizer": build_qwen3_tokenizer()}
    return ours, theirs


DIFFUSERS_EMBEDS = {}


def diffusers_embeds(pipe, prompt):
    """diffusers' own prompt embeddings (encode_prompt), computed once per prompt."""
    if prompt not in DIFFUSERS_EMBEDS:
        DIFFUSERS_EMBEDS[prompt] = pipe.encode_prompt(prompt=prompt, device=DEVICE, max_sequence_length=512)[0]
    return DIFFUSERS_EMBEDS[prompt]


def photo(w, h, seed):
    """A smooth random image (a low-resolution noise field upscaled), more photo-like than white noise."""
    rng = np.random.default_rng(seed)
    small = Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8))
    return small.resize((w, h), Image.Resampling.BICUBIC)


def run_diffusers(theirs, kind, noise, width, height, steps, cfg=1.0, images=None):
    """(final normalised latents [B,128,h,w], float images [B,3,H,W] in [0,1]) from the diffusers pipeline."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinKVPipeline, Flux2KleinPipeline
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type="exponential")
    last = {}

    def grab(pipe, i, t, kwargs):
        last["latents"] = kwargs["latents"].clone()
        return {}

    if kind == "kv":
        pipe = Flux2KleinKVPipeline(scheduler=scheduler, **theirs)
        extra = {}
    else:
        pipe = Flux2KleinPipeline(scheduler=scheduler, **theirs, is_distilled=kind == "distilled")
        extra = {"guidance_scale": cfg}
        if kind == "base" and cfg > 1:
            extra["negative_prompt_embeds"] = diffusers_embeds(pipe, "")
    pipe.set_progress_bar_config(disable=True)
    images = pipe(image=images, prompt_embeds=diffusers_embeds(pipe, PROMPT), height=height, width=width,
                  num_inference_steps=steps, latents=noise.to(DEVICE), num_images_per_prompt=noise.shape[0],
                  output_type="pt", callback_on_step_end=grab, **extra).images
    b, _, h, w = noise.shape
    return last["latents"].transpose(1, 2).reshape(b, 128, h, w), images


def check_against_diffusers(result, expected_latents, expected_images):
    err = relative_error(result.latents, expected_latents)
    print(f"latents: max rel diff {err:.2e}")
    assert err <= tolerance("denoise"), f"latents: max rel diff {err:.3g}"
    rounded = (expected_images.permute(0, 2, 3, 1) * 255).round().to(torch.int16).cpu()
    levels = (result.images.to(torch.int16) - rounded).abs().max().item()
    assert result.images.dtype == torch.uint8 and result.images.shape == rounded.shape
    if image_levels() is not None:
        assert levels <= image_levels(), f"uint8 images differ by {levels} levels"
    return err, levels


CASES = {
    # name: (family, width, height, steps, cfg, batch, reference sizes)
    "distilled": ("distilled", 64, 48, 4, None, 2, []),
    "base-cfg4": ("base", 48, 48, 3, 4.0, 1, []),
    "one-reference": ("distilled", 48, 64, 3, None, 1, [(96, 80)]),
    "three-references": ("distilled", 64, 64, 3, None, 1, [(96, 80), (64, 128), (150, 70)]),
    "kv-references": ("kv", 64, 48, 4, None, 1, [(80, 80), (64, 96)]),
    "base-cfg-reference": ("base", 48, 48, 2, 3.0, 1, [(64, 80)]),
}


@pytest.mark.parametrize("name", CASES)
def test_matches_diffusers(tiny, name):
    ours, theirs = tiny
    family, width, height, steps, cfg, batch, ref_sizes = CASES[name]
    refs = [photo(w, h, seed=i) for i, (w, h) in enumerate(ref_sizes)]
    noise = make_noise(batch, height, width, seed=42)
    expected = run_diffusers(theirs, family, noise, width, height, steps, cfg or 1.0, refs or None)
    result = generate(ours[family], PROMPT, references=refs, width=width, height=height, steps=steps, cfg=cfg,
                      seed=42, batch=batch)
    check_against_diffusers(result, *expected)
    assert result.settings["steps"] == steps and result.settings["references"] == len(refs)


def test_batch_equals_single_runs(tiny):
    models = tiny[0]["base"]
    args = {"width": 48, "height": 32, "steps": 1, "cfg": 2.5, "negative": "blurry"}
    batch = generate(models, PROMPT, seed=7, batch=3, **args)
    assert batch.seeds == [7, 8, 9]
    for i in range(3):
        single = generate(models, PROMPT, seed=7 + i, **args)
        assert_close(batch.latents[i:i + 1], single.latents, "transformer", rtol=0, atol=1e-5)   # 1 step
        if image_levels() is not None:
            assert (batch.images[i].int() - single.images[0].int()).abs().max() <= image_levels()


def test_negative_prompt_is_used(tiny):
    models = tiny[0]["base"]
    args = {"width": 32, "height": 32, "steps": 2, "cfg": 4.0, "seed": 1}
    empty = generate(models, PROMPT, **args)
    other = generate(models, PROMPT, negative="ugly", **args)
    assert (empty.latents - other.latents).abs().max() > max(1e-3, tolerance("transformer"))
    assert other.settings["negative"] == "ugly"


def test_size_defaults_to_first_reference(tiny):
    models = tiny[0]["distilled"]
    result = generate(models, PROMPT, references=[photo(100, 70, 0), photo(64, 64, 1)], steps=1)
    assert result.images.shape == (1, 64, 96, 3)          # 100x70 cropped to 96x64
    assert (result.settings["width"], result.settings["height"]) == (96, 64)


def test_image_to_image_matches_diffusers_inpainting_with_a_full_mask(tiny):
    # Flux2KleinInpaintPipeline with an all-white mask repaints everything, and it also passes the image as a
    # reference: image-to-image at the same strength with the image as the reference
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinInpaintPipeline
    ours, theirs = tiny
    image = photo(80, 64, seed=9)
    pipe = Flux2KleinInpaintPipeline(FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True,
                                                                     time_shift_type="exponential"),
                                     **theirs, is_distilled=True)
    pipe.set_progress_bar_config(disable=True)
    for strength, steps_run in [(0.5, 2), (0.6, 3)]:   # 4 steps; skip int(4 - 4 * strength)
        last = {}
        expected = pipe(image=image, mask_image=Image.new("L", image.size, 255), height=64, width=80,
                        prompt_embeds=diffusers_embeds(pipe, PROMPT), strength=strength, num_inference_steps=4,
                        generator=torch.Generator().manual_seed(3), output_type="pt",
                        callback_on_step_end=lambda p, i, t, kw, last=last: last.update(kw) or {}).images
        result = generate(ours["distilled"], PROMPT, image=image, references=[image], strength=strength, steps=4,
                          seed=3)
        assert result.settings["steps"] == steps_run and result.settings["strength"] == strength
        check_against_diffusers(result, last["latents"].transpose(1, 2).reshape(1, 128, 4, 5), expected)
    # strength 1 ignores the image: plain text-to-image
    full = generate(ours["distilled"], PROMPT, image=image, strength=1.0, steps=4, seed=3)
    t2i = generate(ours["distilled"], PROMPT, width=80, height=64, steps=4, seed=3)
    assert_close(full.latents, t2i.latents, "denoise", rtol=0, atol=1e-6)


def box_mask(size, box) -> Image.Image:
    """A black-and-white mask of ``size`` (W, H): white (repaint) in the ``box`` (left, top, right, bottom)."""
    mask = Image.new("L", size, 0)
    mask.paste(255, box)
    return mask


# (20, 8, 56, 40) on an 80x64 image: its edges cross the centre pixels of some 16-pixel cells, so the mask on the
# latent grid holds 0, 0.5 and 1 (a soft edge even from a hard mask)
INPAINT_CASES = {
    # name: (family, cfg, strength, steps, reference size)
    "distilled": ("distilled", None, 0.6, 4, None),
    "distilled-full-strength": ("distilled", None, 1.0, 3, None),
    "base-cfg": ("base", 3.0, 0.8, 3, None),
    "distilled-reference": ("distilled", None, 0.75, 4, (96, 64)),
}


@pytest.mark.parametrize("name", INPAINT_CASES)
def test_inpainting_matches_diffusers(tiny, name):
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinInpaintPipeline
    ours, theirs = tiny
    family, cfg, strength, steps, ref_size = INPAINT_CASES[name]
    image, mask = photo(80, 64, seed=9), box_mask((80, 64), (20, 8, 56, 40))
    reference = photo(*ref_size, seed=11) if ref_size else None
    pipe = Flux2KleinInpaintPipeline(FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True,
                                                                     time_shift_type="exponential"),
                                     **theirs, is_distilled=family == "distilled")
    pipe.set_progress_bar_config(disable=True)
    extra = {"negative_prompt_embeds": diffusers_embeds(pipe, "")} if cfg else {}
    last = {}
    expected = pipe(image=image, mask_image=mask, image_reference=reference, height=64, width=80,
                    prompt_embeds=diffusers_embeds(pipe, PROMPT), strength=strength, num_inference_steps=steps,
                    guidance_scale=cfg or 1.0, generator=torch.Generator().manual_seed(3), output_type="pt",
                    callback_on_step_end=lambda p, i, t, kw: last.update(kw) or {}, **extra).images
    result = generate(ours[family], PROMPT, image=image, mask=mask, references=[reference] if reference else [],
                      strength=strength, steps=steps, cfg=cfg, seed=3)
    assert result.settings["mask"] and result.settings["steps"] == steps - int(steps - steps * strength)
    check_against_diffusers(result, last["latents"].transpose(1, 2).reshape(1, 128, 4, 5), expected)


def test_kv_inpainting_matches_diffusers_kv_with_the_inpainting_blend(tiny):
    # diffusers has no KV inpainting pipeline: the expectation is Flux2KleinKVPipeline with the source as its
    # reference, started from the noise (strength 1), and the inpainting pipeline's blend applied after each step
    # through its step callback: x <- (1 - m) * ((1 - s') x0 + s' eps) + m * x at the next sigma s' (x0 after the last)
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinKVPipeline
    ours, theirs = tiny
    image, mask = photo(80, 64, seed=9), box_mask((80, 64), (20, 8, 56, 40))
    noise = make_noise(1, 64, 80, seed=5)
    source = ours["kv"].autoencoder.encode(image_to_tensor(image).to(DEVICE)).float()
    m = torch.nn.functional.interpolate(torch.from_numpy(np.asarray(mask) / 255.0).float()[None, None], size=(4, 5),
                                        mode="bilinear").to(DEVICE)
    pipe = Flux2KleinKVPipeline(scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True,
                                                                          time_shift_type="exponential"), **theirs)
    pipe.set_progress_bar_config(disable=True)

    last = {}

    def blend(p, i, t, kwargs):
        s = p.scheduler.sigmas[i + 1].item()
        kept, mask_tokens = rope.pack((1 - s) * source + s * noise.to(DEVICE)), rope.pack(m)
        last["latents"] = (1 - mask_tokens) * kept + mask_tokens * kwargs["latents"]
        return {"latents": last["latents"]}

    expected = pipe(image=[image], prompt_embeds=diffusers_embeds(pipe, PROMPT), height=64, width=80,
                    num_inference_steps=3, latents=noise.to(DEVICE), output_type="pt", callback_on_step_end=blend
                    ).images
    result = generate(ours["kv"], PROMPT, image=image, mask=mask, steps=3, seed=5)
    check_against_diffusers(result, last["latents"].transpose(1, 2).reshape(1, 128, 4, 5), expected)


def test_inpainting_keeps_the_source_latent_outside_the_mask(tiny):
    models = tiny[0]["distilled"]
    image = photo(80, 64, seed=9)
    result = generate(models, PROMPT, image=image, mask=box_mask((80, 64), (16, 16, 48, 48)), strength=0.8,
                      steps=3, seed=1)
    source = models.autoencoder.encode(image_to_tensor(image).to(DEVICE)).float().cpu()
    keep = torch.ones(4, 5, dtype=torch.bool)
    keep[1:3, 1:3] = False                                    # the 2x2 cells under the box
    assert torch.equal(result.latents[0][:, keep], source[0][:, keep])          # exactly: blended to x0 at sigma 0
    assert (result.latents[0][:, ~keep] - source[0][:, ~keep]).abs().max() > 1e-2    # and repainted inside


def test_an_empty_mask_gives_the_source_back_and_says_so(tiny):
    models = tiny[0]["distilled"]
    image = photo(64, 48, seed=2)
    result = generate(models, PROMPT, image=image, mask=Image.new("L", (64, 48), 0), strength=0.5, steps=2, seed=1)
    source = models.autoencoder.encode(image_to_tensor(image).to(DEVICE)).float().cpu()
    assert torch.equal(result.latents, source)
    assert any("mask is empty" in w for w in result.warnings)


def test_inpainting_a_batch_equals_single_runs(tiny):
    models = tiny[0]["distilled"]
    args = {"image": photo(64, 48, seed=2), "mask": box_mask((64, 48), (0, 0, 32, 48)), "strength": 0.7, "steps": 2}
    batch = generate(models, PROMPT, seed=4, batch=2, **args)
    for i in range(2):
        single = generate(models, PROMPT, seed=4 + i, **args)
        assert_close(batch.latents[i:i + 1], single.latents, "transformer", rtol=0, atol=1e-5)


def test_a_mask_of_the_same_shape_is_resized_with_a_note(tiny):
    models = tiny[0]["distilled"]
    image = photo(64, 48, seed=2)
    small = generate(models, PROMPT, image=image, mask=box_mask((32, 24), (0, 0, 16, 24)), steps=1, seed=1)
    full = generate(models, PROMPT, image=image, mask=box_mask((64, 48), (0, 0, 32, 48)), steps=1, seed=1)
    assert any("resized" in w for w in small.warnings) and not any("resized" in w for w in full.warnings)
    assert torch.equal(small.latents, full.latents)


@pytest.mark.parametrize("kwargs,message", [
    ({"mask": Image.new("L", (64, 48), 255)}, "needs the image it masks"),
    ({"image": Image.new("RGB", (64, 48)), "mask": Image.new("L", (48, 64), 255)}, "another shape"),
    ({"image": Image.new("RGB", (64, 48)), "mask": Image.new("L", (64, 48), 255), "strength": 0.0}, "strength"),
])
def test_bad_inpainting_inputs(tiny, kwargs, message):
    with pytest.raises(Flux2Error, match=message):
        generate(tiny[0]["distilled"], PROMPT, **kwargs)


def test_custom_sigmas(tiny):
    models = tiny[0]["distilled"]
    result = generate(models, PROMPT, width=32, height=32, sigmas=[1.0, 0.6, 0.0])
    assert result.settings["steps"] == 2 and result.settings["sigmas"] == [1.0, 0.6, 0.0]


def test_to_uint8_truncates():
    x = torch.tensor([-2.0, -1.0, 0.0, 0.999, 1.0, 3.0]).view(1, 3, 1, 2)
    # 127.5 * (clamp(x) + 1): 0, 0, 127.5 -> 127, 254.87 -> 254, 255, 255
    assert to_uint8(x).flatten().tolist() == [0, 127, 255, 0, 254, 255]


@pytest.mark.parametrize("kwargs,message", [
    ({"width": 50, "height": 64}, "multiple of 16"),
    ({"width": 64, "height": 64, "steps": 0}, "steps"),
    ({"references": [Image.new("RGB", (40, 200))]}, "at least 64"),
    ({"references": [Image.new("RGB", (64, 900))]}, "aspect ratio"),
    ({"width": 64, "height": 64, "sigmas": [0.0, 1.0]}, "decrease"),
    ({"image": Image.new("RGB", (64, 64)), "strength": 0.0}, "strength"),
])
def test_bad_inputs(tiny, kwargs, message):
    with pytest.raises(Flux2Error, match=message):
        generate(tiny[0]["distilled"], PROMPT, **kwargs)


def test_distilled_ignores_cfg_with_a_warning(tiny):
    models = tiny[0]["distilled"]
    a = generate(models, PROMPT, width=32, height=32, steps=1, cfg=5.0)
    b = generate(models, PROMPT, width=32, height=32, steps=1)
    assert torch.equal(a.latents, b.latents) and any("ignored" in w for w in a.warnings)


def test_kv_uses_a_precomputed_cache(tiny):
    models = tiny[0]["kv"]
    refs = [photo(64, 64, 2)]
    first = generate(models, PROMPT, references=refs, width=32, height=32, steps=2)
    from flux2_core.sampling.references import encode_references
    ref, ref_ids = encode_references(models.autoencoder, refs, None, ids=FLUX2.reference_ids, fit=FLUX2.references)
    cache = models.transformer.reference_kv(ref.to(DTYPE), ref_ids)
    again = generate(models, PROMPT, references=refs, width=32, height=32, steps=2, reference_kv=cache)
    assert torch.equal(first.latents, again.latents)
    joint = generate(replace(models, variant=tiny[0]["distilled"].variant), PROMPT, references=refs, width=32,
                     height=32, steps=2)
    assert not torch.equal(first.latents, joint.latents)


def test_bf16_transformer_follows_the_reference_dtypes(tiny):
    """A bf16 transformer: the model sees bf16 sigmas and bf16 tokens, the AE stays float32; the result stays close
    to the run with a float32 transformer."""
    import copy
    base = tiny[0]["base"]
    models = replace(base, transformer=copy.deepcopy(base.transformer).float())
    half = replace(base, transformer=copy.deepcopy(base.transformer).to(torch.bfloat16))
    seen = []
    hook = half.transformer.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append((args[0].dtype, args[2].dtype, kwargs["ref"].dtype)), with_kwargs=True)
    args = {"references": [photo(64, 64, 1)], "width": 32, "height": 32, "steps": 2, "cfg": 2.0, "seed": 4}
    try:
        low = generate(half, PROMPT, **args)
    finally:
        hook.remove()
    assert seen == [(torch.bfloat16,) * 3] * 2
    full = generate(models, PROMPT, **args)
    assert low.latents.dtype == torch.float32
    assert (low.latents - full.latents).abs().max() <= 0.05 * full.latents.abs().max()


# --- caches and text-encoder offload --------------------------------------------------------------------------------

def counting(monkeypatch, obj, name: str) -> list:
    """Wrap ``obj.name`` (a method) so every call is recorded; returns the list of calls' first arguments."""
    calls, original = [], getattr(obj, name)

    def wrapper(*args, **kwargs):
        calls.append(args[0] if args else None)
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapper)
    return calls


def test_repeated_prompts_skip_the_text_encoder(tiny, monkeypatch):
    base = tiny[0]["base"]
    cached = replace(base, prompt_cache=PromptCache())
    uncached = replace(base, prompt_cache=None)
    encodes = counting(monkeypatch, base.prompt_encoder, "encode")
    args = {"width": 32, "height": 32, "steps": 2, "cfg": 3.0, "negative": ""}

    first = generate(cached, PROMPT, seed=1, **args)
    assert encodes == [[PROMPT, ""]]                        # prompt and negative in one batch
    second = generate(cached, PROMPT, seed=2, **args)       # a new seed: no encoder run at all
    third = generate(cached, "a dog", seed=2, **args)       # a new prompt: only it is encoded, the negative is kept
    assert encodes == [[PROMPT, ""], ["a dog"]]

    for result, prompt, seed in [(first, PROMPT, 1), (second, PROMPT, 2), (third, "a dog", 2)]:
        assert torch.equal(result.latents, generate(uncached, prompt, seed=seed, **args).latents)
    assert len(encodes) == 5                                # the uncached runs encode every time


def test_load_models_precomputes_the_empty_negative_of_cfg_models(tiny, tmp_path, monkeypatch):
    sd = random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=3)
    files = [save_bfl_transformer(sd, tmp_path / "flux-2-klein-base-tiny.safetensors"),
             save_comfyui_text_encoder(build_tiny_qwen3(seed=5), tmp_path / "qwen_3_tiny.safetensors"),
             save_bfl_autoencoder(build_diffusers_autoencoder(seed=4), tmp_path / "ae.safetensors")]
    models = pipeline.load_models(*files, device=DEVICE, dtype=DTYPE)
    assert models.variant.uses_cfg and len(models.prompt_cache.cache) == 1     # the empty negative, encoded
    encodes = counting(monkeypatch, models.prompt_encoder, "encode")
    result = generate(models, PROMPT, width=32, height=32, steps=1, cfg=4.0, seed=1)
    assert encodes == [[PROMPT]]
    same = generate(tiny[0]["base"], PROMPT, width=32, height=32, steps=1, cfg=4.0, seed=1)   # same weights
    assert_close(result.latents, same.latents, "transformer", rtol=0, atol=1e-5)   # 1 step


def test_repeated_kv_edit_skips_the_reference_encode_and_pass(tiny, monkeypatch):
    kv = tiny[0]["kv"]
    cached = replace(kv, reference_cache=ReferenceKVCache())
    uncached = replace(kv, reference_cache=None)
    passes = counting(monkeypatch, kv.transformer, "reference_kv")
    encodes = counting(monkeypatch, kv.autoencoder, "encode")
    refs = [photo(64, 64, 2), photo(80, 64, 3)]
    args = {"references": refs, "width": 32, "height": 32, "steps": 2}

    first = generate(cached, PROMPT, seed=1, **args)
    assert (len(passes), len(encodes)) == (1, 2)
    second = generate(cached, "make it night", seed=2, **args)       # new prompt and seed, same references
    assert (len(passes), len(encodes)) == (1, 2)                    # no AE encode, no reference pass
    other = generate(cached, PROMPT, seed=1, references=[refs[1], refs[0]], width=32, height=32, steps=2)
    assert (len(passes), len(encodes)) == (2, 4)                    # other references (order matters): computed

    assert torch.equal(first.latents, generate(uncached, PROMPT, seed=1, **args).latents)
    assert torch.equal(second.latents, generate(uncached, "make it night", seed=2, **args).latents)
    assert not torch.equal(other.latents, first.latents)
    assert (len(passes), len(encodes)) == (4, 8)                    # the uncached runs pay every time


CUDA = torch.device("cuda")    # only a name here: the memory query is faked, nothing runs on it


@pytest.mark.parametrize("choice,encoder_on_device,free,needed,expected", [
    (True, True, 1 << 40, 0, True),              # asked: always
    (False, True, 0, 1 << 40, False),            # asked not to: never
    ("auto", True, 900, 800, False),             # enough free memory
    ("auto", True, 700, 800, True),              # short
    ("auto", False, 1000, 1000, True),           # the encoder (100 bytes) now sits on the CPU: 1000 - 100 < 1000
    ("auto", False, 1100, 1000, False),          # 1100 - 100 >= 1000: it may stay on the device
    ("auto", True, None, 1, False),              # unknown free memory: keep it
])
def test_offload_decision(tiny, choice, encoder_on_device, free, needed, expected):
    fake = type("Encoder", (), {"device": CUDA if encoder_on_device else torch.device("cpu"),
                                "model": torch.nn.Linear(5, 5, bias=False)})()     # 25 float32 = 100 bytes
    asked = []
    decision = memory.should_offload(choice, fake, CUDA, needed, free=lambda d: asked.append(d) or free)
    assert decision is expected
    assert asked == ([CUDA] if choice == "auto" else [])
    # on the CPU "auto" never offloads (there is nowhere to offload to), whatever the free memory
    assert memory.should_offload("auto", fake, torch.device("cpu"), 1 << 60, free=lambda d: 0) is False
    with pytest.raises(Flux2Error, match="offload_encoder"):
        memory.should_offload("sometimes", fake, CUDA, 0)


def test_offloaded_encoder_visits_the_device_only_on_a_cache_miss(tiny, monkeypatch):
    """The encoder rests on the CPU and is moved to the device only to encode a prompt the cache lacks. The moves
    are recorded, not made (there is no GPU here), so the encoder really runs on the CPU."""
    encoder = tiny[0]["base"].prompt_encoder
    moves = []
    monkeypatch.setattr(encoder.model, "to", lambda device: moves.append(device) or encoder.model)
    cache, cpu = PromptCache(), torch.device("cpu")

    def encode(prompts):
        return cache.encode(pipeline.EncoderOnCall(encoder, CUDA, cpu), prompts)

    first = encode(["a fox"])
    assert moves == [cpu, CUDA, cpu]                        # rest, visit the device to encode, rest again
    again = encode(["a fox"])
    assert moves == [cpu, CUDA, cpu, cpu]                   # a hit: it stays on the CPU
    assert torch.equal(first.embeds, again.embeds)
    encode(["a fox", "a cat"])
    assert moves[4:] == [cpu, CUDA, cpu]                    # a miss: one visit for the new prompt


def test_offload_gives_the_same_images(tiny):
    models = replace(tiny[0]["distilled"], prompt_cache=None)
    args = {"width": 32, "height": 32, "steps": 1, "seed": 5}
    assert torch.equal(generate(models, PROMPT, offload_encoder=True, **args).latents,
                       generate(models, PROMPT, offload_encoder=False, **args).latents)


@pytest.mark.parametrize("free,swapped", [(10 ** 9, False), (1000, True), (None, False)])
def test_transformer_steps_aside_while_an_encoder_that_does_not_fit_beside_it_encodes(tiny, monkeypatch, free, swapped):
    """Klein 9B on a 24 GB card: the offloaded encoder (16 GB) cannot visit while the transformer (18 GB) is there,
    so the transformer waits on the CPU during the encode. The moves are recorded, not made (no GPU here)."""
    models = tiny[0]["distilled"]
    moves, cpu = [], torch.device("cpu")
    for name, module in [("encoder", models.prompt_encoder.model), ("transformer", models.transformer)]:
        monkeypatch.setattr(module, "to", lambda device, name=name, module=module: moves.append((name, device)) or module)
    asked = []
    on_call = pipeline.EncoderOnCall(models.prompt_encoder, CUDA, cpu, aside=models.transformer,
                                     free=lambda d: asked.append(d) or free)
    moves.clear()
    embeds = on_call.encode([PROMPT])
    visit = [("encoder", CUDA), ("encoder", cpu)]
    assert moves == ([("transformer", cpu), *visit, ("transformer", CUDA)] if swapped else visit)
    assert asked == [CUDA]
    assert torch.equal(embeds.embeds, models.prompt_encoder.encode([PROMPT]).embeds)
    # an encoder that rests on the device never asks the transformer to move
    moves.clear()
    pipeline.EncoderOnCall(models.prompt_encoder, CUDA, CUDA, aside=models.transformer, free=lambda d: 0).encode([PROMPT])
    assert [m for m in moves if m[0] == "transformer"] == []


@pytest.mark.parametrize("choice,free,on_device", [(True, 10 ** 12, False), (False, 0, True),
                                                   ("auto", 10 ** 12, True), ("auto", 10 ** 6, False)])
def test_load_models_loads_the_text_encoder_where_it_will_rest(tmp_path, monkeypatch, choice, free, on_device):
    """On CUDA the encoder is read into CPU memory and moved to the device only if it is to rest there: an offloaded
    encoder never takes device memory (the CLI used to load it onto the GPU first, so 9B could not start on 24 GB).
    The transformer is made to look as if it were on CUDA; the memory query is faked and the moves recorded."""
    from types import SimpleNamespace

    from flux2_core import weights

    files = [save_bfl_transformer(random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=3),
                                  tmp_path / "flux-2-klein-tiny.safetensors"),
             save_comfyui_text_encoder(build_tiny_qwen3(seed=5), tmp_path / "qwen_3_tiny.safetensors"),
             save_bfl_autoencoder(build_diffusers_autoencoder(seed=4), tmp_path / "ae.safetensors")]
    real_transformer, real_encoder, real_ae = weights.load_transformer, weights.load_text_encoder, weights.load_autoencoder
    loaded_to, moves = [], []

    def on_cuda(path, device, dtype, **kwargs):                     # asked for CUDA, built on the CPU
        _, variant = real_transformer(path, "cpu", dtype, **kwargs)
        return SimpleNamespace(device=CUDA, dtype=torch.float32, modules=lambda: iter(()),
                               named_modules=lambda: iter(())), variant

    def encoder_at(path, device, dtype, spec=None):
        loaded_to.append(torch.device(device))
        encoder = real_encoder(path, device, dtype, spec=spec)
        monkeypatch.setattr(encoder.model, "to", lambda d: moves.append(torch.device(d)) or encoder.model)
        return encoder

    monkeypatch.setattr(weights, "load_transformer", on_cuda)
    monkeypatch.setattr(weights, "load_text_encoder", encoder_at)
    monkeypatch.setattr(weights, "load_autoencoder", lambda path, device, dtype, **kw: real_ae(path, "cpu", dtype, **kw))
    monkeypatch.setattr(memory, "free_memory", lambda device: free)
    models = pipeline.load_models(*files, device="cuda", dtype=torch.float32, offload_encoder=choice)
    assert loaded_to == [torch.device("cpu")]
    assert moves == ([CUDA] if on_device else [])
    assert models.prompt_encoder is not None


# hidden 256 with Klein's head_dim (128) and mlp_ratio (3); two single blocks, as the peak needs one before it.
MEMORY_PARAMS = TransformerParams(in_channels=128, context_in_dim=96, hidden_size=256, num_heads=2, depth=1,
                                  depth_single_blocks=2, mlp_ratio=3.0, axes_dim=(32, 32, 32, 32), theta=2000)


def forward_peak(forward, device: torch.device) -> int:
    """The peak memory ``forward()`` allocates beyond what exists before it, in bytes, after one warm-up call (cuBLAS
    takes its workspace from the allocator on first use). On CUDA from the allocator's peak; on the CPU from the
    profiler's timeline (tests/memory.py) with one thread: the CPU flash-attention kernel keeps about 0.1-1 MB of
    scratch per thread (seen: +1.4 MB with 16 threads at 320 tokens, +10-13 MB at 1088), independent of the token
    count, which at these tiny sizes would rival the activations themselves and is not part of the estimate."""
    from tests.memory import peak_bytes

    forward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        forward()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return peak_bytes(forward)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("batch,n_txt,grid,dtype", [(1, 64, (16, 16), torch.float32), (2, 32, (16, 32), torch.float32),
                                                    (1, 64, (32, 32), torch.bfloat16)])
def test_denoise_memory_covers_the_measured_forward_peak(batch, n_txt, grid, dtype):
    """The transformer forward's peak activation memory (inputs and weights excluded), measured on the CPU and, in
    the CUDA device mode, on the GPU too, is at most ``denoise_memory`` and not far below it (within 1.5x)."""
    g = torch.Generator().manual_seed(0)
    model = Flux2Transformer(MEMORY_PARAMS).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=g))
    h, w = grid
    img = torch.randn(batch, h * w, 128, generator=g)
    txt = torch.randn(batch, n_txt, 96, generator=g)
    img_ids, txt_ids = rope.image_ids(batch, h, w), rope.text_ids(batch, n_txt)
    estimate = memory.denoise_memory(MEMORY_PARAMS, n_txt + h * w, batch, dtype)
    for device in {torch.device("cpu"), DEVICE}:
        model.to(device, dtype)
        inputs = [t.to(device) for t in (img, img_ids, torch.full((batch,), 0.5), txt, txt_ids)]
        inputs = [t.to(dtype) if t.is_floating_point() else t for t in inputs]
        with torch.no_grad():
            peak = forward_peak(lambda args=inputs: model(*args), device)
        scratch = matmul_scratch(MEMORY_PARAMS, batch * (n_txt + h * w), dtype, device)
        print(f"denoise_memory on {device}: measured {peak / 1e6:.2f} MB, estimate {estimate / 1e6:.2f} MB, "
              f"matmul scratch {scratch / 1e6:.2f} MB")
        assert peak <= estimate + scratch and estimate <= 1.5 * peak, (device, peak, estimate, scratch)


def matmul_scratch(params: TransformerParams, tokens: int, dtype: torch.dtype, device: torch.device) -> int:
    """What the widest linear of a single block (linear1, [tokens, H] -> [tokens, 3H + 2M]) allocates beside its
    output, measured: 0 on GPUs and on CPUs with bf16 matmul instructions, but a CPU without them (AVX-512 without
    the BF16 extension, AVX2) computes a bf16 matmul into a float32 buffer of the output's size first. That is a
    property of the host's CPU, not of the model, so it is allowed for here rather than in ``denoise_memory``."""
    if device.type != "cpu":
        return 0
    width = 3 * params.hidden_size + 2 * params.mlp_hidden
    x = torch.randn(tokens, params.hidden_size).to(dtype)
    weight = torch.randn(width, params.hidden_size).to(dtype)
    with torch.no_grad():
        peak = forward_peak(lambda: torch.nn.functional.linear(x, weight), device)
    return max(0, peak - tokens * width * dtype.itemsize)
