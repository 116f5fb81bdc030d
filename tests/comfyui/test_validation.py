"""Settings that cannot run are refused when the prompt is queued (POST /prompt answers 400 with node_errors naming
the input, before any node runs), and what only shows while running (a NaN fed by a link, weights holding NaN) is an
execution error with our message: no image is saved, and the server runs the next prompt."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from flux2_core.errors import Flux2Error
from tests.comfyui import graphs
from tests.comfyui.host import post_raw

NAN_MODEL = "flux-2-klein-tiny-nan.safetensors"


def post_prompt(comfy, prompt: dict) -> tuple[int, dict]:
    """(HTTP status, answer) of POST /prompt. A prompt that passes validation is queued and runs."""
    body = json.dumps({"prompt": prompt, "client_id": "validation-test"}).encode()   # NaN goes out as JSON's NaN
    return post_raw(comfy, "/prompt", body)


def refused(comfy, prompt: dict) -> dict:
    """{node id: [error details]} of a prompt that must be refused with 400."""
    status, answer = post_prompt(comfy, prompt)
    assert status == 400, answer
    return {node: [e["details"] for e in entry["errors"]] for node, entry in answer["node_errors"].items()}


def graph(comfy, **options) -> dict:
    return graphs.ours(comfy.files, "a red fox", **{"seed": 21, "steps": 2, **options})


def test_a_size_that_is_not_a_multiple_of_16_is_refused_at_the_noise(comfy):
    prompt = graph(comfy)
    prompt["6"]["inputs"]["width"] = 100
    errors = refused(comfy, prompt)
    assert list(errors) == ["6"]
    assert any(d.startswith("width - ") and "not a multiple of 16" in d and "96x64" in d for d in errors["6"])


def test_the_schema_bounds_still_hold_for_the_inputs_we_validate(comfy):
    """ComfyUI skips its own min/max for inputs a validate_inputs names: ours checks them again."""
    prompt = graph(comfy)
    prompt["6"]["inputs"]["height"] = 8208              # a multiple of 16, past the schema's 8192
    prompt["8"]["inputs"]["cfg"] = -1.0
    errors = refused(comfy, prompt)
    assert any("height must be in [16, 8192], got 8208" in d for d in errors["6"])
    assert any("cfg must be in [0, 100], got -1" in d for d in errors["8"])


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_cfg_is_refused(comfy, value):
    prompt = graph(comfy)
    prompt["8"]["inputs"]["cfg"] = value
    assert any(d.startswith("cfg - ") and "cfg must be a finite number" in d for d in refused(comfy, prompt)["8"])


def test_image_to_image_without_a_latent_is_refused(comfy):
    prompt = graph(comfy)
    prompt["8"]["inputs"]["denoise"] = 0.5
    assert any("denoise strength 0.5 < 1 is image-to-image, but there is no image" in d
               for d in refused(comfy, prompt)["8"])


def test_a_schedule_that_breaks_at_this_size_is_refused(comfy):
    prompt = graph(comfy, width=8192, height=8192, steps=4)
    errors = refused(comfy, prompt)
    assert list(errors) == ["7"]                          # the noise of that size is fine; its flux2 schedule is not
    assert any("at most about 4688x4688 px" in d for d in errors["7"])
    prompt["7"]["inputs"].update(schedule="power", rho=float("inf"))
    assert any("rho must be a finite number" in d for d in refused(comfy, prompt)["7"])


def test_the_models_own_schedule_needs_the_model_and_is_its_familys(comfy):
    """Without the model connected the Scheduler's model's own is refused at queue time, naming the fix; with it
    linked (unseen at queue time) it runs, and on FLUX.2 Klein its sigmas are the flux2 schedule's: the same latent."""
    prompt = graph(comfy, output="latent")
    prompt["7"]["inputs"]["schedule"] = "model's own"
    errors = refused(comfy, prompt)
    assert list(errors) == ["7"]
    assert any("connect the model, or pick one of flux2, flux3, linear, power" in d for d in errors["7"]), errors
    latents = {}
    for schedule, model in (("flux2", None), ("model's own", graphs.link("1"))):
        prompt = graph(comfy, output="latent", seed=24)
        prompt["7"]["inputs"].update(schedule=schedule, **({"model": model} if model else {}))
        run = comfy.client.run(prompt)
        latents[schedule] = graphs.saved_latent(comfy.base, comfy.client.history(run.prompt_id))
    assert torch.equal(latents["flux2"], latents["model's own"])


def test_a_nan_lora_strength_is_refused(comfy):
    prompt = graph(comfy, loras=[(comfy.files["lora"], float("nan"))])
    assert any("strength must be a finite number" in d for d in refused(comfy, prompt)["40"])


def test_image_to_image_with_a_latent_passes_and_runs(comfy):
    """The latent input is linked, so validation cannot see it: linked and unconnected inputs are told apart."""
    prompt = graph(comfy)
    prompt["30"] = {"class_type": "LoadImage", "inputs": {"image": comfy.images[2]}}
    prompt["31"] = {"class_type": "Flux2KleinAEEncode", "inputs": {"ae": graphs.link("3"), "image": graphs.link("30")}}
    prompt["6"]["inputs"]["latent"] = prompt["7"]["inputs"]["latent"] = graphs.link("31")
    prompt["8"]["inputs"].update(denoise=0.5, latent=graphs.link("31"))
    assert comfy.client.run(prompt).of_type("execution_success")


def run_failing(comfy, prompt: dict) -> tuple[str, str]:
    """(the execution error's message, the prompt id) of a prompt that passes validation and fails while running."""
    client = comfy.client
    ws = client.connect()
    try:
        prompt_id = client.submit(prompt)
        with pytest.raises(Flux2Error) as failure:
            client.follow(ws, prompt_id)
    finally:
        ws.close()
    return str(failure.value), prompt_id


def saved_images(comfy, prompt_id: str) -> list:
    for _ in range(50):                                    # the history entry lands just after the error message
        entry = comfy.client.get_json(f"/history/{prompt_id}").get(prompt_id)
        if entry is not None:
            return [image for output in entry["outputs"].values() for image in output.get("images", [])]
        time.sleep(0.1)
    raise AssertionError(f"prompt {prompt_id} never reached the history")


def test_a_nan_fed_through_a_link_is_an_execution_error_and_the_server_goes_on(comfy):
    prompt = graph(comfy)
    prompt["50"] = {"class_type": "PrimitiveFloat", "inputs": {"value": float("nan")}}   # passes ComfyUI's min/max
    prompt["8"]["inputs"]["cfg"] = graphs.link("50")
    message, prompt_id = run_failing(comfy, prompt)
    assert "(Flux2KleinDenoise) failed" in message and "cfg must be a finite number, got nan" in message
    assert saved_images(comfy, prompt_id) == []
    assert comfy.client.run(graph(comfy, seed=22)).of_type("execution_success")


@pytest.fixture(scope="module")
def nan_model(comfy) -> str:
    """The tiny transformer with one NaN in its final layer, as a file in models/diffusion_models."""
    folder = comfy.base / "models" / "diffusion_models"
    weights = load_file(str(folder / comfy.files["transformer"]))
    weights["final_layer.linear.weight"][0, 0] = float("nan")
    save_file(weights, str(folder / NAN_MODEL))
    return NAN_MODEL


def test_weights_holding_nan_stop_at_the_denoiser_with_no_image_saved(comfy, nan_model):
    message, prompt_id = run_failing(comfy, graph(comfy, model_file=nan_model))
    assert "(Flux2KleinDenoise) failed" in message
    assert "the denoised latents hold NaN or infinite values" in message and "transformer's weights" in message
    assert saved_images(comfy, prompt_id) == []
    assert comfy.client.run(graph(comfy, seed=23)).of_type("execution_success")
