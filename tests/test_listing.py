"""Notes and messages stay a few lines however many items they are about (``flux2_core.listing``): clamped boxes,
LoRA keys that matched nothing, files a models-folder survey passed over, a batch's wrong jobs. Counts drawn from
none to thousands; the expectation is the count and the total, by hand."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flux2_core.errors import Flux2Error
from flux2_core.listing import SHOWN, bounded_list, bounded_notes

COUNTS = st.one_of(st.integers(0, 2 * SHOWN), st.integers(2 * SHOWN, 6000))


@given(COUNTS)
def test_bounded_notes_keep_the_first_and_count_the_rest(n):
    notes = [f"note {i}" for i in range(n)]
    shown = bounded_notes(notes, "notes of the kind")
    if n <= SHOWN:
        assert shown == notes
    else:
        assert shown == [*notes[:SHOWN], f"... and {n - SHOWN} more notes of the kind ({n} in all)"]


@given(COUNTS)
def test_bounded_list_is_one_line(n):
    items = [f"k{i}" for i in range(n)]
    line = bounded_list(items)
    assert line.count(",") <= SHOWN and (n <= SHOWN or line.endswith(f"and {n - SHOWN} more ({n} in all)"))


@settings(max_examples=15, deadline=None)
@given(COUNTS)
def test_boxes_past_the_edge_make_a_few_notes(n):
    """5,000 boxes past the picture's edge printed 5,000 notes (559 KB of log) before."""
    from flux2_core.families.flux3.boxes import clamp_notes, read_boxes

    layout = read_boxes(json.dumps([{"desc": f"thing {i}", "bbox": [-0.1, 0.1, 0.5, 1.2]} for i in range(n)]))
    notes = clamp_notes(layout)
    assert len(notes) == min(n, SHOWN + 1)
    if n > SHOWN:
        assert notes[-1] == (f"... and {n - SHOWN} more boxes reach past the picture's edge and are drawn to it "
                             f"({n} in all)")


@given(COUNTS)
def test_a_loras_unmatched_keys_are_summed_up(n):
    from flux2_core.adapters.lora import MatchReport

    report = MatchReport("style.safetensors", ("blocks",), unmatched={f"lora_unet_x_{i}.alpha": "no module"
                                                                      for i in range(n)})
    line = report.summary()
    assert len(line) < 1000 and (n == 0 or f"{n} key" in line)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(SHOWN + 1, 60))
def test_a_survey_that_passes_over_many_files_says_how_many(tmp_path_factory, n):
    from flux2_core.app import cli

    folder = tmp_path_factory.mktemp("many")
    for sub in ("diffusion_models", "text_encoders", "vae"):
        (folder / sub).mkdir()
    for i in range(n):
        os.symlink(f"gone-{i}.safetensors", folder / "diffusion_models" / f"broken-{i:03}.safetensors")
    with pytest.raises(Flux2Error) as refused:      # the refusal lists what is missing and what was passed over
        cli.find_weights(str(folder), None)
    message = str(refused.value)
    assert message.count("passed over diffusion_models/") == SHOWN, message
    assert f"... and {n - SHOWN} more files passed over ({n} in all)" in message, message
