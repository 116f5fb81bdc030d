"""JSON a user hands us (box files, config files, adapter metadata), read by one guarded reader.

Python's ``json`` alone raises many error types on hostile input and takes NaN and lone surrogates. Here every
document is bounded in size and depth, its strings are real text and its top level the kind the caller reads;
anything else is a Flux2Error that names the source. ``list_at_end`` scans prompt text and never raises.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .errors import Flux2Error

MAX_DEPTH = 32              # real documents nest about 4; far below where Python's parser runs out of stack
MAX_CHARS = 4 << 20         # documents here are kilobytes; a wrong file (a model) is not read whole
KINDS = {dict: "object", list: "list", str: "string", int: "number", float: "number", bool: "true or false",
         type(None): "null"}
JSON_SPACE = re.compile(r"[ \t\n\r]*")      # what JSON calls whitespace (str.strip takes more)
SURROGATE = re.compile("[\ud800-\udfff]")
TOO_DEEP = f"is not a JSON document we read: it nests deeper than {MAX_DEPTH} levels"


class NotJson(Exception):
    """Why a text is no document we read (worded to follow its source's name)."""


def _no_constant(name: str):
    raise NotJson(f"is not valid JSON: {name} is Python's, not JSON's (write a number)")


DECODER = json.JSONDecoder(parse_constant=_no_constant)


def decode(text: str, start: int = 0):
    """The one JSON value from ``start`` to the end of ``text``, checked; NotJson says why it is none."""
    if len(text) - start > MAX_CHARS:
        raise NotJson(f"is {len(text) - start:,} characters long, over the {MAX_CHARS:,} characters a JSON document "
                      f"may have here")
    try:
        value, end = DECODER.raw_decode(text, JSON_SPACE.match(text, start).end())
        end = JSON_SPACE.match(text, end).end()
        if end != len(text):
            raise json.JSONDecodeError("Extra data", text, end)
    except json.JSONDecodeError as e:
        raise NotJson(f"is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise NotJson(TOO_DEEP) from None
    except ValueError as e:                  # a number of thousands of digits
        raise NotJson(f"is not valid JSON ({e})") from None
    _check_tree(value)
    return value


def _check_tree(value) -> None:
    """Depth and text, walked without recursion (the value may be a few hundred levels deep)."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, (dict, list)) and depth > MAX_DEPTH:
            raise NotJson(TOO_DEEP)
        if isinstance(item, dict):
            pending.extend((key, depth + 1) for key in item)
            pending.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            pending.extend((child, depth + 1) for child in item)
        elif isinstance(item, str) and (half := SURROGATE.search(item)):
            raise NotJson(f"holds half a character ({half.group()!a}, a lone surrogate) in {item[:40]!a}, which no "
                          f"text is written with")


def kind_of(value) -> str:
    return KINDS.get(type(value), type(value).__name__)


def parse_json(text: str | bytes, source: str, want: type, fix: str):
    """``text`` (bytes: UTF-8) as a JSON ``want`` (dict or list); ``source`` and ``fix`` are for messages."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise Flux2Error(f"{source} is not UTF-8 text ({e.reason} at byte {e.start}); {fix}") from None
    if not isinstance(text, str):
        raise Flux2Error(f"{source} must be JSON text, got a {type(text).__name__}; {fix}")
    try:
        value = decode(text)
    except NotJson as e:
        raise Flux2Error(f"{source} {e}; {fix}") from None
    if not isinstance(value, want):
        raise Flux2Error(f"{source} holds a JSON {kind_of(value)}, but it must hold a JSON {KINDS[want]}; {fix}")
    return value


def read_json_file(path: Path, want: type, fix: str, what: str):
    """A JSON file (``parse_json``), its size checked before it is read; ``what`` names it in messages."""
    source = f"{what} ({path})"
    try:
        size = path.stat().st_size
        if size > MAX_CHARS:
            raise Flux2Error(f"{source} is {size:,} bytes, over the {MAX_CHARS:,} a JSON document may have here; "
                             f"{fix}")
        raw = path.read_bytes()
    except FileNotFoundError:
        raise Flux2Error(f"{source}: no such file; {fix}") from None
    except OSError as e:
        raise Flux2Error(f"{source} could not be read ({e.strerror or e}); {fix}") from None
    return parse_json(raw, source, want, fix)


STRUCTURE = re.compile(r'["\[\]{}]')


def _escaped(text: str, quote: int) -> bool:
    """Whether the quote at ``quote`` is written \\" (after an odd run of backslashes)."""
    run = quote
    while run > 0 and text[run - 1] == "\\":
        run -= 1
    return (quote - run) % 2 == 1


def list_start(text: str) -> int | None:
    """Where a JSON list that ends ``text`` would start, or None where none can.

    Read backwards: unescaped quotes pair up from the end the same way for any start, so the final "]" has one
    opening "[" at most: one candidate to parse, not one per "[" of the prose before it."""
    if not text.rstrip().endswith("]"):
        return None
    depth, in_string = 0, False
    for mark in reversed(list(STRUCTURE.finditer(text))):
        char, at = mark.group(), mark.start()
        if char == '"':
            in_string = in_string if _escaped(text, at) else not in_string
        elif in_string:
            continue
        elif char in "]}":
            depth += 1
        else:
            depth -= 1
            if depth <= 0:
                return at if depth == 0 and char == "[" else None
    return None


def list_at_end(text: str) -> tuple[int, list] | None:
    """(start, the list) for the JSON list that ends ``text``, else None; never raises."""
    start = list_start(text)
    if start is None:
        return None
    try:
        value = decode(text, start)
    except NotJson:
        return None
    return (start, value) if isinstance(value, list) else None
