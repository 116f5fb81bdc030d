"""Headless ComfyUI client: queue an API-format workflow, follow its progress, download its images.

    python -m flux2_core queue workflows/api/flux2-klein-text-to-image.json --server 127.0.0.1:8188 \\
        --prompt "a red fox in the snow" --seed 7 --set 12.steps=8 --out output/

Standard library only (HTTP through urllib, a small websocket client on a socket). Nothing here imports ComfyUI
or torch. The protocol, as ComfyUI serves it:
    POST /prompt {"prompt", "client_id"}      -> {"prompt_id", "number", "node_errors"}
    ws /ws?clientId=X                         -> JSON messages: progress, executing, execution_error, ...
    GET /history/<prompt_id>                  -> {prompt_id: {"outputs": {node: {"images": [...]}}, "status": ...}}
    GET /view?filename=&subfolder=&type=      -> the image bytes
"""

from __future__ import annotations

import argparse
import base64
import copy
import hashlib
import json
import os
import socket
import struct
import sys
import urllib.error
import urllib.parse
import urllib.request
import uuid

from .errors import Flux2Error

OUR_PREFIX = "Flux2Klein"          # every node id of this pack starts with this
TEXT_INPUTS = ("text", "prompt")   # the prompt-encode node's string input
SEED_INPUTS = ("seed", "noise_seed")


# ---------------------------------------------------------------------------------------------------------------------
# A minimal websocket client (RFC 6455): handshake, unmasked server frames in, masked client frames out.

WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA


class WebSocket:
    def __init__(self, host: str, port: int, path: str, timeout: float = 30.0):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        request = (f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                   f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
        self.sock.sendall(request.encode())
        head = self._read_until(b"\r\n\r\n").decode("latin-1")
        status, *header_lines = head.split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines if h)}
        expected = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
        if " 101 " not in status + " " or headers.get("sec-websocket-accept") != expected:
            self.sock.close()
            raise ConnectionError(f"websocket handshake with {host}:{port}{path} failed: {status!r}")

    def _read_until(self, marker: bytes) -> bytes:
        data = b""
        while not data.endswith(marker):
            byte = self.sock.recv(1)
            if not byte:
                raise ConnectionError("connection closed during the websocket handshake")
            data += byte
        return data

    def _read_exact(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("websocket closed by the server")
            data += chunk
        return data

    def _read_frame(self) -> tuple[bool, int, bytes]:
        b0, b1 = self._read_exact(2)
        fin, opcode, masked, length = bool(b0 & 0x80), b0 & 0x0F, bool(b1 & 0x80), b1 & 0x7F
        if length == 126:
            (length,) = struct.unpack(">H", self._read_exact(2))
        elif length == 127:
            (length,) = struct.unpack(">Q", self._read_exact(8))
        mask = self._read_exact(4) if masked else None
        payload = self._read_exact(length)
        if mask:
            payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        return fin, opcode, payload

    def send(self, opcode: int, payload: bytes = b"") -> None:
        mask = os.urandom(4)
        n = len(payload)
        head = bytes([0x80 | opcode])
        if n < 126:
            head += bytes([0x80 | n])
        elif n < 1 << 16:
            head += bytes([0x80 | 126]) + struct.pack(">H", n)
        else:
            head += bytes([0x80 | 127]) + struct.pack(">Q", n)
        self.sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def recv(self) -> str | bytes | None:
        """The next message: str (text), bytes (binary) or None once the server closed the connection."""
        message, kind = b"", None
        while True:
            fin, opcode, payload = self._read_frame()
            if opcode == OP_PING:
                self.send(OP_PONG, payload)
                continue
            if opcode == OP_PONG:
                continue
            if opcode == OP_CLOSE:
                return None
            kind = opcode if opcode != OP_CONT else kind
            message += payload
            if fin:
                return message.decode("utf-8") if kind == OP_TEXT else message

    def close(self) -> None:
        try:
            self.send(OP_CLOSE, struct.pack(">H", 1000))
        except OSError:
            pass
        self.sock.close()


# ---------------------------------------------------------------------------------------------------------------------
# The ComfyUI HTTP API.

class ComfyClient:
    def __init__(self, server: str, timeout: float = 600.0):
        host, _, port = server.removeprefix("http://").rstrip("/").rpartition(":")
        if not host or not port.isdigit():
            raise Flux2Error(f"--server {server!r} is not HOST:PORT; use e.g. 127.0.0.1:8188")
        self.host, self.port, self.timeout = host, int(port), timeout
        self.client_id = uuid.uuid4().hex

    def url(self, path: str) -> str:
        return f"http://{self.host}:{self.port}{path}"

    def request(self, path: str, body: dict | None = None) -> bytes:
        """GET path, or POST body as JSON. HTTP errors become Flux2Error carrying the server's answer."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url(path), data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as response:
                return response.read()
        except urllib.error.HTTPError as e:
            raise Flux2Error(f"{path} answered {e.code}: {e.read().decode('utf-8', 'replace')[:2000]}") from None
        except urllib.error.URLError as e:
            raise Flux2Error(f"cannot reach ComfyUI at {self.host}:{self.port} ({e.reason}); "
                             "is the server running, and is --server right?") from None

    def get_json(self, path: str):
        return json.loads(self.request(path))

    def post_json(self, path: str, body: dict):
        raw = self.request(path, body)
        return json.loads(raw) if raw.strip() else None

    def connect(self) -> WebSocket:
        return WebSocket(self.host, self.port, f"/ws?clientId={self.client_id}", timeout=self.timeout)

    def submit(self, prompt: dict, extra_data: dict | None = None) -> str:
        body = {"prompt": prompt, "client_id": self.client_id}
        if extra_data:
            body["extra_data"] = extra_data
        return self.post_json("/prompt", body)["prompt_id"]

    def follow(self, ws: WebSocket, prompt_id: str, on_message=None, on_preview=None) -> list[dict]:
        """Read websocket messages until the prompt finishes; returns its JSON messages in order.

        on_message(message) is called for each JSON message of this prompt, on_preview(frame) for each binary frame
        (a latent preview: 4-byte event type, 4-byte image format, image bytes). Raises Flux2Error on an execution
        error or an interrupt.
        """
        messages = []
        while True:
            raw = ws.recv()
            if raw is None:
                raise Flux2Error("the server closed the websocket before the prompt finished")
            if isinstance(raw, bytes):
                if on_preview:
                    on_preview(raw)
                continue
            message = json.loads(raw)
            data = message.get("data") or {}
            if data.get("prompt_id") != prompt_id:
                continue
            messages.append(message)
            if on_message:
                on_message(message)
            kind = message["type"]
            if kind == "execution_error":
                raise Flux2Error(f"node {data.get('node_id')} ({data.get('node_type')}) failed: "
                                 f"{data.get('exception_type')}: {data.get('exception_message')}")
            if kind == "execution_interrupted":
                raise Flux2Error(f"the prompt was interrupted at node {data.get('node_id')}")
            if kind == "executing" and data.get("node") is None:   # sent after the history entry is stored
                return messages

    def images(self, prompt_id: str) -> list[dict]:
        """The image records {filename, subfolder, type} of a finished prompt, in node order."""
        entry = self.get_json(f"/history/{prompt_id}").get(prompt_id)
        if entry is None:
            raise Flux2Error(f"prompt {prompt_id} is not in the server's history")
        outputs = entry.get("outputs", {})
        return [image for node in sorted(outputs, key=str) for image in outputs[node].get("images", [])]

    def download(self, image: dict) -> bytes:
        query = urllib.parse.urlencode({k: image.get(k, "") for k in ("filename", "subfolder", "type")})
        return self.request(f"/view?{query}")

    def interrupt(self) -> None:
        self.post_json("/interrupt", {})


# ---------------------------------------------------------------------------------------------------------------------
# Overrides on an API-format prompt.

def _linked(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)


def prompt_nodes(prompt: dict) -> list[str]:
    """Ids of our prompt-encode nodes that feed a `positive` input (else every one of them)."""
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
    except json.JSONDecodeError:
        return text


def apply_overrides(prompt: dict, sets=(), text: str | None = None, seed: int | None = None) -> dict:
    """A copy of the API prompt with --set NODE.INPUT=VALUE, --prompt and --seed applied."""
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


# ---------------------------------------------------------------------------------------------------------------------
# The command.

def load_workflow(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            workflow = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise Flux2Error(f"cannot read workflow {path}: {e}") from None
    if not isinstance(workflow, dict) or "nodes" in workflow or not all(
            isinstance(n, dict) and "class_type" in n for n in workflow.values()):
        raise Flux2Error(f"{path} is not an API-format workflow ({{id: {{class_type, inputs}}}}); "
                         "use its twin in workflows/api/, or export with 'Export (API)' in ComfyUI")
    return workflow


def print_progress(message: dict) -> None:
    data = message["data"]
    if message["type"] == "progress":
        print(f"  node {data['node']}: step {data['value']}/{data['max']}", flush=True)
    elif message["type"] == "executing" and data.get("node") is not None:
        print(f"running node {data['node']}", flush=True)


def queue(workflow: dict, server: str, out_dir: str, timeout: float = 600.0, on_message=print_progress) -> list[str]:
    """Submit, follow, download: returns the paths of the saved images."""
    client = ComfyClient(server, timeout=timeout)
    ws = client.connect()                 # connect first so no progress message is missed
    try:
        prompt_id = client.submit(workflow)
        client.follow(ws, prompt_id, on_message)
    finally:
        ws.close()
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for image in client.images(prompt_id):
        path = os.path.join(out_dir, os.path.basename(image["filename"]))
        with open(path, "wb") as f:
            f.write(client.download(image))
        paths.append(path)
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flux2_core queue",
                                     description="Queue an API-format workflow on a running ComfyUI server.")
    parser.add_argument("workflow", help="an API-format workflow, e.g. workflows/api/flux2-klein-text-to-image.json")
    parser.add_argument("--server", default="127.0.0.1:8188", help="HOST:PORT of ComfyUI (default 127.0.0.1:8188)")
    parser.add_argument("--set", action="append", default=[], metavar="NODE.INPUT=VALUE",
                        help="set one input of one node (repeatable); VALUE is JSON or a plain string")
    parser.add_argument("--prompt", help="prompt text for the FLUX.2 Klein prompt-encode node feeding `positive`")
    parser.add_argument("--seed", type=int, help="seed for every node with a seed input")
    parser.add_argument("--out", default="output", help="folder for the downloaded images (default output/)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for any server answer")
    args = parser.parse_args(argv)
    try:
        workflow = apply_overrides(load_workflow(args.workflow), args.set, args.prompt, args.seed)
        paths = queue(workflow, args.server, args.out, args.timeout)
    except (Flux2Error, ConnectionError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
