"""Real-ComfyUI integration tests: one ComfyUI server per session, with this pack linked in and tiny random weights.

    COMFYUI_DIR=/path/to/ComfyUI  COMFYUI_PYTHON=/path/to/comfy-venv/bin/python  scripts/test tests/comfyui

COMFYUI_DIR is a ComfyUI source tree (v0.12.1+); COMFYUI_PYTHON is the Python environment the server runs in
(default: the one running pytest). Without COMFYUI_DIR every test here is skipped. See docs/comfyui-testing.md.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from pathlib import Path

import pytest

from tests.comfyui.base_dir import build_base
from tests.comfyui.host import PACK_FOLDER, ComfyServer, Host, HostClient, write_torch_stubs

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
COMFYUI_DIR = os.environ.get("COMFYUI_DIR", "")
SKIP_REASON = "set COMFYUI_DIR to a ComfyUI source tree (v0.12.1+) to run the real-host tests"


def pytest_collection_modifyitems(config, items):
    reason = SKIP_REASON if not COMFYUI_DIR else (
        None if (Path(COMFYUI_DIR) / "main.py").is_file() else f"COMFYUI_DIR={COMFYUI_DIR} has no main.py; {SKIP_REASON}")
    for item in items:
        if HERE in Path(item.fspath).resolve().parents:
            item.add_marker(pytest.mark.comfyui)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def comfy(tmp_path_factory) -> Host:
    """A running ComfyUI with the pack in custom_nodes and tiny weights in its models folders."""
    base = tmp_path_factory.mktemp("comfy-base")
    files, images = build_base(base, ROOT)
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    stubs = write_torch_stubs(tmp_path_factory.mktemp("stubs"), python)
    server = ComfyServer(Path(COMFYUI_DIR), python, base, stubs)
    server.start()
    try:
        yield Host(server, HostClient(server.address, timeout=120), base, files, images)
    finally:
        server.stop()


def share_base(base: Path, shared: Path) -> None:
    """A base directory for one more server beside `shared`'s: the same models (linked) and input pictures
    (copied), the pack, settings; its own output, input and user folders, so servers never write each other's files."""
    base.mkdir(parents=True, exist_ok=True)
    (base / "models").symlink_to(shared / "models", target_is_directory=True)
    shutil.copytree(shared / "input", base / "input")
    (base / "custom_nodes").mkdir()
    (base / "custom_nodes" / PACK_FOLDER).symlink_to(ROOT, target_is_directory=True)
    for name in ("extra_model_paths.yaml", "user/default/comfy.settings.json"):
        (base / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shared / name, base / name)


@pytest.fixture(scope="module")
def more_comfy(comfy, tmp_path_factory):
    """start(n) -> n more running ComfyUI servers (host.ComfyServer) beside the session's `comfy`, on the same tiny
    models, each with a base directory of its own; they are stopped when the module's tests end."""
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    stubs = write_torch_stubs(tmp_path_factory.mktemp("more-stubs"), python)
    servers = []

    def start(n: int) -> list[ComfyServer]:
        new = []
        for _ in range(n):
            base = tmp_path_factory.mktemp("more-comfy-base")
            share_base(base, comfy.base)
            new.append(ComfyServer(Path(COMFYUI_DIR), python, base, stubs))
        servers.extend(new)
        errors = []
        threads = [threading.Thread(target=lambda s=s: errors.append(_started(s))) for s in new]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if any(errors):
            raise RuntimeError("\n".join(e for e in errors if e))
        return new
    try:
        yield start
    finally:
        for server in servers:
            server.stop()


def _started(server: ComfyServer) -> str:
    """Start a server; '' once it answers, else why not."""
    try:
        server.start()
    except RuntimeError as e:
        return str(e)
    return ""
