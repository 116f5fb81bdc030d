"""The engine's public API (flux2_core/__init__.py) and the README's Python example, run on tiny weight files."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import flux2_core

ROOT = Path(__file__).resolve().parents[1]


def test_every_public_name_is_the_engines_own_and_importing_stays_light():
    from flux2_core import errors, pipeline, weights

    assert flux2_core.generate is pipeline.generate and flux2_core.load_models is pipeline.load_models
    assert flux2_core.load_autoencoder is weights.load_autoencoder and flux2_core.Flux2Error is errors.Flux2Error
    assert sorted(flux2_core.__all__) == sorted(flux2_core.API) and set(flux2_core.__all__) <= set(dir(flux2_core))
    light = subprocess.run([sys.executable, "-c", "import sys, flux2_core; print('torch' in sys.modules)"],
                           capture_output=True, text=True, check=True, cwd=ROOT)
    assert light.stdout.strip() == "False"


def test_the_readme_python_example_runs(tmp_path, monkeypatch):
    """The README's example as written, with its three file names pointing at tiny random weights."""
    from tests.tiny.autoencoder import build_diffusers_autoencoder, save_bfl_autoencoder
    from tests.tiny.text_encoder import build_tiny_qwen3, save_comfyui_text_encoder
    from tests.tiny.transformer import TINY_TRANSFORMER, random_bfl_transformer_state_dict, save_bfl_transformer

    readme = (ROOT / "README.md").read_text()
    example = re.findall(r"```python\n(.*?)```", readme, re.DOTALL)[0]         # the first: generate
    monkeypatch.chdir(tmp_path)
    save_bfl_transformer(random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=1),
                         tmp_path / "flux-2-klein-4b.safetensors")
    save_comfyui_text_encoder(build_tiny_qwen3(seed=2), tmp_path / "qwen_3_4b.safetensors")
    save_bfl_autoencoder(build_diffusers_autoencoder(seed=3), tmp_path / "flux2-vae.safetensors")
    example = example.replace("width=1024, height=768", "width=64, height=48")     # tiny weights, tiny picture
    namespace = {}
    exec(compile(example, "README.md", "exec"), namespace)                        # noqa: S102 - our own README
    assert (tmp_path / "fox.png").exists()
    assert namespace["result"].images.shape == (1, 48, 64, 3)
