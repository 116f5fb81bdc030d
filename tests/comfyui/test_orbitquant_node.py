"""An OrbitQuant artifact in the real server: its folder in models/diffusion_models is listed by the model loader as one
entry, and a graph on it gives the picture of the same graph on the float model holding orbitquant's dequantized
weights; the server's Python needs no orbitquant (the engine reads the artifact itself). The artifact is written here
by orbitquant's own quantizer (in the test's Python) from the server's tiny transformer."""

from __future__ import annotations

import copy
import io
import shutil

import numpy as np
import pytest
from PIL import Image

from tests.comfyui import graphs

pytest.importorskip("orbitquant", reason="orbitquant (the format's own library) writes the artifact")

CASE = {"prompt": "a red fox in the snow, orbitquant test", "seed": 5, "steps": 3, "width": 64, "height": 48}
FOLDER = "flux-2-klein-tiny-orbitquant-w4"
TWIN = "flux-2-klein-tiny-orbitquant-dequantized"


@pytest.fixture(scope="module")
def artifact(comfy, tmp_path_factory):
    """(the artifact's folder name, the float twin's folder name) in models/diffusion_models, removed after."""
    from flux2_core import weights
    from tests.test_orbitquant import float_twin
    from tests.tiny.orbitquant import quantize
    from tests.tiny.transformer import diffusers_transformer_from_bfl_file

    models = comfy.base / "models" / "diffusion_models"
    tmp = tmp_path_factory.mktemp("oq-host")
    source = models / comfy.files["transformer"]
    theirs = diffusers_transformer_from_bfl_file(source, weights.inspect_transformer(source)[0], tmp / "config")
    quantize(theirs, models / FOLDER, 4, "flux2")
    float_twin(copy.deepcopy(theirs)).save_pretrained(models / TWIN)
    yield FOLDER, TWIN
    shutil.rmtree(models / FOLDER)
    shutil.rmtree(models / TWIN)


def picture(comfy, model_file: str) -> tuple[np.ndarray, dict]:
    run = comfy.client.run(graphs.ours(comfy.files, **CASE, model_file=model_file))
    (png,) = comfy.client.image_bytes(run.prompt_id)
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int), comfy.client.history(run.prompt_id)


def test_an_artifact_folder_runs_as_the_float_model_of_its_weights(comfy, artifact):
    folder, twin = artifact
    listed = comfy.client.get_json("/object_info/Flux2KleinModelLoader")["Flux2KleinModelLoader"]["input"][
        "required"]["model_name"][1]["options"]
    assert folder in listed and not any(name.startswith(folder + "/") for name in listed), listed
    ours, history = picture(comfy, folder)
    want, _ = picture(comfy, twin)
    assert ours.shape == want.shape == (CASE["height"], CASE["width"], 3)
    assert np.abs(ours - want).max() <= 1                   # the same values, up to rounding at a level boundary
    (info,) = history["outputs"]["1"]["text"]
    assert "orbitquant" in info, info
