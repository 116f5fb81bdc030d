"""The pack's HTTP route: the exact token count of a prompt, for the live label of the web extension.

    POST /flux2_klein/tokens   {"text": "a red fox"}   ->   {"count": 15, "limit": 512}
    POST /flux2_klein/tokens   {"text": "a red fox", "text_encoder": "qwen3vl_4b.safetensors"}   ->   {"count": 11,
                                                                                                 "limit": 4096}

``count`` is what Klein Prompt Encode reports for that prompt (``count_prompt_tokens``: the encoder's chat
template included, before truncation); ``limit`` is the text encoder's. ``text_encoder``, a file of ComfyUI's
text_encoders folder (what the prompt's loader holds), says which: its headers tell a FLUX 3 Qwen3-VL encoder (its
template, 4096 tokens) from FLUX.2's (Qwen3's, 512), which is also the answer without one or for a file that cannot
be read. No model is loaded: only the built-in Qwen3 tokenizer. The server announces the route with the feature flag
``flux2_klein_tokens``; without it the extension shows its own estimate.

Any caller can reach the route, so the body is read only up to MAX_BODY and the text counted only up to MAX_TEXT
characters (413 past either); a body that is not {"text": str} gets 400. Errors are JSON {"error": "..."}; the
extension then keeps its own estimate.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
from dataclasses import dataclass

from aiohttp import web

from ..flux2_core.errors import Flux2Error
from ..flux2_core.families import encoder_for
from ..flux2_core.models.text_encoder import count_prompt_tokens
from ..flux2_core.models.tokenizer import load_tokenizer
from ..flux2_core.variants import TextEncoderSpec

ROUTE = "/flux2_klein/tokens"
FEATURE = "flux2_klein_tokens"
LIMIT = encoder_for(None).max_length    # what an unmarked Qwen3 file is read to: 512 (FLUX 3's Qwen3-VL reads 4096)
# 512 tokens are a few thousand characters; counting 16384 takes milliseconds, and JSON of that many characters
# (up to 4 bytes each in UTF-8) fits 64 KiB.
MAX_TEXT = 16384
MAX_BODY = 64 * 1024
USAGE = 'send JSON {"text": "<prompt>"}, text a string'
MAX_NAME = 1024


@dataclass(frozen=True)
class TokenRequest:
    text: str
    text_encoder: str | None      # a file of ComfyUI's text_encoders folder: whose template and limit

_tokenizer: asyncio.Future | None = None


def register() -> None:
    """Serve the route and announce it (from the pack's comfy_entrypoint, before the server starts)."""
    # ComfyUI's server is there: imported here, so that the handler below imports (and is tested) without ComfyUI
    from . import host

    host.add_route("POST", ROUTE, count_tokens, FEATURE)


async def count_tokens(request: web.Request) -> web.Response:
    asked = prompt_text(await read_body(request, MAX_BODY))
    if isinstance(asked, tuple):
        status, error = asked
        return web.json_response({"error": error}, status=status)
    spec = await asyncio.to_thread(spec_of_file, asked.text_encoder)
    count = await asyncio.to_thread(count_prompt_tokens, await tokenizer(), asked.text, spec.template)
    return web.json_response({"count": count, "limit": spec.max_length})


def spec_of_file(name: str | None) -> TextEncoderSpec:
    """The spec a text encoder file of ComfyUI's folder is read with (the registry's for a file that says nothing,
    FLUX.2's Qwen3, where there is no such file or it cannot be read: the label falls back, the run says what is
    wrong)."""
    if not name:
        return encoder_for(None)
    from . import host  # ComfyUI's folders: only asked when a name is given (inside ComfyUI)

    try:
        if name not in host.model_choices("text_encoders"):    # only what a loader lists: no path of the caller's
            return encoder_for(None)
        path = host.resolve("text_encoders", name)
        return _file_spec(path, os.path.getmtime(path))
    except (Flux2Error, OSError):
        return encoder_for(None)


@functools.lru_cache(maxsize=32)
def _file_spec(path: str, _mtime: float) -> TextEncoderSpec:
    from ..flux2_core.weights import text_encoder_spec

    return text_encoder_spec(path)


async def read_body(request: web.Request, limit: int) -> bytes | None:
    """The request body, or None when it is over ``limit`` bytes (a declared length over it is not even read)."""
    if request.content_length is not None and request.content_length > limit:
        return None
    body = bytearray()
    while chunk := await request.content.read(limit + 1 - len(body)):
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


def prompt_text(body: bytes | None) -> TokenRequest | tuple[int, str]:
    """The prompt (and text encoder) in a request body, or (HTTP status, error message) saying what is wrong with
    the body."""
    if body is None:
        return 413, f"the request is over {MAX_BODY // 1024} KiB: {USAGE} of at most {MAX_TEXT} characters"
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):      # not JSON, not UTF-8, a number of thousands of digits, nested too deep
        return 400, f"the body is not JSON: {USAGE}"
    text = value.get("text") if isinstance(value, dict) else None
    if not isinstance(text, str):
        return 400, f"the body has no text string: {USAGE}"
    encoder = value.get("text_encoder")
    if encoder is not None and (not isinstance(encoder, str) or len(encoder) > MAX_NAME):
        return 400, (f"text_encoder must be the name of a file in ComfyUI's text_encoders folder (at most {MAX_NAME} "
                     f"characters), or left out")
    if len(text) > MAX_TEXT:
        return 413, (f"the text has {len(text)} characters, over the {MAX_TEXT} this route counts (the text encoder "
                     f"reads {LIMIT} tokens, a few thousand characters)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:                # JSON's "\ud800" escapes decode to halves of a character
        return 400, f"the text holds an unpaired surrogate, which is not a character: {USAGE}"
    return TokenRequest(text, encoder)


async def tokenizer():
    """The built-in Qwen3 tokenizer, made once in a worker thread (the first build takes about 2 s). It keeps no
    state between calls (padding and truncation are done beside it), so the prompt encoder may share it."""
    global _tokenizer
    if _tokenizer is None:
        _tokenizer = asyncio.ensure_future(asyncio.to_thread(load_tokenizer))
    try:
        return await asyncio.shield(_tokenizer)
    except Exception:
        _tokenizer = None            # let the next request try again
        raise
