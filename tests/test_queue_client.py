"""The headless queue client against a tiny fake ComfyUI on loopback (HTTP + hand-written websocket frames).

The fake server speaks the protocol ComfyUI v0.12.1 speaks (see docs/comfyui-testing.md): it accepts a prompt,
pushes status / progress / executing messages over the websocket (one as two fragments, one with a 16-bit length,
a ping, a binary preview frame), and serves /history and /view. Everything runs on daemon threads with socket
timeouts, so a broken client fails the test instead of hanging it.
"""

import base64
import hashlib
import json
import struct
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from flux2_core import queue_client
from flux2_core.errors import Flux2Error

PNG = b"\x89PNG\r\n\x1a\n" + b"fake image bytes"
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

    def __init__(self, steps=3, fail=False):
        super().__init__(("127.0.0.1", 0), Handler)
        self.steps, self.fail = steps, fail
        self.prompts, self.pongs, self.views = [], [], []
        self.ws = {}                    # client_id -> socket
        self.done = threading.Event()

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
                                     "exception_type": "RuntimeError", "exception_message": "boom"})
            return
        padding = "x" * 300                                                # a 16-bit length frame
        send("executed", {"node": "6", "output": {"images": [], "pad": padding}, "prompt_id": prompt_id})
        send("execution_success", {"prompt_id": prompt_id})
        send("executing", {"node": None, "prompt_id": prompt_id})
        opcode, payload = read_client_frame(conn)
        self.pongs.append((opcode, payload))


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

    def do_GET(self):
        url = urllib.parse.urlparse(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        if url.path == "/ws":
            accept = base64.b64encode(hashlib.sha1((self.headers["Sec-WebSocket-Key"] + queue_client.WS_GUID)
                                                   .encode()).digest()).decode()
            # Register before answering: once the client reads the 101 it may POST at once, and the POST handler
            # pushes to this socket.
            self.server.ws[query["clientId"]] = self.connection
            self.wfile.write(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                              f"Sec-WebSocket-Accept: {accept}\r\n\r\n").encode())
            self.wfile.flush()
            self.server.done.wait(10)           # keep the connection open until the test ends
            self.close_connection = True
        elif url.path.startswith("/history/"):
            pid = url.path.rsplit("/", 1)[1]
            images = [{"filename": "klein_00001_.png", "subfolder": "", "type": "output"},
                      {"filename": "klein_00002_.png", "subfolder": "sub", "type": "output"}]
            self.reply(200, {pid: {"outputs": {"6": {"images": images}}, "status": {"status_str": "success"}}})
        elif url.path == "/view":
            self.server.views.append(query)
            self.reply(200, PNG + query["filename"].encode(), "image/png")
        else:
            self.reply(404, {"error": "not found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/prompt":
            if "bad" in json.dumps(body["prompt"]):
                return self.reply(400, {"error": {"type": "prompt_outputs_failed_validation"}, "node_errors": {}})
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
        server.done.set()
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
    assert server.pongs == [(queue_client.OP_PONG, b"are you there")] * 2   # masked pongs echoing the ping payload
    assert [Path(p).name for p in paths] == ["klein_00001_.png", "klein_00002_.png"]
    assert Path(paths[1]).read_bytes() == PNG + b"klein_00002_.png"
    assert server.views[1] == {"filename": "klein_00002_.png", "subfolder": "sub", "type": "output"}


def test_main_applies_overrides_and_prints_steps(fake, tmp_path, capsys):
    server = fake(steps=2)
    api = tmp_path / "wf.api.json"
    api.write_text(json.dumps(WORKFLOW))
    code = queue_client.main([str(api), "--server", address(server), "--out", str(tmp_path / "out"),
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
    with pytest.raises(Flux2Error, match="node 5 .*RuntimeError: boom"):
        queue_client.queue(WORKFLOW, address(server), str(tmp_path), timeout=10, on_message=None)


def test_validation_failure_shows_server_answer(fake, tmp_path, capsys):
    server = fake()
    api = tmp_path / "wf.api.json"
    api.write_text(json.dumps(WORKFLOW))
    assert queue_client.main([str(api), "--server", address(server), "--set", "5.cfg=bad"]) == 1
    err = capsys.readouterr().err
    assert "/prompt answered 400" in err and "prompt_outputs_failed_validation" in err
    assert server.prompts == []


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


def test_rejects_ui_workflows_and_bad_servers(tmp_path):
    ui = tmp_path / "ui.json"
    ui.write_text(json.dumps({"version": 0.4, "nodes": [], "links": []}))
    with pytest.raises(Flux2Error, match="not an API-format workflow"):
        queue_client.load_workflow(str(ui))
    with pytest.raises(Flux2Error, match="HOST:PORT"):
        queue_client.ComfyClient("localhost")


def test_unreachable_server_says_so(tmp_path):
    with pytest.raises(Flux2Error, match="cannot reach ComfyUI"):
        queue_client.ComfyClient("127.0.0.1:9", timeout=2).get_json("/system_stats")
