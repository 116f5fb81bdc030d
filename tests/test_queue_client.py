"""The headless queue client against a tiny fake ComfyUI on loopback (HTTP + hand-written websocket frames).

The fake server speaks the protocol ComfyUI v0.12.1 speaks (see docs/comfyui-testing.md): it accepts a prompt,
pushes status / progress / executing messages over the websocket (one as two fragments, one with a 16-bit length,
a ping, a binary preview frame), and serves /history and /view. Its frames are written by hand, not by aiohttp,
so the client's library is checked against the protocol rather than against itself. Everything runs on daemon
threads with socket timeouts, so a broken client fails the test instead of hanging it. Misbehaving servers and
random answers are in test_queue_protocol.py.
"""

import base64
import hashlib
import json
import socket
import struct
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from flux2_core.app import queue_client, queue_command
from flux2_core.errors import Flux2Error
from tests.tiny.pictures import png_bytes

IMAGES = [{"filename": "klein_00001_.png", "subfolder": "", "type": "output"},
          {"filename": "klein_00002_.png", "subfolder": "sub", "type": "output"}]
WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"     # RFC 6455's handshake constant
OP_CLOSE, OP_PONG = 0x8, 0xA
WORKFLOW = {  # the shape of a base workflow: positive and negative prompt-encode nodes, a noise node, a denoiser
    "1": {"class_type": "Flux2KleinPromptEncode", "inputs": {"text": "a cat", "text_encoder": ["4", 0]}},
    "2": {"class_type": "Flux2KleinPromptEncode", "inputs": {"text": "blurry", "text_encoder": ["4", 0]}},
    "3": {"class_type": "Flux2KleinNoise", "inputs": {"seed": 1, "width": 64, "height": 64, "batch_size": 1}},
    "4": {"class_type": "Flux2KleinTextEncoderLoader", "inputs": {"name": "qwen.safetensors"}},
    "5": {"class_type": "Flux2KleinDenoise", "inputs": {"positive": ["1", 0], "negative": ["2", 0],
                                                         "noise": ["3", 0], "cfg": 4.0}},
    "6": {"class_type": "SaveImage", "inputs": {"images": ["5", 0], "filename_prefix": "klein"}},
}


def server_frame(opcode, payload, fin=True):
    n = len(payload)
    head = bytes([(0x80 if fin else 0) | opcode])
    head += bytes([n]) if n < 126 else bytes([126]) + struct.pack(">H", n)
    return head + payload


def read_client_frame(conn):
    """One masked client frame (the client must mask): returns (opcode, unmasked payload)."""
    b0, b1 = conn.recv(2, 0x100)  # MSG_WAITALL
    assert b1 & 0x80, "client frames must be masked"
    n = b1 & 0x7F
    mask = conn.recv(4, 0x100)
    payload = conn.recv(n, 0x100) if n else b""
    return b0 & 0x0F, bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


class FakeComfy(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, steps=3, fail=False, images=IMAGES):
        super().__init__(("127.0.0.1", 0), Handler)
        self.steps, self.fail, self.images = steps, fail, images
        self.prompts, self.pongs, self.views = [], [], []
        self.ws = {}                    # client_id -> socket

    def push(self, client_id, prompt_id):
        """The messages ComfyUI sends for one prompt, in the observed order."""
        conn = self.ws[client_id]

        def send(kind, data):
            conn.sendall(server_frame(1, json.dumps({"type": kind, "data": data}).encode()))
        send("status", {"status": {"exec_info": {"queue_remaining": 1}}})
        send("execution_start", {"prompt_id": "someone-else"})            # another client's prompt: ignored
        send("execution_start", {"prompt_id": prompt_id})
        send("executing", {"node": "5", "display_node": "5", "prompt_id": prompt_id})
        conn.sendall(server_frame(9, b"are you there"))                   # ping: the client must answer pong
        for step in range(1, self.steps + 1):
            message = json.dumps({"type": "progress", "data": {"value": step, "max": self.steps, "node": "5",
                                                               "prompt_id": prompt_id}}).encode()
            if step == 1:                                                  # one message in two fragments
                conn.sendall(server_frame(1, message[:10], fin=False) + server_frame(0, message[10:]))
            else:
                conn.sendall(server_frame(1, message))
            conn.sendall(server_frame(2, struct.pack(">II", 1, 1) + b"jpeg"))  # binary preview frame
        if self.fail:
            send("execution_error", {"prompt_id": prompt_id, "node_id": "5", "node_type": "Flux2KleinDenoise",
                                     "exception_type": "custom_nodes.some-pack.errors.PackError", "exception_message": "boom"})
            return
        padding = "x" * 300                                                # a 16-bit length frame
        send("executed", {"node": "6", "output": {"images": [], "pad": padding}, "prompt_id": prompt_id})
        send("execution_success", {"prompt_id": prompt_id})
        send("executing", {"node": None, "prompt_id": prompt_id})


class Handler(BaseHTTPRequestHandler):
    timeout = 10

    def log_message(self, *args):
        pass

    def reply(self, code, body, kind="application/json"):
        raw = json.dumps(body).encode() if kind == "application/json" else body
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def answer_client_frames(self):
        """Read what the client sends on the websocket: pongs are kept, a close is answered (as servers do)."""
        while True:
            try:
                opcode, payload = read_client_frame(self.connection)
            except (OSError, ValueError):                   # closed, or timed out at the end of a test
                return
            if opcode == OP_PONG:
                self.server.pongs.append((opcode, payload))
            elif opcode == OP_CLOSE:
                self.connection.sendall(server_frame(OP_CLOSE, payload[:2]))
                return

    def do_GET(self):
        url = urllib.parse.urlparse(self.path)
        query = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
        if url.path == "/ws":
            accept = base64.b64encode(hashlib.sha1((self.headers["Sec-WebSocket-Key"] + WS_GUID)
                                                   .encode()).digest()).decode()
            # Register before answering: once the client reads the 101 it may POST at once, and the POST handler
            # pushes to this socket.
            self.server.ws[query["clientId"]] = self.connection
            self.wfile.write(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                              f"Sec-WebSocket-Accept: {accept}\r\n\r\n").encode())
            self.wfile.flush()
            self.answer_client_frames()
            self.close_connection = True
        elif url.path.startswith("/history/"):
            pid = url.path.rsplit("/", 1)[1]
            self.reply(200, {pid: {"outputs": {"6": {"images": self.server.images}},
                                   "status": {"status_str": "success"}}})
        elif url.path == "/view":
            self.server.views.append(query)
            self.reply(200, png_bytes(query["filename"] + query["subfolder"]), "image/png")
        else:
            self.reply(404, {"error": "not found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/prompt":
            if "bad" in json.dumps(body["prompt"]):             # ComfyUI's answer to an input it cannot convert
                return self.reply(400, {
                    "error": {"type": "prompt_outputs_failed_validation", "message": "Prompt outputs failed validation",
                              "details": "", "extra_info": {}},
                    "node_errors": {"5": {"errors": [{
                        "type": "invalid_input_type", "message": "Failed to convert an input value to a FLOAT value",
                        "details": "cfg, bad, could not convert string to float: 'bad'", "extra_info": {}}],
                        "dependent_outputs": ["6"], "class_type": "Flux2KleinDenoise"}}})
            self.server.prompts.append(body)
            prompt_id = f"p-{len(self.server.prompts)}"
            self.reply(200, {"prompt_id": prompt_id, "number": 0, "node_errors": {}})
            self.server.push(body["client_id"], prompt_id)
        else:
            self.reply(404, {"error": "not found"})


@pytest.fixture
def fake():
    servers = []

    def start(**kw):
        server = FakeComfy(**kw)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return server
    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def address(server):
    return f"127.0.0.1:{server.server_address[1]}"


def test_queue_submits_follows_progress_and_downloads(fake, tmp_path, capsys):
    server = fake(steps=3)
    seen, previews = [], []
    client = queue_client.ComfyClient(address(server), timeout=10)
    ws = client.connect()
    prompt_id = client.submit(WORKFLOW)
    client.follow(ws, prompt_id, seen.append, previews.append)
    ws.close()
    assert previews == [struct.pack(">II", 1, 1) + b"jpeg"] * 3
    paths = queue_client.queue(WORKFLOW, address(server), str(tmp_path), timeout=10, on_message=None)

    assert server.prompts[0]["prompt"] == WORKFLOW
    assert [m["type"] for m in seen] == ["execution_start", "executing", "progress", "progress", "progress",
                                         "executed", "execution_success", "executing"]
    assert [m["data"]["value"] for m in seen if m["type"] == "progress"] == [1, 2, 3]
    assert seen[-3]["data"]["output"]["pad"] == "x" * 300
    assert server.pongs == [(OP_PONG, b"are you there")] * 2   # masked pongs echoing the ping payload
    assert [Path(p).name for p in paths] == ["klein_00001_.png", "klein_00002_.png"]
    assert Path(paths[1]).read_bytes() == png_bytes("klein_00002_.pngsub")
    assert server.views[1] == {"filename": "klein_00002_.png", "subfolder": "sub", "type": "output"}


def test_main_applies_overrides_and_prints_steps(fake, tmp_path, capsys):
    server = fake(steps=2)
    api = tmp_path / "wf.api.json"
    api.write_text(json.dumps(WORKFLOW))
    code = queue_command.main([str(api), "--server", address(server), "--out", str(tmp_path / "out"),
                              "--prompt", "a red fox", "--seed", "42", "--set", "5.cfg=2.5", "--set", "6.filename_prefix=fox"])
    out = capsys.readouterr().out
    assert code == 0
    sent = server.prompts[0]["prompt"]
    assert sent["1"]["inputs"]["text"] == "a red fox"          # the prompt feeding `positive` ...
    assert sent["2"]["inputs"]["text"] == "blurry"             # ... not the negative one
    assert sent["3"]["inputs"]["seed"] == 42
    assert sent["5"]["inputs"]["cfg"] == 2.5 and sent["6"]["inputs"]["filename_prefix"] == "fox"
    assert "step 1/2" in out and "step 2/2" in out
    assert (tmp_path / "out" / "klein_00001_.png").exists()


def test_execution_error_is_reported(fake, tmp_path):
    server = fake(steps=1, fail=True)
    with pytest.raises(Flux2Error, match=r"node 5 \(Flux2KleinDenoise\) failed: PackError: boom"):
        queue_client.queue(WORKFLOW, address(server), str(tmp_path), timeout=10, on_message=None)


def test_validation_failure_shows_server_answer(fake, tmp_path, capsys):
    server = fake()
    api = tmp_path / "wf.api.json"
    api.write_text(json.dumps(WORKFLOW))
    assert queue_command.main([str(api), "--server", address(server), "--set", "5.cfg=bad"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: ComfyUI at {address(server)}: refused the workflow (HTTP 400): Prompt outputs "
                          "failed validation\n  node 5 (Flux2KleinDenoise): Failed to convert an input value to a FLOAT "
                          "value: cfg, bad, could not convert string to float: 'bad'\nFix those inputs"), err
    assert "Traceback" not in err
    assert server.prompts == []


def test_images_never_replace_a_file_and_names_are_unique_within_a_run(fake, tmp_path, capsys):
    """Two images of one name (different subfolders on the server) and an older file of that name in --out: the
    older file keeps its bytes, the new ones get -1 and -2, and stdout lists exactly the files written."""
    same = [{"filename": "klein_00001_.png", "subfolder": "a", "type": "output"},
            {"filename": "klein_00001_.png", "subfolder": "b", "type": "output"}]
    server = fake(steps=1, images=same)
    out = tmp_path / "out"
    out.mkdir()
    (out / "klein_00001_.png").write_bytes(b"an older picture")
    api = tmp_path / "wf.api.json"
    api.write_text(json.dumps(WORKFLOW))
    assert queue_command.main([str(api), "--server", address(server), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    written = [line for line in captured.out.splitlines() if line.endswith(".png")]
    assert written == [str(out / "klein_00001_-1.png"), str(out / "klein_00001_-2.png")]
    assert (out / "klein_00001_.png").read_bytes() == b"an older picture"
    assert (out / "klein_00001_-1.png").read_bytes() == png_bytes("klein_00001_.pnga")
    assert (out / "klein_00001_-2.png").read_bytes() == png_bytes("klein_00001_.pngb")
    assert sorted(p.name for p in out.iterdir()) == ["klein_00001_-1.png", "klein_00001_-2.png", "klein_00001_.png"]
    assert "klein_00001_.png exists; wrote klein_00001_-1.png beside it" in captured.err
    assert f"2 image(s) saved in {out}" in captured.err


@pytest.mark.parametrize("make_out, says", [
    (lambda tmp: (tmp / "taken").write_text("x") and tmp / "taken", "is a file, not a folder"),
    (lambda tmp: (tmp / "taken").write_text("x") and tmp / "taken" / "sub", "taken is a file"),
])
def test_a_bad_out_folder_is_refused_before_anything_is_queued(fake, tmp_path, capsys, make_out, says):
    server = fake()
    api = tmp_path / "wf.api.json"
    api.write_text(json.dumps(WORKFLOW))
    out = make_out(tmp_path)
    assert queue_command.main([str(api), "--server", address(server), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {out}") and says in err, err
    assert server.prompts == []                                   # nothing was queued on the server


def test_overrides_without_server():
    assert queue_client.prompt_nodes(WORKFLOW) == ["1"]
    only = {k: v for k, v in WORKFLOW.items() if k != "5"}       # no `positive` link: every prompt-encode node
    assert queue_client.prompt_nodes(only) == ["1", "2"]
    edited = queue_client.apply_overrides(WORKFLOW, ["4.name=other.safetensors", "3.width=[1,2]"], seed=3)
    assert edited["4"]["inputs"]["name"] == "other.safetensors" and edited["3"]["inputs"]["width"] == [1, 2]
    assert WORKFLOW["3"]["inputs"]["seed"] == 1                   # the input is not modified
    with pytest.raises(Flux2Error, match="no node '9'"):
        queue_client.apply_overrides(WORKFLOW, ["9.x=1"])
    with pytest.raises(Flux2Error, match="NODE.INPUT=VALUE"):
        queue_client.apply_overrides(WORKFLOW, ["5cfg=1"])
    with pytest.raises(Flux2Error, match="prompt-encode"):
        queue_client.apply_overrides({"6": WORKFLOW["6"]}, text="x")


@pytest.mark.parametrize("content, says", [
    (json.dumps({"version": 0.4, "nodes": [], "links": []}), "not an API-format workflow"),
    ("{}", "not an API-format workflow"),
    (json.dumps({"1": {"class_type": "SaveImage"}}), "not an API-format workflow"),        # no inputs
    (json.dumps({"1": {"class_type": 7, "inputs": {}}}), "not an API-format workflow"),
    (json.dumps([1, 2]), "not an API-format workflow"),
    ("{not json", "is not a JSON file"),
    (b"\xff\xfe\x00binary", "is not a JSON file"),
    ("[" * 100_000, "is not a JSON file"),                                          # nested past the recursion limit
])
def test_bad_workflow_files_are_refused_with_the_reason(tmp_path, content, says):
    path = tmp_path / "wf.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(Flux2Error, match=says):
        queue_client.load_workflow(str(path))
    with pytest.raises(Flux2Error, match="cannot read workflow .*: No such file"):
        queue_client.load_workflow(str(tmp_path / "missing.json"))


@pytest.mark.parametrize("server, base", [("127.0.0.1:8188", "http://127.0.0.1:8188"),
                                          ("http://localhost:8188/", "http://localhost:8188"),
                                          ("https://comfy.example.org:443", "https://comfy.example.org:443"),
                                          ("[::1]:8188", "http://[::1]:8188")])
def test_server_addresses(server, base):
    assert queue_client.parse_server(server)[0] == base


@pytest.mark.parametrize("server", ["localhost", "127.0.0.1:", "127.0.0.1:http", "127.0.0.1:99999", "host:0",
                                    "ftp://host:21", "host:8188/api", "user:pw@host:8188", "a b:8188", "",
                                    "host:8188?x=1"])
def test_bad_server_addresses_say_how_to_write_one(server):
    with pytest.raises(Flux2Error, match="is not HOST:PORT; use e.g. 127.0.0.1:8188"):
        queue_client.ComfyClient(server)


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf")])
def test_bad_timeouts_are_refused(timeout):
    with pytest.raises(Flux2Error, match="--timeout"):
        queue_client.ComfyClient("127.0.0.1:8188", timeout=timeout)


def test_unreachable_server_says_what_to_check(tmp_path, capsys):
    with socket.socket() as s:                                  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    api = tmp_path / "wf.api.json"
    api.write_text(json.dumps(WORKFLOW))
    assert queue_command.main([str(api), "--server", f"127.0.0.1:{port}", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: ComfyUI at 127.0.0.1:{port}: opening the websocket /ws: cannot connect "
                          "(connection refused). Is ComfyUI running?"), err
    assert "--listen" in err and "Traceback" not in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()                     # nothing made for a run that never started


def test_a_server_that_never_answers_times_out_with_the_fix(tmp_path):
    with socket.socket() as listener:                           # accepts connections (the kernel does), never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        server = f"127.0.0.1:{listener.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(queue_client.ServerError) as error:
            queue_client.queue(WORKFLOW, server, str(tmp_path), timeout=0.5, on_message=None)
    assert time.monotonic() - started < 5
    assert str(error.value) == (f"ComfyUI at {server}: opening the websocket /ws: no answer within 0.5 s; is "
                                "ComfyUI busy or stuck? --timeout SECONDS waits longer")


def test_ctrl_c_says_where_a_queued_prompt_goes(monkeypatch, tmp_path, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(queue_client, "queue", interrupted)
    api = tmp_path / "wf.api.json"
    api.write_text(json.dumps(WORKFLOW))
    assert queue_command.main([str(api)]) == 130
    assert capsys.readouterr().err == ("interrupted: a prompt already queued keeps running in ComfyUI (its images go "
                                       "to ComfyUI's output folder); cancel it in ComfyUI's queue if you do not want "
                                       "it\n")


def test_a_connection_nobody_answers_times_out_with_the_fix(tmp_path):
    with socket.socket() as listener:             # a full accept queue: the kernel drops further connection attempts
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        server = f"127.0.0.1:{listener.getsockname()[1]}"
        waiting = [socket.socket() for _ in range(3)]
        for s in waiting:
            s.setblocking(False)
            s.connect_ex(listener.getsockname())
        time.sleep(0.2)
        try:
            with pytest.raises(queue_client.ServerError) as error:
                queue_client.queue(WORKFLOW, server, str(tmp_path), timeout=0.5, on_message=None)
        finally:
            for s in waiting:
                s.close()
    assert str(error.value).startswith(f"ComfyUI at {server}: opening the websocket /ws: cannot connect (no answer "
                                       "within 0.5 s). Is ComfyUI running?")


def test_a_prompt_queued_with_node_errors_says_which_outputs_are_left_out(capsys):
    """ComfyUI queues a workflow whose other outputs are valid and lists the invalid ones in node_errors (HTTP 200):
    the client goes on with the prompt id and says which nodes were left out and why."""
    from flux2_core.app.queue_client import parse_submit

    answer = {"prompt_id": "abc", "number": 1, "node_errors": {"9": {"class_type": "SaveImage", "errors": [
        {"message": "Required input is missing", "details": "images"}]}}}
    assert parse_submit("127.0.0.1:8188", json.dumps(answer).encode()) == "abc"
    err = capsys.readouterr().err
    assert "queued the workflow without some of its outputs" in err
    assert "node 9 (SaveImage): Required input is missing: images" in err
    assert parse_submit("127.0.0.1:8188", json.dumps({**answer, "node_errors": {}}).encode()) == "abc"
    assert capsys.readouterr().err == ""
