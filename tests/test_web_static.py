"""The web extension without a ComfyUI server: file layout, import paths, syntax, and its pure helpers run in node.

The token estimate is checked against the exact Qwen3 tokenizer of flux2_core on prompts in several languages; the
browser tests in tests/comfyui/ check the extension inside the real frontend.
"""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from flux2_core.app import queue_client

ROOT = Path(__file__).resolve().parents[1]
WEB = ROOT / "web"
EXTENSION = WEB / "js" / "flux2_klein.js"
HELPERS = WEB / "js" / "flux2_klein_tokens.js"
NODE = shutil.which("node")
needs_node = pytest.mark.skipif(NODE is None, reason="node (Node.js) is not installed; the JS helpers are not run")

PROMPTS = {  # (prompt, allowed relative error of the estimate)
    "a red fox in the snow": 0.15,
    "A cinematic photograph of a lighthouse on a rocky cliff at sunset, dramatic clouds, golden hour, 35mm film "
    "grain, shallow depth of field": 0.15,
    "Replace the background with a bustling Tokyo street at night with neon signs reading 'RAMEN' and 'OPEN 24H'; "
    "keep the person's pose and clothing unchanged.": 0.15,
    "Photorealistic product shot of a matte black wireless headphone on a marble pedestal, studio lighting, softbox "
    "reflections, 4K, ultra-detailed": 0.15,
    "Close-up macro photograph of a dewdrop on a spider web, bokeh background in green and blue tones\n\nStyle: "
    "National Geographic": 0.15,
    "Ein gemütliches Café in einer verschneiten Altstadt, warmes Licht fällt aus den Fenstern.": 0.3,
    "Une photo d'une rue pavée à Paris sous la pluie, reflets des lampadaires, parapluies colorés.": 0.3,
    "一只在雪地里的红狐狸，背景是松树林，清晨的阳光": 0.3,
    "Пейзаж с озером и горами на закате, отражение в воде, спокойная атмосфера": 0.3,
}


def run_node(script: str):
    """Run an ES module snippet in node with the helpers imported as `h`; returns its JSON output."""
    code = f"import * as h from {json.dumps(HELPERS.as_uri())};\n{script}"
    done = subprocess.run([NODE, "--input-type=module", "-e", code], check=False, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def relative_imports(path: Path) -> list[str]:
    return re.findall(r"""^\s*import\s[^;]*?from\s+["']([^"']+)["']""", path.read_text(), flags=re.MULTILINE)


def test_extension_imports_resolve_where_comfyui_serves_them():
    # web/js/x.js is served at /extensions/<pack>/js/x.js: ComfyUI's scripts are three folders up.
    imports = relative_imports(EXTENSION)
    assert "../../../scripts/app.js" in imports and "../../../scripts/api.js" in imports
    for target in imports:
        if target.startswith("../../../scripts/"):
            continue
        assert (EXTENSION.parent / target).resolve().is_file(), f"{EXTENSION.name} imports missing {target}"
    assert relative_imports(HELPERS) == [], "the helpers must stay importable without ComfyUI"


def test_frontend_shims_export_what_the_extension_imports():
    frontend = pytest.importorskip("comfyui_frontend_package", reason="comfyui-frontend-package is not installed")
    scripts = Path(frontend.__file__).parent / "static" / "scripts"
    assert re.search(r"export const app\b", (scripts / "app.js").read_text())
    assert re.search(r"export const api\b", (scripts / "api.js").read_text())


def test_node_prefix_is_the_packs():
    source = EXTENSION.read_text()
    assert f'const PREFIX = "{queue_client.OUR_PREFIX}";' in source
    node_ids = re.findall(r"""node_id\s*=\s*["']([^"']+)["']""", "".join(
        p.read_text() for p in sorted((ROOT / "nodes").glob("*.py"))))
    assert all(i.startswith(queue_client.OUR_PREFIX) for i in node_ids), node_ids


@needs_node
def test_javascript_parses():
    for path in sorted(WEB.rglob("*.js")):
        done = subprocess.run([NODE, "--check", str(path)], check=False, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, f"{path}: {done.stderr}"


@needs_node
def test_snap_to_16():
    got = run_node("console.log(JSON.stringify([h.snapTo16(1000), h.snapTo16(1016), h.snapTo16(1031), "
                   "h.snapTo16(7), h.snapTo16(1032, 64, 2048), h.snapTo16(5000, 64, 2050), h.snapTo16(10, 100)]))")
    # 1000/16 = 62.5 rounds up to 63 -> 1008; 7 is below one cell -> 16; the bounds are multiples of 16 inside [min, max]
    assert got == [1008, 1024, 1024, 16, 1040, 2048, 112]


@needs_node
def test_token_estimate_is_close_to_the_qwen3_tokenizer():
    tokenizer = pytest.importorskip("flux2_core.models.tokenizer").build_qwen3_tokenizer()
    template = tokenizer.apply_chat_template([{"role": "user", "content": ""}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=False)
    helpers = run_node("console.log(JSON.stringify({t: h.TEMPLATE_TOKENS, m: h.MAX_TOKENS, n: "
                       f"{json.dumps(list(PROMPTS))}.map(h.approxTokenCount)}}))")
    assert helpers["t"] == len(tokenizer(template)["input_ids"])
    assert helpers["m"] == 512
    errors = []
    for (prompt, bound), estimate in zip(PROMPTS.items(), helpers["n"]):
        exact = len(tokenizer(prompt)["input_ids"])
        errors.append(abs(estimate - exact) / exact)
        assert errors[-1] <= bound, f"{prompt!r}: estimate {estimate}, exact {exact}"
    assert sum(errors) / len(errors) <= 0.1


@needs_node
def test_token_label_warns_past_the_limit():
    got = run_node("console.log(JSON.stringify([h.tokenLabel(40, false), h.tokenLabel(512, true), "
                   "h.tokenLabel(600, true), h.tokenLabel(600, true, 4096), h.tokenLabel(4100, false, 4096)]))")
    assert got == ["≈ 40 / 512 tokens", "512 / 512 tokens", "600 / 512 tokens: 88 past the limit are dropped",
                   "600 / 4096 tokens", "≈ 4100 / 4096 tokens: 4 past the limit are dropped"]


def test_token_route_and_feature_flag_match_the_server_side():
    # nodes/routes.py imports ComfyUI, so its constants are read from the source (tests/comfyui/ checks them live)
    server = dict(re.findall(r'^(ROUTE|FEATURE) = "([^"]+)"$', (ROOT / "nodes" / "routes.py").read_text(), re.MULTILINE))
    client = dict(re.findall(r'^const TOKENS_(ROUTE|FEATURE) = "([^"]+)";$', EXTENSION.read_text(), re.MULTILINE))
    assert server == client == {"ROUTE": "/flux2_klein/tokens", "FEATURE": "flux2_klein_tokens"}
