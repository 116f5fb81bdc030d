"""Boxes through the prompt upsampler: what it is asked, and its answer with the user's boxes kept.

The upsampler reads locked rows after the request and answers with a caption citing each row as ``<id>``, then the
table as JSON. The user's rows come back as given (only ``desc`` may be richer); added rows are kept only when well
formed and cited.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ..family import ReferenceCount
from .boxes import ROW_ID, row_box, row_problem, split_table, table_at_end

SAME_OBJECT = 0.9                  # a renamed row whose box overlaps a locked one this much (IoU) is that object
LOCKED_HEADER = ("LOCKED BOUNDING-BOX ANNOTATIONS ([y_min, x_min, y_max, x_max] on a 0-1000 canvas, with (0, 0) at the "
                 "top-left). This is an authoritative JSON list of dictionaries; preserve every supplied identity, "
                 "provenance value, null, and coordinate exactly:")


@dataclass(frozen=True)
class Request:
    """What the upsampler is given: which of its system prompts, the user's text, and the rows it must keep."""

    task: str                      # "t2i", "i2i", "t2i_bbox" or "i2i_bbox": a key of system_prompts.json
    text: str
    locked: list[dict] | None      # None: no boxes


def rows_in_prompt(prompt: str) -> tuple[str, list[dict]] | None:
    """(prompt, rows) when the prompt already ends in a box table (the model's form or a locked-rows request)."""
    found = table_at_end(prompt)
    if found is None:
        return None
    text, rows = found
    asked = re.fullmatch(r"ORIGINAL PROMPT:\n(.*?)\n\nLOCKED BOUNDING-BOX ANNOTATIONS .*", text, re.DOTALL)
    return (asked.group(1) if asked else text), rows


def already_upsampled(prompt: str) -> bool:
    """An upsampler's answer rather than a request: it has a table, and its caption cites every row."""
    found = rows_in_prompt(prompt)
    return found is not None and all(f"<{row['id']}>" in found[0] for row in found[1])


def request(prompt: str, locked: list[dict] | None, pictures: int) -> Request:
    """The user's boxes (rows) win; without them, a table already at the prompt's end is locked instead."""
    task = "i2i" if pictures else "t2i"
    if not locked:
        found = rows_in_prompt(prompt)
        if found is None:
            return Request(task, prompt, None)
        prompt, locked = found
    text = f"ORIGINAL PROMPT:\n{prompt.strip()}\n\n{LOCKED_HEADER}\n{json.dumps(locked, ensure_ascii=False)}"
    return Request(f"{task}_bbox", text, locked)


def _first_box(row: dict):
    return row.get("bbox") or row.get("tgt_bbox") or row.get("src_bbox")


def _overlap(a: list, b: list) -> float:
    """Intersection over union of two canvas boxes."""
    high = max(0, min(a[2], b[2]) - max(a[0], b[0]))
    wide = max(0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - high * wide
    return high * wide / union if union > 0 else 0.0


def _added_row(row, caption: str, pictures: int) -> dict | None:
    """A row the upsampler added, cleaned, if it is whole, cited and applies to the ``pictures``; else None."""
    if not isinstance(row, dict):
        return None
    row_id, desc = row.get("id"), row.get("desc")
    if not (isinstance(row_id, str) and ROW_ID.fullmatch(row_id) and f"<{row_id}>" in caption
            and isinstance(desc, str) and desc.strip()):
        return None
    if (box := row_box(row.get("bbox"))) is not None:
        return {"id": row_id, "bbox": box, "desc": desc.strip()}
    source, given = row.get("from"), {side: row.get(side) for side in ("src_bbox", "tgt_bbox")}
    boxes = {side: row_box(value) if value is not None else None for side, value in given.items()}
    if any(given[side] is not None and boxes[side] is None for side in given):        # a box given, but malformed
        return None
    added = {"id": row_id, "from": source, **boxes, "desc": desc.strip()}
    if not any(boxes.values()) or row_problem(added, ReferenceCount(pictures)) is not None:
        return None
    return added


def keep_locked(answer: str, locked: list[dict], pictures: int) -> str:
    """The upsampler's answer with the user's rows re-imposed (a redrawn locked box takes the locked id), locked
    rows first, then its valid added rows."""
    caption, rows = split_table(answer)
    rows = [row for row in rows or []]
    locked_ids = {row["id"] for row in locked}
    answered_ids = {row.get("id") for row in rows if isinstance(row, dict)}
    renamed: dict[str, str] = {}
    for lock in locked:
        lock_box = _first_box(lock)
        if lock["id"] in answered_ids or lock_box is None:
            continue
        for row in rows:
            if not isinstance(row, dict) or row.get("id") in renamed or row.get("id") in locked_ids:
                continue
            box = row_box(_first_box(row))
            if box is not None and _overlap(box, lock_box) >= SAME_OBJECT:
                renamed[row["id"]] = lock["id"]
                break
    rows = [{**row, "id": renamed[row["id"]]} if isinstance(row, dict) and row.get("id") in renamed else row
            for row in rows]
    for old, new in renamed.items():
        caption = caption.replace(f"<{old}>", f"<{new}>")
    described = {row["id"]: row.get("desc") for row in rows if isinstance(row, dict) and isinstance(row.get("id"), str)}
    table = []
    for lock in locked:
        desc = described.get(lock["id"])
        table.append({**lock, "desc": desc.strip() if isinstance(desc, str) and desc.strip() else lock.get("desc", "")})
    for row in rows:
        added = _added_row(row, caption, pictures)
        if added is not None and added["id"] not in {kept["id"] for kept in table}:
            table.append(added)
    return f"{caption} {json.dumps(table, ensure_ascii=False)}"
