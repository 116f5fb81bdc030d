"""The plan of a denoise (flux2_core/sampling/run.py): the rules the CLI, the Python API and the Denoise node share."""

import pytest

from flux2_core.errors import Flux2Error
from flux2_core.families import VARIANTS
from flux2_core.sampling.run import plan_denoise

SIGMAS = [1.0, 0.75, 0.5, 0.25, 0.0]


def test_image_to_image_runs_the_tail_of_the_schedule():
    plan = plan_denoise(VARIANTS["klein-4b"], SIGMAS, 1.0, strength=0.5, image=True)
    assert plan.sigmas == [0.5, 0.25, 0.0] and plan.steps == 2 and plan.strength == 0.5
    assert plan_denoise(VARIANTS["klein-4b"], SIGMAS, 1.0, image=True).sigmas == SIGMAS    # strength 1: all of it


def test_the_guidance_rule_of_the_model_decides_cfg():
    distilled = plan_denoise(VARIANTS["klein-4b"], SIGMAS, 3.0).guidance
    assert not distilled.cfg and "cfg 3 is ignored" in distilled.note
    base = plan_denoise(VARIANTS["klein-base-4b"], SIGMAS, 4.0).guidance
    assert base.cfg and base.scale == 4.0 and base.note == ""
    alone = plan_denoise(VARIANTS["klein-base-4b"], SIGMAS, 4.0, negative=False).guidance
    assert not alone.cfg and "none is connected" in alone.note


@pytest.mark.parametrize("name", ["klein-4b", "klein-9b", "klein-9b-kv", "klein-base-4b", "klein-base-9b", "dev"])
def test_only_the_kv_edition_takes_references_as_kv_and_only_when_there_are_some(name):
    """BFL's reference: Klein 9B-KV runs its references once and caches their K/V; every other model joins them."""
    variant = VARIANTS[name]
    assert plan_denoise(variant, SIGMAS, 1.0, references=True).reference_kv is (name == "klein-9b-kv")
    assert plan_denoise(variant, SIGMAS, 1.0, references=False).reference_kv is False
    assert plan_denoise(variant, SIGMAS, 1.0).reference_kv is False


@pytest.mark.parametrize("sigmas, strength, image, message", [
    ([1.0], 1.0, False, "at least two values"),
    ([1.0, 0.5, 0.6], 1.0, False, "strictly decrease"),
    (SIGMAS, 0.5, False, "no image to start from"),
    (SIGMAS, 1e-20, True, "leaves no step to run"),
])
def test_settings_that_cannot_run_are_refused(sigmas, strength, image, message):
    with pytest.raises(Flux2Error, match=message):
        plan_denoise(VARIANTS["klein-4b"], sigmas, 1.0, strength=strength, image=image)
