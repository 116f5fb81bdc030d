"""The pack in ComfyUI's real frontend (headless Chromium): the extension loads cleanly, the UI workflows convert to their
API twins with the frontend's own app.graphToPrompt() and read well fitted to the window, their thumbnails and the
README screenshot are current and the template browser shows the thumbnails, and the extension's token count,
snapping and colours work.

Needs chromium (or CHROMIUM=path) and playwright-core (PLAYWRIGHT_CORE=folder holding node_modules/playwright-core);
skipped with the reason otherwise.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image, ImageChops

from flux2_core.families.flux2.variants import QWEN3_TEMPLATE
from flux2_core.models.text_encoder import count_prompt_tokens
from flux2_core.models.tokenizer import load_tokenizer
from tests.comfyui.host import PACK_FOLDER
from tests.comfyui.test_pack_loads import expected_node_ids

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
NODE = shutil.which("node")
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
PLAYWRIGHT = Path(os.environ["PLAYWRIGHT_CORE"]) / "node_modules" if os.environ.get("PLAYWRIGHT_CORE") else None
UI_NAMES = sorted(p.stem for p in (ROOT / "workflows").glob("*.json"))
PROMPTS = {"short": "a red fox in the snow", "long": "a red fox in the snow, " * 90,   # long: over 512 tokens
           "fallback": "a lighthouse on a cliff at dusk",
           "flux3_encoder": "qwen3vl_tiny.safetensors"}     # a FLUX 3 text encoder's file (base_dir.FILES)


# FLUX2_PICTURES=update writes the thumbnails and the README screenshot where they are committed (one run)
UPDATE = os.environ.get("FLUX2_PICTURES") == "update"
THUMBNAILS = ROOT / "workflows"                               # <name>.jpg beside <name>.json: the template browser's
SCREENSHOT = ROOT / "docs" / "images" / "text-to-image.png"   # shown in the README


@pytest.fixture(scope="module")
def page(comfy, tmp_path_factory):
    """What browser_check.cjs found in the page (one browser session for the module), and where it put the pictures
    it took (``pictures``: thumbnails and screenshot)."""
    if not (NODE and CHROMIUM and PLAYWRIGHT and (PLAYWRIGHT / "playwright-core").is_dir()):
        pytest.skip(f"headless browser tests need node, chromium and playwright-core (found node={NODE}, "
                    f"chromium={CHROMIUM}, PLAYWRIGHT_CORE={os.environ.get('PLAYWRIGHT_CORE')}: set it to a folder "
                    f"holding node_modules/playwright-core)")
    pictures = tmp_path_factory.mktemp("pictures")
    thumbnails, screenshot = (THUMBNAILS, SCREENSHOT) if UPDATE else (pictures, pictures / SCREENSHOT.name)
    done = subprocess.run([NODE, str(HERE / "browser_check.cjs"), f"http://{comfy.server.address}", PACK_FOLDER,
                           json.dumps(UI_NAMES), CHROMIUM, json.dumps(PROMPTS), str(thumbnails), str(screenshot)],
                          capture_output=True, text=True,
                          timeout=300, check=False, env=dict(os.environ, NODE_PATH=str(PLAYWRIGHT)))
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["loaded"], "the extension's setup() never ran:\n" + "\n".join(found["errors"])
    return found | {"thumbnails": thumbnails, "screenshot": screenshot}


def ours_or_uncaught(error: str) -> bool:
    """Every uncaught error and console error counts, except the frontend's own requests for optional files
    a fresh user directory lacks (user.css, favicon, userdata listings): those 404s are not about this pack."""
    if not error.startswith("Failed to load resource"):
        return True
    return f"/extensions/{PACK_FOLDER}/" in error or "flux2" in error.lower()


def test_extension_loads_without_console_errors(page, comfy):
    """No error but those the frontend logs by itself, on the same page with our extension disabled (frontend
    1.49.6 logs "ComfyApp graph accessed before initialization" with no custom node installed)."""
    errors = [e for e in page["errors"] if ours_or_uncaught(e) and e not in page["hostErrors"]]
    assert errors == [], "\n".join(errors)
    expected = expected_node_ids(comfy.client.get_json("/object_info"))
    assert expected and sorted(page["registered"]) == sorted(expected), page["registered"]


@pytest.mark.parametrize("name", UI_NAMES)
def test_ui_workflow_converts_to_its_api_twin(page, name):
    converted = {nid: {"class_type": n["class_type"], "inputs": n["inputs"]} for nid, n in page["prompts"][name].items()}
    twin = json.loads((ROOT / "workflows" / "api" / f"{name}.json").read_text())
    assert converted == {nid: {"class_type": n["class_type"], "inputs": n["inputs"]} for nid, n in twin.items()}


READABLE_ZOOM = 0.6          # below this the frontend draws nodes as empty boxes
# three references chained left to right, each image beside its reference, are too wide for that: read zoomed in
ZOOM = {"flux2-klein-edit-3-references": 0.48, "flux3-klein-edit-3-references": 0.48}


COMPACT = [n for n in UI_NAMES if n.endswith("-compact")]   # the stages packed in one subgraph node
WIDGETS = {"Flux2KleinPromptEncode": ("prompt",), "Flux2KleinNoise": ("seed", "control", "width", "height"),
           "Flux2KleinScheduler": ("steps",), "Flux2KleinDenoise": ("cfg", "denoise"),
           "LoadImage": ("image",)}                                                       # leading widgets_values
STAGES = {"Load models", "Prompt", "Noise and schedule", "Denoise", "Decode and save"}


@pytest.mark.parametrize("name", UI_NAMES)
def test_workflow_has_no_overlaps_and_a_group_per_stage(page, name):
    layout = page["layouts"][name]
    assert layout["overlaps"] == [] and layout["groupOverlaps"] == []
    if name in COMPACT:                 # the stages' groups are inside the subgraph
        assert {"Load models", "Save"} <= set(layout["groups"]) and not (STAGES - {"Load models"}) & set(layout["groups"])
    else:
        assert STAGES <= set(layout["groups"])
    assert "Models and files" in layout["titles"]
    prompts = [t for t in layout["titles"] if t.endswith(" prompt")]
    assert prompts[:1] == ([] if name in COMPACT else ["Positive prompt"]) and len(prompts) == len(set(prompts))


@pytest.mark.parametrize("name", UI_NAMES)
def test_workflow_reads_at_the_fitted_zoom_with_no_link_behind_a_node(page, name):
    layout = page["layouts"][name]
    assert layout["behind"] == [] and layout["scale"] >= ZOOM.get(name, READABLE_ZOOM), layout
    assert layout["thumbnailScale"] >= READABLE_ZOOM       # the thumbnail is drawn in full


@pytest.mark.parametrize("name", COMPACT)
def test_compact_workflow_shows_the_widgets_people_change(page, name):
    ui = json.loads((ROOT / "workflows" / f"{name}.json").read_text())
    definition, = ui["definitions"]["subgraphs"]
    inner = {str(n["id"]): n for n in definition["nodes"]}
    promoted = next(n for n in ui["nodes"] if n["type"] == definition["id"])["properties"]["proxyWidgets"]
    assert {"prompt", "seed", "steps"} <= {widget for _, widget in promoted}
    value = {(i, w): v for i, n in inner.items() for w, v in zip(WIDGETS.get(n["type"], ()), n["widgets_values"])}
    # the subgraph node, as the frontend draws it, shows each promoted widget with the inner node's value, named as
    # that frontend names them: "<inner node>: <widget>" (up to 1.37), or the widget's name with "_1", "_2", ... for
    # a name promoted again (1.49 on)
    seen: dict[str, int] = {}
    later = []
    for _, w in promoted:
        later.append(w if w not in seen else f"{w}_{seen[w]}")
        seen[w] = seen.get(w, 0) + 1
    namings = ([f"{i}: {w}" for i, w in promoted], later)
    assert page["layouts"][name]["promoted"] in [[[[n, value[tuple(key)]] for n, key in zip(names, promoted)]]
                                                 for names in namings]


def changed(a: Path, b: Path) -> float:
    """The share of two pictures (shrunk to 140 pixels wide, in grey) that differs clearly: 0 for the same graph drawn
    twice here, about 0.02 between the text-to-image and LoRA workflows (one node more, the prompt lower)."""
    small = []
    for file in (a, b):
        with Image.open(file) as image:
            small.append(image.convert("L").resize((140, round(image.height * 140 / image.width)),
                                                   Image.Resampling.BOX))
    difference = ImageChops.difference(*small).tobytes()
    return sum(d > 40 for d in difference) / len(difference)


@pytest.mark.parametrize("name", UI_NAMES)
def test_workflow_has_a_small_thumbnail_of_itself(page, name):
    committed = THUMBNAILS / f"{name}.jpg"
    assert committed.is_file(), f"no thumbnail: run the browser test with FLUX2_PICTURES=update ({committed.name})"
    with Image.open(committed) as image:
        assert image.format == "JPEG" and 400 <= image.width <= 600 and image.height <= image.width
    assert committed.stat().st_size < 100_000
    # the thumbnail shows the workflow as the frontend draws it now: a moved node needs a new thumbnail
    assert changed(committed, page["thumbnails"] / f"{name}.jpg") < 0.005, "stale: FLUX2_PICTURES=update"


def test_template_browser_shows_every_thumbnail(page):
    cards = page["cards"]
    assert sorted(cards) == UI_NAMES, cards          # the pack's page of the template browser: one card each
    for name, card in cards.items():                 # a missing thumbnail shows the frontend's default picture
        with Image.open(THUMBNAILS / f"{name}.jpg") as image:
            assert card == {"src": "blob", "width": image.width, "height": image.height}, (name, card)


def test_readme_shows_a_screenshot_of_the_text_to_image_workflow(page):
    assert f"]({SCREENSHOT.relative_to(ROOT).as_posix()})" in (ROOT / "README.md").read_text()
    with Image.open(SCREENSHOT) as image:
        assert image.format == "PNG" and image.size == (1600, 1000)
    assert SCREENSHOT.stat().st_size < 300_000
    assert changed(SCREENSHOT, page["screenshot"]) < 0.005, "stale: FLUX2_PICTURES=update"


def test_scheduler_saved_with_size_widgets_still_loads(page):
    assert page["oldScheduler"] == [["steps", 7], ["schedule", "power"], ["rho", 3.0]]


def test_nodes_share_one_colour_family(page):
    assert len(page["colours"]) > 10 and len({tuple(c) for c in page["colours"]}) == 1, page["colours"]


def test_live_token_count_is_exact_once_the_server_answered(page):
    exact = {name: count_prompt_tokens(load_tokenizer(), PROMPTS[name], QWEN3_TEMPLATE) for name in ("short", "long")}
    assert exact["short"] == 12 + 6 and exact["long"] > 512   # "a| red| fox| in| the| snow" + the chat template
    assert page["feature"] is True
    short, long = page["short"], page["long"]
    assert short["typed"]["label"].startswith("≈ ") and not short["typed"]["exact"]      # the estimate at once
    assert 12 + 4 <= short["typed"]["count"] <= 12 + 8
    assert short["answered"] == {"text": PROMPTS["short"], "encoder": None, "limit": 512, "count": exact["short"],
                                 "exact": True, "label": f"{exact['short']} / 512 tokens", "over": False}
    assert long["answered"]["count"] == exact["long"] and long["answered"]["exact"] and long["answered"]["over"]
    assert long["answered"]["label"] == f"{exact['long']} / 512 tokens: {exact['long'] - 512} past the limit are dropped"
    assert page["requests"] == [PROMPTS["short"], PROMPTS["long"]]   # debounced: fast typing asks once


def test_live_token_count_follows_the_connected_text_encoder(page):
    """Connected to a FLUX 3 (Qwen3-VL) encoder's loader, the prompt counts with its template, up to 4096."""
    from flux2_core.families.flux3.variants import QWEN3_VL_4B
    from tests.comfyui.base_dir import FILES

    assert PROMPTS["flux3_encoder"] == FILES["text_encoder_flux3"]
    exact = count_prompt_tokens(load_tokenizer(), PROMPTS["short"], QWEN3_VL_4B.template)
    assert exact == count_prompt_tokens(load_tokenizer(), PROMPTS["short"], QWEN3_TEMPLATE) - 4      # no empty thinking block
    assert page["flux3"]["answered"] == {"text": PROMPTS["short"], "encoder": PROMPTS["flux3_encoder"], "limit": 4096,
                                         "count": exact, "exact": True, "label": f"{exact} / 4096 tokens",
                                         "over": False}


def test_live_token_count_falls_back_to_the_estimate(page):
    fallback = page["fallback"]
    assert fallback["later"] == fallback["typed"] and not fallback["later"]["exact"]
    assert fallback["later"]["label"].startswith("≈ ") and fallback["later"]["text"] == PROMPTS["fallback"]


def test_width_and_height_snap_to_16(page):
    assert page["snapped"] == [1008, 1024]
