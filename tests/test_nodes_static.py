"""Checks of the ComfyUI pack that need no ComfyUI: what the registry validator runs, the pack entry point, the node
schemas (read from the source), and the workflow files against those schemas.

The nodes themselves import ComfyUI, so their schemas are read with ``ast``; the real-server tests in
tests/comfyui/ check the same things against a running ComfyUI.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMFY_MODULES = {"comfy", "comfy_api", "comfy_extras", "comfy_execution", "folder_paths", "latent_preview", "nodes",
                 "server", "execution", "node_helpers"}
HOST_ONLY = COMFY_MODULES - {"comfy_api"}          # model management, folders, previews, model internals:
HOSTS = {"host.py", "engine_model.py"}             # these two modules only
CORE_NODES = {"LoadImage", "SaveImage", "SetLatentNoiseMask", "ImagePadForOutpaint", "KSampler",   # ComfyUI nodes
              "EmptyFlux2LatentImage", "ConditioningZeroOut"}                                   # our workflows use
VIRTUAL_NODES = {"MarkdownNote", "Note"}           # frontend-only nodes (not in the API format)
CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}
LOADER_FOLDERS = {"model_name": "diffusion_models", "text_encoder_name": "text_encoders", "ae_name": "vae"}


def imported_modules(path: Path) -> set[str]:
    """Top-level names of the absolute imports in a file (relative imports are the pack's own)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_core_never_imports_comfyui():
    for path in sorted((ROOT / "flux2_core").rglob("*.py")):
        assert not imported_modules(path) & COMFY_MODULES, f"{path.name} imports ComfyUI"


def test_only_host_talks_to_comfyui_internals():
    for path in sorted((ROOT / "nodes").glob("*.py")):
        if path.name not in HOSTS:
            assert not imported_modules(path) & HOST_ONLY, f"nodes/{path.name} must go through nodes/host.py"


def test_entry_point_is_v3_only():
    """WEB_DIRECTORY, an async comfy_entrypoint, and no V1 mappings (ComfyUI would then register only those)."""
    spec = importlib.util.spec_from_file_location("pack_under_test", ROOT / "__init__.py",
                                                  submodule_search_locations=[str(ROOT)])
    pack = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pack)                      # importable without ComfyUI: nodes load inside the entry point
    assert pack.WEB_DIRECTORY == "./web"
    assert asyncio.iscoroutinefunction(pack.comfy_entrypoint)
    assert not hasattr(pack, "NODE_CLASS_MAPPINGS") and not hasattr(pack, "NODE_DISPLAY_NAME_MAPPINGS")


# --- node schemas, read from the source -----------------------------------------------------------------------------

def keyword(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def literal(node):
    if isinstance(node, ast.JoinedStr):      # f"{types.CATEGORY}/loaders": keep the literal parts
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return ast.literal_eval(node) if node is not None else None


def node_schemas() -> dict[str, dict]:
    """node id -> {category, description, inputs: {name: {optional, tooltip}}} from every io.Schema(...) call."""
    schemas = {}
    for path in sorted((ROOT / "nodes").glob("*.py")):
        for call in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "Schema"):
                continue
            inputs = {}
            for item in keyword(call, "inputs").elts:
                if isinstance(item, ast.Call) and getattr(item.func, "attr", None) == "Input":
                    inputs[literal(item.args[0])] = {"optional": literal(keyword(item, "optional")) or False,
                                                     "tooltip": keyword(item, "tooltip")}
                else:                              # a helper that builds an input, e.g. dtype_input()
                    inputs[f"<{ast.unparse(item)}>"] = {"optional": False, "tooltip": "helper"}
            schemas[literal(keyword(call, "node_id"))] = {
                "file": path.name, "category": literal(keyword(call, "category")),
                "description": literal(keyword(call, "description")), "inputs": inputs,
                "outputs": len(keyword(call, "outputs").elts)}
    return schemas


SCHEMAS = node_schemas()


def test_node_ids_categories_descriptions_tooltips():
    assert len(SCHEMAS) == 17, sorted(SCHEMAS)
    for node_id, schema in SCHEMAS.items():
        assert node_id.startswith("Flux2Klein"), node_id
        assert schema["category"].startswith("{}/"), (node_id, schema["category"])    # types.CATEGORY/<sub>
        assert len(schema["description"] or "") > 40, node_id
        for name, spec in schema["inputs"].items():
            assert spec["tooltip"] is not None, f"{node_id}.{name} has no tooltip"


def test_every_node_is_registered():
    tree = ast.parse((ROOT / "nodes" / "extension.py").read_text())
    listed = next(n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "NODES")
    newer = next(n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "NEEDS_TYPES")
    classes = {n.name for p in (ROOT / "nodes").glob("*.py") for n in ast.parse(p.read_text()).body
               if isinstance(n, ast.ClassDef) and any(ast.unparse(b) == "io.ComfyNode" for b in n.bases)}
    assert {e.id for e in listed.elts} | {k.id for k in newer.keys} == classes


def test_registry_validator_checks_pass():
    """What `comfy node validate` runs: ruff S102 (exec), S307 (eval), E702 (multiple statements on one line)."""
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "S102,S307,E702", "--no-cache",
                             "--output-format", "concise", str(ROOT)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_pyproject_comfy_metadata():
    tomllib = pytest.importorskip("tomllib")            # Python 3.11+
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project, comfy = data["project"], data["tool"]["comfy"]
    assert re.fullmatch(r"[A-Za-z][A-Za-z0-9._-]{0,99}", project["name"]) and "comfyui" not in project["name"].lower()
    assert re.fullmatch(r"\d+\.\d+\.\d+", project["version"])
    assert comfy["PublisherId"] and comfy["DisplayName"] and comfy["requires-comfyui"].startswith(">=")
    assert "Repository" in project["urls"]


# --- workflows ------------------------------------------------------------------------------------------------------

UI_FILES = sorted((ROOT / "workflows").glob("*.json"))


def flat(ui: dict) -> tuple[dict, list]:
    """A UI workflow's nodes by id and its links (source id, slot, target id, slot, type), with each subgraph node
    replaced by the nodes inside it, named "<subgraph node id>:<id>" as the frontend's graphToPrompt names them."""
    definitions = {d["id"]: d for d in ui.get("definitions", {}).get("subgraphs", [])}
    inside = {n["id"]: definitions[n["type"]] for n in ui["nodes"] if n["type"] in definitions}
    nodes = {str(n["id"]): n for n in ui["nodes"] if n["id"] not in inside}
    nodes |= {f"{i}:{m['id']}": m for i, d in inside.items() for m in d["nodes"]}
    links = [(f"{i}:{k['origin_id']}", k["origin_slot"], f"{i}:{k['target_id']}", k["target_slot"], k["type"])
             for i, d in inside.items() for k in d["links"] if k["origin_id"] >= 0 and k["target_id"] >= 0]
    for _, src, src_slot, dst, dst_slot, kind in ui["links"]:
        if src in inside:                  # from the inner node that feeds the subgraph's output
            k = next(k for k in inside[src]["links"] if k["target_id"] == -20 and k["target_slot"] == src_slot)
            src, src_slot = f"{src}:{k['origin_id']}", k["origin_slot"]
        targets = [(f"{dst}:{k['target_id']}", k["target_slot"]) for k in inside[dst]["links"]
                   if k["origin_id"] == -10 and k["origin_slot"] == dst_slot] if dst in inside else [(dst, dst_slot)]
        links += [(str(src), src_slot, str(t), slot, kind) for t, slot in targets]
    return nodes, links


def test_ui_and_api_workflows_pair_up():
    api = sorted((ROOT / "workflows" / "api").glob("*.json"))
    assert len(UI_FILES) == 20
    assert [p.name for p in UI_FILES] == [p.name for p in api]
    for path in UI_FILES:                  # the template browser lists workflows/*.json: UI files only
        assert "nodes" in json.loads(path.read_text()), f"{path.name} is not a UI workflow"


def check_links(nodes: dict, links: list[tuple], ends: dict) -> None:
    """Each link is listed by the output it leaves and the input it enters (or by the subgraph socket at an end: -10
    its input node, -20 its output node), with one type throughout."""
    for link_id, src, src_slot, dst, dst_slot, kind in links:
        out = ends[-10][src_slot] if src == -10 else nodes[src]["outputs"][src_slot]
        into = ends[-20][dst_slot] if dst == -20 else nodes[dst]["inputs"][dst_slot]
        assert link_id in (out["linkIds"] if src == -10 else out["links"])
        assert link_id in into["linkIds"] if dst == -20 else into["link"] == link_id
        assert out["type"] == kind == into["type"]


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_ui_workflow_structure(path):
    ui = json.loads(path.read_text())
    assert ui["version"] == 0.4 and ui["last_node_id"] == max(n["id"] for n in ui["nodes"])
    nodes = {n["id"]: n for n in ui["nodes"]}
    assert len(nodes) == len(ui["nodes"]) and ui["last_link_id"] == max(k[0] for k in ui["links"])
    check_links(nodes, ui["links"], {})
    definitions = {d["id"]: d for d in ui.get("definitions", {}).get("subgraphs", [])}
    for d in definitions.values():         # a subgraph: version 1 inside, link objects, its sockets at -10 / -20
        inner = {n["id"]: n for n in d["nodes"]}
        check_links(inner, [[k["id"], k["origin_id"], k["origin_slot"], k["target_id"], k["target_slot"], k["type"]]
                            for k in d["links"]], {-10: d["inputs"], -20: d["outputs"]})
        assert d["version"] == 1 and d["state"]["lastLinkId"] >= max(k["id"] for k in d["links"])
    for node in flat(ui)[0].values():
        assert node["type"] in SCHEMAS or node["type"] in CORE_NODES | VIRTUAL_NODES, node["type"]
    for node in nodes.values():
        assert node["type"] in SCHEMAS or node["type"] in CORE_NODES | VIRTUAL_NODES or node["type"] in definitions


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_api_twin_matches_ui_and_schemas(path):
    ui = json.loads(path.read_text())
    api = json.loads((path.parent / "api" / path.name).read_text())
    nodes, flat_links = flat(ui)
    nodes = {k: n for k, n in nodes.items() if n["type"] not in VIRTUAL_NODES}
    assert {k: v["class_type"] for k, v in api.items()} == {k: n["type"] for k, n in nodes.items()}
    links = {(dst, nodes[dst]["inputs"][slot]["name"]): [src, src_slot] for src, src_slot, dst, slot, _ in flat_links}
    for node_id, entry in api.items():
        inputs, ui_node = entry["inputs"], nodes[node_id]
        assert {(node_id, k): v for k, v in inputs.items() if isinstance(v, list)} == \
               {k: v for k, v in links.items() if k[0] == node_id}
        widgets = [v for v in ui_node["widgets_values"] if v not in CONTROL_VALUES and v != "image"]
        assert [v for v in inputs.values() if not isinstance(v, list)] == widgets, node_id
        schema = SCHEMAS.get(entry["class_type"])
        if schema:                          # our nodes: known inputs, every required one given
            named = {k: s for k, s in schema["inputs"].items() if not k.startswith("<")}
            assert set(inputs) - {"dtype"} <= set(named), set(inputs) - set(named)
            assert {k for k, s in named.items() if not s["optional"]} <= set(inputs)


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_workflows_name_their_models_and_images(path):
    ui = json.loads(path.read_text())
    note = next(n for n in ui["nodes"] if n["type"] == "MarkdownNote")["widgets_values"][0]
    api = json.loads((path.parent / "api" / path.name).read_text())
    for node_id, entry in api.items():
        files = {(LOADER_FOLDERS[k], v) for k, v in entry["inputs"].items() if k in LOADER_FOLDERS}
        # GGUF files are left out of properties.models (the frontend checks those against ComfyUI's file lists,
        # which have no .gguf, and would call them missing), and so are files known by a release page, not a file
        # link (FLUX 3's): the note gives their URL instead, a GGUF's ending in its name
        gguf = {(folder, name) for folder, name in files if name.endswith(".gguf")}
        models = flat(ui)[0][node_id]["properties"].get("models", [])
        listed = {(m["directory"], m["name"]) for m in models}
        assert listed <= files - gguf and (listed == files - gguf or "flux3" in path.stem)
        assert all(m["url"].startswith("https://huggingface.co/") and m["url"].endswith(m["name"]) for m in models)
        assert all(f"`{folder}/{name}`" in note for folder, name in files)
        assert all(re.search(rf"`{folder}/{re.escape(name)}` \(https://huggingface\.co/\S+/{re.escape(name)}\)", note)
                   for folder, name in gguf)
        assert all(re.search(rf"`{folder}/{re.escape(name)}` \(https://huggingface\.co/\S+\)", note)
                   for folder, name in files - listed)
        if entry["class_type"] == "LoadImage":
            assert entry["inputs"]["image"] in note, "the note must say which image to provide"


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_workflow_note_opens_with_a_description_that_the_readme_lists(path):
    # the template browser shows only the file name: the note's first paragraph and workflows/README.md say the rest
    ui = json.loads(path.read_text())
    note = next(n for n in ui["nodes"] if n["type"] == "MarkdownNote")["widgets_values"][0]
    heading, blank, paragraph, *_ = note.split("\n")
    assert heading.startswith("### ") and blank == "" and len(paragraph) > 80
    api = json.loads((path.parent / "api" / path.name).read_text())
    files = [v for entry in api.values() for k, v in entry["inputs"].items() if k in LOADER_FOLDERS]
    assert files and all(f in paragraph for f in files), "the description names the model files"
    readme = (ROOT / "workflows" / "README.md").read_text()
    assert f"| `{path.stem}` | **{heading[4:]}**: {paragraph} |" in readme
