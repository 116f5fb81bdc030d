"""The device mode's switch (``tests/device.py``): its parsing, its tolerance rule, and one parity test run under
FLUX2_TEST_DTYPE=bfloat16 in a child pytest, so the mode cannot silently stop working."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import device

ROOT = Path(__file__).resolve().parents[1]


def test_tolerances_keep_the_float32_bounds_and_scale_with_the_unit_roundoff():
    for kind in ("transformer", "autoencoder", "text_encoder", "denoise"):
        assert device.tolerance(kind, torch.float32) == 1e-4          # what every parity test always used
    # bf16 rounds to 8 significant bits (u = 2^-8), fp16 to 11 (u = 2^-11); n layers -> n u
    assert device.tolerance("transformer", torch.bfloat16) == 6 * 2.0 ** -8
    assert device.tolerance("text_encoder", torch.bfloat16) == 27 * 2.0 ** -8
    assert device.tolerance("denoise", torch.float16) == 128 * 2.0 ** -11
    assert device.image_levels(torch.float32) == 1 and device.image_levels(torch.bfloat16) is None
    with pytest.raises(KeyError, match="unknown tolerance kind 'vae'"):
        device.tolerance("vae")


def test_bad_settings_are_refused_with_the_variable_named():
    assert device.parse_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="FLUX2_TEST_DTYPE='bf16' is not one of float32, bfloat16, float16"):
        device.parse_dtype("bf16")
    with pytest.raises(ValueError, match="FLUX2_TEST_DEVICE='gpu' is not a torch device"):
        device.parse_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA device"):
            device.parse_device("cuda")


@pytest.mark.slow
def test_bfloat16_mode_runs_a_parity_test_in_bfloat16():
    """A child pytest with FLUX2_TEST_DTYPE=bfloat16 runs one transformer parity test: the header names the mode, the
    test (which asserts our output's dtype is the mode's) passes, and the error it prints is bf16-sized: a float32
    forward agrees with diffusers to about 1e-6, a bf16 one only to about 1e-3..1e-2."""
    env = {**os.environ, "FLUX2_TEST_DTYPE": "bfloat16", "FLUX2_TEST_DEVICE": "cpu"}
    test = "tests/test_transformer.py::test_forward_matches_diffusers[sigmas0]"
    run = subprocess.run([sys.executable, "-m", "pytest", "-s", "-p", "no:cacheprovider", test], check=False,
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "device mode: FLUX2_TEST_DEVICE=cpu FLUX2_TEST_DTYPE=bfloat16" in out and "1 passed" in out
    diff = float(re.search(r"max rel diff ([0-9.e+-]+)", out).group(1))
    assert 2.0 ** -12 < diff <= device.tolerance("transformer", torch.bfloat16), diff
