"""FLUX 3 Image Klein through our nodes in ComfyUI's own Python (flux3_probe.py)."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import save_file

from flux2_core.families.flux2.schedule import flux2_schedule
from flux2_core.families.flux3.schedule import flux3_schedule
from tests.comfyui.host import PACK_FOLDER

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("flow_map,cfg,edit", [(True, 1.0, False), (False, 3.5, False), (True, 1.0, True)],
                         ids=["distilled", "base-cfg", "edit-with-boxes"])
def test_flux3_runs_through_our_nodes_as_the_engine_runs_it(comfy, tmp_path, flow_map, cfg, edit):
    """Tiny FLUX 3 files (a transformer behind ComfyUI's prefix, a Qwen3-VL folder, the FLUX.2 autoencoder): our
    loaders read them (the text encoder known as Qwen3-VL from its folder), Prompt Encode pads each prompt to its own
    multiple of 80, Denoise draws FLUX 3's noise from the Noise node's seed and (with CFG against the shorter
    empty negative for the base) and AE Decode give the latents and pixels pipeline.generate gives (itself proven against
    flux3-mlx); FLUX.2 Klein to MODEL refuses the model, as ComfyUI 0.12.1 has no FLUX 3 model. The edit: the Layout
    node's boxes in the prompt, and Reference nodes sizing pictures as FLUX 3 does (one alone on its padded canvas,
    then both at 1 MP once a second is chained), each run equal to generate with the same boxes and references."""
    from tests.test_flux3 import flux3_files

    _, state, te, ae = flux3_files(tmp_path, flow_map)
    transformer = tmp_path / "diffusion_models" / "flux3-image-klein-tiny.safetensors"
    transformer.parent.mkdir()
    save_file({"model.diffusion_model." + k: v for k, v in state.items()}, str(transformer))
    result = subprocess.run([comfy.server.python, str(HERE / "flux3_probe.py"),
                             str(comfy.base / "custom_nodes" / PACK_FOLDER), str(transformer), str(te), str(ae),
                             str(cfg), *(["edit"] if edit else [])],
                            cwd=comfy.server.comfy_dir, env=dict(os.environ, PYTHONPATH=str(comfy.server.stubs)),
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert (report["model"], report["variant"], report["encoder"]) == ("Flux3Transformer", "custom", "qwen3-vl")
    assert report["tokens"] == [240 if edit else 160, 80]           # the boxes' rows are part of the prompt
    assert [run["references"] for run in report["runs"]] == ([1, 2] if edit else [0])
    for run in report["runs"]:
        assert run["cfg"] == cfg
        assert run["latents_max_diff"] <= 1e-6 * run["latents_max"] and run["pixels_max_diff"] <= 1, run
    if edit:      # 80x50 alone: fitted as is on an 80x64 canvas; with the second: centre-cropped to 80x48
        assert report["reference_shapes"] == [[1, 128, 3, 5], [1, 128, 4, 2]]
    assert "ComfyUI has no model of FLUX 3 Image Klein" in report["to_model"]
    assert "runs in bfloat16 or float32, not in float16" in report["float16"]      # the loader, asked for float16
    # a fresh Scheduler, the model connected, gives FLUX 3's schedule (the runs above used it), as its flux3 option
    assert report["schedule_default"] == "model's own"
    assert report["sigmas"] == report["named_sigmas"] == pytest.approx(flux3_schedule(3), abs=1e-7)
    assert report["sigmas"] != pytest.approx(flux2_schedule(3, 4 * 3), abs=1e-3)
