"""Adapter file keys: which of our weights, and which rows of it, a key names.

A key is ``<prefix><module path><suffix>``: the suffix gives the tensor's role (``.lora_down.weight`` -> "down",
``.lokr_w1`` -> "w1", ``.alpha``...), the path a Linear in one of the namings users' files have:

    diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight        BFL names (ai-toolkit, ComfyUI, fal), fused qkv
    lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight           kohya/musubi: BFL path with "." -> "_"
    transformer.transformer_blocks.0.attn.to_q.lora_A.weight          diffusers/PEFT: q, k, v separate
    lycoris_transformer_blocks_0_attn_to_q.lokr_w1                    LyCORIS on diffusers: path with "." -> "_"
    lora_te_model_layers_0_self_attn_q_proj.lora_down.weight          text encoder (Qwen3), kept apart

A diffusers module that is part of a fused weight is a row slice of it (``to_q``/``to_k``/``to_v``: rows [0,H),
[H,2H), [2H,3H) of ``img_attn.qkv``), by ``families.flux2.FROM_DIFFUSERS``, the weight loader's table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import Flux2Error
from ..families import linear_shapes
from ..families.flux2 import FROM_DIFFUSERS, SWAPPED_FROM_DIFFUSERS
from ..key_tables import table_recipes
from ..variants import TransformerParams

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

# Qwen3 decoder linears (our text encoder's names: transformers' Qwen3Model, "layers.N.self_attn.q_proj"), behind
# any prefix (lora_te_, text_encoder.model., text_encoders.qwen3_4b.transformer.model., te., base_model.model.model.)
TEXT_ENCODER = re.compile(r"(?:^|[._])layers[._](\d+)[._](self_attn|mlp)[._](q_proj|k_proj|v_proj|o_proj|gate_proj|"
                          r"up_proj|down_proj)$")

# Other model families, by names FLUX.2 Klein never has (checked on keys that matched none of our names).
OTHER_FAMILIES = [
    (re.compile(r"(?:img|txt)_mod[._]1(?:$|[._])|(?:img|txt)_mlp[._]net[._]"), "Qwen-Image"),
    (re.compile(r"(?:img|txt)_mod[._]lin(?:$|[._])|single_blocks[._]\d+[._]modulation[._]lin|norm1(?:_context)?"
                r"[._]linear|single_transformer_blocks[._]\d+[._](?:proj_mlp|norm[._]linear)|ff(?:_context)?[._]net"
                r"[._]|distilled_guidance_layer"), "FLUX.1"),
    (re.compile(r"(?:^|[._])(?:down_blocks|up_blocks|mid_block|input_blocks|output_blocks|middle_block)[._]\d|"
                r"^lora_te[12]_|text_model[._]encoder"), "Stable Diffusion 1.x/2.x/SDXL"),
    (re.compile(r"joint_blocks[._]\d+[._](?:x|context)_block"), "Stable Diffusion 3"),
    (re.compile(r"(?:^|\.|^lora_unet_|^lycoris_)blocks[._]\d+[._](?:self_attn|cross_attn|ffn)(?:$|[._])"), "Wan"),
    (re.compile(r"(?:img|txt)_mod[._]linear|(?:img|txt)_mlp[._]fc\d"), "HunyuanVideo"),
    (re.compile(r"(?:^|[._])layers[._]\d+[._](?:attention|feed_forward)[._]|(?:noise|context)_refiner"),
     "Lumina 2 / Z-Image"),
]

# known hidden sizes, for "made for X" hints
MODELS_BY_HIDDEN = {3072: "Klein 4B", 4096: "Klein 9B", 6144: "FLUX.2 dev"}
BLOCKS = re.compile(r"(?:^|[._])(double_blocks|single_blocks|transformer_blocks|single_transformer_blocks)[._](\d+)"
                    r"(?:[._]|$)")

GROUPS = ("double blocks", "single blocks", "other", "text encoder")   # "other": embedders, modulation, final layer


@dataclass(frozen=True)
class Target:
    """One of our Linear weights, or a row slice of it, as an adapter module patches it."""
    module: str                          # our module name: "double_blocks.0.img_attn.qkv", "layers.3.mlp.up_proj"
    shape: tuple[int, int] | None        # the whole weight's [out, in] (None: a text-encoder weight not given)
    rows: tuple[int, int] | None = None  # the slice [start, stop) of the weight's rows this module is
    swap_halves: bool = False            # diffusers order (scale, shift) -> ours (shift, scale)
    group: str = "other"

    @property
    def delta_shape(self) -> tuple[int, int] | None:
        if self.shape is None:
            return None
        return (self.rows[1] - self.rows[0], self.shape[1]) if self.rows else self.shape


def model_name(hidden: int) -> str:
    return MODELS_BY_HIDDEN.get(hidden, f"a model with hidden size {hidden}")


def _group(module: str) -> str:
    return next((g for g, p in (("double blocks", "double_blocks."), ("single blocks", "single_blocks."))
                 if module.startswith(p)), "other")


# diffusers' fused projections (``fuse_qkv_projections``; a LoKr loaded on fused qkv is saved back under these): the
# names of the three split ones -> the fused one's, which covers all of our fused qkv weight
FUSED_DIFFUSERS = {("to_q", "to_k", "to_v"): "to_qkv", ("add_q_proj", "add_k_proj", "add_v_proj"): "to_added_qkv"}


def transformer_names(params: TransformerParams) -> tuple[dict[str, Target], dict[str, Target]]:
    """(dotted names, underscore names) -> Target, for BFL and diffusers module paths of this model."""
    dotted: dict[str, Target] = {}
    recipe = table_recipes(FROM_DIFFUSERS, SWAPPED_FROM_DIFFUSERS)
    for module, shape in linear_shapes(params).items():
        swapped, group = module + ".weight" in SWAPPED_FROM_DIFFUSERS, _group(module)
        dotted[module] = Target(module, shape, group=group)
        names = [source.removesuffix(".weight") for source in recipe(module + ".weight").sources]   # q, k, v: 3
        part = shape[0] // len(names)
        for i, name in enumerate(names):
            rows = (i * part, (i + 1) * part) if len(names) > 1 else None
            dotted[name] = Target(module, shape, rows, swapped, group)
        parent, leaves = names[0].rpartition(".")[0], tuple(name.rpartition(".")[2] for name in names)
        if leaves in FUSED_DIFFUSERS:
            dotted[f"{parent}.{FUSED_DIFFUSERS[leaves]}"] = Target(module, shape, None, swapped, group)
    return dotted, {name.replace(".", "_"): t for name, t in dotted.items()}


def split_key(key: str) -> tuple[str, str] | None:
    """(module path, role) of an adapter key, or None when its suffix is no adapter tensor's."""
    suffix = next((s for s in _BY_LENGTH if key.endswith(s)), None)
    return (key[: -len(suffix)], SUFFIXES[suffix]) if suffix else None


def resolve(path: str, dotted: dict[str, Target], underscored: dict[str, Target],
            text_encoder_shapes: dict[str, tuple[int, int]] | None) -> tuple[Target, str] | None:
    """The Target a module path names and the file format it shows, or None."""
    for prefix, producer in UNDERSCORE_PREFIXES:
        if path.startswith(prefix) and path[len(prefix):] in underscored:
            return underscored[path[len(prefix):]], f"{producer} ({prefix})"
    for prefix, producer in DOTTED_PREFIXES:
        if path.startswith(prefix) and path[len(prefix):] in dotted:
            target = dotted[path[len(prefix):]]
            naming = "BFL names" if path[len(prefix):] == target.module else "diffusers names"
            return target, f"{producer} ({prefix or 'no prefix'}, {naming})"
    match = TEXT_ENCODER.search(path)
    if match:
        module = f"layers.{match[1]}.{match[2]}.{match[3]}"
        shape = None
        if text_encoder_shapes is not None:
            if module not in text_encoder_shapes:
                return None
            shape = text_encoder_shapes[module]
        return Target(module, shape, group="text encoder"), f"text encoder ({path[: match.start(0) + 1] or 'bare'})"
    return None


def refuse_other_family(keys: list[str], where: str) -> None:
    """Flux2Error when keys that matched nothing carry another model family's names."""
    for key in keys:
        for pattern, family in OTHER_FAMILIES:
            if pattern.search(key):
                raise Flux2Error(f"{where} is an adapter for {family}, not FLUX.2 Klein (key {key!r}); load a LoRA "
                                 f"made for FLUX.2 Klein")


def refuse_missing_blocks(keys: list[str], params: TransformerParams, where: str) -> None:
    """Flux2Error when a key names a block index this model does not have (an adapter for a deeper model)."""
    counts = {"double_blocks": params.depth, "transformer_blocks": params.depth,
              "single_blocks": params.depth_single_blocks, "single_transformer_blocks": params.depth_single_blocks}
    deepest: dict[str, int] = {}
    for key in keys:
        match = BLOCKS.search(key)
        if match:
            kind = "double" if match[1] in ("double_blocks", "transformer_blocks") else "single"
            deepest[kind] = max(deepest.get(kind, -1), int(match[2]))
    for key in keys:
        match = BLOCKS.search(key)
        if match and int(match[2]) >= counts[match[1]]:
            double, single = deepest.get("double", -1) + 1, deepest.get("single", -1) + 1
            guess = {(8, 24): "Klein 9B", (19, 38): "FLUX.1", (8, 48): "FLUX.2 dev"}.get((double, single))
            made = f"; it was probably made for {guess}" if guess else ""
            raise Flux2Error(f"{where} targets block {match[2]} of the {match[1]} ({key!r}), but the model has "
                             f"{params.depth} double and {params.depth_single_blocks} single blocks "
                             f"({model_name(params.hidden_size)}){made}. Use a LoRA made for "
                             f"{model_name(params.hidden_size)}")


def shape_error(where: str, key: str, target: Target, found: tuple[int, int], params: TransformerParams) -> Flux2Error:
    """The error for an adapter module whose ΔW shape does not fit our weight, with what it was probably made for."""
    expected = target.delta_shape
    H = params.hidden_size
    hint = ""
    if target.group != "text encoder":
        if found[1] in MODELS_BY_HIDDEN and found[1] != H and expected[1] == H:
            hint = (f" This adapter was made for {model_name(found[1])} (hidden {found[1]}); the model is "
                    f"{model_name(H)} ({H}): use a LoRA made for {model_name(H)}.")
        elif target.module.endswith((".linear1", "_mlp.0")) and found[0] in (7 * H, 4 * H):
            hint = " Its MLP width is FLUX.1's (4x hidden): this is a FLUX.1 LoRA, which does not fit FLUX.2."
    if not hint:
        hint = " The adapter was made for another model; use one made for this model."
    return Flux2Error(f"{where}: {key!r} gives a weight change of shape {list(found)} but {target.module}"
                      f"{f' rows {target.rows[0]}:{target.rows[1]}' if target.rows else ''} is {list(expected)}."
                      f"{hint}")
