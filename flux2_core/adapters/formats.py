"""Adapter file keys: which of our weights, and which rows of it, a key names.

A key is ``<prefix><module path><suffix>``: the suffix gives the tensor's role (``.lora_down.weight`` -> "down"), the
path a Linear in one of the namings files use (FLUX.2 Klein's examples):

    diffusion_model.<our module>.lora_A.weight                        our (BFL's) names: ai-toolkit, ComfyUI, fal
    lora_unet_<our module with "." -> "_">.lora_down.weight           kohya/musubi
    transformer.transformer_blocks.0.attn.to_q.lora_A.weight          diffusers/PEFT: q, k, v separate
    lycoris_transformer_blocks_0_attn_to_q.lokr_w1                    LyCORIS on diffusers: path with "." -> "_"
    lora_te_model_layers_0_self_attn_q_proj.lora_down.weight          text encoder (Qwen3), kept apart

A module that is part of one of our fused weights is a row slice of it (diffusers' ``to_q``: rows [0,H) of our qkv).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ..errors import Flux2Error
from ..families import Family, family_of_params, linear_shapes

# file suffix -> role; the longest matching suffix wins (".lora_A.default.weight" before ".weight" forms)
SUFFIXES = {
    ".lora_A.weight": "down", ".lora_B.weight": "up", ".lora_A.default.weight": "down",
    ".lora_B.default.weight": "up", ".lora_down.weight": "down", ".lora_up.weight": "up",
    ".lora.down.weight": "down", ".lora.up.weight": "up", "_lora.down.weight": "down", "_lora.up.weight": "up",
    ".lora_linear_layer.down.weight": "down", ".lora_linear_layer.up.weight": "up", ".lora_mid.weight": "mid",
    ".alpha": "alpha", ".dora_scale": "dora_scale", ".diff": "diff", ".diff_b": "diff_b", ".set_weight": "set_weight",
    ".lokr_w1": "w1", ".lokr_w1_a": "w1_a", ".lokr_w1_b": "w1_b", ".lokr_w2": "w2", ".lokr_w2_a": "w2_a",
    ".lokr_w2_b": "w2_b", ".lokr_t2": "t2", ".hada_w1_a": "hada_w1_a", ".hada_w1_b": "hada_w1_b",
    ".hada_w2_a": "hada_w2_a", ".hada_w2_b": "hada_w2_b", ".hada_t1": "hada_t1", ".hada_t2": "hada_t2",
}
_BY_LENGTH = sorted(SUFFIXES, key=len, reverse=True)

# dotted prefixes (tried in order; "" = bare keys) and underscore prefixes, with the producer each stands for
DOTTED_PREFIXES = [("model.diffusion_model.", "ComfyUI"), ("diffusion_model.", "BFL/ai-toolkit"),
                   ("base_model.model.", "PEFT-wrapped"), ("transformer.", "diffusers/PEFT"), ("", "bare")]
UNDERSCORE_PREFIXES = [("lora_unet_", "kohya/musubi"), ("lora_transformer_", "OneTrainer"), ("lycoris_", "LyCORIS")]

# Qwen3 decoder linears ("layers.N.self_attn.q_proj"), behind any prefix
TEXT_ENCODER = re.compile(r"(?:^|[._])layers[._](\d+)[._](self_attn|mlp)[._](q_proj|k_proj|v_proj|o_proj|gate_proj|"
                          r"up_proj|down_proj)$")

# Other model families, by names none of ours has (checked on keys that matched nothing)
OTHER_FAMILIES = [
    (re.compile(r"(?:img|txt)_mod[._]1(?:$|[._])|(?:img|txt)_mlp[._]net[._]"), "Qwen-Image"),
    (re.compile(r"(?:^|[._])(?:down_blocks|up_blocks|mid_block|input_blocks|output_blocks|middle_block)[._]\d|"
                r"^lora_te[12]_|text_model[._]encoder"), "Stable Diffusion 1.x/2.x/SDXL"),
    (re.compile(r"joint_blocks[._]\d+[._](?:x|context)_block"), "Stable Diffusion 3"),
    (re.compile(r"(?:^|\.|^lora_unet_|^lycoris_)blocks[._]\d+[._](?:self_attn|cross_attn|ffn)(?:$|[._])"), "Wan"),
    (re.compile(r"(?:img|txt)_mod[._]linear|(?:img|txt)_mlp[._]fc\d"), "HunyuanVideo"),
    (re.compile(r"(?:^|[._])layers[._]\d+[._](?:attention|feed_forward)[._]|(?:noise|context)_refiner"),
     "Lumina 2 / Z-Image"),
]

OTHER = "other"          # the report group of modules in none of the family's groups (embedders, modulation, ...)
TEXT_ENCODER_GROUP = "text encoder"


@dataclass(frozen=True)
class Target:
    """One of our Linear weights, or a row slice of it, as an adapter module patches it."""
    module: str                          # our module name: a block's fused qkv, "layers.3.mlp.up_proj"
    shape: tuple[int, int] | None        # the whole weight's [out, in] (None: a text-encoder weight not given)
    rows: tuple[int, int] | None = None  # the slice [start, stop) of the weight's rows this module is
    swap_halves: bool = False            # diffusers order (scale, shift) -> ours (shift, scale)
    group: str = OTHER
    naming: str = ""                     # the file layout whose name for the module this is ("BFL", "diffusers")

    @property
    def delta_shape(self) -> tuple[int, int] | None:
        if self.shape is None:
            return None
        return (self.rows[1] - self.rows[0], self.shape[1]) if self.rows else self.shape


# diffusers' fused projections (``fuse_qkv_projections``): the three split names -> the fused one's
FUSED_DIFFUSERS = {("to_q", "to_k", "to_v"): "to_qkv", ("add_q_proj", "add_k_proj", "add_v_proj"): "to_added_qkv"}
BLOCK_INDEX = re.compile(r"(?<=[._])\d+(?=[._]|$)")       # a module path's first index: its block's


@dataclass(frozen=True)
class ModelNames:
    """Every name adapter files give the linears of one model, and what a name with another block index would be."""
    family: Family
    dotted: Mapping[str, Target]                # every layout's module paths -> the weight (rows) they name
    underscored: Mapping[str, Target]           # the same with "." -> "_" (kohya, LyCORIS)
    blocks: Mapping[str, tuple[str, str, int]]  # path with "#" for the index -> (block list, group, blocks in it)
    depths: Mapping[str, int]                   # the family's block groups -> the blocks the model has in each

    def model_name(self, hidden: int) -> str:
        return self.family.adapters.models.get(hidden, f"a model with hidden size {hidden}")


def block_template(path: str) -> tuple[str, str, int] | None:
    """(the path with its block index as "#", the block list's name, the index), or None outside a block."""
    match = BLOCK_INDEX.search(path)
    if match is None:
        return None
    return path[: match.start()] + "#" + path[match.end():], path[: match.start() - 1], int(match[0])


def _depths(family: Family, params) -> dict[str, int]:
    """The family's groups of numbered blocks -> how many blocks the model has in each."""
    indices = {group: {t[2] for m in linear_shapes(params) if m.startswith(prefix) and (t := block_template(m))}
               for group, prefix in family.adapters.groups}
    return {group: len(found) for group, found in indices.items() if found}


@functools.lru_cache(maxsize=8)
def model_names(params) -> ModelNames:
    """The names adapter files may give this model's linears: ours and each of the family's file layouts'."""
    family = family_of_params(params)
    groups = family.adapters.groups
    dotted: dict[str, Target] = {}
    for layout in family.layouts:
        recipe = layout.recipes(set())
        for module, shape in linear_shapes(params).items():
            made = recipe(module + ".weight")
            group = next((g for g, prefix in groups if module.startswith(prefix)), OTHER)
            names = [source.removesuffix(".weight") for source in made.sources]       # fused q, k, v: three
            part = shape[0] // len(names)
            for i, name in enumerate(names):
                rows = (i * part, (i + 1) * part) if len(names) > 1 else None
                dotted.setdefault(name, Target(module, shape, rows, made.swap_halves, group, layout.name))
            parent, leaves = names[0].rpartition(".")[0], tuple(name.rpartition(".")[2] for name in names)
            if leaves in FUSED_DIFFUSERS:
                dotted.setdefault(f"{parent}.{FUSED_DIFFUSERS[leaves]}",
                                  Target(module, shape, None, made.swap_halves, group, layout.name))
    underscored = {name.replace(".", "_"): t for name, t in dotted.items()}
    depths = _depths(family, params)
    blocks = {}
    for name, target in [*dotted.items(), *underscored.items()]:
        template = block_template(name)
        if template and target.group in depths:
            blocks[template[0]] = (template[1], target.group, depths[target.group])
    return ModelNames(family, MappingProxyType(dotted), MappingProxyType(underscored), MappingProxyType(blocks),
                      MappingProxyType(depths))


def split_key(key: str) -> tuple[str, str] | None:
    """(module path, role) of an adapter key, or None when its suffix is no adapter tensor's."""
    suffix = next((s for s in _BY_LENGTH if key.endswith(s)), None)
    return (key[: -len(suffix)], SUFFIXES[suffix]) if suffix else None


def _unprefixed(path: str):
    """(path without the prefix, its joiner "_" or ".", producer, prefix) for every prefix the path has."""
    for prefix, producer in UNDERSCORE_PREFIXES:
        if path.startswith(prefix):
            yield path[len(prefix):], "_", producer, prefix
    for prefix, producer in DOTTED_PREFIXES:
        if path.startswith(prefix):
            yield path[len(prefix):], ".", producer, prefix


def resolve(path: str, names: ModelNames,
            text_encoder_shapes: dict[str, tuple[int, int]] | None) -> tuple[Target, str] | None:
    """The Target a module path names and the file format it shows, or None."""
    for rest, joiner, producer, prefix in _unprefixed(path):
        if joiner == "_" and rest in names.underscored:
            return names.underscored[rest], f"{producer} ({prefix})"
        if joiner == "." and rest in names.dotted:
            target = names.dotted[rest]
            return target, f"{producer} ({prefix or 'no prefix'}, {target.naming} names)"
    match = TEXT_ENCODER.search(path)
    if match:
        module = f"layers.{match[1]}.{match[2]}.{match[3]}"
        shape = None
        if text_encoder_shapes is not None:
            if module not in text_encoder_shapes:
                return None
            shape = text_encoder_shapes[module]
        return Target(module, shape, group=TEXT_ENCODER_GROUP), f"text encoder ({path[: match.start(0) + 1] or 'bare'})"
    return None


def refuse_other_family(keys: list[str], names: ModelNames, params, where: str) -> None:
    """Flux2Error when keys that matched nothing carry another model family's names."""
    model = names.model_name(params.hidden_size)
    for key in keys:
        for pattern, family in (*names.family.adapters.lookalikes, *OTHER_FAMILIES):
            if pattern.search(key):
                raise Flux2Error(f"{where} is an adapter for {family}, not {names.family.title} ({model}) (key "
                                 f"{key!r}); load a LoRA made for {model}")


def refuse_missing_blocks(keys: list[str], names: ModelNames, params, where: str) -> None:
    """Flux2Error when a key names a block this model does not have, with the model it fits."""
    found = []                                                    # (key, block list, group, blocks there, index)
    for key in keys:
        split = split_key(key)
        for rest, *_ in _unprefixed(split[0]) if split else ():
            template = block_template(rest)
            if template and template[0] in names.blocks:
                found.append((key, *names.blocks[template[0]], template[2]))
                break
    beyond = [f for f in found if f[4] >= f[3]]
    if not beyond:
        return
    key, block_list, _, _, index = beyond[0]
    deepest = {group: max(f[4] for f in found if f[2] == group) for group in {f[2] for f in found}}
    has = ", ".join(f"{n} {group}" for group, n in names.depths.items())
    model = names.model_name(params.hidden_size)
    models = [*((names.model_name(v.params.hidden_size), _depths(names.family, v.params))
                for v in names.family.variants if v.params != params),
              *names.family.adapters.other_depths]
    fits = [(sum(d.values()), name) for name, d in models if all(i < d.get(g, 0) for g, i in deepest.items())]
    made = f"; it was probably made for {min(fits)[1]}" if fits else ""
    raise Flux2Error(f"{where} targets block {index} of the {block_list} ({key!r}), but the model has {has} "
                     f"({model}){made}. Use a LoRA made for {model}")


def shape_error(where: str, key: str, target: Target, found: tuple[int, int], names: ModelNames,
                params) -> Flux2Error:
    """The error for an adapter module whose ΔW shape does not fit our weight, with what it was probably made for."""
    expected = target.delta_shape
    H = params.hidden_size
    hint = ""
    if target.group != TEXT_ENCODER_GROUP:
        if found[1] in names.family.adapters.models and found[1] != H and expected[1] == H:
            hint = (f" This adapter was made for {names.model_name(found[1])} (hidden {found[1]}); the model is "
                    f"{names.model_name(H)} ({H}): use a LoRA made for {names.model_name(H)}.")
        else:
            hint = names.family.adapters.shape_hint(target.module, found, H)
    if not hint:
        hint = " The adapter was made for another model; use one made for this model."
    return Flux2Error(f"{where}: {key!r} gives a weight change of shape {list(found)} but {target.module}"
                      f"{f' rows {target.rows[0]}:{target.rows[1]}' if target.rows else ''} is {list(expected)}."
                      f"{hint}")
