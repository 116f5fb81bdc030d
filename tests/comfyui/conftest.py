"""Real-ComfyUI integration tests: one ComfyUI server per session, with this pack linked in and tiny random weights.

    COMFYUI_DIR=/path/to/ComfyUI  COMFYUI_PYTHON=/path/to/comfy-venv/bin/python  scripts/test tests/comfyui

COMFYUI_DIR is a ComfyUI source tree (v0.12.1+); COMFYUI_PYTHON is the Python environment the server runs in
(default: the one running pytest). Without COMFYUI_DIR every test here is skipped. See docs/comfyui-testing.md.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.comfyui.base_dir import build_base
from tests.comfyui.host import ComfyServer, Host, HostClient, write_torch_stubs

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
