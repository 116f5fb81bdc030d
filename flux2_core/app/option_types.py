"""argparse types over the engine's own rules, so an option is refused by argparse's usage line (exit 2) with the
rule's words, never by a traceback deeper in."""

from __future__ import annotations

import argparse

from ..checks import parse_number
from ..errors import Flux2Error


def number_option(name: str, low: float | None = None, high: float | None = None, *, whole: bool = False,
                  above_low: bool = False, hint: str = ""):
    """``type=`` for a numeric option: ``checks.parse_number`` with the option's name and range."""

    def parse(text: str) -> int | float:
        try:
            return parse_number(text, name, low, high, whole=whole, above_low=above_low, hint=hint)
        except Flux2Error as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = "whole number" if whole else "number"       # argparse's name for the type in its messages
    return parse


def dtype_option(text: str) -> str | None:
    """``type=`` for --dtype: a name ``devices.dtype_named`` knows ("bf16", "FP16", "float32", "auto", ...) -> the
    torch dtype's name ("bfloat16", "float16", "float32"), or None for auto."""
    from ..devices import dtype_named

    try:
        dtype = dtype_named(text)
    except Flux2Error as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return None if dtype is None else str(dtype).removeprefix("torch.")


dtype_option.__name__ = "dtype"
