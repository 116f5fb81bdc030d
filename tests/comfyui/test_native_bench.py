"""bench/native.py in working order: our Denoise node against ComfyUI's native FLUX.2 sampler inside one ComfyUI
process, on bench.py's tiny config. It runs in ComfyUI's own Python (COMFYUI_PYTHON) and needs no server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The parity tests' bound for ComfyUI's native FLUX.2 graph against our denoiser in float32 (test_parity.py,
# test_comfyui_native_flux2_graph_agrees: max |diff| over the largest value, at most 1e-4, 3 to 5 steps). The bench
# runs the same two samplers on the same noise, sigmas and prompt embeddings, for 2 steps: no looser.
NATIVE_AGREES = 1e-4


def test_native_bench_times_both_sides_and_they_agree(tmp_path):
    out = tmp_path / "native.json"
    command = [os.environ.get("COMFYUI_PYTHON", sys.executable), str(ROOT / "bench" / "native.py"),
               "--comfyui", os.environ["COMFYUI_DIR"], "--config", "tiny", "--steps", "2", "--repeats", "1",
               "--dtype", "float32", "--json", str(out)]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    print(result.stdout)

    report = json.loads(out.read_text())
    assert (report["config"], report["steps"], report["repeats"], report["dtype"]) == ("tiny", 2, 1, "float32")
    for side in ("native", "ours"):
        timing = report["sides"][side]
        assert timing["compute_dtype"] == "float32"
        assert len(timing["call_s"]) == 1 and timing["call_s"][0] > 0
        assert 0 < timing["step_best_s"] <= timing["step_median_s"]
    assert report["ratio"]["median"] > 0
    assert report["latent_rel_diff"] <= NATIVE_AGREES, report["latent_rel_diff"]
