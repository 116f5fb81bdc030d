"""The layout node: boxes that say where objects go, for FLUX 3 Image Klein's prompts (``families/flux3/boxes.py``)."""

from __future__ import annotations

from comfy_api.latest import io, ui

from ..flux2_core.errors import Flux2Error
from ..flux2_core.families.flux3.boxes import Box, boxes_from_pixels, check_rows, clamp_notes, read_boxes, rows
from . import host, types

EXAMPLE = ('[{"desc": "a red hot-air balloon", "bbox": [0.08, 0.1, 0.45, 0.4]},\n'
           ' {"desc": "a lake reflecting the sky", "bbox": [0.7, 0.0, 1.0, 1.0]}]')


class Layout(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Flux2KleinLayout", display_name="FLUX 3 Klein Layout",
            category=f"{types.CATEGORY}/conditioning",
            description="Where objects go in a FLUX 3 Image Klein picture: a JSON list of boxes, each with a desc and "
                        "a bbox [y_min, x_min, y_max, x_max] in 0-1 of the picture's height and width ((0, 0) is the "
                        "top left); an id names a box (obj_1, obj_2, ... when left out). For an edit a box may move "
                        "something instead: \"from\": \"ref_image_0\" (the first reference picture; ref_image_1 the "
                        "second, ...) with src_bbox (where it is there) and tgt_bbox (where it goes), or \"from\": "
                        "\"target\" with tgt_bbox alone for something new. Connect it to Prompt Encode's boxes; "
                        "FLUX.2 models take no boxes.",
            inputs=[io.String.Input("boxes", multiline=True, default=EXAMPLE,
                                    tooltip="A JSON list: [{\"desc\": ..., \"bbox\": [y_min, x_min, y_max, x_max]}], "
                                            "coordinates 0 to 1.")],
            outputs=[types.Boxes.Output(display_name="boxes", tooltip="The checked boxes, for Prompt Encode.")])

    @classmethod
    def validate_inputs(cls, boxes=None):
        # when the prompt is queued: the boxes as execute reads them
        return host.validate(cls, {"boxes": boxes}, lambda: read_layout(boxes))

    @classmethod
    def execute(cls, boxes: str) -> io.NodeOutput:
        return layout_output(read_layout(boxes))


class LayoutFromBoxes(io.ComfyNode):
    """Listed where the host has ComfyUI's bounding-box type (``NEEDS_TYPES`` in extension.py)."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Flux2KleinLayoutFromBoxes", display_name="FLUX 3 Klein Layout from Boxes",
            category=f"{types.CATEGORY}/conditioning",
            description="The Layout node's boxes from ComfyUI's bounding boxes: a box drawn with the Bounding Box "
                        "node, or those a detector found, in pixels of the picture they are on, one description "
                        "per line in the boxes' order. Connect it to Prompt Encode's boxes.",
            inputs=[io.BoundingBox.Input("bboxes", force_input=True,
                                         tooltip="A box or a list of boxes (x, y, width, height in pixels)."),
                    io.Image.Input("image", tooltip="The picture the boxes are on: its size turns pixels into the "
                                                    "layout's 0-1."),
                    io.String.Input("descs", multiline=True, default="",
                                    tooltip="What goes in each box, one line per box, in the boxes' order.")],
            outputs=[types.Boxes.Output(display_name="boxes", tooltip="The checked boxes, for Prompt Encode.")])

    @classmethod
    def execute(cls, bboxes, image, descs: str) -> io.NodeOutput:
        where = "the Layout from Boxes node"
        lines = [line.strip() for line in descs.splitlines() if line.strip()]
        return layout_output(boxes_from_pixels(pixel_rects(bboxes, where), image.shape[2], image.shape[1], lines,
                                               where))


def layout_output(layout: list[Box]) -> io.NodeOutput:
    shown = "\n".join([*(f"{row['id']}: {row.get('bbox') or row.get('tgt_bbox')} {row['desc']}"
                         for row in rows(layout)), *clamp_notes(layout)])
    return io.NodeOutput(layout, ui=ui.PreviewText(f"{len(layout)} boxes on the 0-1000 canvas\n{shown}"))


def pixel_rects(bboxes, where: str) -> list[tuple[float, float, float, float]]:
    """ComfyUI's bounding-box value as (x, y, width, height) rectangles: one box, a list of boxes, or a detector's
    list per frame of a batch of one."""
    if isinstance(bboxes, list) and len(bboxes) == 1 and isinstance(bboxes[0], list):
        bboxes = bboxes[0]
    if isinstance(bboxes, list) and any(isinstance(item, list) for item in bboxes):
        raise Flux2Error(f"{where}: the boxes are of {len(bboxes)} frames; give the boxes of one picture")
    try:
        return [(float(b["x"]), float(b["y"]), float(b["width"]), float(b["height"]))
                for b in (bboxes if isinstance(bboxes, list) else [bboxes])]
    except (KeyError, TypeError, ValueError):
        raise Flux2Error(f"{where}: boxes come as x, y, width and height in pixels (ComfyUI's bounding boxes), got "
                         f"{str(bboxes)[:80]}") from None


def read_layout(boxes: str) -> list[Box]:
    """The boxes, each row's "from" in a form the model reads; the references it names are not known here (they
    join the conditioning later), so Denoise checks those."""
    layout = read_boxes(boxes, "the Layout node's boxes")
    check_rows(rows(layout), None, "the Layout node's boxes")
    return layout
