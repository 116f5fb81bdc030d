"""A real ComfyUI server for integration tests: stubs, base directory, process, and a small client.

    stubs = write_torch_stubs(tmp / "stubs", python)
    server = ComfyServer(comfy_dir, python, base_dir, stubs)
    server.start()                       # waits for GET /system_stats
    client = HostClient(server.address)
    run = client.run(api_prompt)         # prompt_id, websocket messages, preview frames
    server.stop()

The server runs from a ComfyUI source tree (v0.12.1+) in its own Python environment; nothing here imports ComfyUI.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from flux2_core.app.queue_client import ComfyClient
from flux2_core.errors import Flux2Error

PACK_FOLDER = "flux2-klein-engine"       # the pack's folder name in custom_nodes (its registry id)
# a comfyui-frontend-package's static folder (the one holding index.html) for the server to serve instead of the
# frontend its requirements pin: the browser tests on the newest frontend
FRONT_END_VARIABLE = "COMFYUI_FRONT_END_ROOT"

# ComfyUI imports torchvision and torchaudio (and newer releases more of their submodules: torchvision.ops,
# torchaudio.functional, ...) at start-up; FLUX.2 and FLUX 3 need neither, and the only torchvision on PyPI for this
# torch may be a CUDA build that fails to import. A stub stands for the whole package: any submodule imports, any name
# in it is there (usable as a base class), calling one fails with a clear message, and the package has a version
# (libraries such as transformers parse it). The stubs exist only in a temp dir of the test run.
STUB = '''"""Test-only stub: {name} is not installed for this ComfyUI test server; FLUX.2 and FLUX 3 do not use it."""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stub"
__path__ = []                      # a package: its submodules come from the finder below


class Missing:
    """Stands for any name imported from the stub; using it (calling it) fails with a clear message."""

    def __init__(self, name):
        self.name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Missing(self.name + "." + attr)

    def __call__(self, *args, **kwargs):
        raise RuntimeError(self.name + " is a test stub: it is not installed here")

    def __mro_entries__(self, bases):
        return (object,)           # a class derived from a stubbed one still defines


def _missing(module):
    def attribute(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Missing(module + "." + attr)
    return attribute


__getattr__ = _missing("{name}")


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every {name}.<anything> import: a stub module like this one."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("{name}."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name, "test-only stub")
        module.__path__, module.__version__ = [], __version__
        module.__getattr__ = _missing(spec.name)
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_Submodules())
'''
# PyAV: ComfyUI's video input types import it at start-up; its wheel is too large to carry to a GPU machine for the
# native benchmark, and FLUX.2 reads no video
STUBBED = ("torchvision", "torchaudio", "av")


def write_torch_stubs(folder: Path, python: str) -> Path:
    """Stub packages under folder (for the server's PYTHONPATH) for those of STUBBED that do not import."""
    folder.mkdir(parents=True, exist_ok=True)
    for top in STUBBED:
        if subprocess.run([python, "-c", f"import {top}"], capture_output=True, check=False, timeout=120).returncode == 0:
            continue
        (folder / top).mkdir(parents=True, exist_ok=True)
        (folder / top / "__init__.py").write_text(STUB.format(name=top))
    return folder


@functools.cache
def host_flags(comfy_dir: Path, python: str) -> frozenset[str]:
    """The command-line flags this ComfyUI has (its main.py --help): releases add and drop some, and an unknown flag
    makes main.py exit."""
    run = subprocess.run([python, "main.py", "--help"], cwd=comfy_dir, capture_output=True, text=True, check=False,
                         timeout=300, env=dict(os.environ, PYTHONPATH=""))
    if run.returncode != 0:
        raise RuntimeError(f"{comfy_dir}/main.py --help exited with {run.returncode}:\n{run.stderr[-3000:]}")
    return frozenset(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", run.stdout))


def post_raw(comfy, path: str, body) -> tuple[int, dict]:
    """POST ``body`` (bytes, or an iterable of chunks: sent chunked, without a length) to the test server as it comes,
    past the client's own checks -> (HTTP status, JSON answer)."""
    request = urllib.request.Request(f"http://{comfy.server.address}{path}", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    """Resident memory of a process, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class ComfyServer:
    def __init__(self, comfy_dir: Path, python: str, base_dir: Path, stubs: Path, flags: frozenset[str] | None = None):
        self.comfy_dir, self.python, self.base_dir, self.stubs = Path(comfy_dir), python, Path(base_dir), stubs
        self.flags = flags if flags is not None else host_flags(self.comfy_dir, python)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = self.base_dir / "server.log"
        self.process = None

    def command(self) -> list[str]:
        paths = self.base_dir / "extra_model_paths.yaml"          # base_dir.EXTRA_PATHS, where build_base wrote it
        # assets: scanned at start unless turned off before v0.33's opt-in (--enable-assets), where the flag is gone
        optional = [flag for flag in ("--disable-assets-autoscan",) if flag in self.flags]
        frontend = os.environ.get(FRONT_END_VARIABLE, "")    # another frontend than the host's own (its static folder)
        if frontend:
            if not (Path(frontend) / "index.html").is_file():
                raise RuntimeError(f"{FRONT_END_VARIABLE}={frontend} holds no index.html: give the static folder of "
                                   f"an unpacked comfyui-frontend-package (comfyui_frontend_package/static)")
            optional += ["--front-end-root", frontend]
        return [self.python, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
                "--disable-auto-launch", "--disable-api-nodes", *optional,
                "--base-directory", str(self.base_dir),
                "--database-url", f"sqlite:///{self.base_dir / 'user' / 'comfyui.db'}",
                *(["--extra-model-paths-config", str(paths)] if paths.exists() else [])]

    def start(self, timeout: float = 180.0) -> None:
        env = dict(os.environ, PYTHONPATH=str(self.stubs), PYTHONUNBUFFERED="1")
        (self.base_dir / "user").mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command(), cwd=self.comfy_dir, env=env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        client = ComfyClient(self.address, timeout=5)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                client.get_json("/system_stats")
                return
            except (Flux2Error, OSError):
                time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"ComfyUI did not answer /system_stats within {timeout:.0f} s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def rss_mib(self) -> float:
        return rss_mib(self.process.pid)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=15)


@dataclass
class Run:
    prompt_id: str
    messages: list[dict]         # this prompt's JSON websocket messages, in order
    previews: list[bytes]        # binary preview frames received while it ran

    def of_type(self, kind: str) -> list[dict]:
        return [m["data"] for m in self.messages if m["type"] == kind]


class HostClient(ComfyClient):
    """queue_client's ComfyClient plus what the tests need: one call per prompt, history, images as bytes."""

    def run(self, prompt: dict, **extra_data) -> Run:
        """Submit a prompt and wait for it. Raises Flux2Error on an execution error or an interrupt."""
        ws = self.connect()
        try:
            previews = []
            prompt_id = self.submit(prompt, extra_data or None)
            return Run(prompt_id, self.follow(ws, prompt_id, on_preview=previews.append), previews)
        finally:
            ws.close()

    def run_interrupted(self, prompt: dict, step: int, node: str = "8", only_this: bool = False,
                        **extra_data) -> tuple[dict, list]:
        """Submit a prompt, send /interrupt once node ``node`` reports progress ``step`` or later (progress messages
        may skip a step; ``only_this``: the interrupt names this prompt, so another client's is never hit), and
        follow it to its end: (its final message, [(progress value, monotonic time)] of that node as they arrived)."""
        ws = self.connect()
        try:
            prompt_id, progress = self.submit(prompt, extra_data or None), []
            while True:
                raw = ws.recv()
                if isinstance(raw, bytes):
                    continue
                message = json.loads(raw)
                data = message["data"]
                if data.get("prompt_id") != prompt_id:
                    continue
                if message["type"] == "progress" and data["node"] == node:
                    progress.append((data["value"], time.monotonic()))
                    if data["value"] >= step and len([v for v, _ in progress if v >= step]) == 1:
                        if only_this:
                            self.post_json("/interrupt", {"prompt_id": prompt_id})
                        else:
                            self.interrupt()
                if message["type"] in ("execution_interrupted", "execution_success", "execution_error"):
                    return message, progress
        finally:
            ws.close()

    def history(self, prompt_id: str) -> dict:
        return self.get_json(f"/history/{prompt_id}")[prompt_id]

    def image_bytes(self, prompt_id: str) -> list[bytes]:
        return [self.download(image) for image in self.images(prompt_id)]


@dataclass
class Host:
    """What the session fixture yields: the running server, a client, its base directory and the tiny files."""

    server: ComfyServer
    client: HostClient
    base: Path
    files: dict[str, str]        # "transformer" / "transformer_base" / "text_encoder" / "ae" -> file name
    images: list[str]            # input images (names in base/input) for LoadImage nodes
