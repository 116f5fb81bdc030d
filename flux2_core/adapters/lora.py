"""Adapter files (LoRA, LoKr, LoHa, DoRA, full diffs) -> ``Patch``es on our weights, with a report of what matched.

The math, with ΔW [out, in] for the patch's rows (every loader agrees):
    LoRA   ΔW = s · up @ down,                   up [out, r], down [r, in]; s = alpha / r, or 1 without alpha
    LoKr   ΔW = s · kron(W1, W2),                W1 [a1, a2], W2 [b1, b2]; s = alpha / rank only when a factor is
                                                 decomposed, else 1
    LoHa   ΔW = s · (w1_a @ w1_b) ⊙ (w2_a @ w2_b), s = alpha / w1_b's rows
    diff   ΔW = diff
PEFT files without .alpha keys carry alpha in their ``lora_adapter_metadata``.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ..digests import tensor_digest
from ..errors import Flux2Error
from ..families import ModelParams
from ..listing import bounded_list
from ..user_json import parse_json
from ..weights.checkpoint import TORCH_DTYPES, open_checkpoint, read_tensor
from .formats import (
    OTHER,
    TEXT_ENCODER,
    TEXT_ENCODER_GROUP,
    ModelNames,
    Target,
    model_names,
    refuse_missing_blocks,
    refuse_other_family,
    resolve,
    shape_error,
    split_key,
)

ROLES = {"lora": ("down", "up"), "lokr": ("w1", "w1_a", "w1_b", "w2", "w2_a", "w2_b"),
         "loha": ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"), "diff": ("diff",)}
CONV_ONLY = {"mid": "a LoCon mid weight", "t2": "a LoKr Tucker factor (lokr_t2)", "hada_t1": "a LoHa Tucker factor",
             "hada_t2": "a LoHa Tucker factor"}


@dataclass
class Patch:
    """ΔW for rows ``rows`` (all rows when None) of our weight ``target``: one adapter module of a file."""
    target: str                             # our module name (the model's own, e.g. a block's fused qkv)
    rows: tuple[int, int] | None            # [start, stop) of the weight's rows; q/k/v of a fused qkv or linear1
    kind: str                               # "lora" | "lokr" | "loha" | "diff"
    tensors: dict[str, Tensor]              # by role: down/up, w1/w1_a/w1_b/w2/w2_a/w2_b, hada_*, diff (as stored)
    scale: float                            # s above (alpha rules applied); the user's strength comes on top
    shape: tuple[int, int]                  # ΔW [out, in] (out = the rows' count)
    source: str = ""                        # the module path in the file (for messages)
    swap_halves: bool = False               # ΔW's rows come in the other half order (diffusers' norm_out.linear)
    dora_scale: Tensor | None = None        # DoRA magnitude: [out, 1] (per output row) or [1, in] (per input column)
    group: str = OTHER

    def _factor(self, name: str) -> Tensor:
        t = self.tensors
        return t[name].float() if name in t else t[name + "_a"].float() @ t[name + "_b"].float()

    def _in_our_order(self, rows: Tensor, dim: int) -> Tensor:
        return torch.cat(rows.chunk(2, dim=dim)[::-1], dim=dim) if self.swap_halves else rows

    def delta(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """ΔW [out, in] for the patch's rows, scale included, strength not; computed in float32."""
        t = self.tensors
        if self.kind == "lora":
            d = t["up"].float() @ t["down"].float()
        elif self.kind == "lokr":
            d = torch.kron(self._factor("w1"), self._factor("w2"))
        elif self.kind == "loha":
            d = (t["hada_w1_a"].float() @ t["hada_w1_b"].float()) * (t["hada_w2_a"].float() @ t["hada_w2_b"].float())
        else:
            d = t["diff"].float()
        return self._in_our_order(d * self.scale, 0).to(dtype)

    def branch(self, x: Tensor) -> Tensor:
        """x [..., in] -> ΔW x [..., out] without building ΔW where the kind allows (LoKr: W1 · X · W2ᵀ). Not DoRA."""
        t = {k: v.to(x.device, x.dtype) for k, v in self.tensors.items()}     # no copy once they are x's kind
        if self.kind == "lora":
            y = (x @ t["down"].T) @ t["up"].T * self.scale
        elif self.kind == "lokr":
            w1, w2 = self._factor("w1").to(x.device, x.dtype), self._factor("w2").to(x.device, x.dtype)
            a2, b2 = w1.shape[1], w2.shape[1]
            y = w1 @ x.reshape(*x.shape[:-1], a2, b2) @ w2.T                  # [..., a1, b1]
            y = y.reshape(*x.shape[:-1], -1) * self.scale
        else:
            return x @ self.delta(x.dtype).to(x.device).T                     # delta() is in our row order
        return self._in_our_order(y, -1)

    def dora_factor(self, weight: Tensor, comfyui_quirk: bool = False) -> Tensor:
        """m / (‖W + ΔW‖ + eps), [out, 1] or [1, in], so that W' = (W + ΔW) · factor, as LyCORIS.
        ``comfyui_quirk``: the norm of the original W, as ComfyUI (for parity tests only).
        """
        if self.dora_scale is None:
            raise Flux2Error(f"{self.source} is no DoRA patch (it has no dora_scale)")
        merged = weight.float() + self.delta()
        scale = self.dora_scale.float()
        out_axis = scale.shape[0] == self.shape[0] and scale.shape[-1] == 1
        if out_axis:
            scale = self._in_our_order(scale, 0)
            norm = (weight.float() if comfyui_quirk else merged).norm(dim=1, keepdim=True)    # [out, 1]
        else:
            norm = merged.norm(dim=0, keepdim=True)                                          # [1, in]
        return scale / (norm + torch.finfo(torch.float32).eps)

    def merged(self, weight: Tensor, strength: float = 1.0) -> Tensor:
        """DoRA: W + strength·((W + ΔW)·factor − W), ComfyUI's and LyCORIS's rule for strength ≠ 1."""
        w = weight.float()
        if self.dora_scale is None:
            return (w + strength * self.delta()).to(weight.dtype)
        decomposed = (w + self.delta()) * self.dora_factor(weight)
        return (w + strength * (decomposed - w)).to(weight.dtype)


@dataclass
class MatchReport:
    """What an adapter file's keys matched: tensors per block group, and every key that matched nothing (why)."""
    name: str
    groups: tuple[str, ...]                                                             # the family's, other, text encoder
    tensors: dict[str, int] = field(default_factory=dict)                               # group -> matched keys
    modules: dict[str, int] = field(default_factory=dict)                               # group -> patches (file modules)
    unmatched: dict[str, str] = field(default_factory=dict)                             # key -> why
    formats: list[str] = field(default_factory=list)                                    # as seen, in key order
    kinds: list[str] = field(default_factory=list)                                      # lora, lokr, ... (+dora)

    def __post_init__(self):
        self.tensors = dict.fromkeys(self.groups, 0) | self.tensors
        self.modules = dict.fromkeys(self.groups, 0) | self.modules

    def summary(self, limit: int = 5) -> str:
        groups = ", ".join(f"{g} {self.tensors[g]}" for g in self.groups if self.tensors[g])
        line = (f"{self.name}: {'/'.join(self.kinds) or 'nothing'} ({'; '.join(self.formats)}), "
                f"{sum(self.tensors.values())} tensors in {sum(self.modules.values())} modules: {groups or 'none'}")
        if self.unmatched:
            keys = list(self.unmatched)
            line += f"; {len(keys)} key{'s' * (len(keys) > 1)} matched nothing: {bounded_list(keys, limit)}"
        return line


@dataclass
class Adapter:
    name: str
    patches: list[Patch]                    # on the transformer (our BFL module names)
    text_encoder_patches: list[Patch]       # on the Qwen3 text encoder (its parameter names, without ".weight")
    report: MatchReport
    _digests: dict = field(default_factory=dict, repr=False, compare=False)   # digest() by its argument

    def digest(self, text_encoder: bool = True) -> str:
        """What caches key results by, instead of a file name that can change. Computed once: it reads every tensor."""
        if text_encoder not in self._digests:
            self._digests[text_encoder] = self._hash(text_encoder)
        return self._digests[text_encoder]

    def _hash(self, text_encoder: bool) -> str:
        h = hashlib.blake2b(digest_size=16)
        for p in self.patches + (self.text_encoder_patches if text_encoder else []):
            h.update(repr((p.target, p.rows, p.kind, p.scale, p.swap_halves, sorted(p.tensors))).encode())
            for t in [*p.tensors.values(), *([] if p.dora_scale is None else [p.dora_scale])]:
                h.update(tensor_digest(t).encode())
        return h.hexdigest()


@dataclass(frozen=True)
class AdapterUse:
    """What a chain of LoRA nodes carries; followers read ``file`` again and check it against ``digest``."""

    file: str                      # a LoRA folder entry (the nodes) or a path (followers)
    digest: str                    # Adapter.digest of what it does, as read
    strength: float
    merge: bool | None = None      # merge into quantized weights too (patching.merge_asked)
    adapter: Adapter | None = field(default=None, compare=False, repr=False)    # its patches, once read

    def shared(self) -> dict:
        return {"file": self.file, "digest": self.digest, "strength": self.strength, "merge": self.merge}


def read_adapter(source: str | Path | Mapping[str, Tensor], params: ModelParams,
                 text_encoder_keys: Mapping[str, object] | Iterable[str] | None = None,
                 metadata: Mapping[str, str] | None = None, name: str | None = None) -> Adapter:
    """``text_encoder_keys``: the text encoder's names, or a mapping to tensors or shapes (then checked); None:
    text-encoder patches unchecked.
    """
    if isinstance(source, Mapping):
        state, meta, where = dict(source), dict(metadata or {}), name or "the adapter"
    else:
        state, meta = _read_file(source)
        where = name or Path(source).name
    te_shapes = _text_encoder_shapes(text_encoder_keys)
    names = model_names(params)
    groups = (*(g for g, _ in names.family.adapters.groups), OTHER, TEXT_ENCODER_GROUP)
    report = MatchReport(where, groups)
    modules: dict[tuple[str, str], tuple[Target, dict[str, str]]] = {}      # (path, our module) -> (target, role keys)
    for key in state:
        split = split_key(key)
        found = resolve(split[0], names, te_shapes) if split else None
        if found is None:
            report.unmatched[key] = ("not an adapter tensor" if not split else
                                     "a text-encoder layer this encoder does not have" if TEXT_ENCODER.search(split[0])
                                     else f"no {names.family.title} weight has this name")
            continue
        target, fmt = found
        if fmt not in report.formats:
            report.formats.append(fmt)
        modules.setdefault((split[0], target.module), (target, {}))[1][split[1]] = key

    unmatched = list(report.unmatched)
    refuse_other_family(unmatched, names, params, where)
    refuse_missing_blocks(unmatched, names, params, where)
    patches = []
    for (path, _), (target, roles) in modules.items():
        patch = _patch(path, target, {role: state[k] for role, k in roles.items()}, meta, where, names, params)
        if patch is None:
            report.unmatched.update({k: "an alpha or dora_scale without adapter weights" for k in roles.values()})
            continue
        patches.append(patch)
        report.tensors[target.group] += len(roles)
        report.modules[target.group] += 1
        kind = patch.kind + ("+dora" if patch.dora_scale is not None else "")
        if kind not in report.kinds:
            report.kinds.append(kind)
    if not patches:
        keys = ", ".join(list(state)[:4]) or "none"
        raise Flux2Error(f"{where}: none of its {len(state)} keys is a LoRA/LoKr weight of {names.family.title} (keys such as "
                         f"{keys}); it is not an adapter for this model")
    return Adapter(where, [p for p in patches if p.group != TEXT_ENCODER_GROUP],
                   [p for p in patches if p.group == TEXT_ENCODER_GROUP], report)


def _read_file(path: str | Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    ckpt = open_checkpoint(path, "")
    state = {}
    for file in ckpt.files:
        with open(file, "rb") as f:
            for key, info in ckpt.tensors.items():
                if info.file != file:
                    continue
                if info.dtype not in TORCH_DTYPES:
                    raise Flux2Error(f"{file}: tensor {key!r} is stored as {info.dtype}, which adapters cannot use")
                state[key] = read_tensor(info, f)
    return state, ckpt.metadata


def _text_encoder_shapes(keys) -> dict[str, tuple[int, int] | None] | None:
    if keys is None:
        return None
    items = keys.items() if isinstance(keys, Mapping) else ((k, None) for k in keys)
    return {k.removesuffix(".weight"): (tuple(getattr(v, "shape", v)) if v is not None else None) for k, v in items}


def _matrix(t: Tensor) -> Tensor:
    """A Linear factor stored as a 1x1 conv ([r, in, 1, 1]), as some trainers save them, as a matrix."""
    return t.reshape(t.shape[0], -1) if t.dim() > 2 and all(n == 1 for n in t.shape[2:]) else t


def _peft_alpha(meta: Mapping[str, str], path: str, rank: int, component: str = "transformer") -> float | None:
    """diffusers writes one LoraConfig per adapted model, fields prefixed "transformer." etc. (or none: one for all)."""
    raw = meta.get("lora_adapter_metadata")
    if not raw:
        return None
    config = parse_json(raw, "the adapter's lora_adapter_metadata", dict,
                        "the file's metadata is damaged: save the adapter again, or download it again")
    if not isinstance(config.get("alpha_pattern") or {}, dict):
        raise Flux2Error(f"the adapter's lora_adapter_metadata is not a PEFT LoraConfig (an object with lora_alpha "
                         f"and alpha_pattern): {raw[:80]!r}")
    if any(k.startswith(("transformer.", "text_encoder.")) for k in config):
        mine = component + "."
        config = {k.removeprefix(mine): v for k, v in config.items() if k.startswith(mine)}
    alpha = config.get("lora_alpha")
    module = path.removeprefix(component + ".")
    for pattern, value in (config.get("alpha_pattern") or {}).items():       # PEFT: a regex on the module's name end
        try:
            hit = re.fullmatch(pattern[1:] if pattern.startswith("^") else rf"(.*\.)?{pattern}", module)
        except re.error as error:
            raise Flux2Error(f"the adapter's alpha_pattern {pattern!r} is not a regular expression ({error}); the "
                             f"file's metadata is damaged") from None
        if hit:
            alpha = value
    if alpha is None:
        return None
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise Flux2Error(f"the adapter's lora_adapter_metadata gives {path} the alpha {alpha!r}, not a finite number; "
                         f"the file's metadata is damaged")
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def check_tensors(where: str, path: str, t: dict[str, Tensor]) -> None:
    """The one check of a module's tensors before any is used; ``dora_scale``'s shape is checked later."""
    for role, tensor in t.items():
        key = f"{path}.{role}"
        if not tensor.is_floating_point():
            raise Flux2Error(f"{where}: {key} holds {str(tensor.dtype).removeprefix('torch.')} values, but adapter "
                             f"tensors are floating-point numbers; the file is damaged or not an adapter")
        if tensor.numel() == 0:
            raise Flux2Error(f"{where}: {key} is empty (shape {list(tensor.shape)}); the file is damaged")
        if role == "alpha" and tensor.numel() != 1:
            raise Flux2Error(f"{where}: {key} has shape {list(tensor.shape)}, but alpha is one number (the scale "
                             f"times the rank); the file is damaged or was written by a broken converter")
        if role not in ("alpha", "dora_scale") and tensor.dim() != 2:
            raise Flux2Error(f"{where}: {key} has shape {list(tensor.shape)}, but adapter factors of a linear layer "
                             f"are matrices [rows, columns]; the file is damaged or made for another model")
        if not bool(torch.isfinite(tensor).all()):
            raise Flux2Error(f"{where}: {key} holds NaN or infinite values, which would make every image black; the "
                             f"file is damaged (download it again)")


def _patch(path: str, target: Target, t: dict[str, Tensor], meta, where: str, names: ModelNames,
           params) -> Patch | None:
    title = names.family.title
    for role, what in CONV_ONLY.items():
        if role in t:
            raise Flux2Error(f"{where}: {path} has {what}, which exists only for convolutions; {title} has "
                             f"none, so this adapter is for another model")
    for role in ("diff_b", "set_weight"):
        if role in t:
            raise Flux2Error(f"{where}: {path}.{role} is not supported ("
                             f"{f'{title} linears have no bias' if role == 'diff_b' else 'a replaced weight'})")
    kinds = [k for k, roles in ROLES.items() if any(r in t for r in roles)]
    if not kinds:
        return None
    if len(kinds) > 1:
        raise Flux2Error(f"{where}: {path} mixes {' and '.join(kinds)} tensors; the file is corrupt")
    kind = kinds[0]
    t = {k: _matrix(v) for k, v in t.items()}
    check_tensors(where, path, t)
    alpha = float(t.pop("alpha").float().item()) if "alpha" in t else None
    dora = t.pop("dora_scale", None)

    def need(*roles):
        missing = [r for r in roles if r not in t]
        if missing:
            raise Flux2Error(f"{where}: {path} has no {'/'.join(missing)} tensor for its {kind}; the file is "
                             f"incomplete (download it again)")

    def fit(inner: str, a: Tensor, b: Tensor):
        if a.shape[1] != b.shape[0]:
            raise Flux2Error(f"{where}: {path} {inner}: shapes {list(a.shape)} and {list(b.shape)} do not multiply "
                             f"(ranks {a.shape[1]} and {b.shape[0]} differ); the file is corrupt")

    if kind == "lora":
        need("down", "up")
        fit("up @ down", t["up"], t["down"])
        rank = t["down"].shape[0]
        shape = (t["up"].shape[0], t["down"].shape[1])
        component = "text_encoder" if target.group == TEXT_ENCODER_GROUP else "transformer"
        peft = _peft_alpha(meta, path, rank, component) if alpha is None else None
        scale = alpha / rank if alpha is not None else peft if peft is not None else 1.0
    elif kind == "lokr":
        factors = []
        for w in ("w1", "w2"):
            if w not in t:
                need(w + "_a", w + "_b")
                fit(f"lokr_{w}_a @ lokr_{w}_b", t[w + "_a"], t[w + "_b"])
            factors.append(t[w].shape if w in t else (t[w + "_a"].shape[0], t[w + "_b"].shape[1]))
        shape = (factors[0][0] * factors[1][0], factors[0][1] * factors[1][1])
        rank = t["w2_b"].shape[0] if "w2_b" in t else t["w1_b"].shape[0] if "w1_b" in t else None
        scale = alpha / rank if alpha is not None and rank is not None else 1.0     # full factors: alpha unused
    elif kind == "loha":
        need(*ROLES["loha"])
        fit("hada_w1_a @ hada_w1_b", t["hada_w1_a"], t["hada_w1_b"])
        fit("hada_w2_a @ hada_w2_b", t["hada_w2_a"], t["hada_w2_b"])
        shape = (t["hada_w1_a"].shape[0], t["hada_w1_b"].shape[1])
        if (t["hada_w2_a"].shape[0], t["hada_w2_b"].shape[1]) != shape:
            raise Flux2Error(f"{where}: {path}: the two LoHa products have different shapes; the file is corrupt")
        scale = alpha / t["hada_w1_b"].shape[0] if alpha is not None else 1.0
    else:
        shape, scale = tuple(t["diff"].shape), 1.0
    shape = tuple(int(n) for n in shape)
    if len(shape) != 2 or (target.delta_shape is not None and shape != target.delta_shape):
        raise shape_error(where, path, target, shape, names, params)
    if dora is not None and tuple(dora.shape) not in ((shape[0], 1), (1, shape[1])):
        raise Flux2Error(f"{where}: {path}.dora_scale has shape {list(dora.shape)}; it must be [{shape[0]}, 1] or "
                         f"[1, {shape[1]}] for this weight")
    return Patch(target.module, target.rows, kind, t, scale, shape, path, target.swap_halves, dora, target.group)
