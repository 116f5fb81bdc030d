"""Opt-in ``torch.compile`` of a loaded transformer's blocks, on its device:

    compile_blocks(model)          # in place; the first forward compiles (seconds to minutes), later ones reuse it

Each double and single block's forward is compiled on its own, not the whole model: all blocks of a kind share one
compiled graph (their weights are graph inputs), so the compile cost is two graphs, not 25 or 32. The compiled forward
is an attribute of the block; removing it (``uncompile_blocks``) leaves the block as loaded. What is
outside the blocks (embedders, RoPE table, modulation, final layer) runs eagerly: it is a few small ops per step.

What triggers a new compile, and what does not:

* a new denoising step: no (the sigma only changes the modulation tensors' values);
* a new prompt: no (text is always 512 tokens, so every shape is the same);
* a new resolution, batch size, reference count, or the KV path: yes, once per distinct set of shapes
  (``dynamic=False``, the fastest kernels). ``dynamic=None`` instead lets torch switch to shape-generic kernels after
  the first such change, so later sizes reuse them.

With streamed blocks (``offload.stream_blocks``) only the resident blocks are compiled: the hooks that copy a
streamed block's weights in and out would break a ``fullgraph`` graph, and its step time is mostly the copy anyway.

torch keeps at most ``torch._dynamo.config.recompile_limit`` (8) graphs per block kind and then runs that block
eagerly, with a warning; ``compile_blocks`` raises the limit to ``max_shapes``.

``fullgraph=True`` (the default) turns a graph break into an error. Code that moves weights inside a block's call
breaks the graph: ComfyUI's partial loading (layers whose weights stream in at each call). Compile those with
``fullgraph=False``: the blocks then run as several compiled pieces. Our own block streaming needs no such thing:
its hooks run around a block's call, and only resident blocks are compiled (above).
"""

from __future__ import annotations

import torch
from torch import nn

from .errors import Flux2Error
from .offload import streamed_blocks
from .runtime import run_state


def blocks(model: nn.Module) -> list[nn.Module]:
    """The double then single blocks of a ``Flux2Transformer``."""
    if not hasattr(model, "double_blocks") or not hasattr(model, "single_blocks"):
        raise Flux2Error(f"compile_blocks needs a Flux2Transformer, got {type(model).__name__}")
    return [*model.double_blocks, *model.single_blocks]


def compile_blocks(model: nn.Module, backend="inductor", mode: str | None = None, dynamic: bool | None = False,
                   fullgraph: bool = True, max_shapes: int = 16) -> nn.Module:
    """Compile every block of ``model`` in place (lazily: at its first call), except streamed ones (see above).
    Returns ``model``.

    ``mode``: a torch.compile mode, e.g. "max-autotune-no-cudagraphs" on a GPU. ``fullgraph=True`` makes any graph
    break an error rather than a silent slowdown.
    """
    # Compiled code must see forward hooks added, replaced or removed later (patching.set_adapters runs LoRA
    # branches of fp8 layers as hooks): by default dynamo does not guard on hooks and would keep the old ones.
    torch._dynamo.config.skip_nnmodule_hook_guards = False
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), max_shapes))
    options = {"backend": backend, "dynamic": dynamic, "fullgraph": fullgraph}
    if mode is not None:
        options["mode"] = mode
    streamed = set(streamed_blocks(model))
    uncompile_blocks(model)
    state = run_state(model)
    for block in blocks(model):
        if block not in streamed:
            block.forward = torch.compile(type(block).forward.__get__(block), **options)
            state.compiled_blocks.append(block)
    state.compiled = options
    return model


def compile_decoder(ae: nn.Module, backend="inductor", mode: str | None = None) -> nn.Module:
    """Compile an ``AutoEncoder``'s decoder in place (lazily: at its first decode; each new image size compiles once
    more). Returns ``ae``. Tiled decodes run the decoder's parts eagerly."""
    decoder = ae.decoder
    options = {"backend": backend, "dynamic": False, **({"mode": mode} if mode else {})}
    decoder.forward = torch.compile(type(decoder).forward.__get__(decoder), **options)
    return ae


def is_compiled(model: nn.Module, **options) -> bool:
    """Whether the blocks run compiled (the resident ones, when streamed); with ``options`` (e.g. fullgraph=False),
    compiled with those."""
    state = run_state(model)
    streamed = set(streamed_blocks(model))
    compiled = bool(state.compiled) and all(block in state.compiled_blocks for block in blocks(model)
                                            if block not in streamed)
    return compiled and all(state.compiled.get(k) == v for k, v in options.items())


def uncompile_blocks(model: nn.Module) -> nn.Module:
    """Undo ``compile_blocks``: the blocks run eagerly again (compiled code stays cached in torch)."""
    state = run_state(model)
    for block in state.compiled_blocks:
        del block.forward                  # the class's forward again
    state.compiled, state.compiled_blocks = {}, []
    return model
