"""Headless ComfyUI client (aiohttp, driven synchronously): queue an API-format workflow, follow it on the
websocket, download its images (POST /prompt, ws /ws, GET /history/<id>, GET /view).
Every answer is untrusted: the check_* / parse_* functions read one each, and anything odd ends in a ServerError
that names the server. No file is ever replaced.
"""

from __future__ import annotations

import asyncio
import copy
import ipaddress
import json
import math
import os
import re
import struct
import sys
import urllib.parse
import uuid
from collections.abc import Iterable

import aiohttp

from ..checks import parse_number
from ..errors import Flux2Error
from .outputs import PICTURE_ERRORS, check_folder, picture_format, write_new

OUR_PREFIX = "Flux2Klein"          # every node id of this pack starts with this
TEXT_INPUTS = ("text", "prompt")   # the prompt-encode node's string input
SEED_INPUTS = ("seed", "noise_seed")

ANSWER_LIMIT = 64 << 20            # bytes of an HTTP answer (the biggest, /object_info, is a few MiB)
IMAGE_LIMIT = 1 << 30              # bytes of one downloaded image
MESSAGE_LIMIT = 64 << 20           # bytes of one websocket message (previews are tens of KiB)
SHOWN = 300                        # characters of a bad answer quoted in an error
CONNECT_TIMEOUT = 30.0             # seconds to open a connection (--timeout is for answers, which can take long)
CLOSE_TIMEOUT = 2.0                # seconds to wait for the server's half of a websocket close
PREVIEW_IMAGE, TEXT, PREVIEW_WITH_METADATA = 1, 3, 4    # binary event types (ComfyUI's protocol.py)
RECEIVING = "waiting for the prompt's messages on the websocket"
FIX_CONNECTION = ("Is ComfyUI running? Check the address and port against the line ComfyUI prints at startup "
                  "('To see the GUI go to: http://127.0.0.1:8188'); to reach it from another machine, start ComfyUI "
                  "with --listen")


class ServerError(Flux2Error):

    def __init__(self, server: str, problem: str):
        super().__init__(f"ComfyUI at {server}: {problem}")
        self.server, self.problem = server, problem       # problem: the message without the server's name


class ServerUnreachable(ServerError):
    """The server itself is gone (no connection, no answer in time), so a batch gives its jobs to the others."""


def size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n} bytes"


def shown(value, limit: int = SHOWN) -> str:
    """At most `limit` characters, control characters escaped (a hostile server must not reach the terminal)."""
    if isinstance(value, (bytes, bytearray)):
        return repr(bytes(value[:limit])) + (f"... ({len(value)} bytes)" if len(value) > limit else "")
    if not isinstance(value, str):
        try:
            value = json.dumps(value, ensure_ascii=False)
        except (ValueError, RecursionError):
            value = f"<a {type(value).__name__} nested too deeply to show>"
    cut = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in value[:limit])
    return cut + (f"... ({len(value)} characters)" if len(value) > limit else "")


# --- answers, checked: each reads one answer and returns what the client needs, or raises ----------------------------

def parse_server(server: str) -> tuple[str, str]:
    """--server [http[s]://]HOST:PORT -> (base URL, HOST:PORT), normalized so one server given twice is seen as one."""
    wrong = Flux2Error(f"--server {shown(str(server))} is not HOST:PORT; use e.g. 127.0.0.1:8188 (the address and "
                       "port ComfyUI prints at startup)")
    text = server.strip().rstrip("/") if isinstance(server, str) else ""
    try:
        url = urllib.parse.urlsplit(text if "://" in text else f"http://{text}")
    except ValueError:                                       # "[not-an-address]:80"
        raise wrong from None
    host, colon, port = url.netloc.rpartition(":")
    if (url.scheme not in ("http", "https") or not colon or url.path or url.query or url.fragment or "@" in host
            or not re.fullmatch(r"[0-9]+", port)):
        raise wrong
    try:
        port = parse_number(port, "the port", 1, 65535, whole=True)
    except Flux2Error:
        raise wrong from None
    host = host.removeprefix("[").removesuffix("]") if host.startswith("[") else host
    try:
        host = ipaddress.ip_address(host).compressed        # ::0:1 and ::1 are one address
    except ValueError:
        host = host.lower().removesuffix(".")                # host names: case and a final dot say nothing
        if not re.fullmatch(r"[\w-]+(\.[\w-]+)*", host):
            raise wrong from None
    name = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return f"{url.scheme}://{name}", name


def check_status(server: str, what: str, status: int, body: bytes) -> bytes:
    if status == 200:
        return body
    if what == "POST /prompt" and status == 400:
        raise ServerError(server, f"refused the workflow (HTTP 400): {refusal(body)}\nFix those inputs (e.g. "
                                  "--set NODE.INPUT=VALUE, or the workflow file) and queue it again")
    raise ServerError(server, f"{what} answered HTTP {status}: {shown(body)}")


def refusal(body: bytes) -> str:
    """ComfyUI's 400 answer to /prompt, one line per problem."""
    def said(error: dict) -> str:
        return shown(error["message"]) + (f": {shown(error['details'])}" if error.get("details") else "")

    try:
        answer = json.loads(body)
        lines = [said(answer["error"])] if "error" in answer else []
        for nid, node in answer["node_errors"].items():
            lines += [f"  node {shown(nid, 40)} ({shown(node.get('class_type'), 80)}): {said(error)}"
                      for error in node["errors"]]
        return "\n".join(lines)
    except (ValueError, RecursionError, TypeError, KeyError, AttributeError):    # not that shape: show it raw
        return shown(body, 2000)


def parse_json(server: str, what: str, body: bytes | str):
    if not body.strip():
        raise ServerError(server, f"{what} is empty, where JSON was expected")
    try:
        return json.loads(body)
    except RecursionError:
        raise ServerError(server, f"{what} is JSON nested too deeply to read: {shown(body)}") from None
    except ValueError:                 # not JSON, not UTF-8, or a number too long for Python's int
        raise ServerError(server, f"{what} is not JSON: {shown(body)}") from None


def parse_submit(server: str, body: bytes) -> str:
    answer = parse_json(server, "the answer to POST /prompt", body)
    prompt_id = answer.get("prompt_id") if isinstance(answer, dict) else None
    if not isinstance(prompt_id, str) or not 0 < len(prompt_id) <= 200 or not prompt_id.isprintable():
        raise ServerError(server, f"the answer to POST /prompt has no usable prompt_id: {shown(body)}")
    if answer.get("node_errors"):      # queued all the same: the outputs whose inputs failed are left out
        note(f"ComfyUI at {server} queued the workflow without some of its outputs:\n{refusal(body)}")
    return prompt_id


def parse_message(server: str, text: str) -> dict:
    message = parse_json(server, "a websocket message", text)
    if not (isinstance(message, dict) and isinstance(message.get("type"), str)
            and isinstance(message.get("data"), dict)):
        raise ServerError(server, f'a websocket message is not {{"type": ..., "data": {{...}}}}: {shown(text)}')
    return message


def check_binary(server: str, frame: bytes) -> bytes:
    """A 4-byte event type, then a 4-byte format (previews: 1 JPEG, 2 PNG) or length (text, metadata previews)."""
    event, second = struct.unpack(">II", frame[:8]) if len(frame) >= 8 else (None, None)
    if (event is None or (event == PREVIEW_IMAGE and second not in (1, 2))
            or (event in (TEXT, PREVIEW_WITH_METADATA) and 8 + second > len(frame))):
        raise ServerError(server, f"a binary websocket frame is not a preview or progress text: {shown(frame, 40)}")
    return frame


def finished(server: str, message: dict) -> bool:
    """`executing` with node null (sent once the history entry is stored); an error or an interrupt raises."""
    kind, data = message["type"], message["data"]
    if kind == "execution_error":      # the workflow failed, the server did nothing wrong: the node's message first
        # the class name alone: a pack's exception type carries its folder's path
        error_type = str(data.get("exception_type", "")).rsplit(".", 1)[-1]
        raise Flux2Error(f"node {shown(data.get('node_id'), 40)} ({shown(data.get('node_type'), 80)}) failed: "
                         f"{shown(error_type, 80)}: {shown(data.get('exception_message'), 2000)}")
    if kind == "execution_interrupted":
        raise Flux2Error(f"the prompt was interrupted at node {shown(data.get('node_id'), 40)} (in ComfyUI at "
                         f"{server})")
    return kind == "executing" and "node" in data and data["node"] is None


def follow_frames(server: str, prompt_id: str, frames: Iterable[str | bytes], on_message=None,
                  on_preview=None) -> list[dict]:
    """This prompt's JSON messages until it finishes; other clients' are skipped. Frames that end first raise."""
    messages = []
    for frame in frames:
        if isinstance(frame, bytes):
            check_binary(server, frame)
            if on_preview:
                on_preview(frame)
            continue
        message = parse_message(server, frame)
        if message["data"].get("prompt_id") != prompt_id:
            continue
        messages.append(message)
        if on_message:
            on_message(message)
        if finished(server, message):
            return messages
    raise ServerUnreachable(server, f"the websocket closed before prompt {prompt_id} finished; did ComfyUI stop or "
                              "restart? If it still runs the prompt, the images land in ComfyUI's output folder")


def parse_history(server: str, prompt_id: str, body: bytes) -> list[dict]:
    """The image records {filename, subfolder, type}, in node order."""
    answer = parse_json(server, f"the answer to GET /history/{prompt_id}", body)
    entry = answer.get(prompt_id) if isinstance(answer, dict) else None
    if entry is None:
        raise ServerError(server, f"the answer to GET /history/{prompt_id} has no entry for that prompt: "
                                  f"{shown(body)}")
    outputs = entry.get("outputs") if isinstance(entry, dict) else None
    if not isinstance(outputs, dict) or not all(isinstance(o, dict) and isinstance(o.get("images", []), list)
                                                for o in outputs.values()):
        raise ServerError(server, f"the history of prompt {prompt_id} has no outputs {{node: {{\"images\": [...]}}}}"
                                  f": {shown(body)}")
    images = []
    for node in sorted(outputs):
        for image in outputs[node].get("images", []):
            if not (isinstance(image, dict) and isinstance(image.get("filename"), str)
                    and all(isinstance(image.get(k, ""), str) for k in ("subfolder", "type"))):
                raise ServerError(server, f"node {shown(node, 40)} of prompt {prompt_id} lists an image that is not "
                                          f"{{filename, subfolder, type}}: {shown(image)}")
            images.append({"filename": image["filename"], "subfolder": image.get("subfolder", ""),
                           "type": image.get("type", "output")})
    return images


# by extension; other files are only checked to be non-empty
IMAGE_FORMATS = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP", ".gif": "GIF", ".bmp": "BMP",
                 ".tif": "TIFF", ".tiff": "TIFF"}


def parse_image(server: str, image: dict, body: bytes) -> bytes:
    """Checked before anything is written: a whole picture (decoded, so a cut file is caught) of the named format."""
    name = image["filename"]
    what = f"GET /view sent {shown(name)}"
    if not body:
        raise ServerError(server, f"{what} as 0 bytes (HTTP 200 with an empty body); nothing was written. The file "
                                  f"may be missing or still being written on the server: run the prompt again")
    expected = IMAGE_FORMATS.get(os.path.splitext(name)[1].lower())
    if expected is None:
        return body
    try:
        found = picture_format(body)
    except PICTURE_ERRORS as error:
        raise ServerError(server, f"{what} as {size(len(body))} that are not a readable {expected} picture "
                                  f"({error}); nothing was written. Starts with {shown(body[:16])}") from None
    if found != expected:
        raise ServerError(server, f"{what} as {found} data, not the {expected} its name says; nothing was written")
    return body


def file_name(server: str, image: dict) -> str:
    """The server's file name without any folder part, so no name can reach outside --out."""
    name = image["filename"].replace("\\", "/").rsplit("/", 1)[-1]
    if name in ("", ".", "..") or not name.isprintable() or len(name.encode("utf-8", "replace")) > 200:
        raise ServerError(server, f"an image is named {shown(image['filename'])}, which is no usable file name")
    return name


def check_frame(server: str, kind: aiohttp.WSMsgType, data) -> str | bytes | None:
    if kind in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
        return data
    if kind in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED):
        return None
    if isinstance(data, aiohttp.ServerTimeoutError):       # the heartbeat's ping went unanswered
        raise ServerUnreachable(server, f"stopped answering on the websocket ({shown(str(data))})")
    if getattr(data, "code", None) == aiohttp.WSCloseCode.MESSAGE_TOO_BIG:
        raise ServerError(server, f"sent a websocket message over {size(MESSAGE_LIMIT)}; ComfyUI's messages "
                                  "are far smaller: is this ComfyUI?")
    raise ServerError(server, f"sent a broken websocket frame ({shown(str(data))})")


# --- the network: each HTTP call on a loop of its own, a websocket on one that lives as long as it does -------------

def network_error(server: str, timeout: float, doing: str, error: Exception) -> ServerError:
    if isinstance(error, aiohttp.WSServerHandshakeError):
        return ServerError(server, f"{doing}: the websocket was refused (HTTP {error.status} {shown(error.message)});"
                                   " is this ComfyUI, and the right port?")
    if isinstance(error, aiohttp.ClientConnectorError):       # refused, unknown host, unreachable, TLS
        cause = getattr(error, "os_error", None) or error
        reason = "connection refused" if isinstance(cause, ConnectionRefusedError) else \
            shown(getattr(cause, "strerror", None) or str(cause))
        return ServerUnreachable(server, f"{doing}: cannot connect ({reason}). {FIX_CONNECTION}")
    if isinstance(error, aiohttp.ConnectionTimeoutError):     # nothing answered the connection (a firewall?)
        return ServerUnreachable(server, f"{doing}: cannot connect (no answer within {min(timeout, CONNECT_TIMEOUT):g} s)"
                                   f". {FIX_CONNECTION}")
    if isinstance(error, (TimeoutError, asyncio.TimeoutError)):        # aiohttp's timeouts are both
        return ServerUnreachable(server, f"{doing}: no answer within {timeout:g} s; is ComfyUI busy or stuck? "
                                   "--timeout SECONDS waits longer")
    if isinstance(error, aiohttp.ClientResponseError):      # a status line or header that is not HTTP
        return ServerError(server, f"{doing}: the answer is not HTTP ({shown(error.message)}); is this ComfyUI, "
                                   "and the right port?")
    return ServerUnreachable(server, f"{doing}: the connection broke ({shown(str(error) or type(error).__name__)}); did "
                               "ComfyUI stop or restart?")


NETWORK_ERRORS = (aiohttp.ClientError, OSError, TimeoutError, asyncio.TimeoutError)   # the last two differ on 3.10


class ComfyClient:

    def __init__(self, server: str, timeout: float = 600.0, heartbeat: float | None = None):
        """timeout: seconds for any answer (a message can take a whole step). heartbeat: seconds for HTTP and pings,
        which ComfyUI answers mid-step, so a hung server is found sooner."""
        self.base, self.server = parse_server(server)
        for option, value in (("--timeout", timeout), ("--server-timeout", heartbeat)):
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise Flux2Error(f"{option} {value} must be a number of seconds above 0")
        self.timeout, self.heartbeat = timeout, heartbeat
        self.answer_timeout = min(timeout, heartbeat) if heartbeat else timeout     # for HTTP answers
        self.client_id = uuid.uuid4().hex

    def timeouts(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(sock_connect=min(self.answer_timeout, CONNECT_TIMEOUT),
                                     sock_read=self.answer_timeout)

    def _call(self, doing: str, coroutine, loop: asyncio.AbstractEventLoop | None = None,
              waited: float | None = None):
        """Network failures become ServerErrors; `waited`: the timeout it ran under, if not ``answer_timeout``."""
        try:
            return loop.run_until_complete(coroutine) if loop else asyncio.run(coroutine)
        except NETWORK_ERRORS as e:
            raise network_error(self.server, waited or self.answer_timeout, doing, e) from None

    def exchange(self, path: str, body: dict | None = None, limit: int | None = None) -> tuple[str, int, bytes]:
        """GET path, or POST body as JSON -> ("GET /path", status, answer); over `limit` bytes raises."""
        what = f"{'GET' if body is None else 'POST'} {path}"
        return what, *self._call(what, self._exchange(what, path, body, limit or ANSWER_LIMIT))

    async def _exchange(self, what: str, path: str, body: dict | None, limit: int,
                        form: aiohttp.FormData | None = None) -> tuple[int, bytes]:
        async with aiohttp.ClientSession(timeout=self.timeouts()) as session, session.request(
                what.split()[0], self.base + path, json=body, data=form, allow_redirects=False) as response:
            if response.content_length is not None and response.content_length > limit:
                raise ServerError(self.server, f"the answer to {what} would be {response.content_length} bytes, "
                                               f"over the {size(limit)} this client takes")
            data = bytearray()
            async for chunk in response.content.iter_any():
                data += chunk
                if len(data) > limit:
                    raise ServerError(self.server, f"the answer to {what} runs past the {size(limit)} this "
                                                   f"client takes: {shown(data)}")
            return response.status, bytes(data)

    def request(self, path: str, body: dict | None = None, limit: int | None = None) -> bytes:
        return check_status(self.server, *self.exchange(path, body, limit))

    def post_file(self, path: str, field: str, filename: str, data: bytes,
                  fields: dict[str, str]) -> tuple[str, int, bytes]:
        """A multipart form (ComfyUI's upload routes) -> (what, status, answer), as ``exchange``."""
        what = f"POST {path}"
        form = aiohttp.FormData()
        for name, value in fields.items():
            form.add_field(name, value)
        form.add_field(field, data, filename=filename, content_type="application/octet-stream")
        return what, *self._call(what, self._exchange(what, path, None, ANSWER_LIMIT, form))

    def get_json(self, path: str):
        return parse_json(self.server, f"the answer to GET {path}", self.request(path))

    def post_json(self, path: str, body: dict):
        raw = self.request(path, body)
        return parse_json(self.server, f"the answer to POST {path}", raw) if raw.strip() else None

    def connect(self) -> WebSocket:
        return WebSocket(self)

    def submit(self, prompt: dict, extra_data: dict | None = None) -> str:
        body = {"prompt": prompt, "client_id": self.client_id}
        if extra_data:
            body["extra_data"] = extra_data
        return parse_submit(self.server, self.request("/prompt", body))

    def follow(self, ws: WebSocket, prompt_id: str, on_message=None, on_preview=None) -> list[dict]:
        return follow_frames(self.server, prompt_id, iter(ws.recv, None), on_message, on_preview)

    def images(self, prompt_id: str) -> list[dict]:
        return parse_history(self.server, prompt_id, self.request(f"/history/{urllib.parse.quote(prompt_id, '')}"))

    def download(self, image: dict) -> bytes:
        query = urllib.parse.urlencode({k: image.get(k, "") for k in ("filename", "subfolder", "type")})
        return parse_image(self.server, image, self.request(f"/view?{query}", limit=IMAGE_LIMIT))

    def interrupt(self) -> None:
        self.post_json("/interrupt", {})


class WebSocket:
    """recv() -> str (a JSON message), bytes (a binary frame), None (closed)."""

    def __init__(self, client: ComfyClient):
        self.client, self.loop = client, asyncio.new_event_loop()
        self.session = self.ws = None
        try:
            client._call("opening the websocket /ws", self._open(), self.loop)
        except BaseException:
            self.close()
            raise

    async def _open(self) -> None:
        self.session = aiohttp.ClientSession(timeout=self.client.timeouts())
        self.ws = await self.session.ws_connect(
            f"{self.client.base}/ws?clientId={self.client.client_id}", max_msg_size=MESSAGE_LIMIT,
            timeout=aiohttp.ClientWSTimeout(ws_receive=self.client.timeout, ws_close=CLOSE_TIMEOUT),
            heartbeat=self.client.heartbeat)

    def recv(self) -> str | bytes | None:
        message = self.client._call(RECEIVING, self._receive(), self.loop, self.client.timeout)
        if message is None:
            raise self._silence()
        return check_frame(self.client.server, message.type, message.data)

    async def _receive(self) -> aiohttp.WSMessage | None:
        """None after `timeout` seconds (not aiohttp's: each pong restarts that one)."""
        try:
            return await asyncio.wait_for(self.ws.receive(), self.client.timeout)
        except (TimeoutError, asyncio.TimeoutError):
            return None

    def _silence(self) -> ServerError:
        """With a heartbeat, asks the server: answering means a slow or stuck prompt, not an unreachable server."""
        silent = network_error(self.client.server, self.client.timeout, RECEIVING, TimeoutError())
        if self.client.heartbeat is None:
            return silent
        try:
            self.client.request("/prompt")
        except ServerUnreachable as e:
            return e
        except ServerError:
            pass                       # an odd answer is an answer
        return ServerError(self.client.server, f"{RECEIVING}: no message for {self.client.timeout:g} s, though the "
                                               "server answers; is a step (or a model load) slower than that, or is "
                                               "the prompt stuck? --timeout SECONDS waits longer")

    def close(self) -> None:
        if self.loop.is_closed():
            return
        try:
            self.loop.run_until_complete(self._close())
        except NETWORK_ERRORS:
            pass                       # a connection that broke needs no goodbye
        finally:
            self.loop.close()

    async def _close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self.session is not None:
            await self.session.close()


# --- overrides on an API-format prompt -------------------------------------------------------------------------------

def _linked(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)


def prompt_nodes(prompt: dict) -> list[str]:
    """Our prompt-encode nodes that feed a `positive` input (else all of them)."""
    encoders = [nid for nid, node in prompt.items() if node["class_type"].startswith(OUR_PREFIX)
                and any(isinstance(node["inputs"].get(k), str) for k in TEXT_INPUTS)]
    positive = set()
    frontier = [node["inputs"]["positive"][0] for node in prompt.values() if _linked(node["inputs"].get("positive"))]
    while frontier:                       # walk upstream from each `positive` input to the nodes that feed it
        nid = frontier.pop()
        if nid in positive or nid not in prompt:
            continue
        positive.add(nid)
        frontier += [value[0] for value in prompt[nid]["inputs"].values() if _linked(value)]
    return [nid for nid in encoders if nid in positive] or encoders


def parse_value(text: str):
    """--set values are JSON when they parse as JSON (numbers, true, lists), else plain strings."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):       # not JSON (or an integer of thousands of digits)
        return text


def apply_overrides(prompt: dict, sets=(), text: str | None = None, seed: int | None = None) -> dict:
    prompt = copy.deepcopy(prompt)
    if text is not None:
        targets = prompt_nodes(prompt)
        if not targets:
            raise Flux2Error(f"--prompt: the workflow has no {OUR_PREFIX} prompt-encode node; use --set NODE.text=...")
        for nid in targets:
            key = next(k for k in TEXT_INPUTS if isinstance(prompt[nid]["inputs"].get(k), str))
            prompt[nid]["inputs"][key] = text
    if seed is not None:
        targets = [(nid, k) for nid, node in prompt.items() for k in SEED_INPUTS
                   if isinstance(node["inputs"].get(k), int)]
        if not targets:
            raise Flux2Error("--seed: the workflow has no node with a literal seed input; use --set NODE.seed=...")
        for nid, k in targets:
            prompt[nid]["inputs"][k] = seed
    for item in sets:
        target, eq, value = item.partition("=")
        nid, dot, name = target.partition(".")
        if not eq or not dot or not name:
            raise Flux2Error(f"--set {item!r} is not NODE.INPUT=VALUE (e.g. --set 12.steps=8)")
        if nid not in prompt:
            raise Flux2Error(f"--set {item!r}: the workflow has no node {nid!r}; its nodes are {sorted(prompt)}")
        prompt[nid]["inputs"][name] = parse_value(value)
    return prompt


# --- the command -----------------------------------------------------------------------------------------------------

def load_workflow(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            workflow = json.load(f)
    except OSError as e:
        raise Flux2Error(f"cannot read workflow {path}: {e.strerror or e}") from None
    except (ValueError, RecursionError) as e:          # not JSON, not UTF-8
        raise Flux2Error(f"workflow {path} is not a JSON file ({shown(str(e))})") from None
    return check_workflow(workflow, path)


def check_workflow(workflow, name: str) -> dict:
    """An API-format prompt ({id: {class_type, inputs}}), else a Flux2Error naming `name`."""
    if not (isinstance(workflow, dict) and workflow and "nodes" not in workflow and all(
            isinstance(n, dict) and isinstance(n.get("class_type"), str) and isinstance(n.get("inputs"), dict)
            for n in workflow.values())):
        raise Flux2Error(f"{name} is not an API-format workflow ({{id: {{class_type, inputs}}}}); "
                         "use its twin in workflows/api/, or export with 'Export (API)' in ComfyUI")
    return workflow


def print_progress(message: dict) -> None:
    data = message["data"]
    if message["type"] == "progress":
        print(f"  node {shown(data.get('node'), 40)}: step {shown(data.get('value'), 20)}/"
              f"{shown(data.get('max'), 20)}", flush=True)
    elif message["type"] == "executing" and data.get("node") is not None:
        print(f"running node {shown(data['node'], 40)}", flush=True)


def note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def queue(workflow: dict, server: str, out_dir: str, timeout: float = 600.0, on_message=print_progress,
          on_saved=None, heartbeat: float | None = None) -> list[str]:
    """The saved images' paths; on_saved(path) as each is written. A taken name gets the next free one."""
    client = ComfyClient(server, timeout=timeout, heartbeat=heartbeat)
    out = check_folder(out_dir, "--out")       # before the prompt is queued: a wrong --out must not cost a run
    ws = client.connect()                      # connect first so no progress message is missed
    try:
        prompt_id = client.submit(workflow)
        note(f"queued prompt {prompt_id} on ComfyUI at {client.server}")
        client.follow(ws, prompt_id, on_message)
    finally:
        ws.close()
    images = client.images(prompt_id)
    names = [file_name(client.server, image) for image in images]    # all checked before any is written
    paths = []
    for image, name in zip(images, names):
        data = client.download(image)
        path = write_new(out, name, lambda f, data=data: f.write(data))
        if path.name != name:
            note(f"{out / name} exists; wrote {path.name} beside it")
        paths.append(str(path))
        if on_saved:
            on_saved(str(path))
    return paths
