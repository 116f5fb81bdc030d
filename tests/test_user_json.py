"""JSON a user hands us, read by one guarded reader: a --boxes file, the Layout node's text, an upsampler folder's
config.json, system_prompts.json and preprocessor_config.json, an adapter's metadata. Whatever the text (cut short,
nested thousands deep, null or another wrong kind at the top, NaN, half a character), the answer is the value or a
Flux2Error that names the source and the fix, never another exception. A prompt's own text (brackets and all) is a
layout only when it ends in one."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flux2_core.errors import Flux2Error
from flux2_core.families.flux3 import FLUX3
from flux2_core.families.flux3 import upsampler_rows as layout
from flux2_core.families.flux3.boxes import read_boxes, table_at_end, with_boxes
from flux2_core.sampling.request import boxed_prompt
from flux2_core.upsampler.model import PROMPTS_FILE, find_upsampler, read_system_prompts
from flux2_core.upsampler.pictures import PatchSettings

SYSTEM_PROMPTS = {task: f"the {task} prompt" for task in ("t2i", "i2i", "t2i_bbox", "i2i_bbox")}
GOOD = {  # a valid document for each reader: cut short, it is JSON no longer
    "boxes": [{"desc": "a red kite", "bbox": [0.1, 0.05, 0.6, 0.4]}],
    "config": {"model_type": "qwen3_5", "text_config": {"max_position_embeddings": 4096}},
    "system_prompts": SYSTEM_PROMPTS,
    "preprocessor": {"patch_size": 16, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5]},
    "adapter": {"lora_alpha": 8, "alpha_pattern": {}},
    "model_config": {"axes_dims_rope": [4, 4, 4, 4]},
}


def in_folder(name: str, text: str | bytes, others: dict[str, str]) -> Path:
    folder = Path(tempfile.mkdtemp())
    for other, content in others.items():
        (folder / other).write_text(content)
    (folder / name).write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    return folder


def boxes_file(text):
    from flux2_core.app.cli import read_layout

    path = in_folder("layout.json", text, {}) / "layout.json"
    return read_layout(str(path)), f"the --boxes file ({path})"


def layout_node(text):
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return read_boxes(text, "the Layout node's boxes"), "the Layout node's boxes"


def upsampler_config(text):
    folder = in_folder("config.json", text, {PROMPTS_FILE: json.dumps(SYSTEM_PROMPTS)})
    return find_upsampler(folder), f"the prompt upsampler's config.json ({folder / 'config.json'})"


def system_prompts(text):
    folder = in_folder(PROMPTS_FILE, text, {})
    return read_system_prompts(folder), f"the prompt upsampler's {PROMPTS_FILE} ({folder / PROMPTS_FILE})"


def picture_settings(text):
    folder = in_folder("preprocessor_config.json", text, {})
    return PatchSettings.read(folder), f"the prompt upsampler's preprocessor_config.json ({folder / 'preprocessor_config.json'})"


def model_config(text, role: str = "transformer"):
    """A diffusers folder whose <role>/config.json is ``text``: named as that model's config.json."""
    from safetensors.torch import save_file

    from flux2_core.weights.checkpoint import open_checkpoint

    root = Path(tempfile.mkdtemp())
    (root / role).mkdir()
    save_file({"w": torch.zeros(2)}, str(root / role / "model.safetensors"))
    (root / role / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    return open_checkpoint(root, role).config, f"the {role.replace('_', ' ')}'s config.json ({root / role / 'config.json'})"


def text_encoder_config(text):
    return model_config(text, "text_encoder")


def adapter_metadata(text):
    from flux2_core.adapters.lora import _peft_alpha

    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return _peft_alpha({"lora_adapter_metadata": text}, "transformer.blocks.0.attn.to_q", 4), "lora_adapter_metadata"


READERS = {"boxes": [boxes_file, layout_node], "config": [upsampler_config], "system_prompts": [system_prompts],
           "preprocessor": [picture_settings], "adapter": [adapter_metadata],
           "model_config": [model_config, text_encoder_config]}
KINDS = sorted(READERS)


def nested(depth: int, opener: str) -> str:
    return {"list": "[" * depth + "]" * depth, "object": '{"a":' * depth + "1" + "}" * depth,
            "unclosed": "[" * depth}[opener]


@st.composite
def broken_documents(draw) -> tuple[str, str | bytes]:
    """(the reader's kind, a document no reader may take): nested past any real file's depth, cut short, a wrong
    kind of value at the top, NaN, a lone surrogate, not UTF-8."""
    kind = draw(st.sampled_from(KINDS))
    good = json.dumps(GOOD[kind])
    form = draw(st.sampled_from(["deep", "cut", "top", "nan", "surrogate", "bytes"]))
    if form == "deep":
        text = nested(draw(st.integers(100, 30_000)), draw(st.sampled_from(["list", "object", "unclosed"])))
    elif form == "cut":
        text = good[:draw(st.integers(1, len(good) - 1))]
    elif form == "top":
        text = draw(st.sampled_from(["null", "1", '"a string"', "true", "[]", "{}", "[1, 2]"]))
        if json.loads(text) is not None and type(json.loads(text)) is type(GOOD[kind]):
            text = "null"                      # an empty value of the right kind is a document, not a broken one
    elif form == "nan":
        text = good[:-1] + (", NaN]" if good.startswith("[") else ', "x": NaN}')      # not JSON's, but Python's
    elif form == "surrogate":
        text = good.replace('"', '"\\ud800', 1)
    else:
        text = b"\xff\xfe" + good.encode()[:10]
    return kind, text


@settings(max_examples=120, deadline=None)
@given(broken_documents(), st.data())
def test_a_broken_document_is_refused_by_name_with_the_fix(document, data):
    kind, text = document
    reader = data.draw(st.sampled_from(READERS[kind]))
    if isinstance(text, bytes) and reader in (layout_node, adapter_metadata):
        text = text.decode("utf-8", "replace")            # text the node / a header hands over is decoded already
        if reader is layout_node:
            return                                        # "\ufffd" is a character, and its list is then valid
    with pytest.raises(Flux2Error) as refused:
        reader(text)
    message = str(refused.value)
    # what the file is, its path and the fix (before: the path alone, or the file's name alone)
    subject = reader(json.dumps(GOOD[kind]))[1]
    if reader in (layout_node, adapter_metadata):
        assert subject in message and "; " in message, message
    else:
        what, path = subject.removesuffix(")").split(" (")
        assert what in message and Path(path).name in message and "; " in message, message


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(KINDS), st.data())
def test_a_good_document_is_read(kind, data):
    """The control: the same readers take the documents they are made for."""
    reader = data.draw(st.sampled_from(READERS[kind]))
    reader(json.dumps(GOOD[kind]))


PLAIN = st.text(alphabet='[]{}",:. 0123456789abcefghjklmnopqrstuvwxyz\n', max_size=80)   # no "i", "d": no row ids


@st.composite
def bracketed_prompts(draw) -> str:
    """Prompt text full of brackets, sometimes thousands deep, that ends in no box table."""
    parts = draw(st.lists(st.one_of(PLAIN, st.builds(nested, st.integers(1, 20_000),
                                                      st.sampled_from(["list", "object", "unclosed"]))),
                          min_size=1, max_size=4))
    return "a fox " + " ".join(parts)


@settings(max_examples=80, deadline=None)
@given(bracketed_prompts())
def test_a_prompt_with_brackets_is_plain_text(prompt):
    assert table_at_end(prompt) is None
    assert layout.request(prompt, None, 0) == layout.Request("t2i", prompt, None)
    assert not layout.already_upsampled(prompt)
    assert boxed_prompt(prompt, [], FLUX3, "FLUX 3 Image Klein") == prompt
    boxes = read_boxes(GOOD["boxes"])
    assert boxed_prompt(prompt, boxes, FLUX3, "FLUX 3 Image Klein") == with_boxes(prompt, boxes)
    answer = layout.keep_locked(prompt, [{"id": "kite", "bbox": [100, 50, 600, 400], "desc": "a kite"}], 0)
    assert answer.endswith('[{"id": "kite", "bbox": [100, 50, 600, 400], "desc": "a kite"}]')


@settings(max_examples=40, deadline=None)
@given(bracketed_prompts())
def test_a_prompt_that_ends_in_a_table_is_one(prompt):
    """The control: brackets before a real table do not hide it."""
    rows = [{"id": "kite", "bbox": [100, 50, 600, 400], "desc": "a [red] kite"}]
    assert table_at_end(f"{prompt} {json.dumps(rows)}") == (prompt.rstrip(), rows)


def test_a_document_over_the_size_limit_is_refused_before_it_is_read():
    from flux2_core.user_json import MAX_CHARS

    text = "[" + " " * MAX_CHARS + "]"
    with pytest.raises(Flux2Error, match=f"over the {MAX_CHARS:,} characters"):
        read_boxes(text, "the Layout node's boxes")
    with pytest.raises(Flux2Error, match=rf"the --boxes file \(.*layout.json\) is {len(text):,} bytes, over the {MAX_CHARS:,}"):
        boxes_file(text)
