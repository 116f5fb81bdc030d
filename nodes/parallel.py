"""Klein Parallel: the model's denoising spread over several GPUs (sequence parallelism, flux2_core/runtime/parallel.py).

This ComfyUI process stays rank 0 and runs the sampler as usual (progress, previews and cancel work as without it);
follower processes, one per other GPU, load the same transformer file and take their share of every pass. They start
at the first denoise (each loads the file) and stop when ComfyUI unloads the model between prompts or drops it
(nodes/host.py).
"""

from __future__ import annotations

import dataclasses

from comfy_api.latest import io

from . import types


class Parallel(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Flux2KleinParallel", display_name="Klein Parallel (several GPUs)", search_aliases=types.SEARCH_ALIASES,
            category=f"{types.CATEGORY}/sampling",
            description="Spreads every denoising step over several GPUs of this machine: the image and text tokens are "
                        "split between them and attention trades them (sequence parallelism), so one large image "
                        "comes sooner. The first run starts a process per extra GPU that loads the model file; they "
                        "stop when ComfyUI unloads the model between prompts (Unload models). The GPUs must divide "
                        "the model's attention heads (FLUX.2 Klein 4B and FLUX 3 Image Klein: 24, Klein 9B: 32). "
                        "Results equal one GPU's to float "
                        "rounding.",
            inputs=[types.Model.Input("model", tooltip="From Klein Load Model (LoRAs may follow or precede)."),
                    io.Int.Input("gpus", default=2, min=2, max=8,
                                 tooltip="How many GPUs share the work, this one included (2, 4 or 8 for Klein 9B).")],
            outputs=[types.Model.Output(display_name="model", tooltip="The same model, denoised on several GPUs.")])

    @classmethod
    def execute(cls, model, gpus: int) -> io.NodeOutput:
        return io.NodeOutput(dataclasses.replace(model, ranks=gpus))
