"""Lists in messages and notes, bounded: past a count, the first few and how many more, with the total, so that a
thousand bad boxes, keys or files make a few lines of log and not a thousand."""

from __future__ import annotations

from collections.abc import Sequence

SHOWN = 8            # items a note or message lists before it sums up the rest


def bounded_notes(notes: Sequence[str], what: str, limit: int = SHOWN) -> list[str]:
    """The notes as they are up to ``limit``; past it the first ``limit`` and one line for the rest: "... and 4992 more
    <what> (5000 in all)"."""
    if len(notes) <= limit:
        return list(notes)
    return [*notes[:limit], f"... and {len(notes) - limit} more {what} ({len(notes)} in all)"]


def bounded_list(items: Sequence[str], limit: int = SHOWN, sep: str = ", ") -> str:
    """Items joined in one line; past ``limit`` the first ``limit`` and "and N more (M in all)"."""
    shown = sep.join(items[:limit])
    return shown if len(items) <= limit else f"{shown} and {len(items) - limit} more ({len(items)} in all)"
