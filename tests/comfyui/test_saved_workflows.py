"""Workflows users saved with the last release still load: every node they name is one the server knows, with the
inputs they set. Display names change between releases; node ids and input names do not, and they are what a saved
workflow holds (UI files: each node's "type"; API files: "class_type" and the inputs by name).

The last release's workflows are read from the repository's history at RELEASED (git), as users downloaded them.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RELEASED = "55b1aac"          # the last release's commit: its workflows, before the nodes were named for both families
# widgets the frontend adds to a node by itself (a seed's "control after generate"), not inputs of the node
FRONTEND_WIDGETS = {"control_after_generate"}


def git(*args: str) -> str:
    run = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    assert run.returncode == 0, (f"git {' '.join(args)}: {run.stderr.strip()}; the saved-workflow check needs this "
                                 f"repository's history (a full clone, not a shallow one)")
    return run.stdout


def released(folder: str) -> dict[str, dict]:
    names = [n for n in git("ls-tree", "--name-only", f"{RELEASED}:{folder}").split() if n.endswith(".json")]
    return {name: json.loads(git("show", f"{RELEASED}:{folder}/{name}")) for name in names}


def ui_nodes(workflow: dict) -> list[dict]:
    """The nodes of a UI workflow and of the subgraphs it defines."""
    inner = [n for graph in workflow.get("definitions", {}).get("subgraphs", []) for n in graph["nodes"]]
    return workflow["nodes"] + inner


@pytest.fixture(scope="module")
def object_info(comfy) -> dict:
    return comfy.client.get_json("/object_info")


def test_the_last_release_had_workflows_of_both_kinds():
    assert len(released("workflows")) >= 10 and len(released("workflows/api")) == len(released("workflows"))


def test_every_node_of_a_saved_ui_workflow_is_known(object_info):
    for name, workflow in released("workflows").items():
        subgraphs = {g["id"] for g in workflow.get("definitions", {}).get("subgraphs", [])}
        for node in ui_nodes(workflow):
            if node["type"] in subgraphs or node["type"] in ("Note", "MarkdownNote", "Reroute", "PrimitiveNode"):
                continue                            # the frontend's own nodes and the file's subgraphs
            assert node["type"] in object_info, (name, node["type"])
            known = object_info[node["type"]]["input"]
            inputs = {**known.get("required", {}), **known.get("optional", {})}
            for slot in node.get("inputs", []):
                assert slot["name"] in inputs, (name, node["type"], slot["name"])


def test_every_input_of_a_saved_api_workflow_is_one_its_node_takes(object_info):
    for name, workflow in released("workflows/api").items():
        for node_id, node in workflow.items():
            assert node["class_type"] in object_info, (name, node_id, node["class_type"])
            known = object_info[node["class_type"]]["input"]
            inputs = {**known.get("required", {}), **known.get("optional", {})}
            required = set(known.get("required", {})) - FRONTEND_WIDGETS
            given = set(node["inputs"]) - FRONTEND_WIDGETS
            assert given <= set(inputs), (name, node_id, sorted(given - set(inputs)))
            assert required <= given, (name, node_id, sorted(required - given))
