"""The pack's token route in a real ComfyUI: announced by a server feature flag, and its count is exactly what
flux2_core counts and what FLUX.2 Klein Prompt Encode reports in the same server, template included."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from flux2_core.text_encoder import count_prompt_tokens
from flux2_core.tokenizer import load_tokenizer
from tests.comfyui import graphs

ROUTE = "/flux2_klein/tokens"
PROMPTS = {"short": "a red fox in the snow",
           "long": "a red fox in the snow, " * 90,                                  # over 512 with the template
           "non-ascii": "Ein Café in Zürich, 東京の夜景 🌃, ночь, مرحبا\n\nkeep the \"quotes\""}


def post(comfy, path: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{comfy.server.address}{path}", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def expected():
    tokenizer = load_tokenizer()
    return {name: count_prompt_tokens(tokenizer, prompt) for name, prompt in PROMPTS.items()}


def test_feature_flag_is_announced(comfy):
    assert comfy.client.get_json("/features").get("flux2_klein_tokens") is True


@pytest.mark.parametrize("name", PROMPTS)
@pytest.mark.parametrize("prefix", ["", "/api"])
def test_route_counts_exactly_what_flux2_core_counts(comfy, expected, name, prefix):
    status, answer = post(comfy, prefix + ROUTE, json.dumps({"text": PROMPTS[name]}).encode())
    assert status == 200, answer
    print(f"{prefix}{ROUTE} {name}: {answer}")
    assert answer == {"count": expected[name], "limit": 512}
    assert (expected[name] > 512) == (name == "long")


@pytest.mark.parametrize("name", PROMPTS)
def test_route_agrees_with_the_prompt_encode_node(comfy, name):
    """The label the node shows after a run ("N / 512 tokens...") carries the same N as the route."""
    graph = graphs.ours(comfy.files, PROMPTS[name], steps=1, output="latent")
    # A node whose output ComfyUI takes from its cache (the same node with the same inputs ran in the prompt before)
    # shows no label in the history; an encoder setting no other test uses (auto: float32 on this CPU) keeps this
    # prompt's encode node from being such a node, whichever test ran before.
    graph["2"]["inputs"]["dtype"] = "auto"
    run = comfy.client.run(graph)
    (label,) = comfy.client.history(run.prompt_id)["outputs"]["4"]["text"]
    _, answer = post(comfy, ROUTE, json.dumps({"text": PROMPTS[name]}).encode())
    assert label.startswith(f"{answer['count']} / 512 tokens"), label
    assert ("cut off" in label) == (answer["count"] > 512)


@pytest.mark.parametrize("body", [b"not json", b'["a list"]', b'{"text": 7}', b"{}"])
def test_bad_requests_get_400_with_a_hint(comfy, body):
    status, answer = post(comfy, ROUTE, body)
    assert status == 400 and '{"text"' in answer["error"]
