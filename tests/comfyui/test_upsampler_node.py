"""FLUX 3 Image Klein's prompt upsampler node in ComfyUI's own Python (upsampler_probe.py)."""

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tests.comfyui.host import PACK_FOLDER

HERE = Path(__file__).resolve().parent


def test_the_upsampler_node_answers_as_the_engine(comfy, tmp_path):
    """The node lists the folder in models/prompt_upsamplers, its answers (a request with the Layout node's boxes; an
    edit with one picture and a batch of two) equal PromptUpsampler's on the same pictures (itself equal to mlx-vlm's
    upsampler), Prompt Encode refuses the same boxes a second time, and an interrupt stops it."""
    from flux2_core.upsampler.model import PromptUpsampler
    from tests.test_flux3 import flux3_files
    from tests.tiny.upsampler import save_tiny_upsampler

    folder = save_tiny_upsampler(tmp_path / "prompt_upsamplers" / "bfl" / "flux-3-image-klein-pup")
    _, _, encoder, _ = flux3_files(tmp_path / "flux3", flow_map=True)
    result = subprocess.run([comfy.server.python, str(HERE / "upsampler_probe.py"),
                             str(comfy.base / "custom_nodes" / PACK_FOLDER), str(tmp_path / "prompt_upsamplers"),
                             str(encoder)],
                            cwd=comfy.server.comfy_dir, env=dict(os.environ, PYTHONPATH=str(comfy.server.stubs)),
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["choices"] == [str(Path("bfl") / "flux-3-image-klein-pup")]
    ours = PromptUpsampler(folder, device="cpu", dtype=torch.float32)
    boxes = [{"desc": "a kite", "bbox": [0.1, 0.05, 0.6, 0.4]}]
    assert report["text"] == ours("a red fox in the snow", boxes=boxes).prompt
    pictures = [picture(90, 60, 1), picture(40, 64, 2), picture(40, 64, 3)]
    assert report["edit"] == ours("a red fox in the snow", pictures).prompt
    assert "already ends in a box table" in report["twice"]
    assert report["interrupted"] == "InterruptProcessingException"
    # a box past the picture's edge goes on drawn to the edge (y_min -0.1, x_max 1.2): the node says so
    sun = "box 'sun' reaches past the picture's edge (bbox): it is drawn to the edge"
    assert sun in report["wide_shown"] and "reaches past" not in report["shown"]
    assert '"bbox": [0, 700, 300, 1000]' in report["wide_shown"]             # the clamped row in its answer's table


def picture(width: int, height: int, seed: int) -> Image.Image:
    """The probe's picture as the file it would come from: the same uint8 pixels."""
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(np.ascontiguousarray(
        torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy()))

