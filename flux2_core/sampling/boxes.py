"""Layout boxes: where objects go, as boxes the prompt carries (FLUX 3 Image Klein).

A box is [y_min, x_min, y_max, x_max] in fractions of the picture's height and width (0-1, (0, 0) the top left).
The model reads boxes as text: each becomes a row on a 0-1000 canvas, and the rows, as one JSON list, follow the
prompt after a space ("<prompt> [{"id": "obj_1", "bbox": [100, 50, 600, 400], "desc": "a red kite"}]"). An edit may
also move something: a row with ``from`` (which picture it comes from, "ref_image_1" ...), ``src_bbox`` (where it is
there) and ``tgt_bbox`` (where it goes), either box left out.

The file the command line reads (``--boxes``) and the Layout node's text are that list with 0-1 boxes:

    [{"desc": "a red kite", "bbox": [0.1, 0.05, 0.6, 0.4]},
     {"id": "dog", "desc": "the dog", "from": "ref_image_1", "src_bbox": [0.2, 0.1, 0.9, 0.5],
      "tgt_bbox": [0.3, 0.5, 1.0, 0.9]}]
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from ..errors import Flux2Error
from ..families import FAMILIES, Family

CANVAS = 1000                      # the rows' coordinates run 0..CANVAS
EXAMPLE = '[{"desc": "a red kite", "bbox": [0.1, 0.05, 0.6, 0.4]}]'
SIDES = ("bbox", "src_bbox", "tgt_bbox")


@dataclass(frozen=True)
class Box:
    """One object of a layout; coordinates in 0-1. Either ``bbox`` (where it goes) or a move (``source`` with
    ``src_bbox`` and/or ``tgt_bbox``)."""

    id: str
    desc: str
    bbox: tuple[float, ...] | None = None
    source: str = ""               # the "from" of a move: "ref_image_1", ...
    src_bbox: tuple[float, ...] | None = None
    tgt_bbox: tuple[float, ...] | None = None

    def row(self) -> dict:
        """Its row on the 0-1000 canvas, keys in the order the model was trained on."""
        if self.bbox is not None:
            return {"id": self.id, "bbox": canvas_box(self.bbox), "desc": self.desc}
        return {"id": self.id, "from": self.source, "src_bbox": canvas_box(self.src_bbox),
                "tgt_bbox": canvas_box(self.tgt_bbox), "desc": self.desc}


def canvas_box(box: tuple[float, ...] | None) -> list[int] | None:
    # round() as the reference: halves to even (0.0125 -> 12)
    return None if box is None else [round(v * CANVAS) for v in box]


def read_boxes(data, where: str = "the boxes") -> list[Box]:
    """A layout from its JSON text (or the list parsed from it): every box checked, with what is wrong said."""
    if isinstance(data, str):
        if not data.strip():
            return []
        try:
            data = json.loads(data)
        except json.JSONDecodeError as e:
            raise Flux2Error(f"{where} are not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); write a "
                             f"list of boxes such as {EXAMPLE}") from None
    if not isinstance(data, list):
        raise Flux2Error(f"{where} must be a JSON list of boxes such as {EXAMPLE}, got a {type(data).__name__}")
    boxes = [_box(item, i, where) for i, item in enumerate(data)]
    seen: set[str] = set()
    for box in boxes:
        if box.id in seen:
            raise Flux2Error(f"{where}: two boxes have the id {box.id!r}; give each its own id")
        seen.add(box.id)
    return boxes


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
    sides = {side: _coordinates(item.get(side), f"{name} {side}") for side in SIDES}
    if sides["bbox"] is not None:
        if sides["src_bbox"] is not None or sides["tgt_bbox"] is not None or item.get("from"):
            raise Flux2Error(f"{name} has bbox and a move (from / src_bbox / tgt_bbox): give one of them")
        return Box(box_id, desc, bbox=sides["bbox"])
    if sides["src_bbox"] is None and sides["tgt_bbox"] is None:
        raise Flux2Error(f"{name} has no box: give bbox [y_min, x_min, y_max, x_max] in 0-1 (or src_bbox / tgt_bbox "
                         f"for something moved from a reference)")
    source = item.get("from") or ""
    if not isinstance(source, str):
        raise Flux2Error(f"{name}: from must be text such as \"ref_image_1\"")
    return Box(box_id, desc, source=source, src_bbox=sides["src_bbox"], tgt_bbox=sides["tgt_bbox"])


def _coordinates(value, name: str) -> tuple[float, ...] | None:
    if value is None or value == []:             # the reference reads an empty box as none
        return None
    if not isinstance(value, list) or len(value) != 4 or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) for v in value):
        raise Flux2Error(f"{name} must be four numbers [y_min, x_min, y_max, x_max], got {json.dumps(value)[:80]}")
    if any(not 0 <= v <= 1 for v in value):
        raise Flux2Error(f"{name} is {value}: coordinates are fractions of the height and width, 0 to 1 (for a box "
                         f"on the 0-1000 canvas divide by 1000)")
    y_min, x_min, y_max, x_max = (float(v) for v in value)
    if y_max <= y_min or x_max <= x_min:
        raise Flux2Error(f"{name} is {value}: it is [y_min, x_min, y_max, x_max], so y_max must be above y_min and "
                         f"x_max above x_min")
    return y_min, x_min, y_max, x_max


# --- the prompt form read back (an upsampler's answer, a prompt written with its table) -----------------------------

ROW_ID = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


def split_table(text: str) -> tuple[str, list | None]:
    """(caption, rows): the rows are the JSON list starting at the last "[" from which the rest parses as one (a
    description may hold brackets and quotes, so no pattern can find it)."""
    start = text.rfind("[")
    while start >= 0:
        try:
            rows = json.loads(text[start:])
        except json.JSONDecodeError:
            rows = None
        if isinstance(rows, list):
            return text[:start].rstrip(), rows
        start = text.rfind("[", 0, start)
    return text.strip(), None


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
    """(text, rows) when the prompt already ends in a table of rows on the canvas; a trailing list that is not all
    rows ("... a sign reading [SALE]") is none."""
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


def check_layout(boxes: list[Box], family: Family, model: str) -> None:
    """Boxes for a family that reads none are refused: its prompt would carry text it was never trained on."""
    if boxes and not family.boxes:
        takers = " and ".join(f.title for f in FAMILIES.values() if f.boxes)
        raise Flux2Error(f"{model} takes no layout: boxes are for {takers}; leave the boxes out, or describe where "
                         f"things go in the prompt")


def boxed_prompt(prompt: str, boxes: list[Box], family: Family, model: str) -> str:
    """The prompt with the boxes for a model of ``family`` (``model``: what messages call it), refused where the
    family reads none: its prompt would carry text it was never trained on."""
    check_layout(boxes, family, model)
    if boxes and table_at_end(prompt) is not None:
        raise Flux2Error("the prompt already ends in a box table (the prompt upsampler's answer carries the boxes it "
                         "was given): give the boxes once, to the upsampler or here")
    return with_boxes(prompt, boxes)
