"""Fixtures for the fused kernels (``flux2_core/storage/kernels.py``): import them into a test file to use them.

    fused_on     kernels' decisions and compiled kernels forgotten, FLUX2_NO_FUSED unset: they are used on the CPU
                 (and on CUDA in the device mode), as a user gets them
    fused_any_size   fused_on, and on the CPU for GGUF tensors of any size (ggml takes it only from 2^23 values)
    fused_off    FLUX2_NO_FUSED=1: the plain torch path
"""

from __future__ import annotations

import pytest
import torch

from flux2_core.storage import ggml, kernels


@pytest.fixture
def fused_on(monkeypatch):
    monkeypatch.delenv(kernels.OFF_VARIABLE, raising=False)
    kernels.forget()
    yield
    kernels.forget()


@pytest.fixture
def fused_any_size(monkeypatch, fused_on):
    monkeypatch.setattr(ggml, "CPU_FUSED_MIN_VALUES", 0)


@pytest.fixture
def fused_off(monkeypatch):
    monkeypatch.setenv(kernels.OFF_VARIABLE, "1")
    kernels.forget()
    yield
    kernels.forget()


def graphs() -> int:
    """How many graphs dynamo has compiled in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def ran_fused(fn, device: torch.device) -> bool:
    """Whether ``fn`` has run as its compiled kernel on a device of ``device``'s type since the last
    ``kernels.forget``."""
    return any(key == fn and ran_on.type == device.type for key, ran_on in kernels._proven)
