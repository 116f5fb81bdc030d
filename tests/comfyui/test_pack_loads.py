"""The pack in a real ComfyUI: it imports cleanly, every node is in /object_info, the web files and workflows are served."""

import re
from pathlib import Path

from tests.comfyui.host import PACK_FOLDER

ROOT = Path(__file__).resolve().parents[2]
CATEGORY = "Klein (FLUX.2, FLUX 3)"


NEWER_HOST_NODES = {"Flux2KleinLayoutFromBoxes": "PrimitiveBoundingBox"}        # ComfyUI's bounding boxes: v0.15.0 on


def expected_node_ids(info: dict) -> set[str]:
    """The node ids this host lists: all declared, less those taking an io type the host lacks (the marker: its
    own node of that type, absent from ``info``, its /object_info)."""
    return declared_node_ids() - {node for node, marker in NEWER_HOST_NODES.items() if marker not in info}


def declared_node_ids() -> set[str]:
    """Node ids as written in nodes/*.py (read from the source, independently of ComfyUI's registry)."""
    source = "".join(p.read_text() for p in sorted((ROOT / "nodes").glob("*.py")))
    return set(re.findall(r"""node_id\s*=\s*["']([^"']+)["']""", source))


def test_pack_imports_without_failure(comfy):
    log = comfy.server.log()
    assert "IMPORT FAILED" not in log, log[-6000:]
    assert f"Cannot import {comfy.base / 'custom_nodes' / PACK_FOLDER}" not in log
    assert re.search(rf"\d+\.\d+ seconds: .*custom_nodes/{re.escape(PACK_FOLDER)}$", log, re.MULTILINE), log[-3000:]


def test_every_node_is_registered_with_metadata(comfy):
    info = comfy.client.get_json("/object_info")
    ours = {name: node for name, node in info.items() if node["python_module"] == f"custom_nodes.{PACK_FOLDER}"}
    declared = declared_node_ids()
    assert declared, "no node_id found in nodes/*.py"
    assert set(ours) == expected_node_ids(info)       # nodes of a newer host's io type only where the host has it
    for name, node in ours.items():
        assert name.startswith("Flux2Klein")
        assert node["category"].split("/")[0] == CATEGORY, (name, node["category"])
        assert node["description"], f"{name} has no description"
        assert node["display_name"] and node["display_name"] != name
        for section in ("required", "optional"):
            for input_name, spec in node["input"].get(section, {}).items():
                options = spec[1] if len(spec) > 1 else {}
                assert options.get("tooltip"), f"{name}.{input_name} has no tooltip"


def test_web_extension_and_workflows_are_served(comfy):
    extensions = comfy.client.get_json("/extensions")
    assert f"/extensions/{PACK_FOLDER}/js/flux2_klein.js" in extensions
    assert f"/extensions/{PACK_FOLDER}/js/flux2_klein_tokens.js" in extensions
    served = comfy.client.request(f"/extensions/{PACK_FOLDER}/js/flux2_klein.js")
    assert served == (ROOT / "web" / "js" / "flux2_klein.js").read_bytes()
    templates = comfy.client.get_json("/workflow_templates").get(PACK_FOLDER, [])
    ui_files = sorted(p.stem for p in (ROOT / "workflows").glob("*.json"))
    assert ui_files and sorted(templates) == ui_files           # the UI files, and no API twin among them
