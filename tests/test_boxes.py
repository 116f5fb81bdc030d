"""Layout boxes (FLUX 3 Image Klein): the rows the prompt carries, checked against flux3-mlx's ``bbox.to_canvas``
(BFL's own bbox.py, vendored unchanged there), and every kind of bad box refused with what is wrong."""

from __future__ import annotations

import json

import pytest
import torch

from flux2_core.errors import Flux2Error
from flux2_core.families.flux3.boxes import boxes_from_pixels, read_boxes, with_boxes

bbox = pytest.importorskip("flux3_mlx.bbox", reason="flux3-mlx (a test extra) is the reference for box rows")

LAYOUTS = [
    [{"desc": "a red kite", "bbox": [0.1, 0.05, 0.6, 0.4]}],
    # ids given and not, halves that round to even (0.0125 * 1000 = 12.5 -> 12), the edges, text beyond ASCII
    [{"id": "kite", "desc": "ein roter Drache über dem Feld", "bbox": [0.0125, 0.0, 1.0, 0.3335]},
     {"desc": "a dog", "bbox": [0.5, 0.5, 0.75, 1]}],
    # a move from a reference, one side left out, and an empty box read as none
    [{"id": "dog", "desc": "the dog", "from": "ref_image_1", "src_bbox": [0.2, 0.1, 0.9, 0.5],
      "tgt_bbox": [0.3, 0.5, 1.0, 0.9]},
     {"desc": "a hat", "from": "target", "tgt_bbox": [0.1, 0.1, 0.2, 0.2]},
     {"desc": "a cat", "from": "ref_image_2", "src_bbox": [0.4, 0.4, 0.6, 0.6], "tgt_bbox": []}],
    # boxes drawn past the picture's edges: the reference clamps each coordinate into 0-1 before the row
    [{"desc": "a kite", "bbox": [-0.05, 0.2, 0.4, 1.07]},
     {"id": "dog", "desc": "the dog", "from": "ref_image_0", "src_bbox": [0.2, -0.3, 1.2, 0.5],
      "tgt_bbox": [0.5, 0.5, 1.0001, 0.9]}],
]


@pytest.mark.parametrize("boxes", LAYOUTS)
def test_rows_equal_the_reference(boxes):
    """The text the model reads is the reference's caption: the prompt, a space, the rows on the 0-1000 canvas."""
    prompt = "hot-air balloons over a valley  "
    expected = f"{prompt.rstrip()} {json.dumps(bbox.to_canvas(boxes), ensure_ascii=False)}"
    assert with_boxes(prompt, read_boxes(boxes)) == expected
    assert with_boxes(prompt, read_boxes(json.dumps(boxes))) == expected       # from the JSON text alike


def test_boxes_past_the_edge_are_drawn_to_it_and_said():
    """Each box reaching past an edge is named, with the sides that did; the others are not."""
    from flux2_core.families.flux3.boxes import clamp_notes

    notes = clamp_notes(read_boxes(LAYOUTS[-1] + [{"id": "sun", "desc": "the sun", "bbox": [0, 0, 0.2, 0.2]}]))
    said = "it is drawn to the edge, as the reference draws it"
    assert notes == [f"box 'obj_1' reaches past the picture's edge (bbox): {said}",
                     f"box 'dog' reaches past the picture's edge (src_bbox, tgt_bbox): {said}"]


def test_a_layout_past_the_edge_makes_the_picture_of_its_clamped_layout():
    """generate with boxes past the edge: the same latents as the boxes drawn to the edge by hand (the prompt the model
    reads is the reference's, as test_rows_equal_the_reference shows), and the note among the warnings."""
    from flux2_core.app.demo import demo_models
    from flux2_core.pipeline import generate

    models = demo_models("flux3-klein")
    past = [{"desc": "a kite", "bbox": [-0.05, 0.2, 0.4, 1.07]}]
    edge = [{"desc": "a kite", "bbox": [0.0, 0.2, 0.4, 1.0]}]
    result = generate(models, "a kite", boxes=past, width=64, height=48, steps=2, seed=1)
    expected = generate(models, "a kite", boxes=edge, width=64, height=48, steps=2, seed=1)
    assert torch.equal(result.latents, expected.latents)
    assert any("box 'obj_1' reaches past the picture's edge" in w for w in result.warnings)
    assert not any("edge" in w for w in expected.warnings)


def test_no_boxes_leave_the_prompt_alone():
    assert with_boxes("a fox ", read_boxes("")) == "a fox "
    assert with_boxes("a fox ", read_boxes([])) == "a fox "


@pytest.mark.parametrize("text,message", [
    ("[{\"desc\": \"x\", \"bbox\": [0.1, 0.1, 0.5]}]", r"box 1 bbox must be four numbers"),
    ("[{\"desc\": \"x\", \"bbox\": [100, 50, 600, 400]}]", r"fractions of the height and width, 0 to 1 .*divide by 1000"),
    ("[{\"desc\": \"x\", \"bbox\": [0, 0, 1, 5]}]", r"fractions of the height and width, 0 to 1 .*divide by 1000"),
    ("[{\"desc\": \"x\", \"bbox\": [1.1, 0.2, 1.5, 0.4]}]", r"box 1 bbox is \[1.1, 0.2, 1.5, 0.4\]: it lies wholly outside"),
    ("[{\"desc\": \"x\", \"bbox\": [0.6, 0.1, 0.5, 0.4]}]", r"y_max must be above y_min"),
    ("[{\"desc\": \"x\", \"bbox\": [0.1, \"a\", 0.5, 0.4]}]", r"four numbers"),
    ("[{\"desc\": \"x\", \"bbox\": [0.1, true, 0.5, 0.4]}]", r"four numbers"),
    ("[{\"desc\": \"x\"}]", r"box 1 has no box: give bbox"),
    ("[{\"desc\": \"x\", \"box\": [0.1, 0.1, 0.5, 0.5]}]", r"keys no box has \(box\)"),
    ("[{\"desc\": \"x\", \"bbox\": [0.1, 0.1, 0.5, 0.5], \"tgt_bbox\": [0.1, 0.1, 0.5, 0.5]}]", "give one of them"),
    ("[{\"id\": \"a\", \"bbox\": [0.1, 0.1, 0.5, 0.5]}, {\"id\": \"a\", \"bbox\": [0.2, 0.2, 0.5, 0.5]}]",
     "two boxes have the id 'a'"),
    ("{\"desc\": \"x\", \"bbox\": [0.1, 0.1, 0.5, 0.5]}", "holds a JSON object, but it must hold a JSON list; write a list of boxes"),
    ("[{\"desc\": \"x\", \"bbox\": [0.1, 0.1, 0.5, 0.5]", "not valid JSON"),
    ("[\"a kite\"]", "box 1 must be an object"),
])
def test_bad_boxes_are_refused_with_what_is_wrong(text, message):
    with pytest.raises(Flux2Error, match=message):
        read_boxes(text, "the boxes")


def test_boxes_are_refused_for_a_model_without_layout():
    """FLUX.2 reads no boxes: its prompt would carry JSON it was never trained on (a silent wrong result)."""
    from flux2_core.app.demo import demo_models
    from flux2_core.pipeline import generate

    with pytest.raises(Flux2Error, match="takes no layout: boxes are for FLUX 3 Image Klein"):
        generate(demo_models("klein-4b"), "a kite", boxes=LAYOUTS[0], width=64, height=64)


def test_boxes_are_not_given_twice():
    """An upsampled prompt already ends in its table: boxes on top would make two tables the model never saw."""
    from flux2_core.families.flux3 import FLUX3
    from flux2_core.sampling.request import boxed_prompt

    upsampled = with_boxes("a kite <obj_1> over a field", read_boxes(LAYOUTS[0]))
    with pytest.raises(Flux2Error, match="already ends in a box table .* give the boxes once"):
        boxed_prompt(upsampled, read_boxes(LAYOUTS[0]), FLUX3, "FLUX 3 Image Klein")
    assert boxed_prompt(upsampled, [], FLUX3, "FLUX 3 Image Klein") == upsampled
    assert boxed_prompt("a sign reading [SALE]", read_boxes(LAYOUTS[0]), FLUX3, "x").startswith("a sign reading [SALE] [")


def test_the_command_line_reads_and_checks_the_boxes_file(tmp_path, capsys):
    from flux2_core.app import cli

    argv = ["--demo", "--prompt", "x", "--out", str(tmp_path / "out")]
    assert cli.main([*argv, "--boxes", str(tmp_path / "none.json")]) == 2
    assert f"the --boxes file ({tmp_path / 'none.json'}): no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('[{"desc": "x", "bbox": [10, 10, 50, 50]}]')
    assert cli.main([*argv, "--boxes", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"the boxes in {bad}: box 1 bbox is [10, 10, 50, 50]" in err and "divide by 1000" in err
    good = tmp_path / "good.json"
    good.write_text(json.dumps(LAYOUTS[0]))
    assert cli.main([*argv, "--boxes", str(good)]) == 2         # the demo is FLUX.2: refused, nothing written
    assert "takes no layout" in capsys.readouterr().err
    assert not list((tmp_path / "out").glob("*.png"))


def test_pixel_boxes_become_the_layout_of_their_fractions():
    """ComfyUI's bounding boxes (x, y, width, height in pixels) on a 200x100 picture: [y_min, x_min, y_max, x_max]
    in 0-1, computed by hand; one past the right edge is drawn to it, as a typed layout's is."""
    layout = boxes_from_pixels([(20, 10, 100, 50), (150, 0, 80, 100)], 200, 100, ["a red kite", "a tree"])
    assert [box.bbox for box in layout] == [(0.1, 0.1, 0.6, 0.6), (0.0, 0.75, 1.0, 1.0)]
    assert [box.desc for box in layout] == ["a red kite", "a tree"] and layout[1].clamped
    assert [box.id for box in layout] == ["obj_1", "obj_2"]


@pytest.mark.parametrize(("rects", "size", "descs", "message"), [
    ([(0, 0, 10, 10)], (64, 64), [], "1 boxes but 0 descriptions; write one line per box"),
    ([(0, 0, 0, 10)], (64, 64), ["a"], "box 1 is 0.0x10.0 pixels; a box needs a width and a height"),
    ([(0, 0, 10, 10)], (0, 64), ["a"], "the picture is 0x64 pixels")])
def test_bad_pixel_boxes_are_refused(rects, size, descs, message):
    with pytest.raises(Flux2Error, match=message):
        boxes_from_pixels([tuple(map(float, r)) for r in rects], *size, descs)
