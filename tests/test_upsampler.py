"""FLUX 3 Image Klein's prompt upsampler against flux3-mlx and mlx-vlm's own upsampler (on mlx-cpu), on one tiny random
Qwen3.5 folder: the same answer, word for word, for a request, an edit with two pictures and a layout; its box
protocol and picture sizes against flux3-mlx's (BFL's bbox.py is vendored there unchanged); and bad input refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from flux2_core.errors import Flux2Error
from flux2_core.families.flux3 import upsampler_rows as layout
from flux2_core.upsampler.model import PresencePenalty, PromptUpsampler
from flux2_core.upsampler.pictures import picture_size, prepare_picture
from tests.tiny.upsampler import save_tiny_upsampler

bbox = pytest.importorskip("flux3_mlx.bbox", reason="flux3-mlx (a test extra) is the reference for the box protocol")
pup = pytest.importorskip("flux3_mlx.pup", reason="flux3-mlx (a test extra) is the reference for the pictures")

ROWS = [{"id": "kite", "bbox": [100, 50, 600, 400], "desc": "a red kite"},
        {"id": "dog", "from": "ref_image_1", "src_bbox": [200, 100, 900, 500], "tgt_bbox": [300, 500, 1000, 900],
         "desc": "the dog"}]
PROMPTS = [
    "a fox in the snow",
    "a fox " + json.dumps(ROWS),                                        # the model's own prompt form: rows locked
    "a shop sign reading [SALE]",                                       # a trailing list that is no table
    layout.request("a kite", ROWS, 0).text,                             # the upsampler's request form
    "a kite <kite> and a dog <dog> " + json.dumps(ROWS),                # an answer: every row cited
    "a kite <kite> " + json.dumps(ROWS),                                # not every row cited
    'a dog [{"id": "dog", "bbox": [0.1, 0.1, 0.5, 0.5], "desc": "x"}]',  # 0-1 boxes are not canvas rows
]
ANSWERS = [
    "A kite <kite> over a dog <dog>. " + json.dumps([{"id": "kite", "bbox": [100, 50, 600, 400], "desc": "kite"}]),
    # its own id for a locked box (IoU >= 0.9): renamed in the table and the caption
    "A kite <balloon_1> flies. " + json.dumps([{"id": "balloon_1", "bbox": [102, 50, 600, 401], "desc": "kite"}]),
    # added rows: one whole and cited, one not cited, one malformed, one moved without its source box
    "A kite <kite>, a sun <sun_1>, a cloud. " + json.dumps([
        {"id": "sun_1", "bbox": [0, 800, 150, 950], "desc": " a sun "}, {"id": "cloud_1", "bbox": [0, 0, 90, 90],
                                                                        "desc": "a cloud"},
        {"id": "bird_1", "bbox": [5, 5], "desc": "a bird"},
        {"id": "hat_1", "from": "ref_image_2", "tgt_bbox": [1, 2, 30, 40], "desc": "a hat"}]),
    "A plain caption with no table.",
    "A caption with a broken table [{\"id\": ",
]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("pictures", [0, 2])
def test_the_request_equals_the_reference(prompt, pictures):
    task, text, locked = bbox.plan(prompt, None, pictures)
    ours = layout.request(prompt, None, pictures)
    assert (ours.task, ours.text, ours.locked) == (task, text, locked)
    assert layout.already_upsampled(prompt) == bbox.is_finished(prompt)


def test_given_rows_win_over_a_table_in_the_prompt():
    boxes = [{"desc": "a kite", "bbox": [0.1, 0.05, 0.6, 0.4]}]
    task, text, locked = bbox.plan("a fox " + json.dumps(ROWS), boxes, 1)
    ours = layout.request("a fox " + json.dumps(ROWS), bbox.to_canvas(boxes), 1)
    assert (ours.task, ours.text, ours.locked) == (task, text, locked)


@pytest.mark.parametrize("answer", ANSWERS)
def test_the_answer_keeps_the_locked_rows_as_the_reference(answer):
    locked = [{"id": "kite", "bbox": [100, 50, 600, 400], "desc": "a red kite"},
              {"id": "dog", "from": "ref_image_1", "src_bbox": [200, 100, 900, 500], "tgt_bbox": None,
               "desc": "the dog"}]
    assert layout.keep_locked(answer, json.loads(json.dumps(locked)), 2) == bbox.reconcile(answer, locked)


@pytest.mark.parametrize("count", [1, 2, 3, 10])
@pytest.mark.parametrize("size", [(1024, 1024), (4000, 3000), (31, 5000), (33, 17), (6000, 32), (720, 1280),
                                  (100, 20000)])
def test_picture_sizes_equal_the_reference(size, count):
    assert picture_size(*size, count) == pup.reference_size(*size, count)


def test_a_picture_is_prepared_as_the_reference():
    """Transparent pictures go over white, then the resize and JPEG round trip: the same bytes."""
    rng = np.random.default_rng(0)
    rgba = Image.fromarray(rng.integers(0, 256, (300, 500, 4), dtype=np.uint8), "RGBA")
    for count in (1, 3):
        assert np.array_equal(np.asarray(prepare_picture(rgba, count)), np.asarray(pup.policy_reference(rgba, count)))


@pytest.mark.parametrize("size", [(64, 96), (1024, 768), (40, 64), (33, 17), (3000, 2000)])
def test_the_tower_patches_equal_transformers_picture_processor(tmp_path, size):
    """Cut into merge-grouped patches as transformers' Qwen-VL picture processor (its PIL one) cuts them, resized
    only where the pixel bounds ask for it (a small and a large picture here)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from flux2_core.upsampler.pictures import PatchSettings, picture_patches

    processor = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.48, 0.45, 0.4],
                                         image_std=[0.27, 0.26, 0.28], min_pixels=64 * 64, max_pixels=1024 * 1024)
    processor.save_pretrained(tmp_path)
    picture = Image.fromarray(np.random.default_rng(2).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    expected = processor(images=[picture], return_tensors="np")
    patches, grid = picture_patches(picture, PatchSettings.read(tmp_path))
    assert [list(grid)] == expected["image_grid_thw"].tolist()
    assert np.array_equal(patches, expected["pixel_values"])


def test_a_picture_past_200_to_1_is_refused():
    with pytest.raises(Flux2Error, match="over 200:1.*crop it"):
        picture_size(10, 2500, 1)


def test_the_presence_penalty_counts_each_answered_token_once():
    """By hand: prompt [5, 6, 7], answer so far [1, 1, 3]; the last prompt token (7) and the answer's tokens lose
    the penalty once each, however often they came; the prompt's earlier tokens do not."""
    ids = torch.tensor([[5, 6, 7, 1, 1, 3]])
    logits = torch.zeros(1, 10)
    out = PresencePenalty(1.5, start=2)(ids, logits.clone())
    expected = torch.zeros(1, 10)
    expected[0, [7, 1, 3]] = -1.5
    assert torch.equal(out, expected)
    window = PresencePenalty(1.0, start=2, window=2)(ids, torch.zeros(1, 10))     # only the newest 2 tokens
    assert window[0].nonzero().flatten().tolist() == [1, 3]


def upsamplers(tmp_path_factory, favour_prompt_end: bool):
    folder = save_tiny_upsampler(tmp_path_factory.mktemp("upsampler"), favour_prompt_end=favour_prompt_end)
    theirs = pytest.importorskip("mlx_vlm.models.flux3.upsampler",
                                 reason="mlx-vlm (a test extra) runs flux3-mlx's upsampler")
    return PromptUpsampler(folder, device="cpu", dtype=torch.float32), theirs.Flux3PromptUpsampler(
        str(folder), evict_model=False)


@pytest.fixture(scope="module")
def for_text(tmp_path_factory):
    """Its answers show whether the presence penalty counts the prompt's last token."""
    return upsamplers(tmp_path_factory, favour_prompt_end=True)


@pytest.fixture(scope="module")
def for_edits(tmp_path_factory):
    return upsamplers(tmp_path_factory, favour_prompt_end=False)


def pictures() -> list[Image.Image]:
    rng = np.random.default_rng(1)
    return [Image.fromarray(rng.integers(0, 256, (90, 120, 3), dtype=np.uint8)),
            Image.fromarray(rng.integers(0, 256, (64, 40, 3), dtype=np.uint8))]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["text", "layout", "edit", "edit layout"])
def test_the_answer_equals_mlx_vlm_word_for_word(request, case):
    """The same tiny model, greedy: any difference in the chat turn, the pictures' tokens and patches, the rotary
    positions, the presence penalty or the stop tokens changes the words."""
    ours, theirs = request.getfixturevalue("for_edits" if "edit" in case else "for_text")
    boxes = [{"desc": "a kite", "bbox": [0.1, 0.05, 0.6, 0.4]}] if "layout" in case else None
    shown = pictures() if "edit" in case else []
    counted = []
    answer = ours("a red fox in the snow", shown, boxes=boxes, on_token=counted.append)
    assert answer.prompt == theirs("a red fox in the snow", shown, boxes=boxes)
    assert answer.tokens > 3 and counted == list(range(1, answer.tokens + 1))
    if boxes:
        assert answer.prompt.endswith(json.dumps(bbox.to_canvas(boxes)))


def test_an_upsampled_prompt_is_not_upsampled_again(for_text):
    ours = for_text[0]
    done = "a kite <kite> and a dog <dog> " + json.dumps(ROWS)
    assert ours(done).prompt == done and ours(done).tokens == 0


def test_bad_requests_are_refused(for_text):
    ours = for_text[0]
    with pytest.raises(Flux2Error, match="needs a prompt"):
        ours("  ")
    with pytest.raises(Flux2Error, match="at most 10 pictures"):
        ours("a fox", pictures() * 6)
    with pytest.raises(Flux2Error, match="box 1 bbox must be four numbers"):
        ours("a fox", boxes='[{"desc": "x", "bbox": [1, 2]}]')


def test_folders_that_are_no_upsampler_are_refused(for_text, tmp_path):
    folder = for_text[0].folder
    with pytest.raises(Flux2Error, match="is a folder"):
        PromptUpsampler(tmp_path / "missing")
    with pytest.raises(Flux2Error, match="has no config.json"):
        PromptUpsampler(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "quantization": {"bits": 8}}))
    with pytest.raises(Flux2Error, match="has no system_prompts.json"):
        PromptUpsampler(tmp_path)
    (tmp_path / "system_prompts.json").write_text(json.dumps({"t2i": "x"}))
    with pytest.raises(Flux2Error, match="MLX folder"):
        PromptUpsampler(tmp_path)
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(Flux2Error, match="no system prompt for i2i, t2i_bbox, i2i_bbox"):
        PromptUpsampler(tmp_path)


@pytest.mark.slow
def test_the_command_line_draws_the_upsampled_prompt(for_text, tmp_path, capsys):
    """--upsample with --models: the upsampler folder found there, each prompt rewritten with its boxes locked, and
    the PNG equal to generate on the answer (the boxes are in it already), which it records with the request."""
    from safetensors.torch import save_file

    from flux2_core import pipeline
    from flux2_core.app import cli
    from tests.test_cli import png_parameters
    from tests.test_flux3 import flux3_files

    models = tmp_path / "models"
    _, state, te, ae = flux3_files(models, flow_map=True)
    transformer = models / "flux3-image-klein.safetensors"
    save_file({"model.diffusion_model." + k: v for k, v in state.items()}, str(transformer))
    save_tiny_upsampler(models / "prompt_upsamplers" / "flux-3-image-klein-pup", favour_prompt_end=True)
    boxes = [{"desc": "a kite", "bbox": [0.1, 0.05, 0.6, 0.4]}]
    (tmp_path / "boxes.json").write_text(json.dumps(boxes))
    code = cli.main(["--transformer", str(transformer), "--text-encoder", str(te), "--ae", str(ae), "--models",
                     str(models), "--upsample", "--boxes", str(tmp_path / "boxes.json"), "--prompt", "a red fox",
                     "--width", "64", "--height", "48", "--steps", "2", "--seed", "4", "--device", "cpu", "--dtype",
                     "float32", "--out", str(tmp_path / "out")])
    assert code == 0, capsys.readouterr().err
    answer = for_text[0]("a red fox", boxes=boxes).prompt
    assert f"upsampled ({for_text[0]('a red fox', boxes=boxes).tokens} tokens): {answer}" in capsys.readouterr().err
    written = next((tmp_path / "out").glob("*.png"))
    _, settings = png_parameters(written)
    assert settings["prompt"] == answer and settings["upsampled_from"] == "a red fox" and "boxes" not in settings
    loaded = pipeline.load_models(transformer, te, ae, device="cpu", dtype=torch.float32)
    expected = pipeline.generate(loaded, answer, width=64, height=48, steps=2, seed=4)
    assert np.array_equal(np.asarray(Image.open(written)), expected.images[0].numpy())


def test_the_command_line_refuses_upsampling_without_a_folder(tmp_path):
    from flux2_core.app.cli import find_upsampler_folder

    with pytest.raises(Flux2Error, match="give the upsampler's folder"):
        find_upsampler_folder(None)
    with pytest.raises(Flux2Error, match="no folder under .* holds system_prompts.json"):
        find_upsampler_folder(str(tmp_path))
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "system_prompts.json").write_text("{}")
    with pytest.raises(Flux2Error, match="2 prompt upsampler folders .* name the one to use"):
        find_upsampler_folder(str(tmp_path))


# --- the request's length against the model's context --------------------------------------------------------------

ROOM = 160                     # the tokens a request may take in the short-context upsampler, after its answer's


@pytest.fixture(scope="module")
def short_context(tmp_path_factory):
    """The tiny upsampler with a context of its answer's 3584 tokens and ROOM more."""
    from flux2_core.upsampler.model import MAX_NEW_TOKENS

    folder = save_tiny_upsampler(tmp_path_factory.mktemp("short_context"))
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = MAX_NEW_TOKENS + ROOM
    (folder / "config.json").write_text(json.dumps(config))
    return PromptUpsampler(folder, device="cpu", dtype=torch.float32)


def answering_at_once(upsampler, sent: list[int]):
    """A stand-in for generate: records how many tokens it is sent, answers "fox" and ends."""
    def generate(input_ids, **kwargs):
        sent.append(input_ids.shape[1])
        answer = upsampler.tokenizer.convert_tokens_to_ids(["Ġfox", "<|im_end|>"])
        return torch.cat([input_ids, torch.tensor([answer])], dim=1)
    return generate


@settings(max_examples=12, deadline=None)
@given(words=st.integers(0, 2 * ROOM), shown=st.integers(0, 2))
def test_a_request_past_the_context_is_refused_before_it_is_generated(short_context, words, shown):
    """Each " fox" is one token, so the request "a fox fox ..." is ``words`` tokens past the plain "a" (its system
    prompt, chat turn and pictures included): sent while it leaves the answer its room, refused past that, naming
    the count and the limit, with generate never called."""
    from unittest import mock

    from flux2_core.upsampler.model import MAX_NEW_TOKENS

    sent: list[int] = []
    with mock.patch.object(short_context.model, "generate", answering_at_once(short_context, sent)):
        short_context("a", pictures()[:shown])
        expected = sent[0] + words
        if expected <= ROOM:
            short_context("a" + " fox" * words, pictures()[:shown])
            assert sent == [sent[0], expected]
            return
        with pytest.raises(Flux2Error) as refused:
            short_context("a" + " fox" * words, pictures()[:shown])
    message = str(refused.value)
    assert sent == [sent[0]], "generate was called"
    assert f"{expected} tokens" in message and f"{MAX_NEW_TOKENS + ROOM} tokens" in message, message
    assert "shorten the request" in message and ("fewer" in message) == (shown > 0), message
