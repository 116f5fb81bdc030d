"""Adapter patches applied to a model's linear layers, and undone bit for bit.

    set_adapters(model, [(patch, strength), ...], key=("my_lora", 0.8))   # replaces the set applied before
    set_adapters(model, [])                                               # the model as loaded, bit for bit

How a layer takes its patches (``adapters.Patch``: ΔW for some rows of a layer's weight):

* where the layer's storage merges adapters (float weights): merged, W' = W + Σ strength·ΔW computed in float32
  from the original W, which the layer keeps in CPU memory (``storage.protocol.StoredLinear.merge_weight``). Merged
  weights cost nothing per step, and every new set starts again from the original, so no change of adapters or
  strengths ever drifts.
* where it does not (quantized storage: fp8, GGUF blocks): a run-time branch, y[..., rows] += strength·ΔW x,
  computed from the patch's own factors (LoRA: two thin matmuls) beside the unchanged weight: re-quantizing a merged
  weight would round it again. ``merge=True`` merges anyway, as the storage does it (fp8: quantized again per row with
  a new scale; GGUF: merged into the weight as it is dequantized, at every call). DoRA patches always merge: they
  rescale the whole weight.

``merge=False`` makes float layers take branches too. ``run_state(model).adapter_key`` names the applied set (``key``); the caches
key what they keep by it (``cache.fingerprint``), so nothing computed with one set is served for another.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import replace

import torch
from torch import Tensor, nn

from . import checks
from .adapters import Patch
from .errors import Flux2Error
from .runtime import run_state
from .storage.protocol import StoredLinear


class AppliedAdapters:
    """What ``set_adapters`` leaves on a model (``run_state(model).adapters``): the layers it merged into and the branch
    hooks, so that the next call can undo them."""

    def __init__(self):
        self.merged: list[StoredLinear] = []
        self.hooks: list = []


def merge_asked(flags) -> bool | None:
    """``set_adapters``' ``merge`` for a chain of LoRAs (those applied, strength not 0), each with its own "merge into
    fp8" flag: True (merge everything) if any of them asks, else None (by layer)."""
    return True if any(flags) else None


def set_adapters(model: nn.Module, patches: Sequence[tuple[Patch, float]], key: Hashable = (),
                 merge: bool | None = None) -> None:
    """Apply (patch, strength) pairs to ``model``'s layers (patch.target names a layer of ``model``), after undoing
    whatever an earlier call applied. ``merge``: None merges float layers and branches fp8 ones, True merges all,
    False branches all but DoRA. Patches with strength 0 are left out, so they change nothing at all. Every patch is
    checked against its layer before anything changes: a refused set leaves the model as it was."""
    if merge not in (None, True, False):
        raise Flux2Error(f"merge must be None (by layer), True or False, got {merge!r}")
    by_layer: dict[str, list[tuple[Patch, float]]] = defaultdict(list)
    for patch, strength in patches:
        if strength != 0:            # checked before anything changes: a NaN strength would make the layer NaN
            by_layer[patch.target].append((patch, checks.number("an adapter's strength", strength,
                                                                hint="1 applies it as trained, 0 not at all")))
    layers = {name: _layer(model, name, [p for p, _ in items]) for name, items in by_layer.items()}
    _undo(model)
    state = run_state(model)
    applied = state.adapters = AppliedAdapters()
    state.adapter_key = key if by_layer else ()
    for name, items in by_layer.items():
        layer = layers[name]
        dora = any(p.dora_scale is not None for p, _ in items)
        if dora or merge is True or (merge is None and layer.merges_adapters):
            layer.merge_weight(_merged(items))
            applied.merged.append(layer)
        else:
            applied.hooks.append(layer.register_forward_hook(_branches(items)))


@torch.no_grad()
def _undo(model: nn.Module) -> None:
    state = run_state(model)
    applied = state.adapters
    if applied is None:
        return
    for hook in applied.hooks:
        hook.remove()
    for layer in applied.merged:
        layer.unmerge_weight()
    state.adapters, state.adapter_key = None, ()


def _layer(model: nn.Module, name: str, patches: list[Patch]) -> nn.Module:
    """The linear layer ``name`` of ``model``, checked to fit every patch of it."""
    try:
        layer = model.get_submodule(name)
    except AttributeError:
        raise Flux2Error(f"the adapter patches {name}, which this model does not have; was the adapter read for "
                         f"this model (adapters.read_adapter with its params)?") from None
    if not isinstance(layer, StoredLinear):
        raise Flux2Error(f"the adapter patches {name}, a {type(layer).__name__}, not a linear layer")
    for patch in patches:
        rows = (patch.rows[1] - patch.rows[0]) if patch.rows else layer.out_features
        if patch.shape != (rows, layer.in_features):
            raise Flux2Error(f"the adapter's {patch.source or name} ({list(patch.shape)}) does not fit {name} of this "
                             f"model ({rows} rows of [{layer.out_features}, {layer.in_features}]): it was made for "
                             f"another model size")
    return layer


def _patch_on_device(patch: Patch, device: torch.device) -> Patch:
    """The patch with its tensors on ``device``."""
    scale = None if patch.dora_scale is None else patch.dora_scale.to(device)
    return replace(patch, tensors={k: v.to(device) for k, v in patch.tensors.items()}, dora_scale=scale)


def _merged(items: list[tuple[Patch, float]]):
    """What ``merge_weight`` applies: the patches merged into a float32 weight [out, in], on the weight's device."""
    def patch_weight(weight: Tensor) -> Tensor:
        return _merge_rows(weight, _on_device(items, weight.device))
    return patch_weight


def _merge_rows(weight: Tensor, items: list[tuple[Patch, float]]) -> Tensor:
    """W + Σ strength·ΔW in place on a float32 weight [out, in], each patch on the rows it covers; returns it."""
    for patch, strength in items:
        rows = slice(*patch.rows) if patch.rows else slice(None)
        weight[rows] = patch.merged(weight[rows], strength)
    return weight


def _on_device(items: list[tuple[Patch, float]], device: torch.device) -> list[tuple[Patch, float]]:
    """``items`` with every patch on ``device``, moved there once (the list keeps the moved patches): run-time
    patches move where their layer computes (a streamed block's weights wait on the CPU while it runs on the GPU)."""
    for i, (patch, strength) in enumerate(items):
        if next(iter(patch.tensors.values())).device != device:
            items[i] = (_patch_on_device(patch, device), strength)
    return items


def _branches(items: list[tuple[Patch, float]]):
    """A forward hook adding strength·ΔW x to the rows each patch covers; ΔW is never built for LoRA and LoKr."""
    def hook(layer: nn.Module, args: tuple, out: Tensor) -> Tensor:
        x = args[0]
        out = out.clone() if torch.is_grad_enabled() else out       # in place when nothing records the graph
        for patch, strength in _on_device(items, x.device):
            rows = slice(*patch.rows) if patch.rows else slice(None)
            out[..., rows] += strength * patch.branch(x).to(out.dtype)
        return out
    return hook
