"""The fused-kernel mechanism (flux2_core/storage/kernels.py): a plain torch function compiled once per device type into one
kernel, computing what the function computes; a bounded number of graphs whatever the sizes; the plain function where
kernels are off (FLUX2_NO_FUSED, a device without them, inside a compiled region, no elements) or a compile failed,
and the log saying so once. What the real kernels compute is tested where they are used (test_ggml, test_quant)."""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flux2_core.storage import kernels
from tests.fused import fused_off, fused_on, graphs, ran_fused  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="torch.compile is not supported")


def row_scaled(x: torch.Tensor) -> torch.Tensor:
    """A reduction and a division, in float32, cast to bf16: the shape of the fp8 quantizer."""
    return (x / x.abs().amax(dim=1, keepdim=True).clamp(min=1e-6)).to(torch.bfloat16)


def applying(op):
    """Functions made by one ``def``, differing by the function they capture (as ggml.blocks_kernel's per type)."""
    def apply(x: torch.Tensor) -> torch.Tensor:
        return op(x) + 1
    return apply


# exact in float32 whichever code computes them (inductor's erf, say, is not eager's to the bit)
EXACT_OPS = [torch.abs, torch.neg, torch.square, torch.relu, torch.floor, torch.ceil, torch.round, torch.trunc,
             torch.sign, torch.frac]


@pytest.mark.slow
@pytest.mark.usefixtures("fused_on")
def test_one_graph_for_every_size_and_the_same_values():
    """Sizes vary in both dims: one graph for all (rows and columns symbolic), one more for a single row (dynamo
    specializes size 1), and the values of the plain function, to the bit."""
    g = torch.Generator().manual_seed(0)
    before = graphs()
    for rows, cols in [(5, 64), (17, 64), (300, 96), (2, 1000), (1, 64), (1, 200), (40, 3)]:
        x = torch.randn(rows, cols, generator=g) * 10
        got = kernels.call(row_scaled, x, dynamic=(0, 1))
        assert got.dtype == torch.bfloat16 and torch.equal(got, row_scaled(x))
    assert ran_fused(row_scaled, torch.device("cpu"))
    assert graphs() - before == 2


@pytest.mark.slow
@pytest.mark.usefixtures("fused_on")
def test_functions_of_one_def_compile_apart(caplog):
    """Ten closures of one ``def`` over different functions (more than dynamo's recompile limit of 8 per code object;
    without a code object each, the ninth fails to compile) each compile under a code object of their own: each
    computes its own function, and nothing falls back."""
    x = torch.linspace(-3, 3, 24).reshape(4, 6)
    with caplog.at_level(logging.INFO, logger="flux2_klein"):
        for op in EXACT_OPS:
            fn = applying(op)
            assert torch.equal(kernels.call(fn, x), op(x) + 1), op
            assert ran_fused(fn, x.device)
    assert kernels.unavailable("cpu") is None
    assert "failed" not in caplog.text


@pytest.mark.usefixtures("fused_off")
def test_off_runs_the_plain_function_and_says_why_once(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "compiled", lambda *a: pytest.fail("compiled with FLUX2_NO_FUSED set"))
    x = torch.randn(4, 8)
    with caplog.at_level(logging.INFO, logger="flux2_klein"):
        assert torch.equal(kernels.call(row_scaled, x), row_scaled(x))
        kernels.call(row_scaled, x)
    assert [r.getMessage() for r in caplog.records] == [
        "FLUX.2 Klein: fused kernels not used on cpu, plain torch instead: turned off (FLUX2_NO_FUSED is set)"]


@pytest.mark.usefixtures("fused_on")
def test_on_the_log_says_so_once_and_each_kernel_its_compile(monkeypatch, caplog):
    """The compile itself is replaced by the plain function here (the slow tests compile for real)."""
    monkeypatch.setattr(kernels, "compiled", lambda fn, device: fn)
    x = torch.randn(4, 8)
    with caplog.at_level(logging.INFO, logger="flux2_klein"):
        for _ in range(3):
            kernels.call(row_scaled, x)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert messages[0].startswith("FLUX.2 Klein: fused kernels on cpu (GGUF dequantization, fp8 activation "
                                  "quantization): each is compiled at its first call; FLUX2_NO_FUSED=1 turns them off")
    assert messages[1].startswith("FLUX.2 Klein: row_scaled compiled for cpu in ")


@pytest.mark.usefixtures("fused_on")
def test_a_failed_compile_falls_back_for_the_device_type_with_a_warning(monkeypatch, caplog):
    tries = []

    def no_compiler(fn, device):
        def broken(x):
            tries.append(fn)
            raise RuntimeError("Failed to find a C++ compiler\nmore detail")
        return broken

    monkeypatch.setattr(kernels, "compiled", no_compiler)
    x = torch.randn(4, 8)
    with caplog.at_level(logging.INFO, logger="flux2_klein"):
        assert torch.equal(kernels.call(row_scaled, x), row_scaled(x))
        assert torch.equal(kernels.call(applying(torch.neg), x), 1 - x)     # another kernel: not tried again
    assert len(tries) == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [("FLUX.2 Klein: fused kernels not used on cpu from now on, plain torch instead: the compiled "
                         "row_scaled failed (RuntimeError: Failed to find a C++ compiler)")]
    assert kernels.unavailable("cpu").startswith("the compiled row_scaled failed")


@pytest.mark.usefixtures("fused_on")
def test_a_later_failure_falls_back_too(monkeypatch, caplog):
    """A kernel that compiled once and fails later (a recompile past dynamo's limit, say) does not stop a generation:
    that call and the later ones run plain."""
    calls = []

    def fails_second_time(x):
        calls.append(x.shape)
        if len(calls) > 1:
            raise RuntimeError("recompile limit hit")
        return row_scaled(x)

    monkeypatch.setattr(kernels, "compiled", lambda fn, device: fails_second_time)
    x, y = torch.randn(4, 8), torch.randn(5, 8)
    with caplog.at_level(logging.INFO, logger="flux2_klein"):
        assert torch.equal(kernels.call(row_scaled, x), row_scaled(x))
        assert torch.equal(kernels.call(row_scaled, y), row_scaled(y))
        assert torch.equal(kernels.call(row_scaled, x), row_scaled(x))
    assert len(calls) == 2
    assert "plain torch instead: the compiled row_scaled failed (RuntimeError: recompile limit hit)" in caplog.text


@pytest.mark.usefixtures("fused_on")
def test_out_of_memory_is_not_taken_for_a_failed_compile(monkeypatch):
    def out_of_memory(x):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(kernels, "compiled", lambda fn, device: out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        kernels.call(row_scaled, torch.randn(4, 8))
    assert kernels.unavailable("cpu") is None


@pytest.mark.usefixtures("fused_on")
def test_no_elements_and_compiled_regions_take_the_plain_function(monkeypatch):
    monkeypatch.setattr(kernels, "compiled", lambda *a: pytest.fail("an empty tensor or a traced call compiled"))
    empty = torch.zeros(0, 8)
    assert kernels.call(row_scaled, empty).shape == (0, 8)

    def block(x):
        return kernels.call(row_scaled, x) * 2

    x = torch.randn(4, 8)
    assert torch.equal(torch.compile(block, backend="eager", fullgraph=True)(x), row_scaled(x) * 2)


@pytest.mark.usefixtures("fused_on")
def test_devices_without_fused_kernels_say_why(monkeypatch):
    monkeypatch.setattr(kernels, "_has_triton", lambda: False)
    assert "Triton is not installed" in kernels.unavailable("cuda")
    assert kernels.unavailable("mps") == "they are made for CUDA and the CPU, not mps"
    assert kernels.unavailable("cpu") is None


def test_the_inductor_options_exist_in_this_torch():
    """The rounding options are passed only where inductor has them; this torch has both."""
    from torch._inductor import config

    options = kernels.eager_numerics()
    assert options == {"eager_numerics.division_rounding": True, "eager_numerics.disable_ftz": True}
    with config.patch(options):
        assert config.eager_numerics.division_rounding and config.eager_numerics.disable_ftz


# a process that runs one fused kernel on the CPU and says whether it stayed fused and equal to the plain function
ONE_KERNEL = """
import json, torch
from flux2_core.storage import kernels
from tests.test_kernels import row_scaled
x = torch.linspace(-3, 3, 6 * 40).reshape(6, 40)
out = kernels.call(row_scaled, x)
print(json.dumps({"fused": kernels.unavailable("cpu") is None, "equal": torch.equal(out, row_scaled(x))}))
"""


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"),
                    reason="ATEN_CPU_CAPABILITY's x86 levels")
def test_a_kernel_cached_under_another_aten_cpu_capability_is_not_reused(tmp_path):
    """Inductor's cache does not key a CPU kernel by the instructions ATEN_CPU_CAPABILITY builds it for: without our
    vector width in the key, a kernel cached with avx2 failed to build with ``default`` (no vector code) and crashed
    or computed garbage on the CPU's own level. Three processes share one cache; each keeps its kernel fused and exact."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "FLUX2_NO_FUSED")}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    for capability in ("avx2", "default", None):             # None: the CPU's own level (avx2 or avx512)
        run_env = env if capability is None else {**env, "ATEN_CPU_CAPABILITY": capability}
        done = subprocess.run([sys.executable, "-c", ONE_KERNEL], check=False, cwd=ROOT, env=run_env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (capability, done.stderr[-3000:])
        assert json.loads(done.stdout.strip().splitlines()[-1]) == {"fused": True, "equal": True}, (
            capability, done.stderr[-3000:])
