"""Key tables: how one of our keys is built from a file's keys (``Recipe``), a file's naming (``Layout``), and tables of
templates that map one naming onto another. The tables themselves live with what they name: a model family's in its
entry (``families/``), the autoencoder's and the text encoder's in ``weights/key_mapping.py``.

Placeholders in templates: {i} {j} block indices, {r} the reversed decoder level, {p} weight|bias, {e} encoder|decoder,
{m} a resnet layer, {b} a BatchNorm buffer. A tuple of sources is concatenated along dim 0.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Recipe:
    """Where one of our keys comes from: file keys (concatenated along dim 0 when several: fused q/k/v)."""
    sources: tuple[str, ...]
    swap_halves: bool = False          # diffusers' final-layer modulation is (scale, shift), BFL's (shift, scale)


@dataclass(frozen=True)
class Layout:
    name: str                                              # e.g. "BFL", "diffusers"
    signature: str                                         # a key only this layout has (after the prefix)
    recipes: Callable[[set[str]], Callable[[str], Recipe]]  # file keys -> (our key -> recipe)
    ours: Callable[[str], str | None] = lambda key: key    # a file key -> our key it is (None: none), for loaders
                                                           # that take what the file has (the text encoder)


def same_names(keys: set[str]) -> Callable[[str], Recipe]:
    return lambda key: Recipe((key,))


PLACEHOLDERS = {"i": r"\d+", "j": r"\d+", "p": "weight|bias", "e": "encoder|decoder",
                "m": "norm1|conv1|norm2|conv2", "b": "running_mean|running_var|num_batches_tracked"}


def template_regex(template: str) -> re.Pattern:
    pattern = re.escape(template)
    for name, alternatives in PLACEHOLDERS.items():
        pattern = pattern.replace(re.escape("{" + name + "}"), f"(?P<{name}>{alternatives})")
    return re.compile(pattern)


def table_recipes(table: list, swapped: set[str] = frozenset(), levels: int = 0) -> Callable[[str], Recipe]:
    """our key -> Recipe, from a table of (our template, file template or tuple of them)."""
    compiled = [(template_regex(ours), theirs) for ours, theirs in table]

    def recipe(key: str) -> Recipe:
        for pattern, theirs in compiled:
            match = pattern.fullmatch(key)
            if match:
                fields = match.groupdict()
                if "i" in fields:
                    fields["r"] = str(levels - 1 - int(fields["i"]))
                sources = (theirs,) if isinstance(theirs, str) else theirs
                return Recipe(tuple(s.format(**fields) for s in sources), key in swapped)
        raise KeyError(f"no mapping for {key!r}")       # a missing table row: a bug here, not bad input
    return recipe


def table_names(table: list) -> Callable[[str], str | None]:
    """file key -> our key, from a table of one-to-one (our template, file template) rows; None for other keys."""
    compiled = [(template_regex(theirs), ours) for ours, theirs in table]

    def ours(key: str) -> str | None:
        for pattern, template in compiled:
            match = pattern.fullmatch(key)
            if match:
                return template.format(**match.groupdict())
        return None
    return ours
