"""The Euler loop and FLUX.2 denoising, against hand-computed values and against diffusers 0.42.1 pipelines run on the
same tiny random transformer and VAE with the same noise and prompt embeddings (per-step latents compared).

The FLUX.2 part runs our transformer in the device mode's dtype and device (``tests/device.py``) and our AE in float32
there (as the pipeline does); diffusers runs in float32 on the same device."""

import itertools

import numpy as np
import pytest
import torch
from PIL import Image

from flux2_core.errors import Flux2Error
from flux2_core.families.flux2 import FLUX2
from flux2_core.families.flux2.schedule import flux2_schedule
from flux2_core.families.flux2.transformer import Flux2Transformer
from flux2_core.latents import latent_size
from flux2_core.models.autoencoder import AutoEncoder
from flux2_core.sampling.euler import add_noise, denoise, euler, make_noise
from flux2_core.sampling.references import encode_references
from tests.device import DEVICE, DTYPE, assert_close, relative_error, to, tolerance
from tests.tiny.autoencoder import TINY_AE_PARAMS, bfl_state_dict, build_diffusers_autoencoder
from tests.tiny.transformer import (
    TINY_TRANSFORMER,
    diffusers_transformer_from_bfl_file,
    random_bfl_transformer_state_dict,
    save_bfl_transformer,
)

# --- noise --------------------------------------------------------------------------------------------------------


def test_noise_matches_cpu_generator_per_item():
    noise = make_noise(3, 48, 64, seed=7)
    assert noise.shape == (3, 128, 3, 4) and noise.dtype == torch.float32
    for i in range(3):
        expected = torch.randn((1, 128, 3, 4), generator=torch.Generator("cpu").manual_seed(7 + i))
        assert torch.equal(noise[i:i + 1], expected)
    assert torch.equal(make_noise(1, 48, 64, seed=8), noise[1:2])      # item i of seed s == single run, seed s+i


def test_bfl_noise_option_draws_bf16():
    noise = make_noise(2, 32, 32, seed=3, dtype=torch.bfloat16, bfl_cuda_noise=True)
    expected = torch.randn((1, 128, 2, 2), generator=torch.Generator("cpu").manual_seed(4), dtype=torch.bfloat16)
    assert noise.dtype == torch.bfloat16 and torch.equal(noise[1:], expected)


def test_bad_sizes_and_seeds():
    with pytest.raises(Flux2Error, match="multiple of 16"):
        make_noise(1, 100, 64, seed=0)
    with pytest.raises(Flux2Error, match="width"):
        latent_size(64, 0)
    with pytest.raises(Flux2Error, match="seed"):
        make_noise(1, 64, 64, seed=-1)
    assert latent_size(48, 80) == (3, 5)
    # the size suggested is the nearest multiple of 16 in whole numbers, however large: 2^60 + 24 lies 8 from
    # 2^60 + 16 and 2^60 + 32 (a float holds neither, and rounds it to 2^60)
    with pytest.raises(Flux2Error, match=rf"use e\.g\. 1008x{2**60 + 32}$"):
        latent_size(2**60 + 24, 1000)
    with pytest.raises(Flux2Error, match=r"use e\.g\. 16x48$"):            # halves round up; never below 16
        latent_size(40, 17)


# --- the Euler loop -----------------------------------------------------------------------------------------------


def test_euler_on_a_straight_path():
    # The exact flow-matching velocity for a single data point x0 is v = noise - x0 (constant), so Euler lands on x0
    # after any schedule, and every step's clean estimate x - sigma * v is x0.
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 128, 2, 3, generator=g), torch.randn(2, 128, 2, 3, generator=g)
    seen = []
    sigmas = [1.0, 0.9, 0.5, 0.2, 0.0]

    def velocity(x, t, t_next):
        assert t.shape == t_next.shape == (2,) and t.dtype == t_next.dtype == x.dtype
        seen.append((t[0].item(), t_next[0].item()))
        return noise - x0

    steps = []
    out = euler(velocity, noise, sigmas, callback=steps.append)
    torch.testing.assert_close(out, x0, rtol=0, atol=1e-6)
    assert seen == [pytest.approx(pair) for pair in itertools.pairwise(sigmas)]
    assert [(s.index, s.total, s.sigma, s.sigma_next) for s in steps] == [
        (i, 4, a, b) for i, (a, b) in enumerate(itertools.pairwise(sigmas))]
    for s in steps:
        torch.testing.assert_close(s.denoised, x0, rtol=0, atol=1e-6)
        torch.testing.assert_close(s.x, add_noise(x0, noise, s.sigma_next), rtol=0, atol=1e-6)


def test_euler_bf16_follows_the_reference_rounding():
    # model sees bf16(sigma); the update x + (s_next - s) * v runs in bf16 with the step from the fp32 schedule
    sigmas = flux2_schedule(4, 4096)
    x = torch.randn(1, 128, 2, 2, generator=torch.Generator().manual_seed(1)).bfloat16()
    seen = []
    v = torch.full_like(x, 0.3)
    out = euler(lambda x, t, t_next: (seen.append(t.clone()), v)[1], x, sigmas)
    assert [(1000 * t).item() for t in seen] == [1000, 968, 908, 764]    # bfl-flux2-klein.md 1.3
    assert all(t.dtype == torch.bfloat16 for t in seen)
    expected = x
    for a, b in itertools.pairwise(sigmas):
        step = (np.float32(b - a) * v.float()).bfloat16()          # fp32 step size times v, rounded to bf16
        expected = (expected.float() + step.float()).bfloat16()    # then a bf16 add
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)


def test_callback_can_interrupt():
    class Stop(Exception):
        pass

    def stop_at_2(step):
        if step.index == 1:
            raise Stop

    calls = []
    with pytest.raises(Stop):
        euler(lambda x, t, t_next: (calls.append(1), x)[1], torch.zeros(1, 128, 1, 1), [1.0, 0.5, 0.2, 0.0], stop_at_2)
    assert len(calls) == 2


# --- FLUX.2 denoising vs diffusers ------------------------------------------------------------------------------------

H, W = 64, 48   # 4 x 3 latent cells


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sampling")
    sd = random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=0)
    path = save_bfl_transformer(sd, tmp / "flux-2-klein-tiny.safetensors")
    ours = Flux2Transformer(TINY_TRANSFORMER)
    ours.load_state_dict(sd)
    theirs = diffusers_transformer_from_bfl_file(path, TINY_TRANSFORMER, tmp / "cfg")
    vae = build_diffusers_autoencoder(seed=2)
    ae = AutoEncoder(TINY_AE_PARAMS)
    ae.load_state_dict(bfl_state_dict(vae))
    return to(ours).eval(), theirs.to(DEVICE), ae.to(DEVICE).eval(), vae.to(DEVICE)


def embeds(seed, batch=1):
    """Prompt embeddings in float32 on DEVICE (diffusers' dtype; ``denoise`` casts them to the model's)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 512, TINY_TRANSFORMER.context_in_dim, generator=g).to(DEVICE)


def start_noise(batch, seed):
    """The start noise: float32 on DEVICE, as both pipelines take it."""
    return make_noise(batch, H, W, seed=seed).to(DEVICE)


def ref_images():
    rng = np.random.default_rng(5)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in [(96, 80), (64, 128), (80, 64)]]


def run_diffusers(kind, transformer, vae, noise, steps, prompt_embeds, negative_embeds=None, cfg=1.0, images=None):
    """The diffusers pipeline's latent after every step, unpacked to [B, 128, h, w]."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinKVPipeline, Flux2KleinPipeline
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type="exponential")
    h, w = noise.shape[-2:]
    trace = []

    def grab(pipe, i, t, kwargs):
        trace.append(kwargs["latents"].transpose(1, 2).reshape(noise.shape[0], 128, h, w).clone())
        return {}

    args = {"image": images, "prompt_embeds": prompt_embeds, "latents": noise.clone(), "height": h * 16,
            "width": w * 16, "num_inference_steps": steps, "output_type": "latent", "callback_on_step_end": grab}
    if kind == "kv":
        pipe = Flux2KleinKVPipeline(scheduler, vae, None, None, transformer)
    else:
        pipe = Flux2KleinPipeline(scheduler, vae, None, None, transformer, is_distilled=kind == "distilled")
        args.update(guidance_scale=cfg, negative_prompt_embeds=negative_embeds)
    pipe.set_progress_bar_config(disable=True)
    pipe(**args)
    return trace


def ours_trace(model, noise, steps, txt, **kw):
    """Our latent after every step; the loop runs in the model's dtype, as the pipeline runs it."""
    trace = []
    sigmas = flux2_schedule(steps, noise.shape[-2] * noise.shape[-1])
    out = denoise(model, noise.to(DTYPE), sigmas, txt, callback=lambda s: trace.append(s.x.clone()), **kw)
    assert torch.equal(out, trace[-1]) and out.dtype == DTYPE
    return trace


def assert_traces_close(ours, theirs):
    """Every step within tolerance("denoise") (1e-4 in float32); the first step, one forward from the same noise,
    within the single forward's tolerance("transformer") (also 1e-4 in float32, far tighter than a whole run in
    low precision)."""
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        err, bound = relative_error(a, b), tolerance("transformer" if i == 0 else "denoise")
        print(f"step {i}: max rel diff {err:.2e}")
        assert err <= bound, f"step {i}: max rel diff {err:.3g} > {bound:.3g}"


def test_distilled_matches_diffusers(models):
    ours, theirs, _ae, vae = models
    noise, txt = start_noise(2, 11), embeds(1)
    expected = run_diffusers("distilled", theirs, vae, noise, 4, txt.expand(2, -1, -1))
    assert_traces_close(ours_trace(ours, noise, 4, txt), expected)


def test_cfg_matches_diffusers(models):
    ours, theirs, _ae, vae = models
    noise, txt, neg = start_noise(1, 12), embeds(2), embeds(3)
    expected = run_diffusers("base", theirs, vae, noise, 3, txt, neg, cfg=4.0)
    got = ours_trace(ours, noise, 3, txt, negative_txt=neg, cfg=4.0)
    assert_traces_close(got, expected)
    # and CFG really acts: cfg 1 (= the positive prompt alone) differs from it
    plain = ours_trace(ours, noise, 3, txt)
    assert (plain[-1] - got[-1]).abs().max() > max(1e-3, tolerance("transformer"))


def test_references_match_diffusers(models):
    ours, theirs, ae, vae = models
    noise, txt = start_noise(1, 13), embeds(4)
    images = ref_images()
    ref, ref_ids = encode_references(ae, images, None, ids=FLUX2.reference_ids, fit=FLUX2.references)
    expected = run_diffusers("distilled", theirs, vae, noise, 3, txt, images=images)
    got = ours_trace(ours, noise, 3, txt, ref=ref, ref_ids=ref_ids)
    assert_traces_close(got, expected)
    # with CFG, references go into both halves
    neg = embeds(5)
    expected = run_diffusers("base", theirs, vae, noise, 3, txt, neg, cfg=3.0, images=images[:1])
    ref1, ref1_ids = encode_references(ae, images[:1], None, ids=FLUX2.reference_ids, fit=FLUX2.references)
    assert_traces_close(ours_trace(ours, noise, 3, txt, negative_txt=neg, cfg=3.0, ref=ref1, ref_ids=ref1_ids),
                        expected)


def test_kv_matches_diffusers(models):
    ours, theirs, ae, vae = models
    noise, txt = start_noise(2, 14), embeds(6)
    images = ref_images()[:2]
    ref, ref_ids = encode_references(ae, images, None, ids=FLUX2.reference_ids, fit=FLUX2.references)
    expected = run_diffusers("kv", theirs, vae, noise, 4, txt.expand(2, -1, -1), images=images)
    calls = []
    original = ours.reference_kv
    ours.reference_kv = lambda *a, **k: (calls.append(1), original(*a, **k))[1]
    try:
        got = ours_trace(ours, noise, 4, txt, ref=ref, ref_ids=ref_ids, kv=True)
    finally:
        del ours.reference_kv
    assert calls == [1]                     # reference K/V computed once for all 4 steps
    assert_traces_close(got, expected)
    # a precomputed cache gives the same result, and the KV scheme differs from joint references
    cache = ours.reference_kv(ref.to(DTYPE), ref_ids)
    again = ours_trace(ours, noise, 4, txt, ref_kv=cache)
    assert torch.equal(again[-1], got[-1])
    joint = ours_trace(ours, noise, 4, txt, ref=ref, ref_ids=ref_ids)
    assert (joint[-1] - got[-1]).abs().max() > max(1e-4, tolerance("transformer"))


def test_batch_equals_single_runs(models):
    ours = models[0]
    txt = embeds(7)
    sigmas = flux2_schedule(3, 12)
    batch = denoise(ours, start_noise(3, 20).to(DTYPE), sigmas, txt, negative_txt=embeds(8), cfg=2.0)
    for i in range(3):
        single = denoise(ours, start_noise(1, 20 + i).to(DTYPE), sigmas, txt, negative_txt=embeds(8), cfg=2.0)
        assert_close(batch[i:i + 1], single, "denoise", rtol=0, atol=1e-5)


def test_refs_twice_is_an_error(models):
    ours, _, ae, _ = models
    ref, ref_ids = encode_references(ae, ref_images()[:1], DTYPE, ids=FLUX2.reference_ids, fit=FLUX2.references)
    with pytest.raises(Flux2Error, match="not both"):
        denoise(ours, start_noise(1, 0).to(DTYPE), [1.0, 0.0], embeds(0), ref=ref, ref_ids=ref_ids,
                ref_kv=ours.reference_kv(ref, ref_ids))
