"""A model family's record (``Family``) and what it reads a file through (``ShapeReader``); the registry is
``families/__init__.py``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor, nn

from ..models.layers import Layers
from ..variants import Variant


class ShapeReader(Protocol):
    """What a family reads its parameters from: a file's tensors by our names (the loader's ``Source``)."""

    where: str                                      # the file, for messages

    def has(self, key: str) -> bool: ...

    def shape(self, key: str) -> tuple[int, ...]:
        """The tensor's shape; a Flux2Error naming what the file lacks where it has no such tensor."""

    def count(self, template: str) -> int:
        """How many of ``template.format(0)``, ``template.format(1)``, ... the file holds, from 0 without a gap."""

    def config(self, key: str, kind: str, default):
        """A value of the file's config.json (diffusers folders): ``kind`` "ints" or "number"; ``default`` else."""


@dataclass(frozen=True)
class Family:
    name: str                                       # the registry key, and ``Variant.family`` of its variants
    params_type: type                               # its architecture's parameters (a frozen dataclass)
    title: str                                      # what messages call it: "FLUX.2"
    marker: str                                     # a key (our names) that only this family's transformer files hold
    read_params: Callable[[ShapeReader], object]    # the architecture from a file's shapes
    build: Callable[[object, Layers], nn.Module]    # (params, layers) -> the transformer (the model protocol)
    quantizable: Callable[[str], bool]              # the linears a quantized storage may hold (by module name)
    variant_for: Callable[[object, str], Variant]   # (params, a name hint) -> the registered or a custom variant
    # (model, txt [n, L, C], h, w, *, ref, ref_ids, ref_kv, guidance) -> velocity(x [n, C, h, w], t [n], t_next [n]
    # or None where the sampler does not say): how the model sees a latent batch and one conditioning, and its answer
    # back on the latent grid; the samplers around it (Euler, CFG, inpainting, ComfyUI's) are the same for every family
    condition: Callable[..., Callable[[Tensor, Tensor, Tensor | None], Tensor]]

    def recognizes(self, has: Callable[[str], bool]) -> bool:
        return has(self.marker)
