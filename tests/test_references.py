"""Reference preprocessing against documented numbers and diffusers' Flux2ImageProcessor; reference tokens and ids
against diffusers' Flux2KleinPipeline.prepare_image_latents on the same tiny random VAE."""

import math

import numpy as np
import pytest
import torch
from PIL import Image

from flux2_core.errors import Flux2Error
from flux2_core.families.flux2 import FLUX2
from flux2_core.models.autoencoder import AutoEncoder
from flux2_core.sampling.references import (
    batched_reference_tokens,
    encode_references,
    image_to_tensor,
    pixel_cap,
    prepare_references,
    reference_tokens,
)
from tests.tiny.autoencoder import TINY_AE_PARAMS, bfl_state_dict, build_diffusers_autoencoder


def noise_image(w, h, seed=0, mode="RGB"):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}.get(mode)
    shape = (h, w, channels) if channels else (h, w)
    return Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode)


def diffusers_preprocess(images, area):
    """diffusers' Klein reference preprocessing with the pixel cap made a parameter (diffusers fixes 1024^2)."""
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
    proc = Flux2ImageProcessor(vae_scale_factor=16)
    out = []
    for img in images:
        proc.check_image_input(img)
        if img.width * img.height > area:
            img = proc._resize_to_target_area(img, area)
        w, h = img.width // 16 * 16, img.height // 16 * 16
        out.append(proc.preprocess(img, height=h, width=w, resize_mode="crop"))
    return out


def test_sizes_follow_the_documented_rule():
    # one reference: cap 2024^2; s = sqrt(cap / (w h)), int() floors, then centre crop to multiples of 16
    w, h = 2600, 1700
    s = math.sqrt(2024 ** 2 / (w * h))
    assert (int(w * s), int(h * s)) == (2503, 1636)
    (single,) = prepare_references([noise_image(w, h)], None, FLUX2.references)
    assert single.size == (2496, 1632)
    # several references: 1024^2 each; small ones only cropped
    big, small = prepare_references([noise_image(w, h), noise_image(100, 75)], None, FLUX2.references)
    s = math.sqrt(1024 ** 2 / (w * h))
    assert big.size == (int(w * s) // 16 * 16, int(h * s) // 16 * 16) == (1264, 816)
    assert small.size == (96, 64)
    # exactly at the cap: untouched
    assert prepare_references([noise_image(1024, 1024)] * 2, None, FLUX2.references)[0].size == (1024, 1024)


def test_centre_crop_offsets():
    img = noise_image(100, 75, seed=3)
    (out,) = prepare_references([img], None, FLUX2.references)
    # 100 -> 96 (offset 2), 75 -> 64 (offset 5)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(img)[5:69, 2:98])


@pytest.mark.parametrize("sizes", [[(2100, 2000)], [(1500, 900), (300, 200), (77, 555)], [(96, 80)]])
def test_matches_diffusers_preprocessing(sizes):
    images = [noise_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    area = 2024 ** 2 if len(images) == 1 else 1024 ** 2
    ours = [image_to_tensor(im) for im in prepare_references(images, None, FLUX2.references)]
    theirs = diffusers_preprocess(images, area)
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape and a.dtype == torch.float32
        assert (a - b).abs().max().item() <= 1e-6


def test_modes_are_converted_to_rgb():
    for mode in ["RGBA", "L"]:
        (out,) = prepare_references([noise_image(64, 64, mode=mode)], None, FLUX2.references)
        assert out.mode == "RGB" and out.size == (64, 64)
    arr = np.zeros((64, 80, 3), dtype=np.uint8)
    assert prepare_references([arr], None, FLUX2.references)[0].size == (80, 64)


@pytest.mark.parametrize("size,message", [((63, 200), "at least 64"), ((200, 40), "at least 64"),
                                          ((64, 513), "aspect ratio"), ((1000, 100), "aspect ratio")])
def test_bad_references(size, message):
    with pytest.raises(Flux2Error, match=message):
        prepare_references([noise_image(64, 64), noise_image(*size)], None, FLUX2.references)
    prepare_references([noise_image(64, 512), noise_image(512, 64)], None, FLUX2.references)   # 8:1 exactly is allowed


def test_bad_reference_type():
    with pytest.raises(Flux2Error, match="PIL image"):
        prepare_references(["photo.png"], None, FLUX2.references)


@pytest.mark.slow
def test_tokens_and_ids_match_diffusers():
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    vae = build_diffusers_autoencoder(seed=1)
    ae = AutoEncoder(TINY_AE_PARAMS)
    ae.load_state_dict(bfl_state_dict(vae))
    ae.eval()
    images = [noise_image(96, 80, seed=1), noise_image(64, 128, seed=2), noise_image(130, 70, seed=3)]

    tokens, ids = encode_references(ae, images, torch.float32, ids=FLUX2.reference_ids, fit=FLUX2.references)

    pipe = Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None,
                              tokenizer=None, transformer=None)
    with torch.no_grad():
        ref_tokens, ref_ids = pipe.prepare_image_latents(diffusers_preprocess(images, 1024 ** 2), batch_size=1,
                                                         generator=None, device="cpu", dtype=torch.float32)
    assert tokens.shape == ref_tokens.shape == (1, 30 + 32 + 32, 128)
    assert ids.dtype == torch.int64 and torch.equal(ids, ref_ids)
    assert sorted(set(ids[0, :, 0].tolist())) == [10, 20, 30]
    err = (tokens - ref_tokens).abs().max().item()
    assert err <= 1e-4 * ref_tokens.abs().max().item(), err


def test_pixel_caps_and_tokens_of_batched_latents():
    """BFL's caps (2024^2 alone, 1024^2 each for several); the tokens of a batch of reference latents (ComfyUI's
    reference_latents may hold [n, 128, h, w]) are those of its items one by one, at t = 10, 20, ..."""
    assert (pixel_cap(1, FLUX2.references), pixel_cap(2, FLUX2.references), pixel_cap(5, FLUX2.references)) == (2024 * 2024, 1024 * 1024, 1024 * 1024)
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(1, 128, h, w, generator=g) for h, w in [(2, 3), (2, 3), (4, 1)])
    tokens, ids = reference_tokens([torch.cat([a, b]), c], FLUX2.reference_ids)
    expected = torch.cat([z.flatten(2).transpose(1, 2) for z in (a, b, c)], dim=1)     # "c h w -> (h w) c"
    assert torch.equal(tokens, expected) and ids[0, :, 0].tolist() == [10] * 6 + [20] * 6 + [30] * 4
    assert ids[0, 12:, 1:3].tolist() == [[0, 0], [1, 0], [2, 0], [3, 0]]                  # c's own (h, w) grid
    assert reference_tokens([], FLUX2.reference_ids) == (None, None)


def test_references_batched_as_comfyuis_samplers_batch_them():
    """ComfyUI's samplers hand a model call ref_latents whose item b belongs to image b of the batch (its CONDList
    joins conditionings item by item): each image gets the tokens reference_tokens gives for its own references,
    single latents serve every image, and the ids are those of the references in order."""
    g = torch.Generator().manual_seed(1)
    first, second = torch.randn(2, 128, 2, 3, generator=g), torch.randn(1, 128, 4, 1, generator=g)
    tokens, ids = batched_reference_tokens([first, second], FLUX2.reference_ids)
    for b in range(2):
        expected, expected_ids = reference_tokens([first[b:b + 1], second], FLUX2.reference_ids)
        assert torch.equal(tokens[b:b + 1], expected) and torch.equal(ids, expected_ids)
    assert batched_reference_tokens([], FLUX2.reference_ids) == (None, None)
    with pytest.raises(Flux2Error, match=r"batches \[2, 3\] cannot go together"):
        batched_reference_tokens([first, torch.randn(3, 128, 2, 3)], FLUX2.reference_ids)
