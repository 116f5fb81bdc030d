"""Inpainting in the real host: our Denoise honours the noise_mask that ComfyUI's own nodes put into a LATENT, and
gives what ComfyUI's native FLUX.2 sampler gives on the same LATENT (UNETLoader + SamplerCustomAdvanced(euler),
whose KSamplerX0Inpaint blends before each model call, as ours does: flux2_core/sampling/inpaint.py, BEFORE_MODEL).

Same tiny weights, prompt, seed and sigmas on both sides, float32 on CPU; the mask is a PNG read by LoadImageMask.
The measured differences are printed (pytest -s). With a black-and-white mask the two blending conventions give the
same result (the model sees the noised source outside the mask in both); only grey values tell them apart, so the
soft-mask cases are the ones that pin the convention (diffusers' would be 2.6e-2 away here)."""

import numpy as np
import pytest
import torch
from PIL import Image

from flux2_core.errors import Flux2Error
from tests.comfyui import graphs

PROMPT = "a red fox in the snow"
SIZE = (128, 96)            # tiny_ref_1.png: an 8 x 6 latent grid


def soft_mask() -> np.ndarray:
    """[96, 128] uint8: 0 on the left, a ramp from x = 40 to 88, 255 on the right, in rows 16..79 only."""
    x = np.clip((np.arange(128) - 40) / 48, 0, 1)
    mask = np.zeros((96, 128))
    mask[16:80] = x
    return np.round(mask * 255).astype(np.uint8)


@pytest.fixture(scope="module")
def files(comfy):
    Image.fromarray(soft_mask()).convert("RGB").save(comfy.base / "input" / "inpaint_mask.png")
    Image.new("RGB", (96, 128), (255, 255, 255)).save(comfy.base / "input" / "inpaint_tall.png")
    return comfy.files


def run(comfy, **options) -> dict:
    graph = graphs.inpaint(comfy.files, PROMPT, comfy.images[0], options.pop("mask", "inpaint_mask.png"), SIZE,
                           **options)
    latents = graphs.saved_latents(comfy.base, comfy.client.history(comfy.client.run(graph).prompt_id))
    return {name: latents[node].float() for name, node in (("ours", "60"), ("native", "61"), ("source", "62"))}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


CASES = {
    "soft-mask": {"seed": 3, "steps": 4},
    "strength-and-reference": {"seed": 4, "steps": 4, "split": 2, "references": ["tiny_ref_1.png"]},
    "base-cfg": {"seed": 5, "steps": 3, "cfg": 4.0, "negative": "", "model_file": "base"},
    "InpaintModelConditioning": {"seed": 6, "steps": 3, "encode": "conditioning"},
    "VAEEncodeForInpaint": {"seed": 7, "steps": 3, "encode": "vae_inpaint"},
}


@pytest.mark.parametrize("name", CASES)
def test_our_denoise_equals_comfyuis_native_sampler_on_a_masked_latent(comfy, files, name):
    options = dict(CASES[name])
    if options.get("model_file") == "base":
        options["model_file"] = files["transformer_base"]
    out = run(comfy, **options)
    err = relative(out["ours"], out["native"])
    print(f"\n[{name}] ours vs ComfyUI native with the same noise_mask: relative {err:.3g}")
    assert out["ours"].shape == out["native"].shape == (1, 128, 6, 8)
    assert err <= 1e-4
    assert relative(out["ours"], out["source"]) > 1e-2           # something was repainted


def test_outside_the_mask_the_source_latent_is_kept(comfy, files):
    out = run(comfy, seed=8, steps=4)
    # the latent grid reads the mask bilinearly at each 16-pixel cell's centre: rows 0 and 5 and columns 0..2 are 0
    grid = torch.nn.functional.interpolate(torch.from_numpy(soft_mask() / 255.0)[None, None].float(), size=(6, 8),
                                           mode="bilinear")[0, 0]
    keep = grid == 0
    assert keep.sum() == 28 and not keep.all()
    err = ((out["ours"] - out["source"])[0][:, keep].abs().max() / out["source"].abs().max()).item()
    print(f"\nkept cells: max |ours - source| / max |source| = {err:.3g}")
    assert err <= 1e-5                                   # the Euler step lands on the source up to float rounding
    assert (out["ours"] - out["source"])[0][:, grid == 1].abs().max() > 1e-2


def test_a_mask_of_another_shape_is_refused_with_how_to_fix_it(comfy, files):
    with pytest.raises(Flux2Error, match=r"the mask is 96x128 \(WxH\) but the latent's image is 128x96, another shape"):
        run(comfy, seed=1, steps=2, mask="inpaint_tall.png")


def test_a_masked_latent_without_a_source_image_is_refused(comfy, files):
    # the masked LATENT wired to the noise input and nothing to the latent input: there is no image to keep
    graph = graphs.inpaint(comfy.files, PROMPT, comfy.images[0], "inpaint_mask.png", SIZE, seed=1, steps=2)
    denoise = graph["56"]["inputs"]
    denoise["noise"] = denoise.pop("latent")
    for node in ("57", "58", "59", "61", "62"):          # our Denoise alone
        del graph[node]
    with pytest.raises(Flux2Error, match="a mask needs the image it masks.*Denoise node's latent input"):
        comfy.client.run(graph)
