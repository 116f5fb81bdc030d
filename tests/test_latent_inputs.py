"""The Denoise run asked for in latents (``sampling.run.latent_run``) checks every tensor it is handed before any model
call: a video model's 5-D noise, a prompt batch that differs from the noise's, FLUX.1's 16-channel reference latent,
an empty mask, NaN, ... are each refused naming the input, the shape found and the shape wanted, and where such an
input comes from (before: raw torch errors such as "too many values to unpack")."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flux2_core.errors import Flux2Error
from flux2_core.families import VARIANTS
from flux2_core.sampling.run import latent_run

KLEIN_4B = VARIANTS["klein-4b"]
WIDTH = KLEIN_4B.params.context_in_dim


class NoModel:
    """A model that is never asked: every input is refused before a model call."""

    def __getattr__(self, name):
        pytest.fail(f"the model was asked for {name}")


def good(batch=1, h=4, w=6):
    return {"noise": torch.zeros(batch, 128, h, w), "txt": torch.zeros(1, 8, WIDTH), "negative": None,
            "references": [], "latent": None, "noise_mask": None}


def run(inputs):
    return latent_run(NoModel(), KLEIN_4B, rows=[], drawn=False, sigmas=[1.0, 0.0], cfg=1.0, strength=1.0, **inputs)


def spoiled(kind: str, draw) -> tuple[dict, str]:
    """(inputs with one tensor spoiled, the words the refusal names it by)."""
    inputs = good(batch=draw(st.integers(1, 3)))
    batch = inputs["noise"].shape[0]
    if kind == "noise rank":
        inputs["noise"] = torch.zeros(batch, 128, draw(st.integers(1, 3)), 4, 6)        # a video model's
        return inputs, "the noise latent is shape"
    if kind == "noise channels":
        inputs["noise"] = torch.zeros(batch, draw(st.sampled_from([4, 16, 64, 127])), 4, 6)
        return inputs, "the noise latent is shape"
    if kind == "noise empty":
        inputs["noise"] = torch.zeros(batch, 128, 0, 6)
        return inputs, "the noise latent is shape"
    if kind == "noise NaN":
        inputs["noise"][0, 0, 0, draw(st.integers(0, 5))] = float(draw(st.sampled_from(["nan", "inf", "-inf"])))
        return inputs, "the noise latent holds NaN or infinite values"
    if kind == "prompt batch":
        inputs["noise"] = torch.zeros(2, 128, 4, 6)
        inputs["txt"] = torch.zeros(draw(st.integers(3, 5)), 8, WIDTH)
        return inputs, "the prompt embeddings hold"
    if kind == "prompt rank":
        inputs["txt"] = torch.zeros(8, WIDTH)
        return inputs, "the prompt embeddings is shape"
    if kind == "negative batch":
        inputs["noise"] = torch.zeros(2, 128, 4, 6)
        inputs["negative"] = torch.zeros(3, 8, WIDTH)
        return inputs, "the negative prompt embeddings hold"
    if kind == "reference channels":
        inputs["references"] = [torch.zeros(1, 128, 4, 4), torch.zeros(1, 16, 4, 4)]     # FLUX.1's VAE
        return inputs, "reference latent 2 is shape [1, 16, 4, 4]"
    if kind == "reference batch":
        inputs["references"] = [torch.zeros(2, 128, 4, 4)]
        return inputs, "reference latent 1 is shape"
    if kind == "start latent":
        inputs["latent"] = torch.zeros(1, 16, 4, 6)
        return inputs, "the start latent is shape"
    inputs["latent"] = torch.zeros(1, 128, 4, 6)
    inputs["noise_mask"] = torch.zeros(draw(st.sampled_from([(0,), (1, 0, 8), (0, 64, 64), (1, 1, 1, 1, 1)])))
    return inputs, "the noise mask is"


KINDS = ["noise rank", "noise channels", "noise empty", "noise NaN", "prompt batch", "prompt rank", "negative batch",
         "reference channels", "reference batch", "start latent", "mask"]


@settings(max_examples=80, deadline=None)
@given(kind=st.sampled_from(KINDS), data=st.data())
def test_a_spoiled_input_is_refused_by_name_before_any_model_call(kind, data):
    inputs, named = spoiled(kind, data.draw)
    with pytest.raises(Flux2Error) as refused:
        run(inputs)
    message = str(refused.value)
    assert named in message and (" comes from " in message or " come from " in message), (kind, message)


def test_the_inputs_of_a_real_run_pass_the_checks():
    """The control: the same checks take what the nodes hand over (a prompt per latent, or one for all)."""
    from flux2_core.sampling.run import check_inputs

    for batch, prompts in ((1, 1), (3, 1), (3, 3)):
        inputs = good(batch) | {"txt": torch.zeros(prompts, 8, WIDTH), "negative": torch.zeros(prompts, 8, WIDTH),
                                "references": [torch.zeros(1, 128, 3, 5)], "latent": torch.zeros(1, 128, 4, 6),
                                "noise_mask": torch.ones(1, 64, 96)}
        check_inputs(**inputs)
