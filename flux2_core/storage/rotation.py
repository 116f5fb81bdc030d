"""ConvRot: a group-wise Hadamard rotation of a layer's inputs that spreads outliers before 8- or 4-bit quantization.
H is the regular Hadamard matrix (no all-ones column) / sqrt(size), symmetric and orthogonal: a file stores W·Hᵀ per
group, a call turns its input by H, and (x·H)(W·Hᵀ)ᵀ = x·Wᵀ.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

REGULAR_4 = ((1, 1, 1, -1), (1, 1, -1, 1), (1, -1, 1, 1), (-1, 1, 1, 1))
DEFAULT_GROUP = 256


def is_power_of_4(size: int) -> bool:
    return size >= 4 and size & (size - 1) == 0 and (size.bit_length() - 1) % 2 == 0


@functools.cache
def _hadamard(size: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    h = base = torch.tensor(REGULAR_4, dtype=dtype, device=device)
    while h.shape[0] < size:
        h = torch.kron(h, base)
    return h / size ** 0.5


def hadamard(size: int, device=None, dtype: torch.dtype = torch.float32) -> Tensor:
    """[size, size], size a power of 4."""
    if not is_power_of_4(size):
        raise ValueError(f"a ConvRot group is a power of 4 (16, 64, 256, 1024, ...), not {size}")
    return _hadamard(size, torch.device(device or "cpu"), dtype)


def rotate_input(x: Tensor, size: int) -> Tensor:
    """x [..., K] -> each group of ``size`` along K times H: what a call does to its input."""
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // size, size)
    return torch.matmul(groups, hadamard(size, x.device, x.dtype)).reshape(x.shape)


def rotate_weight(weight: Tensor, size: int) -> Tensor:
    """W [out, in] -> W·Hᵀ per group of inputs; applied to a stored weight it turns it back."""
    groups = weight.reshape(weight.shape[0], weight.shape[1] // size, size)
    return torch.matmul(groups, hadamard(size, weight.device, weight.dtype).T).reshape(weight.shape)


def group_for(in_features: int, target: int = DEFAULT_GROUP) -> int:
    """``target`` where it divides the inputs, else the largest smaller power of 4 that does; 0 if none."""
    size, chosen = 4, 0
    while size <= target and in_features % size == 0:
        chosen, size = size, size * 4
    return chosen
