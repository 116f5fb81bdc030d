"""The test suite's device mode: one switch for the device and dtype our models run in during the tests.

    FLUX2_TEST_DEVICE=cuda FLUX2_TEST_DTYPE=bfloat16 python -m pytest -q

``FLUX2_TEST_DEVICE`` (default ``cpu``) and ``FLUX2_TEST_DTYPE`` (``float32``, the default, ``bfloat16`` or
``float16``). The default is what CI runs, and there every bound is exactly the float32 bound the test always had.

What runs where, in every mode:

* our models (transformer, autoencoder, text encoder, fp8 layers, compiled blocks, the caches over them) run in
  ``DTYPE`` on ``DEVICE``; the pipeline keeps its autoencoder in float32, as ``pipeline.load_models`` does;
* the oracle (diffusers 0.42.1 / transformers) runs in float32 on ``DEVICE``, and our result is compared with it.
  In low precision this measures what matters, how far our bf16 result is from the exact computation. Running the
  oracle in bf16 too would compare two independent rounding noises, and a bound on their difference says little about
  either; comparing with float32 keeps the bound a bound on our error alone;
* tests of code that exists only on the CPU (tokenizer, file parsing, oneDNN linears, the float32 formulas) stay on
  the CPU in float32; a test that cannot run on the chosen device skips and says why (``needs_cpu``).

On CUDA, float32 means float32: TF32 matmuls and convolutions are switched off (``tests/conftest.py``), or the float32
oracle itself would carry ~1e-3 errors.
"""

from __future__ import annotations

import os

import pytest
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"FLUX2_TEST_DTYPE={name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


def parse_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"FLUX2_TEST_DEVICE={name!r} is not a torch device (cpu, cuda, cuda:1, ...): {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"FLUX2_TEST_DEVICE={name!r} but torch {torch.__version__} sees no CUDA device")
    return device


DEVICE = parse_device(os.environ.get("FLUX2_TEST_DEVICE", "cpu"))
DTYPE = parse_dtype(os.environ.get("FLUX2_TEST_DTYPE", "float32"))
DEFAULT_MODE = DEVICE.type == "cpu" and DTYPE == torch.float32


def describe() -> str:
    return f"device mode: FLUX2_TEST_DEVICE={DEVICE} FLUX2_TEST_DTYPE={str(DTYPE).removeprefix('torch.')}"


# ---------------------------------------------------------------------------------------------------------------
# Tolerances: one rule for every mode
# ---------------------------------------------------------------------------------------------------------------
#
# tolerance(kind) = max(FLOAT32[kind], STAGES[kind] * unit_roundoff(DTYPE))
#
# FLOAT32 holds the bound each parity test has always used (float32, CPU). In float32 the second term is at most
# 128 * 2^-24 = 7.6e-6 and never the larger one, so the default mode keeps those bounds exactly.
#
# In low precision every stored result is rounded to the dtype's significand: bf16 keeps 8 bits (7 stored + the
# implicit one), so one rounding moves a value by up to u = 2^-8 = 3.9e-3 of itself; fp16 keeps 11 bits, u = 2^-11.
# The weights and inputs are rounded once, and every layer adds its own rounding error to what flows on (the
# residual stream, or the next convolution's input). We bound the error after n layers by n u: the errors of
# independent roundings would add like a random walk (sqrt(n) u typical), the linear sum is the bound for errors
# that line up. STAGES counts the layers a value passes through; the bounds are measured in our relative measure
# (largest element error over the largest reference value). The CPU bf16 errors seen when they were set follow each
# entry, in units of u.
FLOAT32 = {
    "transformer": 1e-4,     # one forward vs diffusers, max|ours - theirs| / max|theirs|
    "autoencoder": 1e-4,     # encode or decode vs diffusers, same measure
    "text_encoder": 1e-4,    # prompt embeddings vs diffusers, same measure
    "denoise": 1e-4,         # latents after a whole sampling run (several steps) vs diffusers, same measure
}
STAGES = {
    # tiny transformer: input embedders, 2 double and 2 single blocks, final layer: 6 layers -> 6 u = 0.023 in bf16.
    # Seen: forward 1.7-2.2 u, the cached reference K/V 3.0 u. (The KV and joint schemes differ by 8 u on the test's
    # inputs, so the bound still tells them apart.)
    "transformer": 6,
    # tiny AE: encode = conv_in, 8 resnets, 3 downsamples, the mid block (2 resnets, attention), conv_out, quant_conv
    # = 17 layers; decode = post_quant_conv, conv_in, mid block (3), 12 resnets, 3 upsamples, conv_out = 21
    # -> 20 u = 0.078. Seen: encode 6.0 u, decode 5.7 u.
    "autoencoder": 20,
    # Qwen3: the deepest hidden state read (layer 27) has passed 27 layers -> 27 u = 0.105. Seen: 6.5 u.
    "text_encoder": 27,
    # A whole sampling run. Each step's velocity error moves the next step's input, and the tiny random models'
    # velocity field is rough (no training smoothed it), so a small input change moves the output a lot; CFG 4
    # multiplies the difference of its two passes by 4 (an error gain up to 1 + 2 * 4 = 9 per step). Seen: 8-14 u with
    # one pass per step (distilled, KV; 4 steps), 30-117 u with CFG 4 or joint references (2-3 steps, worst: base
    # CFG 4 over 3 steps, 0.457). The bound, 128 u = 0.5, catches only gross errors (a wrong schedule, CFG formula or
    # reference scheme moves the latents by about 100 %). The first step of every run, one forward from the same
    # noise, keeps the tight "transformer" bound (tests/test_sampling.py).
    "denoise": 128,
}


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1 to the next number: the largest relative error of one round-to-nearest."""
    return torch.finfo(dtype).eps / 2


def tolerance(kind: str, dtype: torch.dtype | None = None) -> float:
    """The bound for ``kind`` in ``dtype`` (default: the mode's DTYPE); see the rule above."""
    if kind not in FLOAT32:
        raise KeyError(f"unknown tolerance kind {kind!r}; known: {', '.join(FLOAT32)}")
    return max(FLOAT32[kind], STAGES[kind] * unit_roundoff(DTYPE if dtype is None else dtype))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max|actual - expected| / max|expected|, in float32: the measure every parity bound is stated in."""
    actual, expected = actual.float(), expected.float().to(actual.device)
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, kind: str, *, rtol: float, atol: float) -> None:
    """Our model computed two ways (batched and one by one, loaded two ways, ...), with the depth of computation
    ``kind``. In float32 exactly the test's own elementwise bound, ``torch.testing.assert_close(rtol, atol)``. In low
    precision the kernels of the two ways may round differently; each result is within tolerance(kind) of the exact
    value, so the two are within twice that of each other."""
    if DTYPE == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
        return
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    err, bound = relative_error(actual, expected), 2 * tolerance(kind)
    print(f"{kind}, two ways: max rel diff {err:.2e}")
    assert err <= bound, f"max rel diff {err:.3g} > {bound:.3g} ({kind}, two ways, {DTYPE})"


def image_levels(dtype: torch.dtype | None = None) -> int | None:
    """The bound on uint8 images of two runs whose latents agree within tolerance("denoise"), or None where the
    images say nothing more than the latents. float32: one level (one side rounds, the other truncates). Low
    precision: None; the tiny random decoder turns the latent error of a whole run into up to 190 of 255 levels
    (bf16, CPU, CFG 4), so the latent bound is the check and the images are not compared."""
    return 1 if (DTYPE if dtype is None else dtype) == torch.float32 else None


def needs_cpu(reason: str):
    """Skip a test outside CPU mode, saying why it cannot run on DEVICE."""
    return pytest.mark.skipif(DEVICE.type != "cpu", reason=f"needs the CPU ({reason}); {describe()}")


def to(x, dtype: torch.dtype | None = None):
    """A tensor (or module) moved to DEVICE, floating-point ones cast to ``dtype`` (default DTYPE)."""
    if isinstance(x, torch.Tensor) and not x.is_floating_point():
        return x.to(DEVICE)
    return x.to(DEVICE, DTYPE if dtype is None else dtype)
