"""The main job under torchrun: `torchrun --nproc-per-node N -m flux2_core --demo ...` on CPU gloo ranks gives the
pictures one process gives (sequence parallel: the same image; data parallel: the same files, shared out), and says
what is wrong when the ranks cannot work together."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flux2_core.app import cli
from flux2_core.errors import Flux2Error

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def run(*args, ranks: int = 0, cwd: Path):
    """The CLI in one process (ranks 0) or under torchrun with ``ranks`` processes."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "flux2_core"] if not ranks else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m", "flux2_core"]
    return subprocess.run([*launch, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
                          check=False)


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im).astype(int)


def parameters(path: Path) -> dict:
    with Image.open(path) as im:
        return json.loads(im.text["parameters"])


def test_sequence_parallel_makes_the_image_one_process_makes(tmp_path):
    one = run("--demo", "--prompt", "a red fox", "--seed", "7", "--out", "one", cwd=tmp_path)
    two = run("--demo", "--prompt", "a red fox", "--seed", "7", "--out", "two", ranks=2, cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["flux2_7.png"]      # rank 0 alone writes
    a, b = pixels(tmp_path / "one" / "flux2_7.png"), pixels(tmp_path / "two" / "flux2_7.png")
    # latents equal to float32 rounding (tests/test_parallel.py); the uint8 truncation may flip a rare pixel by 1
    assert np.abs(a - b).max() <= 1 and (a != b).mean() < 0.01
    assert parameters(tmp_path / "two" / "flux2_7.png")["parallel"] == "sequence, 2 ranks"


def test_flux3_runs_sequence_parallel_from_its_files(tmp_path):
    """FLUX 3 Image Klein files (BFL's names, a Qwen3-VL folder, the FLUX.2 autoencoder) with two references, on two
    ranks: the image one process makes; with the step cache, the driver decides, so the ranks skip the steps one
    process skips (a skipped step calls no rank)."""
    from dataclasses import replace

    from safetensors.torch import save_file

    from flux2_core.families.flux3.transformer import Flux3Transformer
    from tests.tiny.autoencoder import build_diffusers_autoencoder, save_bfl_autoencoder
    from tests.tiny.flux3 import TINY_FLUX3, save_tiny_qwen3_vl

    model = Flux3Transformer(replace(TINY_FLUX3, context_in_dim=8 * 32))       # 8 layers of the tiny 32-wide tower
    g = torch.Generator().manual_seed(5)
    save_file({k: torch.randn(v.shape, generator=g) * (0.3 if v.ndim > 1 else 0.1) + (v.ndim == 1)
               for k, v in model.state_dict().items()}, str(tmp_path / "flux3-image-klein.safetensors"))
    save_tiny_qwen3_vl(tmp_path / "te", seed=1)
    save_bfl_autoencoder(build_diffusers_autoencoder(2), tmp_path / "ae.safetensors")
    for i, size in enumerate([(40, 30), (32, 48)]):
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(
            tmp_path / f"ref{i}.png")
    args = ("--transformer", "flux3-image-klein.safetensors", "--text-encoder", "te", "--ae", "ae.safetensors",
            "--prompt", "a fox", "--width", "64", "--height", "48", "--steps", "12", "--seed", "4", "--device", "cpu",
            "--dtype", "float32", "--ref", "ref0.png", "--ref", "ref1.png", "--cache", "1.0")
    one = run(*args, "--out", "one", cwd=tmp_path)
    two = run(*args, "--out", "two", ranks=2, cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    a, b = pixels(tmp_path / "one" / "flux2_4.png"), pixels(tmp_path / "two" / "flux2_4.png")
    assert a.shape == (48, 64, 3) and np.abs(a - b).max() <= 1 and (a != b).mean() < 0.01
    assert parameters(tmp_path / "two" / "flux2_4.png")["parallel"] == "sequence, 2 ranks"
    record = parameters(tmp_path / "one" / "flux2_4.png")["cache"]
    assert record["skipped"] > 0 and parameters(tmp_path / "two" / "flux2_4.png")["cache"] == record


def test_data_parallel_shares_out_prompts_and_batch(tmp_path):
    args = ["--demo", "--prompt", "a red fox", "--prompt", "a cat", "--batch", "3", "--seed", "4"]
    one = run(*args, "--out", "one", cwd=tmp_path)
    two = run(*args, "--parallel", "data", "--out", "two", ranks=2, cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert names == [f"flux2_p{p}_{s}.png" for p in (1, 2) for s in (4, 5, 6)]
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == names
    for name in names:
        assert np.abs(pixels(tmp_path / "one" / name) - pixels(tmp_path / "two" / name)).max() <= 1, name
        assert parameters(tmp_path / "two" / name)["prompt"] == ("a red fox" if "_p1_" in name else "a cat")
    assert "3 image(s)" in two.stderr and "(rank 1 of 2)" in two.stderr


def test_ranks_that_do_not_divide_the_heads_are_refused(tmp_path):
    three = run("--demo", "--prompt", "x", "--out", "out", ranks=3, cwd=tmp_path)
    assert three.returncode != 0
    assert "3 ranks do not divide this model's 2 attention heads: use 2 ranks" in three.stderr
    assert str(ROOT / "flux2_core") not in three.stderr        # torchrun reports the failed ranks; ours say why
    assert not list((tmp_path / "out").glob("*.png"))


@pytest.mark.parametrize(("option", "says"), [(["--compile"], "--compile does not run across several processes"),
                                              (["--offload", "blocks"], "--offload blocks does not run across")])
def test_options_that_cannot_run_across_ranks_are_named(monkeypatch, option, says):
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = cli.build_parser().parse_args(["--prompt", "x", *option])
    with pytest.raises(Flux2Error, match=says):
        cli.join_ranks(args)


def test_image_jobs_share_prompts_and_seeds_contiguously():
    assert cli.image_jobs(1, 4, 10) == [(0, 10, 4)]
    assert cli.image_jobs(2, 3, 0, rank=0, world=2) == [(0, 0, 3)]
    assert cli.image_jobs(2, 3, 0, rank=1, world=2) == [(1, 0, 3)]
    assert cli.image_jobs(2, 2, 5, rank=0, world=3) == [(0, 5, 2)]
    assert cli.image_jobs(2, 2, 5, rank=1, world=3) == [(1, 5, 1)]
    assert cli.image_jobs(2, 2, 5, rank=2, world=3) == [(1, 6, 1)]
    every = [job for rank in range(3) for job in cli.image_jobs(3, 5, 0, rank=rank, world=3)]
    assert sum(count for _, _, count in every) == 15
