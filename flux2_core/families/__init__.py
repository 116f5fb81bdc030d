"""The registry of model families: what differs between FLUX.2 and the families after it, one record each.

A family is a transformer architecture with its file layouts, text encoder and variants. Each is a package here
(``flux2/``, ``flux3/``) and joins the registry through ``register``, which checks its record. The code around the
model asks the record what it must know and never tests which family it is.

    family = ...                                  # the one whose file layout (key_tables.Layout) the file has
    params = family.read_params(shapes)           # the architecture from the file's shapes (``ShapeReader``)
    variant = family.variant_for(params, hint)    # which registered variant those parameters (and the name) are
    model = family.build(params, layers)          # the transformer, its linears made by ``layers``
"""

from __future__ import annotations

import functools

import torch

from ..models.layers import Layers
from ..storage.protocol import stored_linears
from .family import (
    AdapterNaming,
    Family,
    MemoryInputs,
    ModelParams,
    NoiseReading,
    ReferenceCount,
    ReferenceFit,
    ShapeReader,
)
from .flux2 import FLUX2
from .flux3 import FLUX3
from .registry import (
    FAMILIES,
    VARIANTS,
    check_size_for_any,
    encoder_for,
    encoder_hint,
    family_of,
    family_of_encoder,
    family_of_params,
    get_family,
    get_variant,
    register,
    runnable_variant,
    runnable_variants,
    text_encoders,
    unregister,
)

__all__ = [
    "FAMILIES",
    "VARIANTS",
    "AdapterNaming",
    "Family",
    "MemoryInputs",
    "ModelParams",
    "NoiseReading",
    "ReferenceCount",
    "ReferenceFit",
    "ShapeReader",
    "check_size_for_any",
    "encoder_for",
    "encoder_hint",
    "family_of",
    "family_of_encoder",
    "family_of_params",
    "get_family",
    "get_variant",
    "linear_shapes",
    "register",
    "runnable_variant",
    "runnable_variants",
    "text_encoders",
    "unregister",
]

# FLUX.2 first: a models folder's search and a file that says nothing take the first family's variants first
register(FLUX2)
register(FLUX3)


def linear_shapes(params) -> dict[str, tuple[int, int]]:
    """Every linear of the model: module name -> weight [out, in], read off the model built on meta (no hand-kept
    list to drift)."""
    return dict(_linear_shapes(params))


@functools.lru_cache(maxsize=8)
def _linear_shapes(params) -> tuple[tuple[str, tuple[int, int]], ...]:
    with torch.device("meta"):
        model = family_of_params(params).build(params, Layers())
    return tuple((name, (m.out_features, m.in_features)) for name, m in stored_linears(model))

