"""The prompt upsampler node: FLUX 3 Image Klein's own rewriting of a short request (``flux2_core/upsampler``)."""

from __future__ import annotations

from comfy_api.latest import io, ui

from ..flux2_core.families.flux3.boxes import clamp_notes
from ..flux2_core.upsampler.model import MAX_NEW_TOKENS, PromptUpsampler, check_request
from . import host, types
from .conditioning import to_pil

PICTURE_INPUTS = 4


class Upsampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Flux2KleinPromptUpsampler", display_name="FLUX 3 Klein Prompt Upsampler",
            category=f"{types.CATEGORY}/conditioning",
            description="Rewrites a short request into the detailed caption FLUX 3 Image Klein was trained on, with "
                        "BFL's prompt upsampler (BFL recommends it). With pictures it describes the edit; with boxes "
                        "its caption ends in their table, so connect the boxes here and not to Prompt Encode as well. "
                        "The upsampler is a folder in models/prompt_upsamplers; the models ComfyUI holds are unloaded "
                        "while it runs.",
            inputs=[io.Combo.Input("upsampler", options=host.upsampler_choices(),
                                   tooltip="BFL's upsampler folder (with system_prompts.json) in "
                                           "models/prompt_upsamplers."),
                    io.String.Input("prompt", multiline=True, dynamic_prompts=True,
                                    tooltip="The request: what to draw, or for an edit what to change."),
                    types.Boxes.Input("boxes", optional=True,
                                      tooltip="From FLUX 3 Klein Layout: kept exactly in the answer."),
                    *(io.Image.Input(f"image_{i}", optional=True, tooltip="A picture of the edit, in the order the "
                                     "Reference nodes take them (each picture of a batch counts).")
                      for i in range(1, PICTURE_INPUTS + 1))],
            outputs=[io.String.Output(display_name="prompt",
                                      tooltip="The upsampled prompt, for Prompt Encode's prompt.")])

    @classmethod
    def execute(cls, upsampler: str, prompt: str, boxes: list | None = None, **images) -> io.NodeOutput:
        pictures = [to_pil(item) for i in range(1, PICTURE_INPUTS + 1)
                    if images.get(f"image_{i}") is not None for item in images[f"image_{i}"]]
        layout = check_request(prompt, len(pictures), boxes)
        model = PromptUpsampler(host.resolve_upsampler(upsampler), device=host.free_for_upsampler())
        try:
            answer = model(prompt, pictures, boxes=boxes, on_token=host.TokenReporter(MAX_NEW_TOKENS))
        finally:
            del model
            host.free_for_upsampler()
        said = f"{answer.tokens} tokens from {len(pictures)} picture(s)" if answer.tokens else \
            "already upsampled, kept as it is"
        # the boxes go on in its answer's table as drawn: to the picture's edge where they reach past it
        shown = "\n".join([said, *clamp_notes(layout), answer.prompt])
        return io.NodeOutput(answer.prompt, ui=ui.PreviewText(shown))
