"""Opt-in ``torch.compile`` of a loaded transformer's blocks, in place; the first forward compiles.

Each block's forward is compiled on its own, and blocks of a kind share one graph (weights are graph inputs), so the
cost is two graphs. A new resolution, batch or reference count compiles once more. Code that moves weights inside a
block's call (ComfyUI's partial loading) needs ``fullgraph=False``; block streaming's hooks run around the call.
"""

from __future__ import annotations

import torch
from torch import nn

from ..devices import pin_vector_width
from ..errors import Flux2Error
from ..models.run_state import run_state
from .offload import streamed_blocks


def blocks(model: nn.Module) -> list[nn.Module]:
    if not callable(getattr(model, "blocks", None)):
        raise Flux2Error(f"compile_blocks needs a transformer (a model with blocks()), got {type(model).__name__}")
    return model.blocks()



def _pin_on_cpu(module: nn.Module) -> None:
    if any(p.device.type == "cpu" for p in module.parameters()):
        pin_vector_width()


def compile_blocks(model: nn.Module, backend="inductor", mode: str | None = None, dynamic: bool | None = False,
                   fullgraph: bool = True, max_shapes: int = 16) -> nn.Module:
    """Streamed blocks are left eager. ``max_shapes`` raises torch's recompile limit (8 per block kind)."""
    # LoRA branches are forward hooks added later, and by default dynamo does not guard on hooks
    torch._dynamo.config.skip_nnmodule_hook_guards = False
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), max_shapes))
    options = {"backend": backend, "dynamic": dynamic, "fullgraph": fullgraph}
    if mode is not None:
        options["mode"] = mode
    _pin_on_cpu(model)
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
    """Lazily; each new image size compiles once more. Tiled decodes run the decoder's parts eagerly."""
    decoder = ae.decoder
    _pin_on_cpu(decoder)
    options = {"backend": backend, "dynamic": False, **({"mode": mode} if mode else {})}
    decoder.forward = torch.compile(type(decoder).forward.__get__(decoder), **options)
    return ae


def is_compiled(model: nn.Module, **options) -> bool:
    """With ``options`` (e.g. fullgraph=False): compiled with those."""
    state = run_state(model)
    streamed = set(streamed_blocks(model))
    compiled = bool(state.compiled) and all(block in state.compiled_blocks for block in blocks(model)
                                            if block not in streamed)
    return compiled and all(state.compiled.get(k) == v for k, v in options.items())


def uncompile_blocks(model: nn.Module) -> nn.Module:
    """Compiled code stays cached in torch."""
    state = run_state(model)
    for block in state.compiled_blocks:
        del block.forward                  # the class's forward again
    state.compiled, state.compiled_blocks = {}, []
    return model
