"""The token route's handler (nodes/routes.py) on a bare aiohttp server, without ComfyUI: bodies of any size and
shape get a count or a JSON error (413 past the size limits, 400 for anything that is not {"text": str}), never a
500. tests/comfyui/test_token_route.py runs the same requests against the route inside a real ComfyUI."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from flux2_core.families.flux2.variants import QWEN3_TEMPLATE
from flux2_core.models.text_encoder import count_prompt_tokens
from flux2_core.models.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def load_routes():
    """nodes/routes.py as the pack imports it (a package beside flux2_core); it needs no ComfyUI until register()."""
    if "pack_for_routes" not in sys.modules:
        spec = importlib.util.spec_from_file_location("pack_for_routes", ROOT / "__init__.py",
                                                      submodule_search_locations=[str(ROOT)])
        pack = importlib.util.module_from_spec(spec)
        sys.modules["pack_for_routes"] = pack
        spec.loader.exec_module(pack)
    return importlib.import_module("pack_for_routes.nodes.routes")


routes = load_routes()


@pytest.fixture(scope="module")
def post():
    """post(body, chunked=False) -> (status, JSON answer) from the handler on one aiohttp server and event loop
    (kept for the module: the route keeps its tokenizer as a future of that loop)."""
    loop = asyncio.new_event_loop()
    routes._tokenizer = None

    async def start():
        app = web.Application()
        app.router.add_post(routes.ROUTE, routes.count_tokens)
        client = TestClient(TestServer(app))
        await client.start_server()
        return client

    async def chunks(body):
        for i in range(0, len(body), 4096):
            yield body[i:i + 4096]

    async def send(body, chunked):
        response = await client.post(routes.ROUTE, data=chunks(body) if chunked else body,
                                     headers={"Content-Type": "application/json"})
        return response.status, await response.json()

    client = loop.run_until_complete(start())
    yield lambda body, chunked=False: loop.run_until_complete(send(body, chunked))
    loop.run_until_complete(client.close())
    loop.close()
    routes._tokenizer = None


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_counts_what_flux2_core_counts(post, tokenizer):
    texts = ["a red fox", "", "Zürich, 東京 🌃", "x" * routes.MAX_TEXT]
    answers = [post(json.dumps({"text": t}).encode()) for t in texts]
    assert answers == [(200, {"count": count_prompt_tokens(tokenizer, t, QWEN3_TEMPLATE), "limit": 512}) for t in texts]


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_64_kib_gets_413_unread(post, chunked):
    """With a Content-Length the handler refuses before reading; without one (chunked) it stops at the limit."""
    started = time.monotonic()
    answer = post(json.dumps({"text": "a" * (1 << 20)}).encode(), chunked=chunked)
    assert answer == (413, {"error": 'the request is over 64 KiB: send JSON {"text": "<prompt>"}, text a string of '
                                     "at most 16384 characters"})
    assert time.monotonic() - started < 10


def test_a_text_over_the_limit_gets_413(post):
    answer = post(json.dumps({"text": "a" * (routes.MAX_TEXT + 1)}).encode())
    assert answer[0] == 413 and answer[1]["error"].startswith("the text has 16385 characters, over the 16384")


@pytest.mark.parametrize("body, says", [
    (b"", "the body is not JSON"), (b"not json", "the body is not JSON"), (b"\xff\xfe\x00{", "the body is not JSON"),
    (b"[" * 60_000, "the body is not JSON"), (b'{"text": ' + b"1" * 5000 + b"}", "the body is not JSON"),
    (b'["a list"]', "the body has no text string"), (b'{"text": 7}', "the body has no text string"),
    (b'{"text": null}', "the body has no text string"), (b"{}", "the body has no text string"),
    (b'{"text": "\\ud800 half a character"}', "the text holds an unpaired surrogate"),
])
def test_bad_bodies_get_400_with_the_reason_and_the_usage(post, body, says):
    answer = post(body)
    assert answer == (400, {"error": f'{says}, which is not a character: send JSON {{"text": "<prompt>"}}, text a '
                                     "string" if "surrogate" in says else
                                     f'{says}: send JSON {{"text": "<prompt>"}}, text a string'})


@settings(max_examples=50, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=100), st.text(max_size=60).map(lambda t: json.dumps({"text": t}).encode()),
                          st.recursive(st.none() | st.integers() | st.text(max_size=10),
                                       lambda inner: st.lists(inner, max_size=3)
                                       | st.dictionaries(st.sampled_from(["text", "x"]), inner, max_size=2),
                                       max_leaves=8).map(lambda v: json.dumps(v).encode())),
                min_size=1, max_size=4))
def test_any_body_gets_a_count_or_a_json_error(post, bodies):
    for body in bodies:
        status, answer = post(body)
        assert (status, set(answer)) in ((200, {"count", "limit"}), (400, {"error"})), (body, status, answer)
