"""The pack's HTTP route: the exact token count of a prompt, for the live label of the web extension.

    POST /flux2_klein/tokens   {"text": "a red fox"}   ->   {"count": 15, "limit": 512}

``count`` is what FLUX.2 Klein Prompt Encode reports for that prompt (``count_prompt_tokens``: Qwen3's chat template
included, before truncation); ``limit`` is the text encoder's 512. No model is loaded: only the built-in Qwen3
tokenizer. The server announces the route with the feature flag ``flux2_klein_tokens``; without it the extension
shows its own estimate.
"""

from __future__ import annotations

import asyncio
import copy

from aiohttp import web

from ..flux2_core.text_encoder import count_prompt_tokens
from ..flux2_core.tokenizer import load_tokenizer
from ..flux2_core.variants import QWEN3_4B
from . import host

ROUTE = "/flux2_klein/tokens"
FEATURE = "flux2_klein_tokens"
LIMIT = QWEN3_4B.max_length          # 512 for Qwen3-4B and 8B alike

_tokenizer: asyncio.Future | None = None


def register() -> None:
    """Serve the route and announce it (from the pack's comfy_entrypoint, before the server starts)."""
    host.add_route("POST", ROUTE, count_tokens, FEATURE)


async def count_tokens(request: web.Request) -> web.Response:
    try:
        body = await request.json()
    except ValueError:
        body = None
    text = body.get("text") if isinstance(body, dict) else None
    if not isinstance(text, str):
        return web.json_response({"error": 'send JSON {"text": "<prompt>"}, text a string'}, status=400)
    count = await asyncio.to_thread(count_prompt_tokens, await tokenizer(), text)
    return web.json_response({"count": count, "limit": LIMIT})


async def tokenizer():
    """The route's own Qwen3 tokenizer, made once in a worker thread (the first build takes about 2 s).

    Its own copy of the built-in one: the prompt encoder uses that object on the executor thread and switches its
    truncation on and off around each prompt, which must not reach (or race with) the counts here.
    """
    global _tokenizer
    if _tokenizer is None:
        _tokenizer = asyncio.ensure_future(asyncio.to_thread(_own_tokenizer))
    try:
        return await asyncio.shield(_tokenizer)
    except Exception:
        _tokenizer = None            # let the next request try again
        raise


def _own_tokenizer():
    own = copy.deepcopy(load_tokenizer())
    own.backend_tokenizer.no_truncation()      # in case the copy was taken in the middle of an encode
    own.backend_tokenizer.no_padding()
    return own
