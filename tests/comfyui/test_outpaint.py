"""Outpainting in the real host: the flux2-klein-outpaint workflow (its API twin, as shipped, with a tiny picture, a
few steps and float32 loaders) keeps the picture and paints what ComfyUI's Pad Image for Outpainting added.

The expected latent is computed here, apart from the graph: the canvas is built as the pad node documents it (the
picture at (left, top) on 0.5 grey) and encoded with the engine's own autoencoder read from the same file. It is the
padded canvas that is encoded, not the picture alone: the encoder's middle block attends over the whole canvas, so
every latent cell depends on every pixel, the grey ones too."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.comfyui import graphs

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / "workflows" / "api" / "flux2-klein-outpaint.json"
PAD, ENCODE, DENOISE, IMAGE = "13", "11", "7", "10"     # the workflow's node ids
SIDES = (32, 16, 48, 0)          # left, top, right, bottom: multiples of 16, the bottom left alone
FEATHER = 24


def outpaint_graph(image: str, sides=SIDES, feather: int = FEATHER, seed: int = 3, steps: int = 3) -> dict:
    """The shipped API workflow on ``image`` with these pad amounts; SaveLatent of the result ("20") and of the
    encoded canvas ("21")."""
    graph = json.loads(WORKFLOW.read_text())
    graph[IMAGE]["inputs"]["image"] = image
    graph[PAD]["inputs"] |= dict(zip(("left", "top", "right", "bottom"), sides)) | {"feathering": feather}
    graph["5"]["inputs"]["seed"], graph["6"]["inputs"]["steps"] = seed, steps
    for loader in ("1", "2", "3"):
        graph[loader]["inputs"]["dtype"] = "float32"
    graph["20"] = {"class_type": "SaveLatent", "inputs": {"samples": [DENOISE, 0], "filename_prefix": "outpaint"}}
    graph["21"] = {"class_type": "SaveLatent", "inputs": {"samples": [ENCODE, 0], "filename_prefix": "canvas"}}
    return graph


def run(comfy, graph: dict) -> tuple[dict, dict]:
    """(the saved latents by node id, the history's outputs)."""
    entry = comfy.client.history(comfy.client.run(graph).prompt_id)
    return {k: v.float() for k, v in graphs.saved_latents(comfy.base, entry).items()}, entry["outputs"]


def engine_encode(comfy, pixels: np.ndarray) -> torch.Tensor:
    """The engine's latent of an [H, W, 3] picture in 0..1, with the autoencoder file the workflow loads."""
    from flux2_core import weights

    ae = weights.load_autoencoder(comfy.base / "models" / "vae" / json.loads(WORKFLOW.read_text())["3"]["inputs"]
                                  ["ae_name"], "cpu", torch.float32)
    with torch.no_grad():
        return ae.encode(torch.from_numpy(pixels).float().permute(2, 0, 1)[None] * 2 - 1)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def outpainted(comfy):
    source = np.asarray(Image.open(comfy.base / "input" / comfy.images[0]).convert("RGB")) / 255.0   # 128 x 96
    latents, outputs = run(comfy, outpaint_graph(comfy.images[0]))
    return source, latents, outputs


def test_the_canvas_is_the_picture_on_grey_on_the_grid(comfy, outpainted):
    source, latents, outputs = outpainted
    left, top, right, bottom = SIDES
    height, width = source.shape[0] + top + bottom, source.shape[1] + left + right     # 112 x 208: on the grid
    canvas = np.full((height, width, 3), 0.5)
    canvas[top:top + source.shape[0], left:left + source.shape[1]] = source
    expected = engine_encode(comfy, canvas)
    assert latents["21"].shape == latents["20"].shape == expected.shape == (1, 128, height // 16, width // 16)
    err = relative(latents["21"], expected)
    print(f"\nthe graph's encoded canvas vs the engine's encode of the padded picture: relative {err:.3g}")
    assert err <= 1e-5
    assert "text" not in outputs.get(DENOISE, {})            # no note: the mask fits the latent as it is


def test_the_picture_is_kept_and_the_added_area_painted(comfy, outpainted):
    source, latents, _ = outpainted
    left, top, right, bottom = SIDES
    canvas = np.full((source.shape[0] + top + bottom, source.shape[1] + left + right, 3), 0.5)
    canvas[top:top + source.shape[0], left:left + source.shape[1]] = source
    expected = engine_encode(comfy, canvas)[0]
    result = latents["20"][0]
    rows, columns = result.shape[-2:]
    # the picture's cells, each whole 16 x 16 cell at least FEATHER pixels from every side that grew (the mask is 0
    # on all its pixels): rows from y = 48, columns x = 64 .. 127; the added cells: the strips the pad node put on
    cell = np.arange(max(rows, columns)) * 16
    keep_rows = (cell[:rows] >= top + FEATHER) & (cell[:rows] + 16 <= top + source.shape[0])
    keep_columns = (cell[:columns] >= left + FEATHER) & (cell[:columns] + 16 <= left + source.shape[1] - FEATHER)
    kept = torch.from_numpy(keep_rows[:, None] & keep_columns[None, :])
    added = torch.ones(rows, columns, dtype=torch.bool)
    added[top // 16:(top + source.shape[0]) // 16, left // 16:(left + source.shape[1]) // 16] = False
    assert kept.sum() == 16 and added.sum() == rows * columns - 6 * 8
    err = ((result - expected)[:, kept].abs().max() / expected.abs().max()).item()
    print(f"\nkept cells: max |outpainted - engine's canvas latent| / max = {err:.3g}")
    assert err <= 1e-5                               # the Euler steps land on the picture up to float rounding
    painted = (result - expected)[:, added].abs().amax(dim=0)           # per added cell
    assert bool((painted > 1e-2 * expected.abs().max()).all()), painted   # every added cell is painted anew


def test_pads_off_the_grid_give_a_working_result(comfy):
    # 8 pixels on the left (the pad node's step): a 136 x 96 canvas, encoded as its 128 x 96 centre; the mask is cut
    # the same way (no stretching, so no note)
    latents, outputs = run(comfy, outpaint_graph(comfy.images[0], sides=(8, 0, 0, 0), seed=4, steps=2))
    assert latents["20"].shape == latents["21"].shape == (1, 128, 6, 8)
    assert "text" not in outputs.get(DENOISE, {})
    assert relative(latents["20"], latents["21"]) > 1e-2                 # the left edge was painted
