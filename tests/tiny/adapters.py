"""Tiny adapter files (LoRA, LoKr, LoHa, DoRA, diffs) in the formats users have, and diffusers as their oracle.

    lora = random_lora(TINY_TRANSFORMER, ["double_blocks.0.img_attn.qkv", "single_blocks.1.linear1"], rank=4)
    sd, meta = lora_state_dict(lora, "kohya", params, alpha=2.0)        # one of LORA_FORMATS
    save_adapter(sd, tmp / "lora.safetensors", meta)
    fused = diffusers_fused_weights(bfl_file, tmp / "lora.safetensors", params)   # BFL keys, ΔW merged by diffusers

A LoRA here is {our (BFL) module: (down [r, in], up [out, r])}. The diffusers names below are written from the
diffusers model's layout (``next-capabilities.md`` §1.5), not from flux2_core, so tests can check our parser
against them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from flux2_core.families.flux2.transformer import TransformerParams

from .transformer import bfl_transformer_shapes

# name -> (prefix, down suffix, up suffix, dotted BFL names | dotted diffusers names | underscored)
LORA_FORMATS = {
    "ai-toolkit": ("diffusion_model.", "lora_A.weight", "lora_B.weight", "bfl"),            # A
    "comfyui": ("diffusion_model.", "lora_down.weight", "lora_up.weight", "bfl"),           # A‴
    "peft-bfl": ("base_model.model.", "lora_A.weight", "lora_B.weight", "bfl"),             # A′
    "bare-bfl": ("", "lora_A.weight", "lora_B.weight", "bfl"),                              # A″
    "kohya": ("lora_unet_", "lora_down.weight", "lora_up.weight", "bfl_"),                  # B
    "diffusers": ("transformer.", "lora_A.weight", "lora_B.weight", "diffusers"),            # C
    "diffsynth": ("", "lora_A.weight", "lora_B.weight", "diffusers"),                       # C′
    "onetrainer": ("lora_transformer_", "lora_down.weight", "lora_up.weight", "diffusers_"),  # C″
}


def diffusers_parts(module: str) -> tuple[list[str], bool]:
    """The diffusers module(s) holding our module's rows, in row order, and whether the two halves are swapped."""
    parts = module.split(".")
    if parts[0] == "double_blocks":
        n, rest = parts[1], ".".join(parts[2:])
        table = {"img_attn.qkv": ["attn.to_q", "attn.to_k", "attn.to_v"],
                 "txt_attn.qkv": ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
                 "img_attn.proj": ["attn.to_out.0"], "txt_attn.proj": ["attn.to_add_out"],
                 "img_mlp.0": ["ff.linear_in"], "img_mlp.2": ["ff.linear_out"],
                 "txt_mlp.0": ["ff_context.linear_in"], "txt_mlp.2": ["ff_context.linear_out"]}
        return [f"transformer_blocks.{n}.{p}" for p in table[rest]], False
    if parts[0] == "single_blocks":
        name = {"linear1": "attn.to_qkv_mlp_proj", "linear2": "attn.to_out"}[parts[2]]
        return [f"single_transformer_blocks.{parts[1]}.{name}"], False
    table = {"img_in": "x_embedder", "txt_in": "context_embedder",
             "time_in.in_layer": "time_guidance_embed.timestep_embedder.linear_1",
             "time_in.out_layer": "time_guidance_embed.timestep_embedder.linear_2",
             "double_stream_modulation_img.lin": "double_stream_modulation_img.linear",
             "double_stream_modulation_txt.lin": "double_stream_modulation_txt.linear",
             "single_stream_modulation.lin": "single_stream_modulation.linear",
             "final_layer.linear": "proj_out", "final_layer.adaLN_modulation.1": "norm_out.linear"}
    return [table[module]], module == "final_layer.adaLN_modulation.1"


def module_shapes(params: TransformerParams) -> dict[str, tuple[int, int]]:
    """Our Linear modules (no ".weight") with their [out, in], from the BFL checkpoint layout."""
    return {k.removesuffix(".weight"): s for k, s in bfl_transformer_shapes(params).items() if len(s) == 2}


def random_lora(params: TransformerParams, modules: list[str], rank: int = 4, seed: int = 0):
    """{module: (down [rank, in], up [out, rank])}, N(0, 1) down and N(0, 0.1) up so ΔW is neither 0 nor huge."""
    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(params)
    return {m: (torch.randn(rank, shapes[m][1], generator=g), 0.1 * torch.randn(shapes[m][0], rank, generator=g))
            for m in modules}


def lora_state_dict(lora: dict, fmt: str, alpha: float | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """The LoRA written as format ``fmt`` (a LORA_FORMATS name); alpha as ``.alpha`` keys, or for the diffusers
    formats without alpha keys ("diffusers", "diffsynth") as PEFT metadata ``lora_adapter_metadata``."""
    prefix, down_name, up_name, naming = LORA_FORMATS[fmt]
    sd, metadata, names_written = {}, {}, []
    for module, (down, up) in lora.items():
        if naming.startswith("bfl"):
            pieces = [(module, up)]
        else:
            names, swapped = diffusers_parts(module)
            if swapped:                          # diffusers holds (scale, shift), we (shift, scale)
                up = torch.cat(up.chunk(2)[::-1])
            pieces = list(zip(names, up.chunk(len(names))))   # q/k/v: the same down, a third of up's rows each
        for name, up_part in pieces:
            path = prefix + (name.replace(".", "_") if naming.endswith("_") else name)
            names_written.append(name)
            sd[f"{path}.{down_name}"] = down.clone()
            sd[f"{path}.{up_name}"] = up_part.clone()
            if alpha is not None and fmt not in ("diffusers", "diffsynth"):
                sd[f"{path}.alpha"] = torch.tensor(float(alpha))
    if alpha is not None and fmt in ("diffusers", "diffsynth"):
        rank = next(iter(lora.values()))[0].shape[0]
        metadata = {"lora_adapter_metadata": json.dumps({"transformer.r": rank, "transformer.lora_alpha": alpha,
                                                          "transformer.target_modules": names_written})}
    return sd, metadata


def adapter_state_dict(modules: dict[str, dict[str, torch.Tensor]], prefix: str = "diffusion_model.",
                       underscore: bool = False) -> dict[str, torch.Tensor]:
    """Generic writer: {module path: {suffix ("lokr_w1", "hada_w1_a", "alpha", "dora_scale", "diff"): tensor}}."""
    out = {}
    for path, tensors in modules.items():
        name = prefix + (path.replace(".", "_") if underscore else path)
        out.update({f"{name}.{suffix}": t.clone() for suffix, t in tensors.items()})
    return out


def near_square(n: int) -> tuple[int, int]:
    """(a, b) with a·b = n, a <= b and a as large as possible: the split LyCORIS and PEFT pick by default."""
    a = max(d for d in range(1, int(n ** 0.5) + 1) if n % d == 0)
    return a, n // a


def random_lokr(shape: tuple[int, int], decompose: tuple[str, ...] = (), rank: int = 2, seed: int = 0):
    """LoKr factors for a weight [out, in]: w1 [a1, a2] small, w2 [b1, b2] large (near-square splits);
    each factor named in ``decompose`` is stored as its _a [., rank] / _b [rank, .] pair instead."""
    g = torch.Generator().manual_seed(seed)
    (a1, b1), (a2, b2) = near_square(shape[0]), near_square(shape[1])
    out = {}
    for name, (rows, cols) in (("lokr_w1", (a1, a2)), ("lokr_w2", (b1, b2))):
        if name[-2:] in decompose:
            out[name + "_a"] = torch.randn(rows, rank, generator=g) * 0.3
            out[name + "_b"] = torch.randn(rank, cols, generator=g) * 0.3
        else:
            out[name] = torch.randn(rows, cols, generator=g) * 0.3
    return out


def save_adapter(state_dict: dict[str, torch.Tensor], path: str | Path, metadata: dict | None = None) -> Path:
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(path), metadata=metadata or None)
    return Path(path)


def diffusers_fused_weights(bfl_file: str | Path, adapter_file: str | Path, params: TransformerParams,
                            config_dir: str | Path) -> dict[str, torch.Tensor]:
    """Our (BFL) weights after diffusers 0.42.1 loads the adapter into its Flux2Transformer2DModel (its own converters,
    ``Flux2LoraLoaderMixin.lora_state_dict`` + ``load_lora_into_transformer``) and fuses it (``fuse_lora``).
    The fused diffusers weights come back to BFL names through diffusers' own layout (q/k/v concatenated, or its fused
    to_qkv where a LoKr made it fuse them; norm_out.linear's halves swapped back)."""
    from diffusers.loaders.lora_pipeline import Flux2LoraLoaderMixin

    from .transformer import diffusers_transformer_from_bfl_file

    model = diffusers_transformer_from_bfl_file(bfl_file, params, config_dir)
    sd, metadata = Flux2LoraLoaderMixin.lora_state_dict(str(adapter_file), return_lora_metadata=True)
    Flux2LoraLoaderMixin.load_lora_into_transformer(sd, model, metadata=metadata)
    model.fuse_lora(lora_scale=1.0)
    theirs = {n.replace(".base_layer", ""): p.detach() for n, p in model.named_parameters() if "lora_" not in n
              and "lokr_" not in n}
    out = {}
    for module in module_shapes(params):
        names, swapped = diffusers_parts(module)
        fused = names[0].rsplit(".", 1)[0] + (".to_qkv" if "to_q" in names[0] else ".to_added_qkv")
        if len(names) == 3 and fused + ".weight" in theirs:
            weight = theirs[fused + ".weight"]
        else:
            weight = torch.cat([theirs[n + ".weight"] for n in names])
        out[module] = torch.cat(weight.chunk(2)[::-1]) if swapped else weight
    return out
