"""The machine every test assumes (tests/machine.py) and scripts/test's second pass: a test that reads the CPU's flags
without setting its machine is run again as the other kind of CPU, where a comparison that silently took this box's
dtype fails."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import pytest
import torch

from flux2_core import devices
from tests import machine as machines

ROOT = Path(__file__).resolve().parents[1]

FORGETFUL = '''
import torch
from flux2_core import devices
from tests import machine as machines


def test_forgot_to_say_which_cpu():
    assert devices.compute_dtype("cpu").dtype == torch.float32     # true of one kind of CPU only


def test_said_which_cpu(machine):
    machine.set(machines.ZEN4)
    assert devices.compute_dtype("cpu").dtype == torch.bfloat16


def test_never_asks():
    assert torch.ones(2).sum().item() == 2
'''


@pytest.mark.slow
def test_a_test_that_forgets_its_machine_fails_in_one_of_the_two_passes(tmp_path):
    """scripts/test on a file of three tests: only the one that read the flags without setting a machine is run again,
    as the other kind; it passes in one pass and fails in the other, whichever kind this box is, so the run fails."""
    (tmp_path / "test_forgetful.py").write_text(FORGETFUL)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLUX2_TEST", "PYTEST_XDIST", "ONEDNN_", "DNNL_"))}
    run = subprocess.run(["bash", "scripts/test", "-p", "no:cacheprovider", "-c", "pyproject.toml", "--rootdir", ".",
                          "-p", "tests.conftest", str(tmp_path / "test_forgetful.py")],
                         check=False, cwd=ROOT, env={**env, "FLUX2_TEST_WORKERS": "0"}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    out = run.stdout
    assert run.returncode == 1, out
    assert "[tests] the 1 tests that read the CPU's flags, again as the other kind of CPU" in out, out
    # the child's first pass: this box without the variables (left out of its environment above)
    bf16_box = machines.computes_bf16(dataclasses.replace(machines.this_box(), onednn_isa=""))
    first, second = out.split("again as the other kind of CPU")
    assert ("1 failed, 2 passed" if bf16_box else "3 passed") in first, out
    assert ("1 passed, 2 deselected" if bf16_box else "1 failed, 2 deselected") in second, out
    assert second.count("test_forgot_to_say_which_cpu") >= 1 and "test_said_which_cpu" not in second, out


def test_the_pinned_machine_answers_for_every_probe(machine):
    """The engine's probes answer for the machine set; torch's own flags stay the box's (inductor builds for it)."""
    real = torch.cpu._is_avx512_supported()
    machine.set(machines.SAPPHIRE_RAPIDS.held_to("avx2"))
    assert devices.cpu_flags() == devices.CpuFlags(amx=True, avx512_bf16=True, vnni=True)
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "avx2" and "DNNL_MAX_CPU_ISA" not in os.environ
    assert devices.compute_dtype("cpu").dtype == torch.float32 and devices.cpu_int8_saturates()
    machine.set(machines.AVX2)
    assert "ONEDNN_MAX_CPU_ISA" not in os.environ and not devices.cpu_int8() and not devices.cpu_bf16()
    machine.free(123)
    from flux2_core.runtime import memory
    assert memory.free_memory("cpu") == 123
    assert torch.cpu._is_avx512_supported() == real


def test_each_test_starts_on_the_default_machine(machine):
    """Whatever the test before it set (in this process), a test starts on the default machine."""
    assert machine.current == machines.default() and not machine.chosen
    assert os.environ.get("ONEDNN_MAX_CPU_ISA", "") == machines.default().onednn_isa


def test_the_other_kind_is_the_other_rule():
    for kind in machines.KINDS.values():
        other = machines.other_kind(kind)
        if machines.computes_bf16(kind):
            assert other == {machines.KIND_VARIABLE: "", "ONEDNN_MAX_CPU_ISA": "AVX2"}
            assert not machines.computes_bf16(kind.held_to("AVX2"))
        else:
            assert other == {machines.KIND_VARIABLE: machines.ZEN4.name} and machines.computes_bf16(machines.ZEN4)


def test_an_unknown_kind_is_refused_with_the_known_ones(monkeypatch):
    monkeypatch.setenv(machines.KIND_VARIABLE, "pentium")
    with pytest.raises(ValueError, match="FLUX2_TEST_CPU='pentium' is not one of avx2, avx512, avx512-bf16, amx"):
        machines.default()

