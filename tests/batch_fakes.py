"""A fake ComfyUI for the batch tests: several prompts at once, uploads, a queue, and ways to misbehave.

Each server runs aiohttp on a thread and event loop of its own (as test_queue_protocol's Scripted does) and speaks
what ComfyUI v0.12.1 speaks for a batch: GET /prompt {"exec_info": {"queue_remaining"}}, POST /upload/image
(multipart; overwrite off: a file of the same name and bytes is kept once, other bytes get "name (1).png"), POST
/prompt, the websocket's status / executing / progress messages for the client id that queued the prompt, GET
/history/<id> and GET /view. Its PNGs carry the prompt they were made for as the "prompt" text, as SaveImage writes
it, and their colour comes from the prompt's seed and text, so a test can tell whose image a file is.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import threading
import time

from aiohttp import web
from PIL import Image, PngImagePlugin


def picture_for(prompt: dict, index: int = 0) -> bytes:
    """The PNG a fake server saves for `prompt`: a colour from its seeds and texts, the prompt as its text."""
    digest = hashlib.sha256(json.dumps(prompt, sort_keys=True).encode() + bytes([index])).digest()
    info = PngImagePlugin.PngInfo()
    info.add_text("prompt", json.dumps(prompt))
    out = io.BytesIO()
    Image.new("RGB", (8, 8), tuple(digest[:3])).save(out, "PNG", pnginfo=info)
    return out.getvalue()


class FakeServer:
    """Knobs (attributes, changed by a test at any time): images (per prompt), steps, fail_seeds (seeds whose
    prompt ends in an execution error), upload_answer ((status, body) instead of the real answer), hang_after
    (the prompt after whose answer it stops answering anything, see hang), hang_seeds (seeds whose prompt makes it
    stop answering so: a job that brings its server down), hung (it did), swap (history of prompt n lists prompt n-1's images),
    queue_remaining (other clients' prompts: GET /prompt and the status messages count them besides the prompts
    queued here and not ended, as ComfyUI's queue_remaining does), delay (seconds a
    prompt runs), cut_view (a name ending: its download is cut short)."""

    def __init__(self, images: int = 1, steps: int = 2):
        self.images, self.steps = images, steps
        self.fail_seeds: set[int] = set()
        self.upload_answer = None
        self.hang_after: int | None = None
        self.hang_seeds: set[int] = set()
        self.hung = False
        self.swap = False
        self.queue_remaining = 0
        self.delay = 0.0
        self.cut_view: str | None = None         # a /view of a file whose name ends so: half the PNG is sent
        self.prompts: list[dict] = []            # every prompt queued, in order
        self.pending = 0                         # prompts queued and not ended (a hung one never ends)
        self.most_pending = 0                    # the most that were at once
        self.upload_delay = 0.0                  # seconds an upload takes
        self.most_uploads = 0                    # the most uploads under way at once
        self._uploading = 0
        self.uploads: list[str] = []             # every file name sent to /upload/image
        self.inputs: dict[str, bytes] = {}       # the input folder
        self.outputs: dict[str, bytes] = {}      # the output folder
        self.history: dict[str, dict] = {}
        self.sockets: dict[str, web.WebSocketResponse] = {}
        self.loop = asyncio.new_event_loop()
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)   # stop() is a kill: no long grace
        self.loop.run_until_complete(self.runner.setup())
        self.site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(self.site.start())
        self.port = self.runner.addresses[0][1]
        self.address = f"127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop answering: the listening socket and every connection closed (as a killed server)."""
        if self.loop.is_closed() or not self.thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def hang(self) -> None:
        """Stop answering anything (HTTP, websocket pings) without closing a connection: its event loop stops
        (as in a process that is stuck or suspended); the kernel still accepts connections."""
        self.loop.call_soon_threadsafe(time.sleep, 3600)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/ws":
            return await self.websocket(request)
        if request.path == "/prompt" and request.method == "GET":
            return web.json_response({"exec_info": {"queue_remaining": self.queue_remaining + self.pending}})
        if request.path == "/upload/image":
            return await self.upload(request)
        if request.path == "/prompt":
            return await self.queue_prompt(request)
        if request.path.startswith("/history/"):
            pid = request.path.rsplit("/", 1)[1]
            return web.json_response({pid: self.history[pid]} if pid in self.history else {})
        if request.path == "/view":
            name = request.query.get("filename", "")
            if self.cut_view and name.endswith(self.cut_view) and name in self.outputs:
                return web.Response(body=self.outputs[name][:40], content_type="image/png")
            if name not in self.outputs:
                return web.Response(status=404, text="404: Not Found")
            return web.Response(body=self.outputs[name], content_type="image/png")
        return web.Response(status=404, text="not found")

    async def upload(self, request: web.Request) -> web.Response:
        form = await request.post()
        image = form.get("image")
        self.uploads.append(image.filename)
        self._uploading += 1
        self.most_uploads = max(self.most_uploads, self._uploading)
        try:
            await asyncio.sleep(self.upload_delay)
        finally:
            self._uploading -= 1
        if self.upload_answer is not None:
            status, body = self.upload_answer
            return web.Response(status=status, body=body)
        data = image.file.read()
        name, n = image.filename, 0
        stem, _, suffix = name.rpartition(".")
        while name in self.inputs and self.inputs[name] != data:     # ComfyUI: a duplicate by bytes is kept once
            n += 1
            name = f"{stem} ({n}).{suffix}"
        self.inputs[name] = data
        return web.json_response({"name": name, "subfolder": "", "type": "input"})

    async def queue_prompt(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.prompts.append(body["prompt"])
        self.pending += 1
        self.most_pending = max(self.most_pending, self.pending)
        prompt_id = f"p-{len(self.prompts)}"
        seeds = [node["inputs"].get("seed") for node in body["prompt"].values()]
        if (self.hang_after is not None and len(self.prompts) >= self.hang_after
                or any(seed in self.hang_seeds for seed in seeds)):
            self.hung = True
            self.loop.call_later(0.05, time.sleep, 3600)               # answers this, then nothing more
        else:
            asyncio.ensure_future(self.run(body["client_id"], prompt_id, body["prompt"], len(self.prompts)))
        return web.json_response({"prompt_id": prompt_id, "number": len(self.prompts), "node_errors": {}})

    async def run(self, client_id: str, prompt_id: str, prompt: dict, number: int) -> None:
        try:
            await self._run(client_id, prompt_id, prompt, number)
        finally:
            self.pending -= 1

    async def _run(self, client_id: str, prompt_id: str, prompt: dict, number: int) -> None:
        ws = self.sockets.get(client_id)

        async def send(kind, **data):
            if ws is not None and not ws.closed:
                await ws.send_str(json.dumps({"type": kind, "data": data}))
        await send("status", status={"exec_info": {"queue_remaining": self.queue_remaining + self.pending}},
                   sid=client_id)
        await send("execution_start", prompt_id=prompt_id)
        await send("executing", node="7", display_node="7", prompt_id=prompt_id)
        for step in range(1, self.steps + 1):
            await asyncio.sleep(self.delay / max(self.steps, 1))
            await send("progress", value=step, max=self.steps, node="7", prompt_id=prompt_id)
        seeds = [node["inputs"].get("seed") for node in prompt.values()]
        if any(seed in self.fail_seeds for seed in seeds):
            await send("execution_error", prompt_id=prompt_id, node_id="7", node_type="Flux2KleinDenoise",
                       exception_type="RuntimeError", exception_message="boom")
            return
        # As ComfyUI 0.12.1, it saves the prompt with its cache check of each Load Image added to the node
        saved = {nid: {**node, "is_changed": ["0" * 64]} if node["class_type"] == "LoadImage" else node
                 for nid, node in prompt.items()}
        images = []
        for i in range(self.images):
            name = f"flux2-klein_{number:05d}_{i}.png"
            self.outputs[name] = picture_for(saved, i)
            images.append({"filename": name, "subfolder": "", "type": "output"})
        if self.swap and number > 1:
            images = self.history[f"p-{number - 1}"]["outputs"]["9"]["images"]
        self.history[prompt_id] = {"outputs": {"9": {"images": images}}, "status": {"status_str": "success"}}
        await send("executing", node=None, prompt_id=prompt_id)

    async def websocket(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        client_id = request.query.get("clientId", "")
        self.sockets[client_id] = ws
        await ws.send_str(json.dumps({"type": "status", "data": {
            "status": {"exec_info": {"queue_remaining": self.queue_remaining + self.pending}}, "sid": client_id}}))
        async for _ in ws:                       # aiohttp answers the client's pings as it reads
            pass
        return ws
