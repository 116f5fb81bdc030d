"""The queue client against random and malformed server answers (hypothesis), and against a misbehaving server.

The check_* / parse_* functions of queue_client read one answer each without a network; the end-to-end tests run the
whole client against a small aiohttp server on loopback that answers whatever the example scripts (broken JSON,
odd statuses, dropped connections, junk websocket frames, raw bytes under the websocket framing). The contract
everywhere: a correct result, or the client's own error (a ServerError naming the server, or a Flux2Error for a
workflow that failed), never another exception, and never a file replaced.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import struct
import tempfile
import threading
from pathlib import Path
from unittest import mock

import aiohttp
import pytest
from aiohttp import web
from hypothesis import event, given, settings
from hypothesis import strategies as st
from PIL import Image

from flux2_core.app import queue_client as qc
from flux2_core.app import queue_command
from flux2_core.errors import Flux2Error
from tests.tiny.pictures import png_bytes

SERVER = "comfy.test:8188"
PROMPT_ID = "p-1"
FAST = settings(max_examples=100, deadline=None)
STATUSES = [200, 201, 301, 302, 400, 403, 404, 413, 500, 502, 503]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=15)


def outcome(call):
    """(result, None), or (None, error) for the client's own errors; any other exception fails the test."""
    try:
        return call(), None
    except qc.ServerError as e:
        assert e.server == SERVER and str(e).startswith(f"ComfyUI at {SERVER}: "), e
        return None, e


def message(kind: str, **data) -> str:
    return json.dumps({"type": kind, "data": data})


def is_message(text: str) -> bool:
    """The shape every ComfyUI websocket text message has (server.py send_json): {"type": str, "data": {...}}."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return False
    return isinstance(value, dict) and isinstance(value.get("type"), str) and isinstance(value.get("data"), dict)


# ---------------------------------------------------------------------------------------------------------------------
# Quoting and single answers.

def test_shown_escapes_what_a_terminal_would_obey_and_cuts_long_answers():
    assert qc.shown("a\x1b[31mred\nline") == "a\\x1b[31mred\\nline"
    assert qc.shown(b"\x00\xffok") == "b'\\x00\\xffok'"
    assert qc.shown("x" * 1000, 10) == "xxxxxxxxxx... (1000 characters)"
    assert qc.shown({"a": [1, None]}) == '{"a": [1, null]}'
    assert qc.shown("Zürich, 東京") == "Zürich, 東京"                 # printable text stays as it is


@FAST
@given(st.one_of(st.text(), st.binary(), json_values), st.integers(1, 400))
def test_shown_is_always_printable_and_bounded(value, limit):
    text = qc.shown(value, limit)
    assert text.isprintable()
    assert len(text) <= 10 * limit + 40     # the longest escape of one character is \U0001xxxx; plus the size note


@pytest.mark.parametrize("body, says", [
    (b"", "the answer to X is empty, where JSON was expected"),
    (b"  \n", "the answer to X is empty, where JSON was expected"),
    (b"<html>502 Bad Gateway</html>", "the answer to X is not JSON: b'<html>502 Bad Gateway</html>'"),
    (b"\xff\xfe{", "the answer to X is not JSON: b'\\xff\\xfe{'"),
    (b"[" * 100_000, "the answer to X is JSON nested too deeply to read: b'[[["),
    (b"1" * 5000, "the answer to X is not JSON"),                           # past Python's int digit limit
])
def test_answers_that_are_not_json(body, says):
    _, error = outcome(lambda: qc.parse_json(SERVER, "the answer to X", body))
    assert str(error).startswith(f"ComfyUI at {SERVER}: {says}"), error


@FAST
@given(st.binary(max_size=200))
def test_random_bytes_are_json_or_our_error(body):
    value, error = outcome(lambda: qc.parse_json(SERVER, "the answer to X", body))
    if error is None:
        assert json.dumps(value) == json.dumps(json.loads(body))         # (compared as text: NaN != NaN)


@FAST
@given(st.one_of(json_values, st.fixed_dictionaries({"prompt_id": json_values}),
                 st.fixed_dictionaries({"prompt_id": st.text(max_size=40), "number": st.integers()})))
def test_submit_answers(answer):
    prompt_id, error = outcome(lambda: qc.parse_submit(SERVER, json.dumps(answer).encode()))
    sent = answer.get("prompt_id") if isinstance(answer, dict) else None
    usable = isinstance(sent, str) and 0 < len(sent) <= 200 and sent.isprintable()
    assert (prompt_id, error is None) == ((sent, True) if usable else (None, False))
    if error:
        assert "POST /prompt has no usable prompt_id" in str(error)


@FAST
@given(st.integers(100, 599), st.binary(max_size=100))
def test_statuses(status, body):
    result, error = outcome(lambda: qc.check_status(SERVER, "GET /history/x", status, body))
    assert (result, error is None) == ((body, True) if status == 200 else (None, False))
    if error:
        assert f"GET /history/x answered HTTP {status}: " in str(error)


@FAST
@given(st.one_of(st.binary(max_size=100), json_values.map(lambda v: json.dumps(v).encode()),
                 st.fixed_dictionaries({"error": json_values, "node_errors": json_values}).map(
                     lambda v: json.dumps(v).encode())))
def test_a_refused_prompt_is_quoted_whatever_the_body(body):
    _, error = outcome(lambda: qc.check_status(SERVER, "POST /prompt", 400, body))
    assert "refused the workflow (HTTP 400): " in str(error)
    assert all(line.isprintable() for line in str(error).splitlines())


# ---------------------------------------------------------------------------------------------------------------------
# Websocket frames.

def preview(event=1, second=1, rest=b"jpeg") -> bytes:
    return struct.pack(">II", event, second) + rest


@pytest.mark.parametrize("frame", [preview(1, 1), preview(1, 2, b""), preview(3, 1, b"5progress text"),
                                   preview(4, 2, b"{}" + b"png"), preview(9, 0)])       # 9: a future event type
def test_binary_frames_comfyui_sends(frame):
    assert qc.check_binary(SERVER, frame) == frame


@pytest.mark.parametrize("frame", [b"", b"\x00\x00\x00\x01", preview(1, 3), preview(3, 10, b"5"),
                                   preview(4, 2 ** 32 - 1, b"{}")])
def test_binary_frames_of_another_shape(frame):
    _, error = outcome(lambda: qc.check_binary(SERVER, frame))
    assert "a binary websocket frame is not a preview or progress text" in str(error)


@FAST
@given(st.binary(max_size=40))
def test_random_binary_frames(frame):
    outcome(lambda: qc.check_binary(SERVER, frame))


@FAST
@given(st.one_of(st.text(max_size=50), json_values.map(json.dumps),
                 st.fixed_dictionaries({"type": json_values, "data": json_values}).map(json.dumps)))
def test_text_frames(text):
    parsed, error = outcome(lambda: qc.parse_message(SERVER, text))
    assert (error is None) == is_message(text)
    if parsed is not None:
        assert parsed == json.loads(text)


@pytest.mark.parametrize("kind, data, expected", [
    (aiohttp.WSMsgType.TEXT, "{}", "{}"), (aiohttp.WSMsgType.BINARY, b"\x01", b"\x01"),
    (aiohttp.WSMsgType.CLOSE, 1000, None), (aiohttp.WSMsgType.CLOSED, None, None),
    (aiohttp.WSMsgType.CLOSING, None, None)])
def test_what_aiohttp_receives(kind, data, expected):
    assert qc.check_frame(SERVER, kind, data) == expected


def test_oversize_and_broken_frames_say_so():
    too_big = aiohttp.WebSocketError(aiohttp.WSCloseCode.MESSAGE_TOO_BIG, "Message size 70000000 exceeds limit")
    _, error = outcome(lambda: qc.check_frame(SERVER, aiohttp.WSMsgType.ERROR, too_big))
    assert "sent a websocket message over 64 MiB" in str(error)
    broken = aiohttp.WebSocketError(aiohttp.WSCloseCode.PROTOCOL_ERROR, "Received frame with non-zero reserved bits")
    _, error = outcome(lambda: qc.check_frame(SERVER, aiohttp.WSMsgType.ERROR, broken))
    assert str(error) == f"ComfyUI at {SERVER}: sent a broken websocket frame (Received frame with non-zero reserved bits)"


# Tagged frames: each knows what follow_frames must make of it, so the expected outcome of a sequence is computed
# from the tags alone.
ours = st.sampled_from(["execution_start", "executing", "progress", "executed", "execution_cached"]).map(
    lambda kind: ("ours", message(kind, prompt_id=PROMPT_ID, node="5", value=1, max=4)))
foreign = st.one_of(st.just(message("status", status={"exec_info": {"queue_remaining": 1}}, sid="x")),
                    st.just(message("progress", prompt_id="someone-else", node="5", value=1, max=4)),
                    st.just(message("executing", node=None, prompt_id="someone-else")),
                    st.just(message("crystools.monitor", cpu_utilization=3))).map(lambda text: ("foreign", text))
previews = st.one_of(st.binary(max_size=20).map(lambda image: preview(1, 1, image)),
                     st.tuples(st.text(max_size=5), st.binary(max_size=10)).map(
                         lambda t: preview(3, len(t[0].encode()), t[0].encode() + t[1]))).map(lambda f: ("preview", f))
junk = st.one_of(st.text(max_size=30).filter(lambda t: not is_message(t)),
                 json_values.filter(lambda v: not isinstance(v, dict)).map(json.dumps),
                 st.fixed_dictionaries({"type": json_values.filter(lambda v: not isinstance(v, str)), "data": st.just({})}
                                       ).map(json.dumps),
                 st.fixed_dictionaries({"type": st.text(), "data": json_values.filter(lambda v: not isinstance(v, dict))}
                                       ).map(json.dumps),
                 st.binary(max_size=7), st.binary(max_size=10).map(lambda b: preview(1, 7, b))).map(lambda f: ("junk", f))
end = st.just(("end", message("executing", node=None, prompt_id=PROMPT_ID)))
failure = st.just(("failure", message("execution_error", prompt_id=PROMPT_ID, node_id="5", node_type="Denoise",
                                      exception_type="RuntimeError", exception_message="out of memory\x1b[2J")))


def expected_outcome(tagged) -> tuple[str, list]:
    """What follow_frames must do with these frames: ("done", our messages), ("junk" | "failure" | "closed", [])."""
    seen = []
    for tag, frame in tagged:
        if tag in ("junk", "failure"):
            return tag, []
        if tag in ("ours", "end"):
            seen.append(json.loads(frame))
        if tag == "end":
            return "done", seen
    return "closed", []


@FAST
@given(st.lists(st.one_of(ours, foreign, previews, junk, end, failure), max_size=12))
def test_frame_sequences(tagged):
    got, previewed = [], []
    result, error = None, None
    try:
        result = qc.follow_frames(SERVER, PROMPT_ID, iter([frame for _, frame in tagged]), got.append,
                                  previewed.append)
    except Flux2Error as e:
        error = e
    kind, messages = expected_outcome(tagged)
    if kind == "done":
        assert error is None and result == messages and got == messages
    elif kind == "failure":
        assert type(error) is Flux2Error and str(error) == ("node 5 (Denoise) failed: RuntimeError: out of "
                                                            "memory\\x1b[2J")
    else:
        assert isinstance(error, qc.ServerError) and error.server == SERVER
        assert ("websocket closed before prompt p-1 finished" in str(error)) == (kind == "closed"), error
    stop = next((i for i, (tag, _) in enumerate(tagged) if tag in ("junk", "failure", "end")), len(tagged))
    assert previewed == [frame for tag, frame in tagged[:stop] if tag == "preview"]


@FAST
@given(st.lists(st.one_of(st.text(max_size=40), st.binary(max_size=40), json_values.map(json.dumps),
                          st.fixed_dictionaries({"type": st.sampled_from(["executing", "execution_error", "progress",
                                                                          "execution_interrupted"]),
                                                 "data": st.dictionaries(st.sampled_from(["prompt_id", "node"]),
                                                                         st.sampled_from([PROMPT_ID, None, 5, "5"]))}
                                                ).map(json.dumps)), max_size=10))
def test_any_frame_sequence_ends_in_a_result_or_our_error(frames):
    try:
        messages = qc.follow_frames(SERVER, PROMPT_ID, iter(frames), qc.print_progress)
    except Flux2Error:
        return
    assert messages[-1]["type"] == "executing" and messages[-1]["data"]["node"] is None
    assert all(m["data"]["prompt_id"] == PROMPT_ID for m in messages)


# ---------------------------------------------------------------------------------------------------------------------
# History and file names.

image_records = st.fixed_dictionaries({"filename": st.text(max_size=20)},
                                      optional={"subfolder": st.text(max_size=5), "type": st.sampled_from(["output",
                                                                                                           "temp"])})


@FAST
@given(st.dictionaries(st.text(min_size=1, max_size=3), st.lists(image_records, max_size=3), max_size=4))
def test_well_formed_histories_list_every_image_in_node_order(outputs):
    body = json.dumps({PROMPT_ID: {"outputs": {node: {"images": images} for node, images in outputs.items()},
                                   "status": {"status_str": "success"}}}).encode()
    expected = [{"filename": image["filename"], "subfolder": image.get("subfolder", ""),
                 "type": image.get("type", "output")} for node in sorted(outputs) for image in outputs[node]]
    assert qc.parse_history(SERVER, PROMPT_ID, body) == expected


@FAST
@given(st.one_of(json_values, st.fixed_dictionaries({PROMPT_ID: json_values}),
                 st.fixed_dictionaries({PROMPT_ID: st.fixed_dictionaries({"outputs": json_values})}),
                 st.fixed_dictionaries({PROMPT_ID: st.fixed_dictionaries({"outputs": st.dictionaries(
                     st.text(max_size=3), st.fixed_dictionaries({"images": st.lists(json_values, max_size=3)}))})})))
def test_malformed_histories(answer):
    images, _ = outcome(lambda: qc.parse_history(SERVER, PROMPT_ID, json.dumps(answer).encode()))
    for image in images or []:
        assert all(isinstance(image[k], str) for k in ("filename", "subfolder", "type"))


@pytest.mark.parametrize("filename, name", [("klein_00001_.png", "klein_00001_.png"), ("../../.bashrc", ".bashrc"),
                                            ("..\\..\\evil.png", "evil.png"), ("/etc/passwd", "passwd"),
                                            ("sub/Zürich.png", "Zürich.png")])
def test_file_names_lose_their_folders(filename, name):
    assert qc.file_name(SERVER, {"filename": filename}) == name


@pytest.mark.parametrize("filename", ["", "..", "a/", "a/..", "x\x00.png", "x\n.png", "\u202eevil.png", "x" * 300])
def test_unusable_file_names(filename):
    _, error = outcome(lambda: qc.file_name(SERVER, {"filename": filename}))
    assert "which is no usable file name" in str(error)


@FAST
@given(st.text(max_size=40))
def test_a_file_name_never_leaves_the_folder(filename):
    name, _ = outcome(lambda: qc.file_name(SERVER, {"filename": filename}))
    if name is not None:
        assert os.path.dirname(os.path.normpath(os.path.join("out", name))) == "out" and "\\" not in name


# ---------------------------------------------------------------------------------------------------------------------
# End to end: a scripted aiohttp server.

DROP = "drop"                    # an answer: the connection is closed without one


class Raw(bytes):
    """Bytes written to the socket as they are, under aiohttp's framing (as a websocket frame or an HTTP answer)."""


def jpeg_bytes() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (4, 4)).save(out, "JPEG")
    return out.getvalue()


def good_view(request):
    return 200, png_bytes(f"image {request.query['filename']} from {request.query['subfolder']!r}")


GOOD = {"prompt": (200, json.dumps({"prompt_id": PROMPT_ID, "number": 0, "node_errors": {}}).encode()),
        "ws": [message("status", status={}, sid="x"), message("executing", node="5", prompt_id=PROMPT_ID),
               message("progress", value=1, max=1, node="5", prompt_id=PROMPT_ID), preview(),
               message("executing", node=None, prompt_id=PROMPT_ID)],
        "history": (200, json.dumps({PROMPT_ID: {"outputs": {"9": {"images": [
            {"filename": "a.png", "subfolder": "", "type": "output"},
            {"filename": "a.png", "subfolder": "x", "type": "output"}]}}}}).encode()),
        "view": good_view}


class Scripted:
    """A fake ComfyUI on aiohttp, on a thread and event loop of its own, answering as `script` says (GOOD's keys;
    an HTTP answer is (status, body), DROP, or a function of the request giving one)."""

    def __init__(self):
        self.script, self.served, self.queued = dict(GOOD), [], None
        self.loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.address = f"127.0.0.1:{self.runner.addresses[0][1]}"
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/ws":
            return await self.websocket(request)
        kind = request.path.strip("/").split("/")[0]                 # prompt, history, view
        if kind == "prompt" and self.queued is not None:
            self.queued.set()
        answer = self.script.get(kind, (404, b"not found"))
        answer = answer(request) if callable(answer) else answer
        if answer == DROP or isinstance(answer, Raw):
            request.transport.write(answer if isinstance(answer, Raw) else b"")    # bytes as they are, then hang up
            request.transport.close()
            return web.Response()
        if kind == "view" and answer[0] == 200:
            self.served.append(answer[1])
        if not isinstance(answer[1], list):
            return web.Response(status=answer[0], body=answer[1])
        response = web.StreamResponse(status=answer[0])            # a list of chunks: sent without a length
        response.enable_chunked_encoding()
        await response.prepare(request)
        for chunk in answer[1]:
            await response.write(chunk)
        await response.write_eof()
        return response

    async def websocket(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        self.queued = queued = asyncio.Event()
        await ws.prepare(request)
        # Wait for the prompt, reading meanwhile so that a client which gives up first gets its close answered.
        reading, waiting = asyncio.ensure_future(ws.receive()), asyncio.ensure_future(queued.wait())
        await asyncio.wait([reading, waiting], timeout=10, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if not queued.is_set():
            return ws
        frames = self.script["ws"]
        try:
            for frame in frames:
                if isinstance(frame, Raw):
                    request.transport.write(bytes(frame))
                elif isinstance(frame, bytes):
                    await ws.send_bytes(frame)
                else:
                    await ws.send_str(frame)
        except (ConnectionError, RuntimeError):                      # the client has gone
            return ws
        if any(isinstance(frame, Raw) for frame in frames):
            request.transport.close()                                # past raw bytes no clean close is possible
        else:
            await ws.close()
        return ws


@pytest.fixture(scope="module")
def scripted():
    server = Scripted()
    yield server
    server.stop()


def run_queue(server: Scripted, script: dict) -> tuple[list[str], Exception | None, dict, dict, list[str]]:
    """queue() in a fresh --out holding an older a.png -> (paths, error, files before, files after, saved)."""
    server.script, server.served = {**GOOD, **script}, []
    saved = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        out.mkdir()
        (out / "a.png").write_bytes(b"an older picture")
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        try:
            paths, error = qc.queue({"1": {"class_type": "X", "inputs": {}}}, server.address, str(out), timeout=10,
                                    on_message=None, on_saved=saved.append), None
        except Flux2Error as e:
            paths, error = [], e
        after = {p.name: p.read_bytes() for p in out.iterdir()}
        assert all(Path(p).parent == out for p in saved)
    return paths, error, before, after, [Path(p).name for p in saved]


def test_a_well_behaved_server(scripted):
    paths, error, _, after, saved = run_queue(scripted, {})
    assert error is None and saved == ["a-1.png", "a-2.png"] == [Path(p).name for p in paths]
    assert after == {"a.png": b"an older picture", "a-1.png": png_bytes("image a.png from ''"),
                     "a-2.png": png_bytes("image a.png from 'x'")}


@pytest.mark.parametrize("script, says", [
    ({"prompt": (200, b"")}, "the answer to POST /prompt is empty, where JSON was expected"),
    ({"prompt": (200, b"<html>proxy error</html>")}, "the answer to POST /prompt is not JSON: b'<html>proxy error</html>'"),
    ({"prompt": (200, b'["p-1"]')}, """the answer to POST /prompt has no usable prompt_id: b'["p-1"]'"""),
    ({"prompt": (502, b"Bad Gateway")}, "POST /prompt answered HTTP 502: b'Bad Gateway'"),
    ({"prompt": (301, b"")}, "POST /prompt answered HTTP 301: b''"),
    ({"prompt": DROP}, "POST /prompt: the connection broke (Server disconnected); did ComfyUI stop or restart?"),
    ({"prompt": Raw(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{")},
     "POST /prompt: the connection broke (Response payload is not completed"),
    ({"prompt": Raw(b"SSH-2.0-OpenSSH_9.6\r\n")}, "POST /prompt: the answer is not HTTP (Bad status line"),
    ({"ws": [message("executing", node="5", prompt_id=PROMPT_ID), "not json"]},
     "a websocket message is not JSON: not json"),
    ({"ws": [preview(), b"\x00\x01"]}, "a binary websocket frame is not a preview or progress text: b'\\x00\\x01'"),
    ({"ws": [message("progress", value=1, prompt_id=PROMPT_ID)]}, "the websocket closed before prompt p-1 finished"),
    ({"ws": [Raw(b"\x81\x05hel")]}, "the websocket closed before prompt p-1 finished"),        # cut mid-frame
    ({"ws": [Raw(b"\x83\x00")]}, "sent a broken websocket frame"),                             # reserved opcode
    ({"ws": [Raw(b"\x81\x02\xff\xfe")]}, "sent a broken websocket frame"),                     # text, not UTF-8
    ({"ws": [Raw(b"\x82\x7f" + struct.pack(">Q", 1 << 40))]}, "sent a websocket message over 64 MiB"),
    ({"history": (200, b"{}")}, "the answer to GET /history/p-1 has no entry for that prompt: b'{}'"),
    ({"history": (200, json.dumps({PROMPT_ID: {"outputs": {"9": {"images": [{"filename": 7}]}}}}).encode())},
     'node 9 of prompt p-1 lists an image that is not {filename, subfolder, type}: {"filename": 7}'),
    ({"history": (200, json.dumps({PROMPT_ID: {"outputs": {"9": {"images": [{"filename": ".."}]}}}}).encode())},
     "an image is named .., which is no usable file name"),
    ({"history": (404, b"")}, "GET /history/p-1 answered HTTP 404: b''"),
    ({"view": (404, b"404: Not Found")},
     "GET /view?filename=a.png&subfolder=&type=output answered HTTP 404: b'404: Not Found'"),
    ({"view": (200, b"")}, "GET /view sent a.png as 0 bytes (HTTP 200 with an empty body); nothing was written"),
    ({"view": (200, png_bytes("cut")[:40])}, "GET /view sent a.png as 40 bytes that are not a readable PNG picture"),
    ({"view": (200, b"<html>502 Bad Gateway</html>")}, "GET /view sent a.png as 28 bytes that are not a readable PNG"),
    ({"view": (200, jpeg_bytes())}, "GET /view sent a.png as JPEG data, not the PNG its name says"),
])
def test_a_misbehaving_server_gets_one_clear_error(scripted, script, says, capsys, tmp_path):
    """Through the command itself: exit code 1, one message naming the server and quoting what it sent, no
    traceback, and the older file untouched."""
    scripted.script, scripted.served = {**GOOD, **script}, []
    workflow = tmp_path / "wf.json"
    workflow.write_text(json.dumps({"1": {"class_type": "X", "inputs": {}}}))
    (tmp_path / "a.png").write_bytes(b"an older picture")
    assert queue_command.main([str(workflow), "--server", scripted.address, "--out", str(tmp_path), "--timeout", "10"]) == 1
    err = capsys.readouterr().err
    error = err[err.index("error: "):]
    assert error.startswith(f"error: ComfyUI at {scripted.address}: {says}"), err
    assert "Traceback" not in err and error.count("\n") == 1
    assert (tmp_path / "a.png").read_bytes() == b"an older picture"


def test_images_saved_before_an_error_are_reported(scripted, capsys, tmp_path):
    scripted.script, scripted.served = {**GOOD, "view": second_view_fails}, []
    workflow = tmp_path / "wf.json"
    workflow.write_text(json.dumps({"1": {"class_type": "X", "inputs": {}}}))
    assert queue_command.main([str(workflow), "--server", scripted.address, "--out", str(tmp_path / "out")]) == 1
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["running node 5", "  node 5: step 1/1", str(tmp_path / "out" / "a.png")]
    assert (tmp_path / "out" / "a.png").read_bytes() == png_bytes("image a.png from ''")
    assert "error: ComfyUI at" in captured.err and "GET /view?filename=a.png&subfolder=x&type=output: the " \
        "connection broke" in captured.err


def test_oversize_answers_stop_at_the_limit(scripted):
    big = (200, b"[" + b"1," * 5000 + b"1]")
    with mock.patch.object(qc, "ANSWER_LIMIT", 4096):
        _, error, *_ = run_queue(scripted, {"history": big})
        assert "the answer to GET /history/p-1 would be 10003 bytes, over the 4096 bytes this client takes" in str(error)
        _, error, *_ = run_queue(scripted, {"history": (200, [b"[", b"1," * 5000, b"1]"])})   # no Content-Length
        assert "the answer to GET /history/p-1 " in str(error) and "4096 bytes this client takes" in str(error)
    with mock.patch.object(qc, "IMAGE_LIMIT", 100):
        _, error, _, after, _ = run_queue(scripted, {"view": (200, b"x" * 101)})
        assert "would be 101 bytes, over the 100 bytes" in str(error) and after == {"a.png": b"an older picture"}
    with mock.patch.object(qc, "MESSAGE_LIMIT", 1000):
        _, error, *_ = run_queue(scripted, {"ws": [message("status", pad="x" * 2000)]})
        assert "sent a websocket message over 1000 bytes" in str(error)


http_answers = st.one_of(st.tuples(st.sampled_from(STATUSES), st.binary(max_size=40)),
                         st.tuples(st.just(200), json_values.map(lambda v: json.dumps(v).encode())), st.just(DROP),
                         st.binary(max_size=60).map(Raw),                       # anything but HTTP
                         st.binary(max_size=60).map(lambda tail: Raw(b"HTTP/1.1 200 OK\r\n" + tail)))   # broken HTTP
hostile_histories = st.lists(st.fixed_dictionaries({"filename": st.sampled_from(["a.png", "../a.png", "b.png", "..",
                                                                                  "", "a\x00.png"]) | st.text(max_size=8),
                                                    "subfolder": st.sampled_from(["", "x"])}), max_size=4).map(
    lambda images: (200, json.dumps({PROMPT_ID: {"outputs": {"9": {"images": images}}}}).encode()))
ws_frames = st.one_of(ours.map(lambda t: t[1]), foreign.map(lambda t: t[1]), previews.map(lambda t: t[1]),
                      junk.map(lambda t: t[1]), end.map(lambda t: t[1]), st.binary(max_size=12).map(Raw))

def second_view_fails(request):
    """The first image downloads, the second does not: the first must be saved and reported all the same."""
    return good_view(request) if request.query["subfolder"] == "" else DROP


def mostly(good, bad):
    """`good` three times in four, so that later steps of a run get their turn too."""
    return st.sampled_from([True, True, True, False]).flatmap(lambda ok: st.just(good) if ok else bad)


scripts = st.fixed_dictionaries({
    "prompt": mostly(GOOD["prompt"], http_answers),
    "ws": mostly(GOOD["ws"], st.tuples(st.lists(ws_frames, max_size=6), st.booleans()).map(
        lambda frames_end: frames_end[0] + [GOOD["ws"][-1]] * frames_end[1])),
    "history": mostly(GOOD["history"], http_answers | hostile_histories),
    "view": mostly(GOOD["view"], st.one_of(st.tuples(st.sampled_from(STATUSES), st.binary(max_size=40)),
                                           st.just(DROP), st.just(second_view_fails)))})


@settings(max_examples=100, deadline=None)
@given(scripts)
def test_whatever_the_server_sends_no_file_is_replaced(scripted, script):
    """Random answers at every step of a run: the client ends with a result or its own error, the older file keeps
    its bytes, and the new files are exactly the ones it reported, each holding what the server served for it."""
    paths, error, before, after, saved = run_queue(scripted, script)
    event(f"{len(saved)} saved, " + (str(error).split(": ")[1][:28] if error else "no error"))   # the statistics
    if isinstance(error, qc.ServerError):
        assert error.server == scripted.address and str(error).startswith(f"ComfyUI at {scripted.address}: ")
    assert after["a.png"] == before["a.png"]
    assert sorted(set(after) - {"a.png"}) == sorted(saved)
    assert [after[name] for name in saved] == scripted.served[:len(saved)]
    if error is None:
        assert [Path(p).name for p in paths] == saved
