"""The pack's token route in a real ComfyUI: announced by a server feature flag, and its count is exactly what
flux2_core counts and what Klein Prompt Encode reports in the same server, template included."""

from __future__ import annotations

import json
import time

import pytest

from flux2_core.families.flux2.variants import QWEN3_TEMPLATE
from flux2_core.models.text_encoder import count_prompt_tokens
from flux2_core.models.tokenizer import load_tokenizer
from tests.comfyui import graphs
from tests.comfyui.host import post_raw as post

ROUTE = "/flux2_klein/tokens"
PROMPTS = {"short": "a red fox in the snow",
           "long": "a red fox in the snow, " * 90,                                  # over 512 with the template
           "non-ascii": "Ein Café in Zürich, 東京の夜景 🌃, ночь, مرحبا\n\nkeep the \"quotes\""}


@pytest.fixture(scope="module")
def expected():
    tokenizer = load_tokenizer()
    return {name: count_prompt_tokens(tokenizer, prompt, QWEN3_TEMPLATE) for name, prompt in PROMPTS.items()}


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


def test_route_counts_for_the_text_encoder_named(comfy):
    """A FLUX 3 (Qwen3-VL) encoder's file: its template and 4096; FLUX.2's, one not in the folder, or a path out of
    it: Qwen3's and 512; a name that is no string: 400."""
    from flux2_core.families.flux3.variants import QWEN3_VL_4B

    tokenizer, text = load_tokenizer(), PROMPTS["long"]
    flux2, flux3 = (count_prompt_tokens(tokenizer, text, QWEN3_TEMPLATE),
                    count_prompt_tokens(tokenizer, text, QWEN3_VL_4B.template))
    for encoder, answer in [(comfy.files["text_encoder_flux3"], {"count": flux3, "limit": 4096}),
                            (comfy.files["text_encoder"], {"count": flux2, "limit": 512}),
                            ("no-such-file.safetensors", {"count": flux2, "limit": 512}),
                            ("../../user/comfyui.db", {"count": flux2, "limit": 512})]:
        status, got = post(comfy, ROUTE, json.dumps({"text": text, "text_encoder": encoder}).encode())
        assert (status, got) == (200, answer), encoder
    status, got = post(comfy, ROUTE, json.dumps({"text": text, "text_encoder": 7}).encode())
    assert status == 400 and "text_encoder must be the name of a file" in got["error"]


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


@pytest.mark.parametrize("body", [b"not json", b'["a list"]', b'{"text": 7}', b"{}", b"", b'{"text": null}',
                                  b"\xff\xfe\x00{", b"[" * 60_000, b'{"text": ' + b"1" * 5000 + b"}",
                                  b'{"text": "\\ud800 half a character"}'])
def test_bad_requests_get_400_with_a_hint(comfy, body):
    """Not JSON, not UTF-8, nested past Python's recursion limit, a number past its digit limit, no text string,
    half a character: each a JSON 400 saying what to send, none a 500 with a traceback in the log."""
    status, answer = post(comfy, ROUTE, body)
    assert status == 400 and '{"text"' in answer["error"], answer
    assert "Error handling request" not in comfy.server.log()     # what aiohttp logs above a handler's traceback


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_64_kib_gets_413_at_once(comfy, chunked):
    """A megabyte of text (which used to be read and counted, for minutes) is refused at the size limit: unread when
    its length is declared, at 64 KiB when it comes in chunks."""
    body = json.dumps({"text": "a red fox " * 100_000}).encode()
    started = time.monotonic()
    status, answer = post(comfy, ROUTE, iter([body[i:i + 8192] for i in range(0, len(body), 8192)]) if chunked
                          else body)
    assert status == 413 and answer["error"].startswith("the request is over 64 KiB"), answer
    assert time.monotonic() - started < 10


def test_a_text_past_the_counted_length_gets_413(comfy):
    status, answer = post(comfy, ROUTE, json.dumps({"text": "a" * 16385}).encode())
    assert status == 413 and answer["error"].startswith("the text has 16385 characters, over the 16384"), answer
    status, answer = post(comfy, ROUTE, json.dumps({"text": "a" * 16384}).encode())   # the longest still counted
    assert status == 200 and answer["count"] > 512
