"""Layout boxes: where objects go, as boxes the prompt carries (FLUX 3 Image Klein).

A box is [y_min, x_min, y_max, x_max] in fractions of the height and width (0-1, (0, 0) the top left). The model
reads boxes as text: each a row on a 0-1000 canvas, the rows one JSON list after the prompt and a space. A move has
``from`` ("ref_image_N" with ``src_bbox``, or "target" for something new), ``src_bbox`` and ``tgt_bbox``;
``check_rows`` holds that rule, and every path that hands rows to the model calls it.

``--boxes`` files and the Layout node's text are that list with 0-1 boxes:

    [{"desc": "a red kite", "bbox": [0.1, 0.05, 0.6, 0.4]},
     {"id": "dog", "desc": "the dog", "from": "ref_image_0", "src_bbox": [0.2, 0.1, 0.9, 0.5],
      "tgt_bbox": [0.3, 0.5, 1.0, 0.9]}]
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from ...errors import Flux2Error
from ...listing import bounded_notes
from ...user_json import list_at_end, parse_json
from ..family import ReferenceCount

CANVAS = 1000                      # the rows' coordinates run 0..CANVAS
EXAMPLE = '[{"desc": "a red kite", "bbox": [0.1, 0.05, 0.6, 0.4]}]'
WRITE_A_LAYOUT = f"write a list of boxes such as {EXAMPLE}"
SIDES = ("bbox", "src_bbox", "tgt_bbox")


@dataclass(frozen=True)
class Box:
    """One object of a layout, in 0-1: either ``bbox`` or a move (``source``, ``src_bbox``, ``tgt_bbox``)."""

    id: str
    desc: str
    bbox: tuple[float, ...] | None = None
    source: str = ""               # the "from" of a move: "ref_image_0", ..., "target"
    src_bbox: tuple[float, ...] | None = None
    tgt_bbox: tuple[float, ...] | None = None
    clamped: tuple[str, ...] = ()  # the sides given reaching past the picture's edge, drawn to the edge

    def row(self) -> dict:
        """Its row on the 0-1000 canvas, keys in the order the model was trained on."""
        if self.bbox is not None:
            return {"id": self.id, "bbox": canvas_box(self.bbox), "desc": self.desc}
        return {"id": self.id, "from": self.source, "src_bbox": canvas_box(self.src_bbox),
                "tgt_bbox": canvas_box(self.tgt_bbox), "desc": self.desc}


def clamp_notes(boxes: list[Box]) -> list[str]:
    """One note per box drawn to the picture's edge (the reference clamps into 0-1 too)."""
    return bounded_notes([f"box {box.id!r} reaches past the picture's edge ({', '.join(box.clamped)}): it is drawn to "
                          f"the edge, as the reference draws it" for box in boxes if box.clamped],
                         "boxes reach past the picture's edge and are drawn to it")


def canvas_box(box: tuple[float, ...] | None) -> list[int] | None:
    # round() as the reference: halves to even (0.0125 -> 12)
    return None if box is None else [round(v * CANVAS) for v in box]


def read_boxes(data, where: str = "the boxes") -> list[Box]:
    """A layout from its JSON text (or the list parsed from it): every box checked, with what is wrong said."""
    if isinstance(data, str):
        if not data.strip():
            return []
        data = parse_json(data, where, list, WRITE_A_LAYOUT)
    if not isinstance(data, list):
        raise Flux2Error(f"{where} must be a JSON list of boxes such as {EXAMPLE}, got a {type(data).__name__}")
    boxes = [_box(item, i, where) for i, item in enumerate(data)]
    seen: set[str] = set()
    for box in boxes:
        if box.id in seen:
            raise Flux2Error(f"{where}: two boxes have the id {box.id!r}; give each its own id")
        seen.add(box.id)
    return boxes


def boxes_from_pixels(rects: list[tuple[float, float, float, float]], width: int, height: int, descs: list[str],
                      where: str = "the boxes") -> list[Box]:
    """A layout from pixel rectangles (x, y, w, h; (0, 0) the top left), one description each."""
    if len(descs) != len(rects):
        raise Flux2Error(f"{where}: {len(rects)} boxes but {len(descs)} descriptions; write one line per box, in the "
                         f"boxes' order")
    if width <= 0 or height <= 0:
        raise Flux2Error(f"{where}: the picture is {width}x{height} pixels; give the picture the boxes are on")
    for i, (_, _, w, h) in enumerate(rects):
        if not (w > 0 and h > 0):
            raise Flux2Error(f"{where}: box {i + 1} is {w}x{h} pixels; a box needs a width and a height")
    return read_boxes([{"desc": desc, "bbox": [y / height, x / width, (y + h) / height, (x + w) / width]}
                       for (x, y, w, h), desc in zip(rects, descs)], where)


def _box(item, index: int, where: str) -> Box:
    name = f"{where}: box {index + 1}"
    if isinstance(item, Box):
        return item
    if not isinstance(item, dict):
        raise Flux2Error(f"{name} must be an object such as {EXAMPLE[1:-1]}, got {json.dumps(item)[:80]}")
    unknown = sorted(set(item) - {"id", "desc", "from", *SIDES})
    if unknown:
        raise Flux2Error(f"{name} has keys no box has ({', '.join(unknown)}); a box has id, desc and bbox, or for a "
                         f"move id, desc, from, src_bbox and tgt_bbox")
    box_id, desc = item.get("id") or f"obj_{index + 1}", item.get("desc") or ""
    if not isinstance(box_id, str) or not isinstance(desc, str):
        raise Flux2Error(f"{name}: id and desc must be text")
    read = {side: _coordinates(item.get(side), f"{name} {side}") for side in SIDES}
    sides = {side: None if box is None else box[0] for side, box in read.items()}
    clamped = tuple(side for side, box in read.items() if box is not None and box[1])
    if sides["bbox"] is not None:
        if sides["src_bbox"] is not None or sides["tgt_bbox"] is not None or item.get("from"):
            raise Flux2Error(f"{name} has bbox and a move (from / src_bbox / tgt_bbox): give one of them")
        return Box(box_id, desc, bbox=sides["bbox"], clamped=clamped)
    if sides["src_bbox"] is None and sides["tgt_bbox"] is None:
        raise Flux2Error(f"{name} has no box: give bbox [y_min, x_min, y_max, x_max] in 0-1 (or src_bbox / tgt_bbox "
                         f"for something moved from a reference)")
    source = item.get("from") or ""
    if not isinstance(source, str):
        raise Flux2Error(f"{name}: from must be text: {FROM_FORMS}")
    return Box(box_id, desc, source=source, src_bbox=sides["src_bbox"], tgt_bbox=sides["tgt_bbox"], clamped=clamped)


# Coordinates past the edge are clamped into 0-1, as the reference does; a whole picture past an edge is another
# convention (most often the 0-1000 canvas): refused.
REACH = (-1.0, 2.0)


def _coordinates(value, name: str) -> tuple[tuple[float, ...], bool] | None:
    """(the box clamped into 0-1, whether it was clamped); None for no box."""
    if value is None or value == []:             # the reference reads an empty box as none
        return None
    if not isinstance(value, list) or len(value) != 4 or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) for v in value):
        raise Flux2Error(f"{name} must be four numbers [y_min, x_min, y_max, x_max], got {json.dumps(value)[:80]}")
    if any(not REACH[0] <= v <= REACH[1] for v in value):        # NaN fails this too
        raise Flux2Error(f"{name} is {value}: coordinates are fractions of the height and width, 0 to 1 (for a box "
                         f"on the 0-1000 canvas divide by 1000)")
    y_min, x_min, y_max, x_max = (float(v) for v in value)
    if y_max <= y_min or x_max <= x_min:
        raise Flux2Error(f"{name} is {value}: it is [y_min, x_min, y_max, x_max], so y_max must be above y_min and "
                         f"x_max above x_min")
    box = tuple(min(1.0, max(0.0, v)) for v in (y_min, x_min, y_max, x_max))
    if box[2] <= box[0] or box[3] <= box[1]:
        raise Flux2Error(f"{name} is {value}: it lies wholly outside the picture (0 to 1 each way); move it inside")
    return box, box != (y_min, x_min, y_max, x_max)


# --- what a row's "from" may name: one rule for the user's rows and the upsampler's ----------------------------------

REFERENCE_NAME = re.compile(r"ref_image_(0|[1-9][0-9]{0,5})")   # no run has a million references
NEW_CONTENT = "target"
FROM_FORMS = ('"ref_image_0" for the first reference picture, "ref_image_1" for the second, ... (something taken '
              'from that picture, with its src_bbox), or "target" (something new, with tgt_bbox alone)')


def row_problem(row: dict, references: ReferenceCount | None) -> str | None:
    """What keeps a canvas row from applying to the run, with the fix; None when it applies. ``references`` None
    (the Layout node): only the row's form is checked."""
    if row.get("bbox") is not None:             # placed, not moved: every run reads it
        return None
    source = row.get("from")
    named = REFERENCE_NAME.fullmatch(source) if isinstance(source, str) else None
    problem = _form_problem(source, named, moved=row.get("src_bbox") is not None)
    if problem is None and references is not None:
        problem = _reference_problem(source, named, references)
    return problem


def _form_problem(source, named: re.Match | None, moved: bool) -> str | None:
    """A from the model reads; a reference's has a src_bbox, "target" has none."""
    if source in (None, ""):
        return f"a move (src_bbox / tgt_bbox) needs from: {FROM_FORMS}; or place it with bbox"
    if named is None and source != NEW_CONTENT:
        return f"from is {json.dumps(source, ensure_ascii=False)[:60]}, which the model does not read: write {FROM_FORMS}"
    if named is None and moved:
        return ('from "target" is something new, which has no src_bbox: leave src_bbox out, or name the reference '
                'picture it is taken from ("ref_image_0", ...)')
    if named is not None and not moved:
        return (f"from \"{source}\" takes something from that reference picture, so it needs src_bbox (where it is "
                f"there); for something new write from \"target\"")
    return None


def _reference_problem(source: str, named: re.Match | None, references: ReferenceCount) -> str | None:
    """A row with from belongs to an edit, and a reference it names must be one the model is given."""
    if references.total == 0:
        return ("a row with from is for an edit, and this run has no reference pictures (a picture made from text): "
                "give the reference pictures, or place it with bbox [y_min, x_min, y_max, x_max] instead")
    index = int(named.group(1)) if named is not None else 0
    if index < references.total:
        return None
    last = references.total - 1
    given = "ref_image_0" + (f" to ref_image_{last}" if last else "")
    return (f"from \"{source}\" names reference picture {index + 1}, but the model is given {references.describe()}, "
            f"named {given} in order: name one of those, or give the picture")


def check_rows(layout_rows: list[dict], references: ReferenceCount | None, where: str) -> None:
    """Every row that cannot apply to the run (``row_problem``), named with what is wrong in one Flux2Error."""
    problems = [f"box {i + 1} ({row.get('id')}): {problem}" for i, row in enumerate(layout_rows)
                if (problem := row_problem(row, references)) is not None]
    if problems:
        raise Flux2Error(f"{where}: " + "; ".join(problems))


def rows_read(prompt: str, boxes: list[Box]) -> list[dict]:
    """The rows the model will read: the boxes given, else the table the prompt already ends in."""
    if boxes:
        return rows(boxes)
    found = table_at_end(prompt)
    return found[1] if found is not None else []


# --- the prompt form read back (an upsampler's answer, a prompt written with its table) -----------------------------

ROW_ID = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


def split_table(text: str) -> tuple[str, list | None]:
    """(caption, rows), rows the JSON list ending the text (a parser, not a pattern: descriptions hold brackets)."""
    found = list_at_end(text)
    if found is None:
        return text.strip(), None
    start, rows = found
    return text[:start].rstrip(), rows


def row_box(box) -> list | None:
    """The box if it is a proper [y_min, x_min, y_max, x_max] on the 0-1000 canvas, else None (0-1 boxes are not)."""
    if not isinstance(box, (list, tuple)) or len(box) != 4:
        return None
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for v in box):
        return None
    y_min, x_min, y_max, x_max = box
    if min(y_min, x_min) < 0 or y_max <= y_min or x_max <= x_min or max(y_max, x_max) > CANVAS or max(box) <= 1:
        return None
    return list(box)


def table_at_end(prompt: str) -> tuple[str, list[dict]] | None:
    """(text, rows) when the prompt ends in a table of canvas rows (not "... a sign reading [SALE]")."""
    text, found = split_table(prompt)
    if not found or not all(isinstance(row, dict) and isinstance(row.get("id"), str) and ROW_ID.fullmatch(row["id"])
                            and any(row_box(row.get(side)) for side in SIDES) for row in found):
        return None
    return text, found


def rows(boxes: list[Box]) -> list[dict]:
    return [box.row() for box in boxes]


def with_boxes(prompt: str, boxes: list[Box]) -> str:
    """The text the model reads: the prompt, a space, the rows as JSON (the prompt alone without boxes)."""
    if not boxes:
        return prompt
    return f"{prompt.rstrip()} {json.dumps(rows(boxes), ensure_ascii=False)}"
