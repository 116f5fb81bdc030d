"""Each family states the longest side it makes (``Family.largest_side``: FLUX 3 Image Klein's reference's 4K), and the
one size check refuses a side past it before any model loads: from the command line, in generate and in the Denoise
run asked for in latents. Expectations are the records' numbers, written here by hand."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flux2_core.errors import Flux2Error
from flux2_core.families import FAMILIES

STATED = {"flux2": 8192, "flux3": 4096}       # FLUX 3: "up to 4K" (BFL's model table); FLUX.2: the nodes' widest


def test_each_family_states_its_longest_side():
    assert {name: FAMILIES[name].largest_side for name in STATED} == STATED


@settings(max_examples=200, deadline=None)
@given(family=st.sampled_from(sorted(STATED)), short=st.integers(1, 64), long=st.integers(1, 70_000),
       turned=st.booleans())
def test_a_side_past_the_familys_limit_is_refused_and_none_within_it(family, short, long, turned):
    """Sizes drawn on the 16-pixel grid at any aspect (16 x 1048576 among them, which FLUX 3 took before)."""
    width, height = 16 * short, 16 * long
    if turned:
        width, height = height, width
    record = FAMILIES[family]
    if max(width, height) > STATED[family]:
        with pytest.raises(Flux2Error, match=rf"{record.title} makes pictures up to {STATED[family]} px a side; "
                                             rf"{width}x{height} \(WxH\) is past it: use e\.g\. (\d+)x(\d+)") as refused:
            record.check_size(width, height)
        suggested = [int(v) for v in refused.value.args[0].split("use e.g. ")[1].split(",")[0].split("x")]
        record.check_size(*suggested)                     # what it suggests is a size it makes
    else:
        record.check_size(width, height)


def test_the_command_line_refuses_before_any_model_loads(tmp_path, capsys, monkeypatch):
    from safetensors.torch import save_file

    from flux2_core import weights
    from flux2_core.app import cli
    from tests.tiny.flux3 import random_flux3_state_dict, tiny_flux3

    transformer = tmp_path / "flux3-image-klein.safetensors"
    save_file(random_flux3_state_dict(tiny_flux3()), str(transformer))
    monkeypatch.setattr(weights, "load_transformer", lambda *a, **k: pytest.fail("a model loaded"))
    code = cli.main(["--transformer", str(transformer), "--text-encoder", str(tmp_path / "te"), "--ae",
                     str(tmp_path / "ae.safetensors"), "--prompt", "a fox", "--width", "16", "--height", "1048576",
                     "--device", "cpu", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "FLUX 3 Image Klein makes pictures up to 4096 px a side" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_generate_and_the_latent_run_refuse_before_the_model_runs():
    """FLUX 3 asked for 4112 px a side: generate (the request) and the run a Denoise node asks for in latents."""
    import torch

    from flux2_core.families.flux3.variants import VARIANTS
    from flux2_core.sampling.request import read_request
    from flux2_core.sampling.run import latent_run

    variant = VARIANTS[0]
    with pytest.raises(Flux2Error, match="FLUX 3 Image Klein makes pictures up to 4096 px a side"):
        read_request(variant, "a fox", width=4112, height=64)

    class NoModel:
        def __getattr__(self, name):
            pytest.fail(f"the model was asked for {name}")

    with pytest.raises(Flux2Error, match=r"4096 px a side; 64x4112 \(WxH\)"):
        latent_run(NoModel(), variant, txt=torch.zeros(1, 80, 8), negative=None, references=[], rows=[],
                   noise=torch.zeros(1, 128, 257, 4), drawn=False, latent=None, noise_mask=None, sigmas=[1.0, 0.0],
                   cfg=1.0, strength=1.0)
