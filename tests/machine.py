"""The machine a test assumes: one description of a CPU, pinned for every test, so that an outcome depends on the code
and not on the box it runs on.

The engine reads the machine in two probes: the CPU's instruction flags (``devices.cpu_flags``, behind the compute
dtype and the int8 matmul), beside the variables that hold oneDNN below them, and the CPU's free memory
(``runtime.memory.free_memory``: refusals, streaming, tiling). ``tests/conftest.py`` pins both for every test to
``default()``, and the variables with them; a test of a rule sets the machine it describes (the ``machine`` fixture):

    def test_zen4_computes_in_bf16(machine):
        machine.set(ZEN4)
        assert devices.compute_dtype("cpu").dtype == torch.bfloat16

``default()`` is this box as it is (its real flags, torch's kernel build and the variables), or the kind
``FLUX2_TEST_CPU`` names (``scripts/test`` runs the tests that read the machine once more as each kind this box is not:
those passes are what fail when a test forgot to ask for the dtype it compares in). What a probe cannot change stays real: the kernels torch and oneDNN
run (and what torch itself reads of the CPU: inductor builds for the real one), and processes a test starts, which
read the real flags (give them ``--dtype``).

A test that reads a probe without setting a machine is written to ``FLUX2_TEST_MACHINE_LOG`` (``scripts/test``'s
list of the tests to run as the other kinds); ``@pytest.mark.real_machine`` leaves a test on the real probes (a
probe's own test).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import pytest
import torch

GIB = 1 << 30
KIND_VARIABLE = "FLUX2_TEST_CPU"
LOG_VARIABLE = "FLUX2_TEST_MACHINE_LOG"


@dataclass(frozen=True)
class Machine:
    name: str
    amx: bool = False                 # AMX tiles (Intel Sapphire Rapids on): bf16 and int8 dot products
    avx512_bf16: bool = False         # AVX-512 BF16 (AMD Zen 4 / 5, Intel Cooper Lake, ...)
    vnni: bool = False                # AVX-512 VNNI: 8-bit dot products (torch then gives int8 matmuls to oneDNN)
    onednn_isa: str = ""              # ONEDNN_MAX_CPU_ISA: what oneDNN is held to ("" none)
    aten: str = "AVX512"              # the build of torch's own kernels (ATEN_CPU_CAPABILITY picks a lower one)
    free_memory: int = 16 * GIB       # what the OS can give without swapping

    @property
    def flags(self):
        from flux2_core.devices import CpuFlags

        return CpuFlags(self.amx, self.avx512_bf16, self.vnni or self.amx, self.aten)

    def held_to(self, isa: str) -> Machine:
        return replace(self, name=f"{self.name} held to {isa}", onednn_isa=isa)

    def kernels(self, aten: str) -> Machine:
        """The same CPU running torch's ``aten`` build of its own kernels (ATEN_CPU_CAPABILITY)."""
        return replace(self, name=f"{self.name} on {aten} kernels", aten=aten)

    def rules_see(self) -> tuple:
        """What the CPU rules weigh of this machine: its instructions, how far oneDNN is held (below bf16, below
        VNNI, or not) and, on an AMX CPU, whether torch runs its AVX-512 kernels."""
        from flux2_core.devices import ONEDNN_WITHOUT_BF16, ONEDNN_WITHOUT_VNNI

        isa = self.onednn_isa.strip().upper()
        return (self.amx, self.avx512_bf16, self.vnni or self.amx, isa in ONEDNN_WITHOUT_BF16,
                isa in ONEDNN_WITHOUT_VNNI, self.amx and self.aten != "AVX512")

    def same_cpu(self, other: Machine) -> bool:
        """Whether the rules decide alike for the two (names, free memory and what no rule weighs aside)."""
        return self.rules_see() == other.rules_see()

    def __str__(self) -> str:
        flags = [flag for flag, on in (("AMX", self.amx), ("AVX-512 BF16", self.avx512_bf16),
                                       ("AVX-512 VNNI", self.vnni)) if on]
        held = f", ONEDNN_MAX_CPU_ISA={self.onednn_isa}" if self.onednn_isa else ""
        return f"{self.name} ({', '.join(flags) or 'no bf16 or VNNI instructions'}{held}, {self.aten} kernels)"


# The CPU kinds the project has met, and the held states users make of them. Each decides differently in one rule at
# least: the compute dtype (bf16 or float32), int8 matmul (fast, slow or with wrong sums) and why.
AVX2 = Machine("avx2", aten="AVX2")                                           # AMD Zen 2 / 3, most laptops
ICE_LAKE = Machine("avx512", vnni=True)                                       # AVX-512 with VNNI, no BF16 (Ice Lake)
ZEN4 = Machine("avx512-bf16", avx512_bf16=True, vnni=True)                    # AMD Zen 4 / 5
SAPPHIRE_RAPIDS = Machine("amx", amx=True, avx512_bf16=True, vnni=True)       # Intel Xeon from Sapphire Rapids
# a VNNI CPU whose oneDNN is held to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2): float32, and int8 sums that overflow 16 bits
VNNI_HELD_AVX2 = replace(SAPPHIRE_RAPIDS.held_to("AVX2"), name="avx2-vnni")
# an AMX CPU on torch's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2): bf16 attention cannot run there, so float32
AMX_ON_AVX2 = replace(SAPPHIRE_RAPIDS.kernels("AVX2"), name="amx-avx2-kernels")
KINDS = {m.name: m for m in (AVX2, ICE_LAKE, ZEN4, SAPPHIRE_RAPIDS, VNNI_HELD_AVX2, AMX_ON_AVX2)}


def onednn_isa_set() -> str:
    """What this process's environment holds oneDNN to (``devices.onednn_cap``'s reading, kept apart from it so that
    a change there cannot change what the tests think the box is)."""
    return next((os.environ[v].strip().upper() for v in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
                 if os.environ.get(v)), "")


def this_box() -> Machine:
    """The real CPU, torch's kernel build on it and the variables set for this process."""
    amx, bf16, vnni = (torch.cpu._is_amx_tile_supported(), torch.cpu._is_avx512_bf16_supported(),
                       torch.cpu._is_vnni_supported())
    base = SAPPHIRE_RAPIDS if amx else ZEN4 if bf16 else ICE_LAKE if vnni else AVX2
    box = replace(base, name=f"this box ({base.name})", aten=torch.backends.cpu.get_cpu_capability())
    isa = onednn_isa_set()
    return box.held_to(isa) if isa else box


def default() -> Machine:
    name = os.environ.get(KIND_VARIABLE, "")
    if not name:
        return this_box()
    if name not in KINDS:
        raise ValueError(f"{KIND_VARIABLE}={name!r} is not one of {', '.join(KINDS)}")
    return KINDS[name]


def computes_bf16(machine: Machine) -> bool:
    """The hand-written expectation of the compute dtype rule: bf16 instructions oneDNN may use, and on an AMX CPU
    torch's AVX-512 kernels (its bf16 attention needs them there)."""
    return ((machine.amx or machine.avx512_bf16) and machine.onednn_isa.strip().upper() not in (
        "SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")
        and not (machine.amx and machine.aten != "AVX512"))


def other_kinds(machine: Machine, box: Machine | None = None) -> list[Machine]:
    """The kinds a run on ``machine`` is not: scripts/test's second pass runs the tests that read the machine once as
    each (``FLUX2_TEST_CPU``). On a box whose torch cannot run bf16 attention (an AMX CPU on AVX2 kernels) the kinds
    that compute in bf16 are left out: their runs would fail in torch itself, whatever the tests assume."""
    box = box or this_box()
    real_bf16_attention = not (box.amx and box.aten != "AVX512")
    return [kind for kind in KINDS.values()
            if not kind.same_cpu(machine) and (real_bf16_attention or not computes_bf16(kind))]


class Pinned:
    """The probes of this process, answering for ``current`` (``tests/conftest.py`` makes one for the session and
    starts each test on ``default``); ``set`` changes the machine for the rest of the test (the ``machine`` fixture)."""

    def __init__(self, machine: Machine):
        from flux2_core import devices
        from flux2_core.runtime import memory

        self.default = self.current = machine
        self.test, self.chosen, self.real = "", False, False
        self.patch = pytest.MonkeyPatch()
        real_flags, real_free = devices.cpu_flags, memory.free_memory

        def flags():
            if self.real:
                return real_flags()
            if not self.chosen:
                self._note()
            return self.current.flags

        self.patch.setattr(devices, "cpu_flags", flags)
        # the same in every kind: read without a note in the log
        self.patch.setattr(memory, "free_memory", lambda device: real_free(device) if self.real or torch.device(
            device).type != "cpu" else self.current.free_memory)
        self._set_variables()

    def _note(self):
        """The first flag a test reads without having set its machine: its id into the log (the tests the other kind
        runs again)."""
        path = os.environ.get(LOG_VARIABLE)
        if path and self.test:
            with open(path, "a") as f:
                f.write(self.test + "\n")
            self.test = ""

    def begin(self, nodeid: str, real: bool = False):
        self.test, self.chosen, self.real, self.current = nodeid, False, real, self.default
        self._set_variables()

    def set(self, machine: Machine) -> Machine:
        self.current, self.chosen = machine, True
        self._set_variables()
        return machine

    def free(self, nbytes: int) -> None:
        """The CPU's free memory for the rest of the test (a memory rule's test)."""
        self.current = replace(self.current, free_memory=nbytes)

    def _set_variables(self):
        """The variables the rules read as the machine has them. ATEN_CPU_CAPABILITY is not one: the rules read torch's
        kernel build through the flags, and the variable would change what inductor builds for the real CPU."""
        for variable in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
            self.patch.delenv(variable, raising=False)
        if self.current.onednn_isa:
            self.patch.setenv("ONEDNN_MAX_CPU_ISA", self.current.onednn_isa)
