"""Every API workflow of workflows/api/ runs in the real server through the headless client and yields images.

The model files and input images the workflows name exist as tiny stand-ins (see base_dir.stage_workflow_files);
only the image size is made small (--set NODE.width/height=64), so each run takes seconds on a CPU.
"""

import json
from pathlib import Path

import pytest
from PIL import Image

from flux2_core.app import queue_client, queue_command

ROOT = Path(__file__).resolve().parents[2]
API_FILES = sorted((ROOT / "workflows" / "api").glob("*.json"))


def test_there_are_workflows():
    assert len(API_FILES) >= 7, API_FILES


@pytest.mark.parametrize("path", API_FILES, ids=lambda p: p.stem)
def test_api_workflow_runs_and_yields_images(comfy, path, tmp_path, capsys):
    workflow = json.loads(path.read_text())
    small = [f"{nid}.{k}=64" for nid, node in workflow.items() for k in ("width", "height")
             if isinstance(node["inputs"].get(k), int)]
    seed = 7 + API_FILES.index(path)     # one seed per workflow: a graph another one shares is run, not cached
    argv = [str(path), "--server", comfy.server.address, "--out", str(tmp_path), "--prompt", "a tiny test prompt",
            "--seed", str(seed), *[arg for item in small for arg in ("--set", item)]]
    code = queue_command.main(argv)
    out = capsys.readouterr()
    assert code == 0, out.err + comfy.server.log()[-4000:]
    steps = [line.split("step ")[1] for line in out.out.splitlines() if "step " in line]
    assert steps and steps[-1].split("/")[0] == steps[-1].split("/")[1], out.out    # progress reached the last step
    images = sorted(tmp_path.glob("*.png"))
    assert [str(p) for p in images] == [line for line in out.out.splitlines() if line.endswith(".png")]
    assert len(images) == 1
    with Image.open(images[0]) as image:
        assert image.format == "PNG" and image.size[0] % 16 == 0 and image.size[1] % 16 == 0
        sent = json.loads(image.text["prompt"])          # SaveImage embeds the prompt it ran
    positive = queue_client.prompt_nodes(workflow)
    assert positive and all(sent[nid]["inputs"]["prompt"] == "a tiny test prompt" for nid in positive)
    assert [n["inputs"]["seed"] for n in sent.values() if "seed" in n["inputs"]] == [seed]


def test_flux3_workflows_run_on_flux3_stand_ins(comfy):
    """The FLUX 3 workflows' files stand in for FLUX 3 ones (so their runs above are FLUX 3 runs, with the
    Qwen3-VL encoder), not for FLUX.2's under another name."""
    from tests.comfyui.base_dir import FILES

    flux3 = [p for p in API_FILES if p.stem.startswith("flux3-")]
    assert len(flux3) == 3
    for path in flux3:
        inputs = {k: v for node in json.loads(path.read_text()).values() for k, v in node["inputs"].items()}
        models = comfy.base / "models"
        assert (models / "diffusion_models" / inputs["model_name"]).samefile(
            models / "diffusion_models" / FILES["transformer_flux3"])
        assert (models / "text_encoders" / inputs["text_encoder_name"]).samefile(
            models / "text_encoders" / FILES["text_encoder_flux3"])
