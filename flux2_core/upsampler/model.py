"""FLUX 3 Image Klein's prompt upsampler: a short request in, the detailed caption the image model was trained on out.

BFL's upsampler is a vision-language model in a Hugging Face folder with ``system_prompts.json`` (one per task); it
runs on the transformers model its ``config.json`` names.

Decoding is greedy with a presence penalty (1.5 for text-to-image, which keeps the caption from looping; none for
edits), as flux3-mlx's upsampler. An answer not ended within 3584 tokens is refused rather than cut.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..devices import check_cpu_dtype, compute_dtype, dtype_named
from ..errors import Flux2Error
from ..families import ReferenceCount
from ..families.flux3.boxes import check_rows, read_boxes, rows, rows_read
from ..families.flux3.upsampler_rows import already_upsampled, keep_locked, request
from ..user_json import read_json_file
from .pictures import DOWNLOAD_AGAIN, MAX_PICTURES, PatchSettings, picture_patches, prepare_picture

MAX_NEW_TOKENS = 3584
PRESENCE_PENALTY = {"t2i": 1.5, "i2i": 0.0}
TASKS = ("t2i", "i2i", "t2i_bbox", "i2i_bbox")
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
PROMPTS_FILE = "system_prompts.json"
# the user turn of an edit: the pictures, then this (the locked-box form when the request carries rows)
EDIT_REQUEST = {
    False: "Reference images follow in order (the first image, the second image, ...).\nUser request: {instruction}\n"
           "Output the caption.",
    True: "Reference images follow in attachment order: ref_image_0, ref_image_1, ...\nUser editing instruction: "
          "{instruction}\nDecide the edit, imagine the target image, and output the annotation record.",
}


@dataclass(frozen=True)
class Upsampled:
    prompt: str                    # what the image model should read (with its box table where boxes were given)
    tokens: int                    # how many the upsampler wrote


def upsamplers_under(root: str | Path) -> list[Path]:
    """The upsampler folders (with system_prompts.json) one or two levels under ``root``, sorted."""
    root = Path(root)
    return sorted({path.parent for pattern in (f"*/{PROMPTS_FILE}", f"*/*/{PROMPTS_FILE}") for path in root.glob(pattern)})


def find_upsampler(folder: str | Path) -> Path:
    """The folder if it holds an upsampler (config.json and system_prompts.json), else a Flux2Error that says why."""
    folder = Path(folder)
    if not folder.is_dir():
        raise Flux2Error(f"the prompt upsampler is a folder (config.json, {PROMPTS_FILE}, the weights and the "
                         f"tokenizer), not {folder}")
    if not (folder / "config.json").is_file():
        raise Flux2Error(f"{folder} has no config.json: give the Hugging Face folder of FLUX 3 Image Klein's prompt "
                         "upsampler")
    if not (folder / PROMPTS_FILE).is_file():
        raise Flux2Error(f"{folder} has no {PROMPTS_FILE}: the upsampler's system prompts come with it in BFL's "
                         "release; download the whole folder")
    config = read_json_file(folder / "config.json", dict, DOWNLOAD_AGAIN, "the prompt upsampler's config.json")
    if "quantization" in config and "quantization_config" not in config:
        raise Flux2Error(f"{folder} is an MLX folder (its config has MLX's quantization); it runs on Apple's MLX only: "
                         "use BFL's Hugging Face release of the upsampler")
    return folder


def read_system_prompts(folder: Path) -> dict[str, str]:
    prompts = read_json_file(folder / PROMPTS_FILE, dict, DOWNLOAD_AGAIN, f"the prompt upsampler's {PROMPTS_FILE}")
    missing = [task for task in TASKS if not isinstance(prompts.get(task), str)]
    if missing:
        raise Flux2Error(f"{folder / PROMPTS_FILE} has no system prompt for {', '.join(missing)}; download it again")
    return prompts


def check_request(prompt: str, pictures: int, boxes=None) -> list:
    """Refuses what the upsampler cannot take, before it loads; returns the boxes read. The rows it will lock must
    name pictures it is shown."""
    if not prompt.strip():
        raise Flux2Error("the prompt upsampler needs a prompt: write what the picture should show")
    if pictures > MAX_PICTURES:
        raise Flux2Error(f"the prompt upsampler takes at most {MAX_PICTURES} pictures, got {pictures}")
    layout = read_boxes(boxes or [])
    passed_on = not layout and already_upsampled(prompt)
    check_rows([] if passed_on else rows_read(prompt, layout), ReferenceCount(pictures), "the boxes")
    return layout


def context_length(config, folder: Path) -> int:
    """How many tokens the upsampler's model reads (its text config's max_position_embeddings)."""
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        raise Flux2Error(f"{folder / 'config.json'} gives no context length (max_position_embeddings is {limit!r}); "
                         f"{DOWNLOAD_AGAIN}")
    return limit


def check_length(tokens: int, context: int, pictures: int) -> None:
    """A request must leave MAX_NEW_TOKENS of the context for the answer (past it the positions are untrained)."""
    room = context - MAX_NEW_TOKENS
    if tokens > room:
        fewer = " or give fewer reference pictures (their patches are tokens too)" if pictures else ""
        raise Flux2Error(f"the request to the prompt upsampler is {tokens} tokens (its system prompt, the request"
                         f"{' and the pictures' if pictures else ''}), but its model reads {context} tokens and keeps "
                         f"{MAX_NEW_TOKENS} of them for its answer, so a request may take at most {max(room, 0)}: "
                         f"shorten the request{fewer}")


class PresencePenalty:
    """Subtracts ``penalty`` once from the logit of each token already in the answer (from ``start`` on)."""

    def __init__(self, penalty: float, start: int, window: int = MAX_NEW_TOKENS):
        self.penalty, self.start, self.window = penalty, start, window

    def __call__(self, ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """ids [B, L] (prompt and answer so far), logits [B, vocab] float."""
        for row in range(ids.shape[0]):
            seen = ids[row, self.start:][-self.window:].unique()
            logits[row, seen] -= self.penalty
        return logits


class Watcher:
    """transformers' stopping-criterion protocol, for a callback on each new token (progress, interrupts)."""

    def __init__(self, prompt_length: int, on_token: Callable[[int], None] | None):
        self.prompt_length, self.on_token = prompt_length, on_token

    def __call__(self, ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        if self.on_token is not None:
            self.on_token(ids.shape[1] - self.prompt_length)
        return torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)


class PromptUpsampler:
    """Loaded once, called per prompt: ``upsampler("a fox", pictures=[...], boxes=...)``."""

    def __init__(self, folder: str | Path, device: str | torch.device | None = None, dtype: torch.dtype | None = None):
        from transformers import AutoModelForImageTextToText, AutoTokenizer

        self.folder = find_upsampler(folder)
        self.system_prompts = read_system_prompts(self.folder)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        asked = dtype_named(dtype)
        if asked is not None and self.device.type == "cpu":
            check_cpu_dtype(asked)
        self.dtype = asked or compute_dtype(self.device, fp16=False).dtype
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.folder, local_files_only=True)
            self.model = AutoModelForImageTextToText.from_pretrained(self.folder, dtype=self.dtype,
                                                                     local_files_only=True)
        except (OSError, ValueError, KeyError) as e:
            raise Flux2Error(f"the prompt upsampler in {self.folder} could not be loaded ({e}); it needs its whole "
                             "Hugging Face folder (config.json, the weights, the tokenizer and the processor "
                             "files) and a transformers release that knows its architecture (pip install -U "
                             "transformers)") from None
        self.context = context_length(self.model.config, self.folder)
        self.model.to(self.device).eval()
        self.stops = [self.tokenizer.convert_tokens_to_ids(token) for token in STOP_TOKENS]

    def _inputs(self, text: str, pictures: list[Image.Image]) -> dict:
        """Token ids (each picture's one pad token widened to its patch count) and the pictures' patches."""
        if not pictures:
            return {"input_ids": self.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids}
        settings = PatchSettings.read(self.folder)
        cut = [picture_patches(picture, settings) for picture in pictures]
        pad = self.tokenizer.convert_ids_to_tokens(self.model.config.image_token_id)
        if text.count(pad) != len(pictures):
            raise Flux2Error(f"the upsampler's chat template placed {text.count(pad)} picture(s) for {len(pictures)}; "
                             "its tokenizer files do not match the model")
        merge = settings.merge_size ** 2
        pieces = text.split(pad)
        widened = pieces[0] + "".join(pad * (math.prod(grid) // merge) + piece
                                      for (_, grid), piece in zip(cut, pieces[1:]))
        ids = self.tokenizer(widened, add_special_tokens=False, return_tensors="pt").input_ids
        inputs = {"input_ids": ids,
                  "pixel_values": torch.from_numpy(np.concatenate([patches for patches, _ in cut])).to(self.dtype),
                  "image_grid_thw": torch.tensor([grid for _, grid in cut])}
        if "mm_token_type_ids" in inspect.signature(self.model.forward).parameters:
            # which tokens are picture patches (1) and which text (0): the 3D rotary positions are laid out by it
            inputs["mm_token_type_ids"] = (ids == self.model.config.image_token_id).int()
        return inputs

    @torch.no_grad()
    def __call__(self, prompt: str, pictures: Sequence[Image.Image] = (), boxes=None,
                 on_token: Callable[[int], None] | None = None) -> Upsampled:
        """``boxes``: a layout; the answer then ends in their table. ``on_token(count)`` may raise to stop."""
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        layout = check_request(prompt, len(pictures), boxes)
        if not layout and already_upsampled(prompt):
            return Upsampled(prompt, 0)
        asked = request(prompt, rows(layout) or None, len(pictures))
        if pictures:
            shown = [prepare_picture(picture, len(pictures)) for picture in pictures]
            content = [{"type": "image"} for _ in shown] + [
                {"type": "text", "text": EDIT_REQUEST[asked.locked is not None].format(instruction=asked.text)}]
        else:
            shown, content = [], asked.text
        messages = [{"role": "system", "content": self.system_prompts[asked.task]},
                    {"role": "user", "content": content}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  enable_thinking=False)
        inputs = self._inputs(text, shown)
        length = inputs["input_ids"].shape[1]
        check_length(length, self.context, len(pictures))
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        penalty = PRESENCE_PENALTY["i2i" if pictures else "t2i"]
        settings = GenerationConfig(do_sample=False, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=self.stops,
                                    pad_token_id=self.stops[0])
        out = self.model.generate(
            **inputs, attention_mask=torch.ones_like(inputs["input_ids"]), generation_config=settings,
            logits_processor=LogitsProcessorList([PresencePenalty(penalty, length - 1)] if penalty else []),
            stopping_criteria=StoppingCriteriaList([Watcher(length, on_token)]))
        answer = out[0, length:]
        ended = answer.numel() > 0 and int(answer[-1]) in self.stops
        if not ended:
            raise Flux2Error(f"the prompt upsampler wrote {MAX_NEW_TOKENS} tokens without finishing its caption; "
                             "shorten the request, or write the prompt yourself")
        caption = self.tokenizer.decode(answer, skip_special_tokens=True).strip()
        if not caption:
            raise Flux2Error("the prompt upsampler answered with nothing; rephrase the request")
        return Upsampled(keep_locked(caption, asked.locked, len(pictures)) if asked.locked else caption, int(answer.numel()))
