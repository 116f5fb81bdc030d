"""The machine every test assumes (tests/machine.py) and scripts/test's second passes: a test that reads the CPU's
flags without setting its machine is run again as each kind of CPU this box is not, where a comparison that silently
took this box's dtype fails."""

from __future__ import annotations

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
def test_a_test_that_forgets_its_machine_fails_in_one_of_the_passes(tmp_path):
    """scripts/test on a file of three tests, told the box is an AVX2 one: only the test that read the flags without
    setting a machine is run again, once as each other kind; it passes where the kind computes in float32 and fails
    where it computes in bf16, so the run fails, whatever box runs it."""
    (tmp_path / "test_forgetful.py").write_text(FORGETFUL)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLUX2_TEST", "PYTEST_XDIST", "ONEDNN_", "DNNL_"))}
    run = subprocess.run(["bash", "scripts/test", "-p", "no:cacheprovider", "-c", "pyproject.toml", "--rootdir", ".",
                          "-p", "tests.conftest", str(tmp_path / "test_forgetful.py")],
                         check=False, cwd=ROOT, env={**env, "FLUX2_TEST_WORKERS": "0",
                                                     machines.KIND_VARIABLE: machines.AVX2.name},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = run.stdout
    assert run.returncode == 1, out
    first, *passes = out.split("[tests] the 1 tests that read the CPU's flags, again as CPU kind ")
    assert "3 passed" in first, out                          # told AVX2: float32, as the forgetful test assumes
    others = {kind.name: kind for kind in machines.KINDS.values() if kind != machines.AVX2}
    assert [p.split()[0] for p in passes] == list(others), out
    for text in passes:
        kind = others[text.split()[0]]
        assert ("1 failed, 2 deselected" if machines.computes_bf16(kind) else "1 passed, 2 deselected") in text, text
        assert "test_said_which_cpu" not in text, text
    assert any(machines.computes_bf16(kind) for kind in others.values())


def test_the_pinned_machine_answers_for_every_probe(machine):
    """The engine's probes answer for the machine set; torch's own flags stay the box's (inductor builds for it)."""
    real = torch.cpu._is_avx512_supported()
    machine.set(machines.SAPPHIRE_RAPIDS.held_to("avx2"))
    assert devices.cpu_flags() == devices.CpuFlags(amx=True, avx512_bf16=True, vnni=True, aten="AVX512")
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


def rule_outcomes(machine) -> dict[str, tuple]:
    outcomes = {}
    for kind in machines.KINDS.values():
        machine.set(kind)
        chosen = devices.compute_dtype("cpu")
        outcomes[kind.name] = (chosen.dtype, chosen.why, devices.cpu_int8(), devices.cpu_int8_saturates())
    return outcomes


def test_each_kind_is_one_the_rules_tell_apart(machine):
    """The kinds the project has met (AVX2 only, AVX-512 VNNI, AVX-512 BF16, AMX) and the held states users make of
    them (a VNNI CPU on oneDNN's AVX2 kernels, an AMX CPU on torch's AVX2 kernels): each decides differently somewhere,
    the compute dtype as written by hand (``computes_bf16``)."""
    outcomes = rule_outcomes(machine)
    assert len(set(outcomes.values())) == len(machines.KINDS)
    for name, (dtype, *_) in outcomes.items():
        assert (dtype == torch.bfloat16) == machines.computes_bf16(machines.KINDS[name]), name
    assert {"avx2", "avx512", "avx512-bf16", "amx", "avx2-vnni", "amx-avx2-kernels"} == set(machines.KINDS)
    assert outcomes["avx2-vnni"][3] and not outcomes["avx2-vnni"][2]         # VNNI held to AVX2: wrong int8 sums
    assert outcomes["amx-avx2-kernels"][0] == torch.float32 and outcomes["amx-avx2-kernels"][2]   # int8 stays fast


def test_the_second_pass_runs_every_kind_the_first_is_not():
    kinds = list(machines.KINDS.values())
    for kind in kinds:
        assert machines.other_kinds(kind, box=machines.ZEN4) == [k for k in kinds if k is not kind]
    box = machines.this_box()
    others = machines.other_kinds(box)
    assert all(not k.same_cpu(box) for k in others) and len(others) >= len(kinds) - 3
    # what no rule weighs makes no other kind: torch's kernel build on a CPU without AMX, a oneDNN cap above its ISA
    assert machines.other_kinds(machines.ZEN4.kernels("AVX2"), box=machines.ZEN4) == [k for k in kinds
                                                                                     if k is not machines.ZEN4]
    assert machines.ZEN4.held_to("AVX512_CORE_AMX").same_cpu(machines.ZEN4)
    # a box whose own torch cannot run bf16 attention runs no kind that computes in bf16
    held = machines.other_kinds(machines.AMX_ON_AVX2, box=machines.AMX_ON_AVX2)
    assert held == [k for k in kinds if k is not machines.AMX_ON_AVX2 and not machines.computes_bf16(k)]


def test_an_unknown_kind_is_refused_with_the_known_ones(monkeypatch):
    monkeypatch.setenv(machines.KIND_VARIABLE, "pentium")
    with pytest.raises(ValueError, match="FLUX2_TEST_CPU='pentium' is not one of avx2, avx512, avx512-bf16, amx, avx2-vnni, "
                       "amx-avx2-kernels"):
        machines.default()

