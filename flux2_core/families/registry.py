"""The registry of model families (``FAMILIES``) and their variants (``VARIANTS``), filled by ``register`` alone,
and its lookups."""

from __future__ import annotations

import collections.abc
import types
import typing
from dataclasses import fields, replace

from ..errors import Flux2Error
from ..variants import TextEncoderSpec, Variant
from .family import Family

FAMILIES: dict[str, Family] = {}
VARIANTS: dict[str, Variant] = {}       # name -> variant, in the order of registration: what a models folder tries


def register(family: Family) -> Family:
    """Adds ``family`` and its variants, refusing a field of the wrong kind, another family's variants or a name
    already taken."""
    if not isinstance(family, Family):
        raise Flux2Error(f"a model family is registered as a families.Family record, got {type(family).__name__}")
    hints = typing.get_type_hints(Family)
    for f in fields(Family):
        value = getattr(family, f.name)
        if not _fits(value, hints[f.name]):
            raise Flux2Error(f"the model family {family.name!r} cannot be registered: its {f.name} must be "
                             f"{_kind(hints[f.name])}, got {type(value).__name__} {value!r:.80}")
    for v in family.variants:
        if v.family != family.name or not isinstance(v.params, family.params_type):
            raise Flux2Error(f"the model family {family.name!r} cannot be registered: its variant {v.name!r} says it "
                             f"is of the family {v.family!r} with {type(v.params).__name__}; each of its variants "
                             f"must name it and hold {family.params_type.__name__}")
    taken = [name for name in (family.name, *(v.name for v in family.variants)) if name in FAMILIES or name in VARIANTS]
    if taken:
        raise Flux2Error(f"the model family {family.name!r} cannot be registered: {', '.join(map(repr, taken))} "
                         f"already registered; give it names of its own")
    FAMILIES[family.name] = family
    VARIANTS.update((v.name, v) for v in family.variants)
    return family


def check_size_for_any(width: int, height: int) -> None:
    """Before the files say which family runs: refuses a size no registered family makes."""
    max(FAMILIES.values(), key=lambda family: family.largest_side).check_size(width, height)


def unregister(name: str) -> None:
    """Removes a family and its variants (tests' toy family)."""
    family = FAMILIES.pop(name)
    for v in family.variants:
        del VARIANTS[v.name]


def _fits(value, hint) -> bool:
    """Whether ``value`` is of the kind a type hint of ``Family`` says."""
    origin, args = typing.get_origin(hint) or hint, typing.get_args(hint)
    if hint is object or hint is typing.Any:
        return True
    if origin is collections.abc.Callable:
        return callable(value)
    if origin in (types.UnionType, typing.Union):
        return any(_fits(value, a) for a in args)
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(item, args[0]) for item in value)
        return not args or (len(args) == len(value) and all(map(_fits, value, args)))
    if origin is dict:
        return isinstance(value, dict) and (not args or all(_fits(k, args[0]) and _fits(v, args[1])
                                                            for k, v in value.items()))
    if isinstance(origin, type) and getattr(origin, "_is_protocol", False):
        return True                      # a protocol: what it needs is called, not declared
    return isinstance(origin, type) and isinstance(value, origin)


def _kind(hint) -> str:
    origin = typing.get_origin(hint) or hint
    if origin is collections.abc.Callable:
        return "callable"
    return f"a {getattr(origin, '__name__', str(origin))}" + (" of the kinds its annotation names"
                                                             if typing.get_args(hint) else "")


def get_family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise Flux2Error(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}") from None


def family_of(variant: Variant) -> Family:
    return get_family(variant.family)


def family_of_params(params) -> Family:
    """The family whose architecture ``params`` describe (each family has its own parameter class)."""
    family = next((f for f in FAMILIES.values() if type(params) is f.params_type), None)
    if family is None:
        raise Flux2Error(f"{type(params).__name__} is no model family's parameters; known: "
                         f"{', '.join(f.params_type.__name__ for f in FAMILIES.values())}")
    return family


def get_variant(name: str) -> Variant:
    try:
        return VARIANTS[name]
    except KeyError:
        raise Flux2Error(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}") from None


def runnable_variants() -> list[Variant]:
    """The variants whose text encoder this engine reads, in the registry's order."""
    return [v for v in VARIANTS.values() if v.text_encoder.loadable]


def runnable_variant(name: str) -> Variant:
    """The variant called ``name``; Flux2Error where there is none or it cannot run here."""
    known = ", ".join(v.name for v in runnable_variants())
    variant = VARIANTS.get(name) if isinstance(name, str) else None
    if variant is None:
        raise Flux2Error(f"unknown variant {name!r}; the variants run here: {known}")
    if not variant.text_encoder.loadable:
        raise Flux2Error(f"{variant.title} ({name}) does not run here: its text encoder, {variant.text_encoder.title}, "
                         f"is not one this engine reads; the variants run here: {known}")
    return variant


def text_encoders() -> list[TextEncoderSpec]:
    """Every registered variant's text encoder, once each, in the registry's order."""
    return list(dict.fromkeys(v.text_encoder for v in VARIANTS.values()))


def encoder_for(model: str | None, hidden: int = 0) -> TextEncoderSpec:
    """The spec a text encoder file is read with where no family asks: the first that reads ``model`` at this width,
    else the first that reads it, made ``hidden`` wide."""
    readers = [s for s in text_encoders() if s.loadable and s.reads(model)]
    if not readers:
        raise Flux2Error(f"no model family reads a {model or 'unmarked'} text encoder; the encoders read here: "
                         f"{'; '.join(s.wanted for s in text_encoders() if s.loadable)}")
    exact = next((s for s in readers if s.hidden_size == hidden), None)
    if exact is not None or not hidden:
        return exact or readers[0]
    return replace(readers[0], name="custom", hidden_size=hidden)


def family_of_encoder(spec: TextEncoderSpec) -> Family:
    """The family whose prompts this encoder reads (its variants', else the first reading the same language model);
    Flux2Error where none does."""
    variant = next((v for v in VARIANTS.values() if v.text_encoder == spec), None) or next(
        (v for v in VARIANTS.values() if v.text_encoder.model == spec.model), None)
    if variant is None:
        raise Flux2Error(f"no model family reads prompts encoded by {spec.title} ({spec.model}); {encoder_hint()}")
    return family_of(variant)


def encoder_hint() -> str:
    """Which text encoder each release reads, for messages."""
    lines = {}
    for spec in text_encoders():
        if spec.loadable:
            names = [*spec.files[:1], *([f"a {spec.gguf_stem} GGUF"] if spec.gguf_stem else [])]
            lines.setdefault(spec.name, f"{spec.reader} reads {spec.title}" + (f" ({' or '.join(names)})" if names
                                                                               else ""))
    return "; ".join(lines.values()) + "."
