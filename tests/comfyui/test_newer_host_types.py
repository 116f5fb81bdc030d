"""Nodes that take io types of newer hosts: listed where the host has the type, absent on the floor (v0.12.1).

Klein Layout from Boxes takes ComfyUI's bounding boxes (v0.15.0 on): here one drawn with ComfyUI's own Bounding Box
node on an input picture, whose layout row is computed by hand from the pixels given.
"""

from __future__ import annotations

import pytest
from PIL import Image

from flux2_core.errors import Flux2Error


def boxes_graph(comfy, descs: str) -> tuple[dict, tuple[int, int]]:
    width, height = Image.open(comfy.base / "input" / comfy.images[0]).size
    box = {"x": width // 4, "y": height // 2, "width": width // 2, "height": height // 4}
    return {"1": {"class_type": "LoadImage", "inputs": {"image": comfy.images[0]}},
            "2": {"class_type": "PrimitiveBoundingBox", "inputs": box},
            "3": {"class_type": "Flux2KleinLayoutFromBoxes",
                  "inputs": {"bboxes": ["2", 0], "image": ["1", 0], "descs": descs}},
            "4": {"class_type": "PreviewAny", "inputs": {"source": ["3", 0]}}}, (width, height)


def test_layout_from_comfyuis_bounding_boxes(comfy):
    info = comfy.client.get_json("/object_info")
    if "PrimitiveBoundingBox" not in info:        # a host without bounding boxes lists no node taking them
        assert "Flux2KleinLayoutFromBoxes" not in info
        return
    graph, (width, height) = boxes_graph(comfy, "a red kite\n")
    box = graph["2"]["inputs"]
    want = [round(1000 * v) for v in (box["y"] / height, box["x"] / width, (box["y"] + box["height"]) / height,
                                      (box["x"] + box["width"]) / width)]
    run = comfy.client.run(graph)
    text = comfy.client.history(run.prompt_id)["outputs"]["3"]["text"][0]
    assert text.splitlines() == ["1 boxes on the 0-1000 canvas", f"obj_1: {want} a red kite"], text

    with pytest.raises(Flux2Error) as error:                    # one description too many
        comfy.client.run(boxes_graph(comfy, "a red kite\na tree")[0])
    message = str(error.value)
    assert "1 boxes but 2 descriptions; write one line per box" in message and "Traceback" not in message, message
