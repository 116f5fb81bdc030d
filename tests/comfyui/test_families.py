"""A second model family through our nodes in ComfyUI's own Python (family_probe.py): the proof that the nodes ask
the family registry rather than assume FLUX.2."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.comfyui.host import PACK_FOLDER
from tests.toy_family import ToyModel, ToyParams
from tests.toy_family.schedule import toy_schedule

HERE = Path(__file__).resolve().parent


def test_a_second_family_runs_through_our_nodes_as_the_engine_runs_it(comfy, tmp_path):
    """A toy transformer file (tests/toy_family/) beside the tiny Qwen3 and autoencoder: our loader reads it through
    the toy's entry into a plain holder (ComfyUI has no model of it), Prompt Encode, Noise, Scheduler, Denoise with CFG
    and AE Decode give the latents and pixels pipeline.generate gives on the same files (the toy's own schedule, noise
    reading and prompt padding), with a reference too (the toy's K/V-style references, made once for two runs), and
    FLUX.2 Klein to MODEL refuses the toy's model, saying what to use."""
    g = torch.Generator().manual_seed(3)
    toy_file = tmp_path / "diffusion_models" / "toy.safetensors"
    toy_file.parent.mkdir()
    save_file({k: torch.randn(v.shape, generator=g) / v.shape[1] ** 0.5
               for k, v in ToyModel(ToyParams()).state_dict().items()}, str(toy_file))
    models = comfy.base / "models"
    result = subprocess.run([comfy.server.python, str(HERE / "family_probe.py"),
                             str(comfy.base / "custom_nodes" / PACK_FOLDER), str(toy_file),
                             str(models / "text_encoders" / comfy.files["text_encoder"]),
                             str(models / "vae" / comfy.files["ae"])],
                            cwd=comfy.server.comfy_dir, env=dict(os.environ, PYTHONPATH=str(comfy.server.stubs)),
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert (report["model"], report["variant"], report["holder"]) == ("ToyModel", "toy", "Flux2KleinTransformer")
    assert report["latents_max_diff"] <= 1e-6 * report["latents_max"] and report["pixels_max_diff"] <= 1
    # the Scheduler's model's own, which those latents ran with, is the toy's schedule, though the toy has no option
    # of its own in the node's list
    assert report["sigmas"] == report["named_sigmas"] == pytest.approx(toy_schedule(3, 2 * 3)) and not report["listed"]
    # with a reference, taken as K/V: both runs equal generate, the reference changed the picture, and the reference
    # pass ran once over its 4 x 6 latent cells (the second run reused the K/V)
    assert all(diff <= 1e-6 * report["edit_max"] for diff in report["edit_max_diffs"])
    assert report["edit_changed"] > 1e-3 * report["edit_max"]
    assert report["reference_passes"] == [[1, 24, 128]]
    assert "ComfyUI has no model of Toy" in report["to_model"] and "Klein Denoise" in report["to_model"]
