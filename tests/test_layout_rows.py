"""Layout rows checked against the run (FLUX 3 Image Klein): a row's ``from`` must be a form the model reads
(``ref_image_<n>``, n counting the run's references from 0, or ``target``), and must name a reference the run gives.

The expectation is written here from the model's own conventions, not from the code under test: the upsampler is told
"Reference images follow in attachment order: ref_image_0, ref_image_1, ..." and BFL's bbox.py keeps a provenance row
only as ``ref_image_<digits>`` with a source box or ``target`` without one; a picture made from text has no
reference to move anything from; inpainting gives the model the picture being inpainted as its first reference.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from flux2_core.errors import Flux2Error
from flux2_core.families import VARIANTS

BOX = [0.1, 0.1, 0.5, 0.5]
SOURCES = st.one_of(
    st.sampled_from(["ref_image_0", "ref_image_1", "ref_image_2", "ref_image_3", "ref_image_7", "target"]),
    # forms the model does not read (or no from at all)
    st.sampled_from([None, "", "ref_image_01", "ref_image_-1", "ref_image_", "image_0", "Ref_Image_0", "ref_image_0 ",
                     "<ref_image_0>", "ref_image_１", "the first picture", "targets"]),
    st.text(max_size=12))


@st.composite
def layout_row(draw, index: int) -> dict:
    row = {"id": f"row_{'abcde'[index]}", "desc": "a thing"}
    if draw(st.booleans()):
        return {**row, "bbox": BOX}
    source, src, tgt = draw(SOURCES), draw(st.booleans()), draw(st.booleans())
    if not (src or tgt):
        tgt = True                          # a row with no box at all is another refusal (read_boxes' own)
    return {**row, **({} if source is None else {"from": source}), **({"src_bbox": BOX} if src else {}),
            **({"tgt_bbox": BOX} if tgt else {})}


@st.composite
def layouts(draw) -> list[dict]:
    return [draw(layout_row(i)) for i in range(draw(st.integers(1, 5)))]


def cannot_apply(row: dict, references: int) -> bool:
    """Independent of the code: what the model can read in a run given ``references`` pictures."""
    if "bbox" in row:
        return False
    source, moved = row.get("from"), "src_bbox" in row
    named = re.fullmatch(r"ref_image_(0|[1-9][0-9]*)", source) if isinstance(source, str) else None
    if named is None and source != "target":
        return True                         # not a form the model reads
    if (source == "target") == moved:
        return True                         # new content has no source box; moved content needs one
    return references == 0 or (named is not None and int(named.group(1)) >= references)


def assert_refused_exactly(error: Flux2Error | None, layout: list[dict], references: int) -> None:
    bad = [i for i, row in enumerate(layout) if cannot_apply(row, references)]
    if not bad:
        assert error is None, f"refused a layout that applies ({references} references): {error}"
        return
    assert error is not None, f"accepted rows {bad} that cannot apply ({references} references): {layout}"
    message = str(error)
    for i, row in enumerate(layout):
        named = f"box {i + 1} ({row['id']})" in message
        assert named == (i in bad), f"row {i + 1} {'not ' if named else ''}named wrongly in: {message}"


def fake_flux3_models():
    """Enough of ``Models`` for ``generate`` to read its inputs: the layout is checked before any model runs."""
    from types import SimpleNamespace

    from flux2_core.pipeline import Models

    transformer = SimpleNamespace(dtype=torch.float32, device=torch.device("cpu"))
    return Models(transformer, VARIANTS["flux3-klein"], None, None, prompt_cache=None, reference_cache=None)


PICTURE = Image.new("RGB", (64, 48), (120, 80, 40))
WRONG_NOISE = torch.zeros(1, 1, 1, 1)     # generate refuses it right after the layout: past the layout = accepted


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts(), pictures=st.integers(0, 3), inpainted=st.booleans())
def test_generate_refuses_exactly_the_rows_that_cannot_apply(layout, pictures, inpainted):
    from flux2_core.pipeline import generate

    edit = {"image": PICTURE, "mask": Image.new("L", PICTURE.size, 255)} if inpainted else {}
    error = None
    try:
        generate(fake_flux3_models(), "a fox", references=[PICTURE] * pictures, boxes=layout, width=64, height=48,
                 noise=WRONG_NOISE, **edit)
    except Flux2Error as e:
        if "noise must be" not in str(e):
            error = e
    assert_refused_exactly(error, layout, pictures + inpainted)


@settings(max_examples=150, deadline=None)
@given(layout=layouts(), pictures=st.integers(0, 3))
def test_the_upsamplers_check_refuses_exactly_the_rows_that_cannot_apply(layout, pictures):
    from flux2_core.upsampler.model import check_request

    error = None
    try:
        check_request("a fox", pictures, layout)
    except Flux2Error as e:
        error = e
    assert_refused_exactly(error, layout, pictures)


@settings(max_examples=150, deadline=None)
@given(row=layout_row(1), pictures=st.integers(0, 3))
def test_a_row_the_upsampler_adds_is_kept_only_where_it_applies(row, pictures):
    """The same rule for the rows the upsampler writes itself: one that cannot apply is left out of its answer."""
    from flux2_core.families.flux3.boxes import CANVAS, split_table
    from flux2_core.families.flux3.upsampler_rows import keep_locked

    canvas = {side: [round(v * CANVAS) for v in BOX] if side in row else None for side in ("src_bbox", "tgt_bbox")}
    added = {"id": row["id"], **({"bbox": [100, 100, 500, 500]} if "bbox" in row else
                                 {"from": row.get("from"), **canvas}), "desc": "a thing"}
    locked = [{"id": "kite", "bbox": [600, 600, 900, 900], "desc": "a kite"}]
    answer = f"A kite <kite> and a thing <{row['id']}>. {json.dumps([locked[0], added])}"
    kept = split_table(keep_locked(answer, locked, pictures))[1]
    assert [r["id"] for r in kept] == ["kite"] + ([] if cannot_apply(row, pictures) else [row["id"]])


@pytest.mark.parametrize("source,pictures,refused", [
    ("ref_image_1", 1, "names reference picture 2"),             # numbered from 0: one picture is ref_image_0
    ("ref_image_0", 0, "no reference pictures"),                 # a move in a picture made from text
    ("ref_image_0", 1, None),
    ("image_1", 2, "which the model does not read"),
])
def test_the_command_line_checks_the_rows_before_loading(tmp_path, capsys, source, pictures, refused):
    from flux2_core.app import cli

    layout = tmp_path / "layout.json"
    layout.write_text(json.dumps([{"id": "dog", "desc": "the dog", "from": source, "src_bbox": BOX, "tgt_bbox": BOX}]))
    for i in range(pictures):
        PICTURE.save(tmp_path / f"ref{i}.png")
    refs = [arg for i in range(pictures) for arg in ("--ref", str(tmp_path / f"ref{i}.png"))]
    (tmp_path / "models").mkdir()
    assert cli.main(["--variant", "flux3-klein", "--models", str(tmp_path / "models"), "--prompt", "a dog",
                     "--out", str(tmp_path / "out"), "--boxes", str(layout), *refs]) == 2
    err = capsys.readouterr().err
    if refused:
        assert str(layout) in err and "box 1 (dog): " in err and refused in err
    else:                                   # past the rows: the weights are looked for, and are not there
        assert "box 1" not in err and "no weights found" in err


@pytest.mark.parametrize("digits", [7, 5000])
def test_a_reference_index_of_thousands_of_digits_is_refused_not_a_traceback(digits):
    """int() of a 5000-digit index raised ValueError (Python's 4300-digit limit) past every Flux2Error handler."""
    from flux2_core.families import ReferenceCount
    from flux2_core.families.flux3.boxes import check_rows

    row = {"id": "a", "from": "ref_image_" + "1" * digits, "src_bbox": [0, 0, 500, 500],
           "tgt_bbox": [500, 500, 900, 900], "desc": "x"}
    with pytest.raises(Flux2Error, match="box 1 \\(a\\): from is .*which the model does not read"):
        check_rows([row], ReferenceCount(2), "the layout")
