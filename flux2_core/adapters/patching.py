"""Adapter patches applied to a model's linear layers, and undone bit for bit.

Float weights merge: W' = W + Σ strength·ΔW in float32 from the original W, kept on the CPU, so nothing drifts.
Quantized storage runs a branch y[..., rows] += strength·ΔW x beside the weight, since re-quantizing would round
again. DoRA merges unless ``merge=False``. ``run_state(model).adapter_key`` names the applied set for the caches.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import replace

import torch
from torch import Tensor, nn

from .. import checks
from ..errors import Flux2Error
from ..models.run_state import run_state
from ..storage.protocol import StoredLinear
from .lora import Patch


class AppliedAdapters:
    """What the next ``set_adapters`` undoes: the layers merged into and the branch hooks."""

    def __init__(self):
        self.merged: list[StoredLinear] = []
        self.hooks: list = []


def merge_asked(flags) -> bool | None:
    """True (merge everything) if any LoRA of a chain asks to merge into fp8, else None (by layer)."""
    return True if any(flags) else None


def set_adapters(model: nn.Module, patches: Sequence[tuple[Patch, float]], key: Hashable = (),
                 merge: bool | None = None) -> None:
    """Replaces whatever an earlier call applied ([]: as loaded). ``merge``: None by layer, True merges all, False
    branches all. Every patch is checked first, so a refused set leaves the model as it was.
    """
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
        if merge is True or (merge is None and (dora or layer.merges_adapters)):
            layer.merge_weight(_merged(items))
            applied.merged.append(layer)
        else:
            applied.hooks.append(layer.register_forward_hook(_branches(items, _dora_factors(layer, items))))


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
    try:
        layer = model.get_submodule(name)
    except AttributeError:
        raise Flux2Error(f"the adapter patches {name}, which this model does not have; was the adapter read for "
                         f"this model (lora.read_adapter with its params)?") from None
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
    scale = None if patch.dora_scale is None else patch.dora_scale.to(device)
    return replace(patch, tensors={k: v.to(device) for k, v in patch.tensors.items()}, dora_scale=scale)


def _merged(items: list[tuple[Patch, float]]):
    """For ``merge_weight``: the patches merged into a float32 weight [out, in] on its device."""
    def patch_weight(weight: Tensor) -> Tensor:
        return _merge_rows(weight, _on_device(items, weight.device))
    return patch_weight


def _merge_rows(weight: Tensor, items: list[tuple[Patch, float]]) -> Tensor:
    """In place on a float32 weight [out, in]."""
    for patch, strength in items:
        rows = slice(*patch.rows) if patch.rows else slice(None)
        weight[rows] = patch.merged(weight[rows], strength)
    return weight


def _on_device(items: list[tuple[Patch, float]], device: torch.device) -> list[tuple[Patch, float]]:
    """Moved once (the list keeps them): a streamed block's patches move where it computes."""
    for i, (patch, strength) in enumerate(items):
        if next(iter(patch.tensors.values())).device != device:
            items[i] = (_patch_on_device(patch, device), strength)
    return items


@torch.no_grad()
def _dora_factors(layer: StoredLinear, items: list[tuple[Patch, float]]) -> list[Tensor | None]:
    """Per patch, its DoRA factor ([rows, 1] or [1, in]) as ``_merge_rows`` would compute it; None for the others."""
    if all(patch.dora_scale is None for patch, _ in items):
        return [None] * len(items)
    # a copy: a float32 layer's float_weight is its weight itself
    weight, factors = layer.float_weight(torch.float32, torch.device("cpu")).clone(), []
    for patch, strength in items:
        rows = slice(*patch.rows) if patch.rows else slice(None)
        factors.append(None if patch.dora_scale is None else patch.dora_factor(weight[rows]))
        weight[rows] = patch.merged(weight[rows], strength)
    return factors


def _branches(items: list[tuple[Patch, float]], factors: list[Tensor | None]):
    """A forward hook; ΔW is never built for LoRA and LoKr."""
    def hook(layer: nn.Module, args: tuple, out: Tensor) -> Tensor:
        x = args[0]
        out = out.clone() if torch.is_grad_enabled() else out       # in place when nothing records the graph
        factors[:] = [None if f is None else f.to(x.device) for f in factors]      # moved once, as the patches
        return _branched(layer, _on_device(items, x.device), factors, x, out)
    return hook


def _branched(layer: nn.Module, items: list[tuple[Patch, float]], factors: list[Tensor | None], x: Tensor,
              out: Tensor) -> Tensor:
    """``out`` (W x) made W' x, patch after patch as ``_merge_rows`` makes W'. DoRA per row: W x + s·(f ⊙ (W + ΔW) x
    − W x); per column: (W + ΔW)(f ⊙ x), with the earlier patches applied again."""
    for i, ((patch, strength), factor) in enumerate(zip(items, factors)):
        rows = slice(*patch.rows) if patch.rows else slice(None)
        if factor is None:
            out[..., rows] += strength * patch.branch(x).to(out.dtype)
            continue
        if factor.shape[-1] == 1:                                    # [rows, 1]
            base, delta = out[..., rows].float(), patch.branch(x.float())
            scaled = (base + delta) * factor.T
        else:                                                        # [1, in]
            xs = x * factor.to(x.dtype)
            base = out[..., rows].float()
            scaled = _branched(layer, items[:i], factors[:i], xs, layer.forward(xs))[..., rows].float() + \
                patch.branch(xs.float())
        out[..., rows] = (base + strength * (scaled - base)).to(out.dtype)
    return out
