"""Masks and the two blending conventions of flux2_core/sampling/inpaint.py, against hand-computed values.

The whole runs are compared with their peers elsewhere: the engine's (AFTER_STEP) with diffusers'
Flux2KleinInpaintPipeline in tests/test_pipeline.py, the node's (BEFORE_MODEL) with ComfyUI's own sampler in
tests/comfyui/test_inpaint.py."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from flux2_core.errors import Flux2Error
from flux2_core.sampling import inpaint
from flux2_core.sampling.euler import add_noise, euler
from flux2_core.sampling.inpaint import AFTER_STEP, BEFORE_MODEL, Inpaint


def test_a_mask_image_is_its_grey_level():
    image = Image.new("RGB", (3, 2), (255, 255, 255))
    image.putpixel((1, 0), (0, 0, 0))
    image.putpixel((2, 1), (51, 51, 51))                   # grey 51 -> 0.2, kept soft
    mask = inpaint.mask_tensor(image)
    assert mask.shape == (1, 1, 2, 3) and mask.dtype == torch.float32
    assert mask[0, 0].tolist() == [[1.0, 0.0, 1.0], [1.0, 1.0, pytest.approx(0.2)]]


def test_a_mask_is_read_as_asked_and_two_readings_that_disagree_are_refused(tmp_path):
    """grey: white = repaint; alpha: transparent = repaint (ComfyUI's mask editor), whatever the colours; auto: the
    grey levels of a mask without transparency (a black and white PNG saved with an opaque alpha too), and where the
    two readings disagree (white strokes on a transparent layer) a refusal that names the choice: through the engine
    (image_mask) and from a file as the command line opens it."""
    from flux2_core.sampling.references import open_picture

    drawn = Image.new("RGBA", (3, 1), (0, 0, 0, 255))
    for x, a in enumerate((0, 255, 128)):
        drawn.putpixel((x, 0), (255 * (x % 2), 0, 0, a))       # colours that say the opposite of the alpha
    opaque = Image.new("RGBA", (3, 1), (0, 0, 0, 255))
    for x, v in enumerate((255, 0, 51)):
        opaque.putpixel((x, 0), (v, v, v, 255))
    palette = Image.new("P", (3, 1), 1)
    palette.putpalette([0, 0, 0, 255, 255, 255] * 2)
    palette.putpixel((2, 0), 0)
    palette.info["transparency"] = 0                            # index 0 (black) transparent: pixel 2 repainted
    by_alpha = {"drawn": [255, 0, 127], "palette": [0, 0, 255]}
    for name, mask in (("drawn", drawn), ("opaque", opaque), ("palette", palette)):
        mask.save(tmp_path / f"{name}.png")
        for picture in (mask, open_picture(tmp_path / f"{name}.png")):
            if name == "opaque":                                # no transparency: grey, with or without auto
                assert list(inpaint.mask_levels(picture).levels.tobytes()) == [255, 0, 51]
                with pytest.raises(Flux2Error, match="has no transparency to read it by"):
                    inpaint.mask_levels(picture, reading="alpha")
                continue
            reading = inpaint.mask_levels(picture, reading="alpha")
            assert list(reading.levels.tobytes()) == by_alpha[name] and "transparent areas are repainted" in reading.note
            grey = inpaint.mask_levels(picture, reading="grey")
            assert list(grey.levels.tobytes()) == list(picture.convert("L").tobytes()), name
            with pytest.raises(Flux2Error, match=r"reads two ways.*--mask-reading on the command line"):
                inpaint.mask_levels(picture)
    la = Image.new("LA", (3, 1), (255, 255))
    la.putpixel((1, 0), (255, 0))
    assert list(inpaint.mask_levels(la, reading="alpha").levels.tobytes()) == [0, 255, 0]
    image = Image.new("RGB", (32, 16))
    column = [x * 3 // 32 for x in range(32)]                   # each of the 3 pixels widened to a third
    drawn_big = Image.new("RGBA", (32, 16))
    drawn_big.putdata([drawn.getpixel((c, 0)) for _ in range(16) for c in column])
    by_hand = Image.new("L", (32, 16))
    by_hand.putdata([by_alpha["drawn"][c] for _ in range(16) for c in column])
    got, notes = inpaint.image_mask(drawn_big, image, (32, 16), reading="alpha")
    expected_mask, _ = inpaint.image_mask(by_hand, image, (32, 16))
    assert torch.equal(got, expected_mask) and notes and "read by its transparency" in notes[0]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([0.0, 0.003, 0.05, 0.5, 1.0]))
def test_auto_takes_the_reading_both_agree_on_and_refuses_past_a_sliver(seed, share):
    """A 40 x 25 mask whose transparency marks where to repaint and whose grey levels agree except on a drawn share
    of its pixels: auto reads it by its transparency up to 0.5% of them (a sliver), and past it refuses."""
    rng = np.random.default_rng(seed)
    repaint = rng.random((25, 40)) < 0.4
    white = repaint.copy()
    flip = rng.random((25, 40)) < share
    white[flip] = ~white[flip]
    rgba = np.zeros((25, 40, 4), np.uint8)
    rgba[..., :3] = np.where(white, 255, 0)[..., None]
    rgba[..., 3] = np.where(repaint, 0, 255)
    mask = Image.fromarray(rgba, "RGBA")
    if flip.mean() <= inpaint.SLIVER:
        levels = np.asarray(inpaint.mask_levels(mask).levels)
        assert np.array_equal(levels >= 128, repaint)
    else:
        with pytest.raises(Flux2Error, match=r"reads two ways: by its transparency it repaints"):
            inpaint.mask_levels(mask)
    assert np.array_equal(np.asarray(inpaint.mask_levels(mask, reading="alpha").levels) >= 128, repaint)
    assert np.array_equal(np.asarray(inpaint.mask_levels(mask, reading="grey").levels) >= 128, white)


def test_the_latent_grid_reads_the_centre_pixels_of_each_cell_bilinearly():
    # a 16x downscale with corners not aligned samples pixel 16 * i + 7.5: the mean of pixels 7 and 8 of each cell
    mask = torch.zeros(1, 1, 32, 48)
    mask[0, 0, 7, 7] = 1.0                                  # one of the 4 centre pixels of cell (0, 0)
    mask[0, 0, 23:25, 39:41] = 0.6                          # all 4 centre pixels of cell (1, 2)
    mask[0, 0, 16:32, 16:22] = 1.0                          # a stroke in cell (1, 1) that misses its centre
    grid, note = inpaint.latent_mask(mask, 1, 2, 3)
    assert note == "" and grid.shape == (1, 1, 2, 3)
    expected = torch.tensor([[0.25, 0.0, 0.0], [0.0, 0.0, 0.6]])
    torch.testing.assert_close(grid[0, 0], expected, rtol=0, atol=1e-7)


def test_a_mask_already_on_the_grid_is_used_as_it_is():
    mask = torch.rand(2, 1, 3, 4, generator=torch.Generator().manual_seed(0))
    grid, note = inpaint.latent_mask(mask, 2, 3, 4)
    assert note == "" and torch.equal(grid, mask)
    grid, _ = inpaint.latent_mask(mask[:, 0], 2, 3, 4)     # ComfyUI's MASK [B, H, W]
    assert torch.equal(grid, mask)


def test_a_mask_of_the_same_shape_is_resized_with_a_note_and_another_shape_is_refused():
    # a 500x375 mask over an image cropped to 992x736 (62x46 cells): the same shape within a cell, resized
    grid, note = inpaint.latent_mask(torch.ones(1, 1, 375, 500), 1, 46, 62)
    assert grid.shape == (1, 1, 46, 62) and "resized" in note and "500x375" in note
    with pytest.raises(Flux2Error, match="another shape"):
        inpaint.latent_mask(torch.ones(1, 1, 1000, 750), 1, 46, 62)


@pytest.mark.parametrize("width, height", [(1000, 750), (119, 400), (767, 1024), (1080, 2432)])
def test_a_mask_at_the_size_of_the_image_before_its_crop_is_cut_as_the_image_was(width, height):
    """ComfyUI's mask comes at the loaded picture's size, the latent from the picture centre-cropped to the 16-pixel
    grid (1000x750 -> 992x736: 4 px off the left, 7 off the top): the mask is cut the same way, pixel for pixel
    (a stroke at the crop's first column lands in the first cell), with no note; even far from square, where
    stretching would have refused it as another shape."""
    w, h = width // 16, height // 16
    left, top = (width - 16 * w) // 2, (height - 16 * h) // 2
    mask = torch.zeros(1, 1, height, width)
    mask[..., top + 7:top + 9, left + 7:left + 9] = 1.0          # the centre of the crop's first cell
    mask[..., :, :left] = 1.0                                     # outside the crop: must not reach the grid
    grid, note = inpaint.latent_mask(mask, 1, h, w)
    expected = torch.zeros(1, 1, h, w)
    expected[..., 0, 0] = 1.0
    assert note == "" and torch.equal(grid, expected)
    assert inpaint.check_mask_size((64, 48), (64, 48)) == ""


def test_an_empty_mask_of_any_shape_repaints_nothing():
    """ComfyUI's Load Image gives a 64 x 64 zero mask for an image without alpha: over a 992x736 image it keeps the
    whole source and says the mask is empty, instead of a shape error about a mask nobody painted."""
    empty = torch.zeros(1, 64, 64)
    grid, note = inpaint.latent_mask(empty, 1, 46, 62)
    assert note == "" and grid.shape == (1, 1, 46, 62) and not grid.any()
    assert "empty" in inpaint.mask_note(empty, grid)


@pytest.mark.parametrize("mask,message", [
    (torch.ones(3, 1, 32, 32), "3 masks for a batch of 2"),
    (torch.full((1, 1, 32, 32), 1.5), r"in \[0, 1\]"),
    (torch.full((1, 1, 32, 32), float("nan")), r"in \[0, 1\]"),
    (torch.ones(1, 3, 32, 32), "a mask must be"),
])
def test_bad_masks(mask, message):
    with pytest.raises(Flux2Error, match=message):
        inpaint.latent_mask(mask, 2, 2, 2)


def test_notes_for_masks_that_repaint_nothing():
    empty = torch.zeros(1, 1, 32, 32)
    assert "empty" in inpaint.mask_note(empty, inpaint.latent_mask(empty, 1, 2, 2)[0])
    thin = empty.clone()
    thin[..., :, 0:4] = 1.0                                  # a 4-pixel stroke between the cells' centres
    assert "between the centres" in inpaint.mask_note(thin, inpaint.latent_mask(thin, 1, 2, 2)[0])
    thin[..., 7:9, 7:9] = 1.0
    assert inpaint.mask_note(thin, inpaint.latent_mask(thin, 1, 2, 2)[0]) == ""


def test_an_image_mask_follows_the_source_crop_and_resize():
    # a 40x36 source is cropped to 32x32 (4 px off each side, 2 off the top and bottom): the mask is cropped alike
    mask = Image.new("L", (40, 36), 0)
    mask.paste(255, (4, 2, 20, 34))                          # the left half of the crop
    pixels, notes = inpaint.image_mask(mask, Image.new("RGB", (40, 36)), (32, 32))
    assert notes == [] and pixels.shape == (1, 1, 32, 32)
    assert pixels[0, 0, :, :16].min() == 1 and pixels[0, 0, :, 16:].max() == 0
    pixels, _ = inpaint.image_mask(mask, Image.new("RGB", (40, 36)), (64, 64))     # the source used at 64x64
    assert pixels.shape == (1, 1, 64, 64) and pixels[0, 0, :, :31].min() == 1 and pixels[0, 0, :, 33:].max() == 0


# --- the two blends in the Euler loop -----------------------------------------------------------------------------

def fields(seed=0):
    g = torch.Generator().manual_seed(seed)
    source, noise = torch.randn(1, 128, 2, 3, generator=g), torch.randn(1, 128, 2, 3, generator=g)
    mask = torch.tensor([[0.0, 0.5, 1.0], [1.0, 0.25, 0.0]])[None, None]
    return source, noise, mask


def model(x, t, t_next=None):
    """Any velocity that depends on x and t, so a wrong blend shows."""
    return torch.tanh(x) * (1 + t.view(-1, 1, 1, 1)) - 0.3


SIGMAS = [0.8, 0.55, 0.3, 0.0]


def test_after_step_is_the_diffusers_loop():
    source, noise, mask = fields()
    x = add_noise(source, noise, SIGMAS[0])
    out = euler(model, x, SIGMAS, inpaint=Inpaint(source, noise, mask, AFTER_STEP))
    expected = x
    for sigma, sigma_next in itertools.pairwise(SIGMAS):           # step, then x <- (1 - m) x0_noisy + m x
        t = torch.full((1,), sigma)
        stepped = expected + (sigma_next - sigma) * model(expected, t)
        kept = source if sigma_next == 0 else sigma_next * noise + (1 - sigma_next) * source
        expected = (1 - mask) * kept + mask * stepped
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    keep = (mask == 0).expand_as(out)
    assert torch.equal(out[keep], source.expand_as(out)[keep])    # exactly the source where nothing is repainted


def test_before_model_is_comfyuis_loop():
    source, noise, mask = fields(1)
    x = add_noise(source, noise, SIGMAS[0])
    seen = []
    out = euler(lambda x, t, t_next: (seen.append(x), model(x, t, t_next))[1], x, SIGMAS,
                inpaint=Inpaint(source, noise, mask, BEFORE_MODEL))
    expected = x
    for i, (sigma, sigma_next) in enumerate(itertools.pairwise(SIGMAS)):
        # the model sees x_in = m x + (1 - m) (s eps + (1 - s) x0); D = m (x_in - s v) + (1 - m) x0;
        # Euler from x: x + (s' - s) (x - D) / s
        x_in = expected * mask + (sigma * noise + (1 - sigma) * source) * (1 - mask)
        torch.testing.assert_close(seen[i], x_in, rtol=0, atol=1e-6)
        denoised = (x_in - sigma * model(x_in, torch.full((1,), sigma))) * mask + source * (1 - mask)
        expected = expected + (sigma_next - sigma) * (expected - denoised) / sigma
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    keep = (mask == 0).expand_as(out)
    torch.testing.assert_close(out[keep], source.expand_as(out)[keep], rtol=0, atol=1e-6)


def test_a_full_mask_is_plain_sampling_in_both_conventions():
    source, noise, _ = fields(2)
    x = add_noise(source, noise, SIGMAS[0])
    plain = euler(model, x, SIGMAS)
    for blend in (AFTER_STEP, BEFORE_MODEL):
        out = euler(model, x, SIGMAS, inpaint=Inpaint(source, noise, torch.ones(1, 1, 2, 3), blend))
        torch.testing.assert_close(out, plain, rtol=0, atol=1e-6)


def test_an_unknown_blend_is_refused():
    with pytest.raises(Flux2Error, match="blend must be"):
        Inpaint(*fields(), "midway")
