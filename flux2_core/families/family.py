"""A model family's record (``Family``) and the protocols it is read through; the registry is ``families``."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from ..errors import Flux2Error
from ..key_tables import Layout
from ..models.layers import Layers
from ..variants import Variant


class ModelParams(Protocol):
    """What the code around a model reads of any family's parameters (the rest is the family's own)."""

    context_in_dim: int          # the width of the prompt embeddings the model takes
    num_heads: int               # attention heads: what sequence parallelism splits over the ranks
    hidden_size: int             # the token width (what LoRA messages tell models apart by)


@runtime_checkable
class Transformer(Protocol):
    """What streaming, compiling, parallelism and the memory rules ask of any family's transformer. KV editions
    also give ``reference_kv(ref, ref_ids) -> ReferenceKV``."""

    params: ModelParams

    def blocks(self) -> list[nn.Module]:
        """The repeated blocks, in the order they run."""

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype."""


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
class MemoryInputs:
    """What ``runtime.memory`` needs of an architecture (its formulas are the same for every family)."""

    peak_values: int          # values per token alive at the peak of one block's call
    table_bytes: int          # float32 bytes per token of the RoPE table (or other per-token tables) at that peak
    hidden: int               # the token width: sequence parallelism splits it by heads over the ranks
    kv_layers: int            # the blocks that keep a reference's K/V (each K and V [tokens, hidden])


@dataclass(frozen=True)
class AdapterNaming:
    """What LoRA matching needs of a family beyond the model's linears and its layouts' names."""

    groups: tuple[tuple[str, str], ...]              # (a report group, the module prefix it holds): the rest is "other"
    models: dict[int, str]                           # hidden size -> the model, for "made for X" messages
    lookalikes: tuple[tuple[re.Pattern, str], ...]   # a key pattern of a family often taken for this one -> its name
    other_depths: tuple[tuple[str, dict[str, int]], ...]   # other models sharing our names: blocks per group
    shape_hint: Callable[[str, tuple[int, int], int], str]   # (module, ΔW [out, in], hidden) -> what it was made for


# A seed's draw (one float32 CPU draw per image, seeded seed + i, [n, 128, h, w]) -> the family's start noise on the
# latent grid. One draw serves every family, so the Noise node draws before the model is known.
NoiseReading = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class ReferenceCount:
    """The reference pictures, plus the inpainted picture (reference 1), which counts toward a family's limit."""

    pictures: int
    inpainted: bool = False

    @property
    def total(self) -> int:
        return self.pictures + self.inpainted

    def describe(self) -> str:
        pictures = f"{self.pictures} reference picture{'' if self.pictures == 1 else 's'}"
        return f"{pictures} plus the picture being inpainted ({self.total})" if self.inpainted else pictures


@dataclass(frozen=True)
class ReferenceFit:
    """How a family's reference images are sized before encoding (``sampling/references.py`` applies it)."""

    single_pixels: int           # one reference alone is scaled down to at most this many pixels
    multi_pixels: int            # each of several references
    min_side: int                # a smaller side is refused
    max_aspect: float | None     # a longer aspect ratio is refused (None: any)
    max_count: int | None        # at most this many references (None: any number)
    padded: bool                 # a lone reference is reflect-padded to its canvas and the result cropped (FLUX 3)
    max_side: int                # (padded only; 0 otherwise)
    pad_min: int


@dataclass(frozen=True)
class Family:
    """No field has a default, so a family cannot silently get another's; ``families.register`` checks them."""
    name: str                                       # the registry key, and ``Variant.family`` of its variants
    params_type: type                               # its architecture's parameters (a frozen dataclass)
    title: str                                      # what messages call it: "FLUX.2"
    variants: tuple[Variant, ...]                   # its releases (``families.VARIANTS`` gathers every family's)
    layouts: tuple[Layout, ...]                     # the namings of its transformer files
    lookalikes: tuple[tuple[str, str], ...]         # (a key, what the file is): files often taken for this family's
    gguf_archs: tuple[str, ...]                     # the general.architecture values of its GGUF transformer files
    files_hint: str                                 # the files to pass, for messages
    read_params: Callable[[ShapeReader], object]    # the architecture from a file's shapes
    build: Callable[[object, Layers], Transformer]  # (params, layers) -> the transformer
    quantizable: Callable[[str], bool]              # the linears a quantized storage may hold (by module name)
    variant_for: Callable[[object, str], Variant]   # (params, a name hint) -> the registered or a custom variant
    # (model, txt [n, L, C], h, w, *, ref, ref_ids, ref_kv, guidance, txt_lengths) -> velocity(x [n, C, h, w], t [n],
    # t_next [n] or None) on the latent grid; txt_lengths: each sample's real text rows (None: all L)
    condition: Callable[..., Callable[[Tensor, Tensor, Tensor | None], Tensor]]
    memory: Callable[[object], MemoryInputs]        # params -> the inputs of its memory estimate
    schedule: Callable[[int, int], list[float]]     # (steps, image tokens) -> its default sigmas, 1 down to 0
    schedule_name: str                              # the schedule as the Scheduler node lists it ("flux2")
    adapters: AdapterNaming                         # what LoRA matching and its messages know of it
    noise: NoiseReading                             # how it reads a seed's draw as its start noise
    latent_dtype: Callable[[torch.dtype], torch.dtype]   # compute dtype -> the latent's between steps
    # [(h, w) of each reference latent] -> their position ids [1, sum(h*w), 4] (what tells references apart)
    reference_ids: Callable[..., Tensor]
    references: ReferenceFit                        # how its reference images are sized
    takes_layout: bool                              # its prompts may carry layout boxes (``sampling/request.py``)
    dtypes: tuple[torch.dtype, ...]                 # the compute dtypes its transformer runs in, the preferred first
    largest_side: int                               # the longest side of a picture it makes, in pixels
    guidance_embedded: Callable[[object], bool]     # params -> takes the guidance scale as input (not CFG)

    def check_size(self, width: int, height: int) -> None:
        """Refuses a side past ``largest_side``, before any model loads."""
        if max(width, height) > self.largest_side:
            fit = self.largest_side / max(width, height)
            smaller = "x".join(str(max(16, int(side * fit) // 16 * 16)) for side in (width, height))
            raise Flux2Error(f"{self.title} makes pictures up to {self.largest_side} px a side; "
                             f"{width}x{height} (WxH) is past it: use e.g. {smaller}, or make a smaller picture and "
                             f"upscale it")
