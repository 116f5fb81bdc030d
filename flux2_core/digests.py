"""Content digests (blake2b, 16 bytes) that key the caches: equal content gives an equal digest whatever object holds
it; shape, dtype and image mode are part of the content."""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor


def image_digest(images) -> str:
    h = hashlib.blake2b(digest_size=16)
    for im in images:
        h.update(f"{im.mode}:{im.size};".encode())
        h.update(im.tobytes())
    return h.hexdigest()


def tensor_digest(*tensors: Tensor) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(f"{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
