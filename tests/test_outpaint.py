"""Outpainting: an image on a larger canvas (``inpaint.expand_canvas``) whose added area is repainted on the
inpainting path, fading into the image over a feathered edge; where the mask keeps the image, the result's latent is
exactly the image's (as for inpainting). The CLI's --expand and its refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from flux2_core.app import cli
from flux2_core.errors import Flux2Error
from flux2_core.sampling import inpaint


def picture(width=96, height=64, seed=0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.mark.parametrize("text,sides", [("0,0,256,0", (0, 0, 256, 0)), ("1, 16,17,0", (16, 16, 32, 0)),
                                        ("32,32,32,32", (32, 32, 32, 32))])
def test_expand_is_rounded_up_to_the_grid(text, sides):
    assert inpaint.parse_expand(text) == sides


@pytest.mark.parametrize("text,message", [("0,0,0,0", "adds nothing"), ("10,10", "four whole numbers"),
                                          ("-16,0,0,0", r"LEFT pixels must be in \[0, 8192\]"),
                                          ("a,b,c,d", "LEFT pixels must be a whole number written with digits 0-9"),
                                          ("0,0,²,0", "RIGHT pixels must be a whole number written with digits 0-9"),
                                          ("0,0,0,9999", r"BOTTOM pixels must be in \[0, 8192\]")])
def test_bad_expands(text, message):
    with pytest.raises(Flux2Error, match=message):
        inpaint.parse_expand(text)


def test_the_canvas_holds_the_image_and_a_mask_over_what_was_added():
    source = picture(100, 70)                                  # cropped to 96 x 64 first, as every input is
    canvas = inpaint.expand_canvas(source, (0, 16, 64, 0), feather=32)
    assert canvas.image.size == canvas.mask.size == (160, 80) and canvas.box == (0, 16, 96, 80)
    crop = source.crop((2, 3, 98, 67))
    assert np.array_equal(np.asarray(canvas.image.crop(canvas.box)), np.asarray(crop))
    assert (np.asarray(canvas.image)[:16] == inpaint.OUTPAINT_FILL).all()           # the new strip on top
    mask = np.asarray(canvas.mask).astype(int)
    assert (mask[:16] == 255).all() and (mask[:, 96:] == 255).all()                 # all that was added: repainted
    assert (mask[16 + 32:, :96 - 32] == 0).all()                                    # deep inside the image: kept
    # the feather: falls from the grown top and right edges into the image, 32 pixels wide, not at the left (the
    # image's own edge there is the canvas edge)
    column = mask[16:, 10]
    assert column[0] > column[15] > column[31] > column[32] == 0 and (np.diff(column[:33]) <= 0).all()
    row = mask[60, :96]
    assert row[95] > row[80] > row[64] > row[63] == 0 and row[0] == 0


def test_a_canvas_over_the_limit_is_refused():
    with pytest.raises(Flux2Error, match="makes a 1104x64 canvas.*expand less"):
        inpaint.expand_canvas(picture(), (0, 0, 1000 // 16 * 16 + 16, 0), max_pixels=64 * 1000)


def test_outpainting_keeps_the_image_s_latent_where_the_mask_keeps_it():
    """The canvas on the inpainting path (demo weights): cells the latent mask keeps (0) end exactly at the image's
    latent; the added area is painted anew."""
    from flux2_core.app.demo import demo_models
    from flux2_core.pipeline import generate
    from flux2_core.sampling.references import image_to_tensor

    models = demo_models("klein-4b", "cpu")
    canvas = inpaint.expand_canvas(picture(64, 64), (0, 0, 64, 0), feather=16)
    result = generate(models, "more of the same", image=canvas.image, mask=canvas.mask, steps=2, seed=3)
    with torch.no_grad():
        source = models.autoencoder.encode(image_to_tensor(canvas.image))
    latent_mask, _ = inpaint.latent_mask(inpaint.mask_tensor(canvas.mask), 1, *source.shape[-2:])
    kept = latent_mask[0, 0] == 0
    assert kept.any() and (~kept).any()
    assert torch.equal(result.latents[0][:, kept], source[0][:, kept])
    assert not torch.equal(result.latents[0][:, ~kept], source[0][:, ~kept])


def test_cli_expand(tmp_path, capsys):
    src = tmp_path / "src.png"
    picture(64, 48).save(src)
    argv = ["--demo", "--prompt", "x", "--steps", "1", "--seed", "2"]
    assert cli.main([*argv, "--image", str(src), "--expand", "16,0,30,0", "--out", str(tmp_path / "o")]) == 0, \
        capsys.readouterr().err
    assert Image.open(tmp_path / "o" / "flux2_2.png").size == (64 + 16 + 32, 48)
    for extra, message in ((["--expand", "0,0,16,0"], "give the image to expand"),
                           (["--image", str(src), "--mask", str(src), "--expand", "0,0,16,0"], "makes its own mask"),
                           (["--image", str(src), "--expand", "0,0,0"], "four whole numbers"),
                           (["--steps", "200", "--image", str(src), "--expand", "0,0,8000,8000"], "canvas")):
        assert cli.main([*argv, *extra, "--out", str(tmp_path / "x")]) == 2
        assert message in capsys.readouterr().err or pytest.fail(message)
