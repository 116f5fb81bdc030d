"""The registry of model families: what differs between FLUX.2 and the families after it, one record each.

A family is a transformer architecture with its file layouts, its text encoder and its variants; FLUX.2 (Klein 4B / 9B,
base, 9B-KV, dev) is the first. The code around the model (weights, adapters, runtime, sampling, the nodes, all in the
layers above this one) asks a family record what it must know of the model it holds — its files' namings, how to read
its parameters and build it, which of its linears a quantized storage may hold, how it sees a latent batch, its memory
estimate's inputs, its schedule — and never tests which family it is.

    family = ...                                  # the one whose file layout (key_tables.Layout) the file has
    params = family.read_params(shapes)           # the architecture from the file's shapes (``ShapeReader``)
    variant = family.variant_for(params, hint)    # which registered variant those parameters (and the name) are
    model = family.build(params, layers)          # the transformer, its linears made by ``layers``
"""

from __future__ import annotations

import functools

import torch

from ..errors import Flux2Error
from ..models.layers import Layers
from ..storage.protocol import stored_linears
from ..variants import VARIANTS, TextEncoderSpec, Variant
from .family import AdapterNaming, Family, MemoryInputs, ModelParams, NoiseDraw, ReferenceFit, ShapeReader
from .flux2 import FLUX2
from .flux3 import FLUX3

__all__ = [
    "FAMILIES",
    "AdapterNaming",
    "Family",
    "MemoryInputs",
    "ModelParams",
    "NoiseDraw",
    "ReferenceFit",
    "ShapeReader",
    "family_of",
    "family_of_encoder",
    "family_of_params",
    "get_family",
    "linear_shapes",
]

FAMILIES: dict[str, Family] = {f.name: f for f in (FLUX2, FLUX3)}


def get_family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise Flux2Error(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}") from None


def family_of(variant: Variant) -> Family:
    return get_family(variant.family)


def family_of_encoder(spec: TextEncoderSpec) -> Family:
    """The family whose prompts an encoder of this model reads (Qwen3-VL: FLUX 3; Qwen3 and the rest: FLUX.2): what
    a prompt's conditioning knows of the model it is for before it meets one (how references are sized, boxes)."""
    return family_of(next((v for v in VARIANTS.values() if v.text_encoder.model == spec.model), VARIANTS["klein-4b"]))


def family_of_params(params) -> Family:
    """The family whose architecture ``params`` describe (each family has its own parameter class)."""
    family = next((f for f in FAMILIES.values() if type(params) is f.params_type), None)
    if family is None:
        raise Flux2Error(f"{type(params).__name__} is no model family's parameters; known: "
                         f"{', '.join(f.params_type.__name__ for f in FAMILIES.values())}")
    return family


def linear_shapes(params) -> dict[str, tuple[int, int]]:
    """Every linear of the model ``params`` describe: module name -> weight [out, in], read off the model built on
    the meta device (what adapters may target; no hand-kept list to drift from the model)."""
    return dict(_linear_shapes(params))


@functools.lru_cache(maxsize=8)
def _linear_shapes(params) -> tuple[tuple[str, tuple[int, int]], ...]:
    with torch.device("meta"):
        model = family_of_params(params).build(params, Layers())
    return tuple((name, (m.out_features, m.in_features)) for name, m in stored_linears(model))

