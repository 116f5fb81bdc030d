"""The Compile node: a model opted into torch.compile, and the compile mode each run sets on the shared transformer."""

from __future__ import annotations

import dataclasses

from comfy_api.latest import io

from ..flux2_core.runtime import compile as compiling
from . import host, types


class Compile(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Flux2KleinCompile", display_name="Klein Compile", search_aliases=types.SEARCH_ALIASES,
            category=f"{types.CATEGORY}/sampling",
            description="Runs the model's transformer blocks through torch.compile in the denoiser. The first run at "
                        "a new image size, batch or reference count compiles (about a minute on a GPU, longer on a "
                        "CPU); later steps, prompts and seeds reuse it and run faster. Needs a working Triton (GPU) or "
                        "C++ compiler (CPU).",
            inputs=[types.Model.Input("model", tooltip="From Klein Load Model.")],
            outputs=[types.Model.Output(display_name="model", tooltip="The same model, marked to run compiled.")])

    @classmethod
    def execute(cls, model: host.Managed) -> io.NodeOutput:
        return io.NodeOutput(dataclasses.replace(model, compiled=True))


def set_compiled(model: host.Managed) -> None:
    """Compile the blocks when this model came through the Compile node, else run them eagerly: the transformer is
    shared by every branch that uses the loader's output, so each denoiser sets the mode it needs. A model ComfyUI
    loaded only partially streams weights inside the blocks' calls, which breaks a full graph: it is compiled in
    pieces (fullgraph=False) rather than failing."""
    fullgraph = not host.partially_loaded(model)
    if model.compiled and not compiling.is_compiled(model.core, fullgraph=fullgraph):
        compiling.compile_blocks(model.core, fullgraph=fullgraph)
    elif not model.compiled and compiling.is_compiled(model.core):
        compiling.uncompile_blocks(model.core)
