"""Weights: safetensors files in every layout users have, loaded into our modules (whose keys are BFL's).

| model        | accepted                                                                                          |
|--------------|---------------------------------------------------------------------------------------------------|
| transformer  | BFL single file (``flux-2-klein-4b.safetensors``); ComfyUI ``diffusion_models/`` file (BFL keys,   |
|              | with or without ``model.diffusion_model.``); diffusers ``transformer/`` folder or pipeline root    |
| autoencoder  | BFL ``ae.safetensors``; ComfyUI ``vae/flux2-vae.safetensors`` (BFL keys, maybe ``vae.``);          |
|              | diffusers ``vae/`` folder or pipeline root                                                        |
| text encoder | HF / diffusers ``text_encoder/`` folder (one file or shards + index); ComfyUI                     |
|              | ``text_encoders/qwen_3_4b.safetensors`` (HF keys, maybe ``text_encoders.qwen3_4b.transformer.``)  |

A load goes in five steps:

1. find the files (one file, or a folder's single file / index + shards) and check every safetensors header;
2. find the key prefix (ComfyUI nests models under ``model.diffusion_model.``, ``vae.``, ``text_encoders.…``) and
   the layout (BFL or diffusers naming) from one signature key;
3. read the architecture from tensor shapes and build the module on the meta device (no memory);
4. for every key the module expects, a *recipe* names the file tensors it comes from (a rename, a q/k/v concat, a
   halves swap); they are read straight to the target device, dequantized if fp8, cast, reshaped (Linear <-> 1x1 conv);
5. ``load_state_dict(strict=True, assign=True)``: the module's parameters *are* the tensors read, so nothing is
   allocated twice.

Nothing is ever unpickled: .ckpt / .pt / .bin files are refused with a message saying to use a .safetensors file.

Quantised files are dequantized on load to the compute dtype (``weight.float() * scale``, then cast):

* ComfyUI fp8 / "fp8mixed": float8 weights with a per-tensor ``.weight_scale`` (listed in the
  ``_quantization_metadata`` safetensors metadata or in ``.comfy_quant`` tensors), and the older ``scaled_fp8``
  files with ``.scale_weight``;
* BFL fp8 ("fp8r"): float8_e4m3fn weights with a per-row ``.weight_scale`` [N];
* BFL nvfp4: packed E2M1 weights [N, K/2] (even element in the low nibble), float8 block scales ``.weight_scale``
  [N, K/16] and a global ``.weight_scale_2``;
* Hugging Face fine-grained fp8 (``Qwen/Qwen3-4B-FP8``): float8 weights with block scales ``.weight_scale_inv``;
* plain float8 weights with no scale.

``.input_scale`` (activation scales) are not needed and dropped. Any other scheme is refused with a Flux2Error.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from .autoencoder import AutoEncoder
from .errors import Flux2Error
from .text_encoder import PromptEncoder, build_qwen3_encoder
from .tokenizer import load_tokenizer
from .transformer import Flux2Transformer
from .variants import QWEN3_4B, QWEN3_8B, AutoEncoderParams, TransformerParams, Variant, get_variant, variant_for_params

# ---------------------------------------------------------------------------------------------------------------
# 1. safetensors headers: read and check, never unpickle
# ---------------------------------------------------------------------------------------------------------------

# bytes per element of the safetensors dtype codes (sub-byte codes such as F4 are not size-checked)
ITEM_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
              "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
PICKLE_SUFFIXES = {".ckpt", ".pt", ".pth", ".bin", ".pkl", ".pickle"}
MAX_HEADER = 100 * 2**20


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    name: str                  # the key as stored in the file
    dtype: str                 # safetensors dtype code: "BF16", "F8_E4M3", ...
    shape: tuple[int, ...]


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The tensors of one .safetensors file and its metadata, after checking that the file is whole."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        start = f.read(8)
        length = struct.unpack("<Q", start)[0] if len(start) == 8 else -1
        raw = f.read(length) if 0 < length <= min(size - 8, MAX_HEADER) else b""
    try:
        header = json.loads(raw) if raw[:1] == b"{" else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict):
        refuse_other_format(path, start)
        raise Flux2Error(f"{path} is not a valid .safetensors file (its header cannot be read): the file is corrupt "
                         f"or only partly downloaded; download it again")
    metadata = header.pop("__metadata__", None) or {}
    data_size = size - 8 - length
    tensors = {}
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(n) for n in entry["shape"]), entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise Flux2Error(f"{path} is corrupt: the header entry for {name!r} is malformed; download it again") from None
        if end > data_size:
            raise Flux2Error(f"{path} is truncated: tensor {name!r} ends at byte {end:,} of the data but the file holds "
                             f"only {data_size:,}; the download was probably interrupted, download it again")
        if dtype in ITEM_BYTES and end - begin != ITEM_BYTES[dtype] * math.prod(shape):
            raise Flux2Error(f"{path} is corrupt: tensor {name!r} ({dtype} {list(shape)}) has {end - begin:,} bytes")
        tensors[name] = TensorInfo(path, name, dtype, shape)
    return tensors, metadata


def refuse_other_format(path: Path, start: bytes) -> None:
    """Raise a Flux2Error naming the format when a weights file is pickle-based or GGUF (nothing is loaded)."""
    if start[:4] == b"GGUF":
        raise Flux2Error(f"{path} is a GGUF file; GGUF weights are not supported here. Use the .safetensors release "
                         f"(bf16 or fp8) of these weights")
    pickled = start[:1] == b"\x80" and start[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")    # pickle protocol 2-5
    if start[:4] == b"PK\x03\x04" or pickled or path.suffix.lower() in PICKLE_SUFFIXES:     # torch.save is a zip
        raise Flux2Error(f"{path} is a pickle-based checkpoint (.ckpt/.pt/.bin), not a .safetensors file. Pickle files "
                         f"can run arbitrary code when opened, so they are never loaded here: download the "
                         f".safetensors version of these weights (or convert the file once with a tool you trust)")


# ---------------------------------------------------------------------------------------------------------------
# 2. finding the files: a single file, a model folder, or a diffusers pipeline root
# ---------------------------------------------------------------------------------------------------------------

STANDARD_NAMES = ("diffusion_pytorch_model.safetensors", "model.safetensors")


@dataclass
class Checkpoint:
    path: Path                          # what the caller gave
    files: list[Path]
    tensors: dict[str, TensorInfo]      # every key of every file, as stored
    metadata: dict[str, str]            # safetensors metadata (merged over shards)
    config: dict                        # the folder's config.json ({} for a single file)
    root: Path | None                   # the pipeline root holding model_index.json, if any


def open_checkpoint(path: str | Path, subfolder: str) -> Checkpoint:
    """Find and check the safetensors files at ``path`` (a file, a model folder or a pipeline root)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise Flux2Error(f"weights not found: {path} does not exist; check the path (or the file name in the model "
                         f"folder)")
    folder = None
    if path.is_file():
        files = [path]
    else:
        folder = path / subfolder if (path / subfolder).is_dir() else path      # a diffusers pipeline root
        files = _folder_files(folder)
    tensors, metadata = {}, {}
    for file in files:
        found, meta = read_header(file)
        tensors.update(found)
        metadata.update(meta)
    config = _read_json(folder / "config.json") if folder else {}
    root = next((p for p in ([folder, folder.parent] if folder else [path.parent])
                 if (p / "model_index.json").is_file()), None)
    return Checkpoint(path, files, tensors, metadata, config, root)


def _weight_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith((".safetensors", ".sft")))


def _folder_files(folder: Path) -> list[Path]:
    """The files of one model folder: those its index names, else its one .safetensors file."""
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        index = next((i for i in indexes if i.name[: -len(".index.json")] in STANDARD_NAMES), indexes[0])
        weight_map = _read_json(index).get("weight_map", {})
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if not files or missing:
            raise Flux2Error(f"{index} names shards that are not in {folder}: {', '.join(missing[:5]) or 'none'}; "
                             f"download the missing files")
        return files
    files = _weight_files(folder)
    standard = [f for f in files if f.name in STANDARD_NAMES]
    if len(standard) == 1 or len(files) == 1:
        return standard or files
    if files:
        raise Flux2Error(f"{folder} holds several .safetensors files ({', '.join(f.name for f in files[:5])}) and no "
                         f"*.safetensors.index.json; pass the path of one file")
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise Flux2Error(f"{folder} has only pickle-based weights ({', '.join(pickles[:3])}), which are never loaded "
                         f"here because they can run code; download the .safetensors version")
    raise Flux2Error(f"{folder} holds no .safetensors weights; pass a .safetensors file or a model folder")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Flux2Error(f"{path} is not valid JSON ({e}); download it again") from None


# ---------------------------------------------------------------------------------------------------------------
# 3. layouts: which naming the file uses, behind which prefix, and what a file is when it is not what we want
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Recipe:
    """Where one of our keys comes from: file keys (concatenated along dim 0 when several: fused q/k/v)."""
    sources: tuple[str, ...]
    swap_halves: bool = False          # diffusers' final-layer modulation is (scale, shift), BFL's (shift, scale)


@dataclass(frozen=True)
class Layout:
    name: str                                              # e.g. "BFL", "diffusers"
    signature: str                                         # a key only this layout has (after the prefix)
    recipes: Callable[[set[str]], Callable[[str], Recipe]]  # file keys -> (our key -> recipe)


def same_names(keys: set[str]) -> Callable[[str], Recipe]:
    return lambda key: Recipe((key,))


def find_layout(ckpt: Checkpoint, layouts: list[Layout], what: str, loader: str) -> tuple[Layout, str]:
    """The layout whose signature key the checkpoint has, and the prefix in front of it ("" when none)."""
    for layout in layouts:
        prefixes = [k[: -len(layout.signature)] for k in ckpt.tensors if k.endswith(layout.signature)]
        prefixes = [p for p in prefixes if p == "" or p.endswith(".")]
        if prefixes:
            return layout, min(prefixes, key=len)
    raise Flux2Error(f"{ckpt.path} is not {what}: it looks like {describe(ckpt)}. {loader}")


def describe(ckpt: Checkpoint) -> str:
    """A short description of what a checkpoint holds, from its keys (for error messages)."""
    keys = set(ckpt.tensors)

    def has(suffix: str) -> str | None:
        return next((k for k in keys if k.endswith(suffix)), None)

    if not keys:
        return "an empty file (no tensors)"
    if any("lora" in k.lower() for k in keys):
        return "a LoRA (its keys mention lora); load it as a LoRA on top of a model, not as a model"
    if has("double_stream_modulation_img.lin.weight") or has("double_stream_modulation_img.linear.weight"):
        return "a FLUX.2 transformer (diffusion model)"
    if has("double_blocks.0.img_mod.lin.weight") or has("transformer_blocks.0.norm1.linear.weight"):
        return "a FLUX.1 transformer; FLUX.2 Klein needs its own flux-2-klein-*.safetensors"
    if has("decoder.conv_in.weight"):
        if has("bn.running_mean"):
            return "a FLUX.2 autoencoder (VAE)"
        return "an autoencoder without FLUX.2's latent BatchNorm (a FLUX.1 or Stable Diffusion VAE)"
    q_norm, q_proj = has("layers.0.self_attn.q_norm.weight"), has("layers.0.self_attn.q_proj.weight")
    if q_proj:
        hidden = ckpt.tensors[q_proj].shape[-1]
        if q_norm:
            return f"{qwen3_name(hidden)} text encoder (hidden size {hidden})"
        if has("layers.0.self_attn.k_proj.bias"):
            return f"a Qwen2.5 text encoder (hidden size {hidden})"
        return f"a {'Mistral' if hidden == 5120 else 'Llama/Mistral-style'} text encoder (hidden size {hidden})"
    if has("text_model.encoder.layers.0.mlp.fc1.weight"):
        return "a CLIP text encoder"
    if has("encoder.block.0.layer.0.SelfAttention.k.weight"):
        return "a T5 text encoder"
    if has("input_blocks.0.0.weight"):
        return "a Stable Diffusion UNet"
    return f"an unrecognised checkpoint (keys such as {', '.join(sorted(keys)[:3])})"


def qwen3_name(hidden: int) -> str:
    names = {1024: "a Qwen3-0.6B", 2048: "a Qwen3-1.7B", 2560: "a Qwen3-4B", 4096: "a Qwen3-8B", 5120: "a Qwen3-14B"}
    return names.get(hidden, "a Qwen3")


# ---------------------------------------------------------------------------------------------------------------
# 4. key mapping tables: our (BFL) key <- the file's key(s)
# ---------------------------------------------------------------------------------------------------------------
# Placeholders: {i} {j} block indices, {r} the reversed decoder level, {p} weight|bias, {e} encoder|decoder,
# {m} a resnet layer, {b} a BatchNorm buffer. A tuple of sources is concatenated along dim 0.

PLACEHOLDERS = {"i": r"\d+", "j": r"\d+", "p": "weight|bias", "e": "encoder|decoder",
                "m": "norm1|conv1|norm2|conv2", "b": "running_mean|running_var|num_batches_tracked"}

TRANSFORMER_FROM_DIFFUSERS = [
    ("img_in.weight", "x_embedder.weight"),
    ("txt_in.weight", "context_embedder.weight"),
    ("time_in.in_layer.weight", "time_guidance_embed.timestep_embedder.linear_1.weight"),
    ("time_in.out_layer.weight", "time_guidance_embed.timestep_embedder.linear_2.weight"),
    ("guidance_in.in_layer.weight", "time_guidance_embed.guidance_embedder.linear_1.weight"),
    ("guidance_in.out_layer.weight", "time_guidance_embed.guidance_embedder.linear_2.weight"),
    ("double_stream_modulation_img.lin.weight", "double_stream_modulation_img.linear.weight"),
    ("double_stream_modulation_txt.lin.weight", "double_stream_modulation_txt.linear.weight"),
    ("single_stream_modulation.lin.weight", "single_stream_modulation.linear.weight"),
    ("double_blocks.{i}.img_attn.qkv.weight", ("transformer_blocks.{i}.attn.to_q.weight",
                                               "transformer_blocks.{i}.attn.to_k.weight",
                                               "transformer_blocks.{i}.attn.to_v.weight")),
    ("double_blocks.{i}.txt_attn.qkv.weight", ("transformer_blocks.{i}.attn.add_q_proj.weight",
                                               "transformer_blocks.{i}.attn.add_k_proj.weight",
                                               "transformer_blocks.{i}.attn.add_v_proj.weight")),
    ("double_blocks.{i}.img_attn.norm.query_norm.scale", "transformer_blocks.{i}.attn.norm_q.weight"),
    ("double_blocks.{i}.img_attn.norm.key_norm.scale", "transformer_blocks.{i}.attn.norm_k.weight"),
    ("double_blocks.{i}.txt_attn.norm.query_norm.scale", "transformer_blocks.{i}.attn.norm_added_q.weight"),
    ("double_blocks.{i}.txt_attn.norm.key_norm.scale", "transformer_blocks.{i}.attn.norm_added_k.weight"),
    ("double_blocks.{i}.img_attn.proj.weight", "transformer_blocks.{i}.attn.to_out.0.weight"),
    ("double_blocks.{i}.txt_attn.proj.weight", "transformer_blocks.{i}.attn.to_add_out.weight"),
    ("double_blocks.{i}.img_mlp.0.weight", "transformer_blocks.{i}.ff.linear_in.weight"),
    ("double_blocks.{i}.img_mlp.2.weight", "transformer_blocks.{i}.ff.linear_out.weight"),
    ("double_blocks.{i}.txt_mlp.0.weight", "transformer_blocks.{i}.ff_context.linear_in.weight"),
    ("double_blocks.{i}.txt_mlp.2.weight", "transformer_blocks.{i}.ff_context.linear_out.weight"),
    ("single_blocks.{i}.linear1.weight", "single_transformer_blocks.{i}.attn.to_qkv_mlp_proj.weight"),
    ("single_blocks.{i}.linear2.weight", "single_transformer_blocks.{i}.attn.to_out.weight"),
    ("single_blocks.{i}.norm.query_norm.scale", "single_transformer_blocks.{i}.attn.norm_q.weight"),
    ("single_blocks.{i}.norm.key_norm.scale", "single_transformer_blocks.{i}.attn.norm_k.weight"),
    ("final_layer.linear.weight", "proj_out.weight"),
    ("final_layer.adaLN_modulation.1.weight", "norm_out.linear.weight"),      # halves swapped
]
SWAPPED_FROM_DIFFUSERS = {"final_layer.adaLN_modulation.1.weight"}

# diffusers numbers decoder levels from the deepest (up_blocks.0), BFL from the shallowest (up.0): {r} = levels-1-i.
# Attention q/k/v/out are 1x1 convs [C,C,1,1] in BFL and Linears [C,C] in diffusers; shapes are fitted on load.
AUTOENCODER_FROM_DIFFUSERS = [
    ("encoder.quant_conv.{p}", "quant_conv.{p}"),
    ("decoder.post_quant_conv.{p}", "post_quant_conv.{p}"),
    ("{e}.conv_in.{p}", "{e}.conv_in.{p}"),
    ("{e}.conv_out.{p}", "{e}.conv_out.{p}"),
    ("{e}.norm_out.{p}", "{e}.conv_norm_out.{p}"),
    ("encoder.down.{i}.block.{j}.{m}.{p}", "encoder.down_blocks.{i}.resnets.{j}.{m}.{p}"),
    ("encoder.down.{i}.block.{j}.nin_shortcut.{p}", "encoder.down_blocks.{i}.resnets.{j}.conv_shortcut.{p}"),
    ("encoder.down.{i}.downsample.conv.{p}", "encoder.down_blocks.{i}.downsamplers.0.conv.{p}"),
    ("decoder.up.{i}.block.{j}.{m}.{p}", "decoder.up_blocks.{r}.resnets.{j}.{m}.{p}"),
    ("decoder.up.{i}.block.{j}.nin_shortcut.{p}", "decoder.up_blocks.{r}.resnets.{j}.conv_shortcut.{p}"),
    ("decoder.up.{i}.upsample.conv.{p}", "decoder.up_blocks.{r}.upsamplers.0.conv.{p}"),
    ("{e}.mid.block_1.{m}.{p}", "{e}.mid_block.resnets.0.{m}.{p}"),
    ("{e}.mid.block_2.{m}.{p}", "{e}.mid_block.resnets.1.{m}.{p}"),
    ("{e}.mid.attn_1.norm.{p}", "{e}.mid_block.attentions.0.group_norm.{p}"),
    ("{e}.mid.attn_1.q.{p}", "{e}.mid_block.attentions.0.to_q.{p}"),
    ("{e}.mid.attn_1.k.{p}", "{e}.mid_block.attentions.0.to_k.{p}"),
    ("{e}.mid.attn_1.v.{p}", "{e}.mid_block.attentions.0.to_v.{p}"),
    ("{e}.mid.attn_1.proj_out.{p}", "{e}.mid_block.attentions.0.to_out.0.{p}"),
    ("bn.{b}", "bn.{b}"),
]


def _template_regex(template: str) -> re.Pattern:
    pattern = re.escape(template)
    for name, alternatives in PLACEHOLDERS.items():
        pattern = pattern.replace(re.escape("{" + name + "}"), f"(?P<{name}>{alternatives})")
    return re.compile(pattern)


def table_recipes(table: list, swapped: set[str] = frozenset(), levels: int = 0) -> Callable[[str], Recipe]:
    """our key -> Recipe, from a table of (our template, file template or tuple of them)."""
    compiled = [(_template_regex(ours), theirs) for ours, theirs in table]

    def recipe(key: str) -> Recipe:
        for pattern, theirs in compiled:
            match = pattern.fullmatch(key)
            if match:
                fields = match.groupdict()
                if "i" in fields:
                    fields["r"] = str(levels - 1 - int(fields["i"]))
                sources = (theirs,) if isinstance(theirs, str) else theirs
                return Recipe(tuple(s.format(**fields) for s in sources), key in swapped)
        raise KeyError(f"no mapping for {key!r}")       # a missing table row: a bug here, not bad input
    return recipe


def bfl_autoencoder_recipes(keys: set[str]) -> Callable[[str], Recipe]:
    """BFL names; VAEs saved by ComfyUI keep the two 1x1 quant convs at the top level (``quant_conv.*``)."""
    top = {"encoder.quant_conv.": "quant_conv.", "decoder.post_quant_conv.": "post_quant_conv."}

    def recipe(key: str) -> Recipe:
        for ours, theirs in top.items():
            if key.startswith(ours) and theirs + key[len(ours):] in keys:
                return Recipe((theirs + key[len(ours):],))
        return Recipe((key,))
    return recipe


def diffusers_autoencoder_recipes(keys: set[str]) -> Callable[[str], Recipe]:
    levels = len({m.group(1) for k in keys if (m := re.match(r"decoder\.up_blocks\.(\d+)\.", k))})
    return table_recipes(AUTOENCODER_FROM_DIFFUSERS, levels=levels)


TRANSFORMER_LAYOUTS = [
    Layout("BFL", "double_stream_modulation_img.lin.weight", same_names),
    Layout("diffusers", "double_stream_modulation_img.linear.weight",
           lambda keys: table_recipes(TRANSFORMER_FROM_DIFFUSERS, SWAPPED_FROM_DIFFUSERS)),
]
AUTOENCODER_LAYOUTS = [
    Layout("BFL", "encoder.down.0.block.0.conv1.weight", bfl_autoencoder_recipes),
    Layout("diffusers", "encoder.down_blocks.0.resnets.0.conv1.weight", diffusers_autoencoder_recipes),
]
OPTIONAL_KEYS = {"bn.num_batches_tracked"}       # not every AE file has it; it is unused, so 0 is fine


# ---------------------------------------------------------------------------------------------------------------
# 5. quantised weights
# ---------------------------------------------------------------------------------------------------------------

SCALE_SUFFIXES = (".weight_scale", ".scale_weight", ".weight_scale_inv")
DROPPED_SUFFIXES = (".input_scale", ".scale_input", ".comfy_quant", ".weight_scale_2") + SCALE_SUFFIXES
UNSUPPORTED_SUFFIXES = {".qweight": "GPTQ/AWQ", ".qzeros": "GPTQ/AWQ", ".g_idx": "GPTQ", ".SCB": "bitsandbytes int8",
                        ".absmax": "bitsandbytes", ".quant_map": "bitsandbytes",
                        ".quant_state.bitsandbytes__nf4": "bitsandbytes nf4",
                        ".quant_state.bitsandbytes__fp4": "bitsandbytes fp4"}
COMFY_FP8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)   # nvfp4 codes


def comfy_formats(ckpt: Checkpoint, prefix: str) -> dict[str, str]:
    """ComfyUI's quantisation formats of the layers behind ``prefix`` (layer key, prefix stripped -> format), from
    the ``_quantization_metadata`` safetensors metadata and ``.comfy_quant`` tensors.

    Refuses formats that cannot be dequantized here, and files quantised with other tools (GPTQ, bitsandbytes).
    """
    keys = [k for k in ckpt.tensors if k.startswith(prefix)]
    for key in keys:
        for suffix, tool in UNSUPPORTED_SUFFIXES.items():
            if key.endswith(suffix):
                raise Flux2Error(f"{ckpt.path} is quantised with {tool} ({key}), which is not supported; use the "
                                 f"bf16 or fp8 .safetensors release of these weights")
    formats = {}
    meta = ckpt.metadata.get("_quantization_metadata")
    if meta:
        try:
            layers = json.loads(meta).get("layers", {})
        except (json.JSONDecodeError, AttributeError):
            raise Flux2Error(f"{ckpt.path}: its _quantization_metadata is not valid JSON; download it again") from None
        formats.update({k: v.get("format") if isinstance(v, dict) else v for k, v in layers.items()})
    for key in keys:
        if key.endswith(".comfy_quant"):
            raw = _read_small(ckpt.tensors[key])
            formats[key[: -len(".comfy_quant")]] = json.loads(bytes(raw.tolist()).decode()).get("format")
    formats = {k[len(prefix):]: v for k, v in formats.items() if k.startswith(prefix)}
    for layer, fmt in formats.items():
        if fmt not in COMFY_FP8:
            hint = " (ComfyUI's nvfp4 layout)" if fmt == "nvfp4" else ""
            raise Flux2Error(f"{ckpt.path}: layer {layer} uses the quantisation format {fmt!r}{hint}, which cannot be "
                             f"loaded here; supported are bf16/fp16/fp32 and fp8 (float8_e4m3fn, float8_e5m2) files")
    return formats


def _read_small(info: TensorInfo) -> torch.Tensor:
    with safe_open(str(info.file), framework="pt", device="cpu") as f:
        return f.get_tensor(info.name)


def dequantize(weight: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int]) -> torch.Tensor:
    """float8 weight [N, K] (or any shape for a per-tensor scale) -> float32 weight * scale.

    scale: None or one number (per tensor), [N] or [N, 1] (per row), or [ceil(N/bn), ceil(K/bk)] (per block).
    """
    w = weight.float()
    if scale is None or scale.numel() == 1:
        return w if scale is None else w * scale.float().reshape(())
    scale = scale.float()
    if scale.numel() == w.shape[0]:
        return w * scale.reshape(-1, *([1] * (w.ndim - 1)))
    if w.ndim == 2 and scale.ndim == 2 and scale.shape == (-(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])):
        full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        return w * full[: w.shape[0], : w.shape[1]]
    raise Flux2Error(f"a float8 weight {list(w.shape)} has a scale of shape {list(scale.shape)}, which is not a known "
                     f"quantisation (per tensor, per row or per {block[0]}x{block[1]} block)")


def dequantize_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """BFL nvfp4: packed E2M1 codes [N, K/2] (even element in the low nibble), float8 scales [N, K/16] -> float32."""
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)     # [N, K]
    values = torch.tensor(E2M1, device=packed.device)[codes.long()]
    scale = block_scale.float() * global_scale.float()                                          # [N, K/16]
    if scale.shape != (codes.shape[0], codes.shape[1] // 16):
        raise Flux2Error(f"an nvfp4 weight [{codes.shape[0]}, {codes.shape[1]}] has block scales "
                         f"{list(block_scale.shape)}; expected [{codes.shape[0]}, {codes.shape[1] // 16}]")
    return values * scale.repeat_interleave(16, dim=1)


# ---------------------------------------------------------------------------------------------------------------
# 6. reading our state dict: recipes -> tensors on the target device, dequantized, cast, shape-fitted
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class Source:
    """A checkpoint seen through its prefix and layout: the tensors one of our modules can take from it."""
    ckpt: Checkpoint
    layout: Layout
    prefix: str
    keys: set[str]                       # the file's keys behind the prefix, prefix stripped (scales excluded)
    recipe: Callable[[str], Recipe]
    formats: dict[str, str]              # ComfyUI fp8 formats per layer (prefix stripped)

    def has(self, key: str) -> bool:
        return all(s in self.keys for s in self.recipe(key).sources)

    def shape(self, key: str) -> tuple[int, ...] | None:
        """Shape of our key as the file provides it, unpacked if nvfp4 (None when absent)."""
        recipe = self.recipe(key)
        if not all(s in self.keys for s in recipe.sources):
            return None
        shapes = [self.info(s).shape for s in recipe.sources]
        rest = list(shapes[0][1:])
        if self.is_nvfp4(recipe.sources[0][: -len(".weight")]):
            rest = [2 * rest[0]]                         # two E2M1 values per byte
        return (sum(s[0] for s in shapes), *rest)

    def scale_key(self, layer: str) -> str | None:
        """The full file key of a layer's weight scale, if it has one."""
        return next((self.prefix + layer + s for s in SCALE_SUFFIXES
                     if self.prefix + layer + s in self.ckpt.tensors), None)

    def is_nvfp4(self, layer: str) -> bool:
        return self.prefix + layer + ".weight_scale_2" in self.ckpt.tensors

    def info(self, key: str) -> TensorInfo:
        return self.ckpt.tensors[self.prefix + key]

    def describe(self) -> str:
        where = f" behind the prefix {self.prefix!r}" if self.prefix else ""
        return f"{self.layout.name} layout{where}; the file looks like {describe(self.ckpt)}"


def open_source(path, subfolder: str, layouts: list[Layout], what: str, loader: str) -> Source:
    ckpt = open_checkpoint(path, subfolder)
    layout, prefix = find_layout(ckpt, layouts, what, loader)
    formats = comfy_formats(ckpt, prefix)
    keys = {k[len(prefix):] for k in ckpt.tensors if k.startswith(prefix)}
    keys = {k for k in keys if not k.endswith(DROPPED_SUFFIXES) and k != "scaled_fp8"}
    return Source(ckpt, layout, prefix, keys, layout.recipes(keys), formats)


class TensorReader:
    """Reads file tensors straight to one device, dequantizing fp8 / nvfp4 weights to float32."""

    def __init__(self, source: Source, device: torch.device):
        self.source, self.device, self.handles = source, device, {}
        block = source.ckpt.config.get("quantization_config", {}).get("weight_block_size") or (128, 128)
        self.block = (int(block[0]), int(block[1]))

    def raw(self, key: str) -> torch.Tensor:
        """One tensor as stored, by its full file key, in memory of its own.

        On the CPU, safetensors hands out views of the memory-mapped file (unaligned, and changed or gone when the
        file is replaced), so they are copied; on a GPU the tensor is read straight into device memory.
        """
        info = self.source.ckpt.tensors[key]
        if info.file not in self.handles:
            self.handles[info.file] = safe_open(str(info.file), framework="pt", device=str(self.device))
        tensor = self.handles[info.file].get_tensor(info.name)
        return tensor.clone() if tensor.device.type == "cpu" else tensor

    def __call__(self, key: str) -> torch.Tensor:
        """One tensor by its key behind the prefix; a quantised weight comes back dequantized (float32)."""
        tensor = self.raw(self.source.prefix + key)
        if not key.endswith(".weight"):
            return tensor
        layer = key[: -len(".weight")]
        scale = self.source.scale_key(layer)
        if self.source.is_nvfp4(layer):
            return dequantize_nvfp4(tensor, self.raw(scale), self.raw(self.source.prefix + layer + ".weight_scale_2"))
        if layer in self.source.formats and tensor.dtype == torch.uint8:     # fp8 kept in a uint8 container
            tensor = tensor.view(COMFY_FP8[self.source.formats[layer]])
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return dequantize(tensor, self.raw(scale) if scale else None, self.block)
        if scale or not tensor.is_floating_point():
            raise Flux2Error(f"{self.source.ckpt.path}: {self.source.prefix + key} is stored as {tensor.dtype}"
                             f"{' with a scale' if scale else ''}, a quantisation this loader does not know; use the "
                             f"bf16 or fp8 .safetensors release of these weights")
        return tensor


def read_state_dict(source: Source, expected: dict[str, torch.Tensor], device: torch.device,
                    dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Our state dict from the file: every key of ``expected`` (a meta state dict), checked, read, cast.

    Floating tensors are cast to ``dtype``; integer buffers (num_batches_tracked) keep theirs. A file key that no
    recipe uses is an error, as is a missing one (except ``OPTIONAL_KEYS``).
    """
    missing = [s for k in expected if k not in OPTIONAL_KEYS or source.has(k)
               for s in source.recipe(k).sources if s not in source.keys]
    used = {s for k in expected for s in source.recipe(k).sources}
    unexpected = sorted(source.keys - used)
    if missing or unexpected:
        raise Flux2Error(mismatch_message(source, sorted(set(missing)), unexpected))
    read = TensorReader(source, device)
    state = {}
    for key, like in expected.items():
        if not source.has(key):                       # an optional key the file lacks
            state[key] = torch.zeros(like.shape, dtype=like.dtype, device=device)
            continue
        recipe = source.recipe(key)
        parts = [read(s) for s in recipe.sources]
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if recipe.swap_halves:
            first, second = tensor.chunk(2, dim=0)
            tensor = torch.cat([second, first], dim=0)
        state[key] = fit(tensor, like, key, source).to(dtype if like.is_floating_point() else like.dtype)
    return state


def fit(tensor: torch.Tensor, like: torch.Tensor, key: str, source: Source) -> torch.Tensor:
    """``tensor`` in ``like``'s shape: equal, or equal up to trailing 1-dims (Linear [C,C] <-> 1x1 conv [C,C,1,1])."""
    if tensor.shape == like.shape:
        return tensor
    if _without_trailing_ones(tensor.shape) == _without_trailing_ones(like.shape):
        return tensor.reshape(like.shape)
    raise Flux2Error(f"{source.ckpt.path}: {key} has shape {list(tensor.shape)} in the file but the model built from "
                     f"the file's other tensors needs {list(like.shape)}; the file is inconsistent or damaged "
                     f"({source.describe()})")


def _without_trailing_ones(shape) -> list[int]:
    shape = list(shape)
    while shape and shape[-1] == 1:
        shape.pop()
    return shape


def mismatch_message(source: Source, missing: list[str], unexpected: list[str]) -> str:
    lines = [f"{source.ckpt.path} does not fit the model ({source.describe()})."]
    if missing:
        lines.append(f"Missing from the file ({len(missing)}): {', '.join(missing[:5])}"
                     f"{', ...' if len(missing) > 5 else ''}")
    if unexpected:
        lines.append(f"Not expected ({len(unexpected)}): {', '.join(unexpected[:5])}"
                     f"{', ...' if len(unexpected) > 5 else ''}")
    lines.append("Check that the file is complete and is the model this loader is for.")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# 7. building on meta and assigning
# ---------------------------------------------------------------------------------------------------------------

def default_device_dtype(device, dtype) -> tuple[torch.device, torch.dtype]:
    """cuda if available, else cpu; bfloat16 on cuda, float32 elsewhere."""
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device, dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)


def build_on_meta(make: Callable[[], nn.Module]) -> nn.Module:
    """The module with every parameter and buffer on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        return make()


def assign(model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """Load ``state`` by assignment: the parameters become these very tensors. Returns the model in eval mode."""
    model.load_state_dict(state, strict=True, assign=True)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"{type(model).__name__} kept {left[:5]} on the meta device: tensors that are not in its "
                           f"state dict must be created on first use")
    return model.eval().requires_grad_(False)


def count(source: Source, template: str) -> int:
    """How many consecutive indices n = 0, 1, ... have ``template.format(n)`` in the file."""
    n = 0
    while source.has(template.format(n)):
        n += 1
    return n


def need_shape(source: Source, key: str) -> tuple[int, ...]:
    shape = source.shape(key)
    if shape is None:
        raise Flux2Error(mismatch_message(source, list(source.recipe(key).sources), []))
    return shape


# ---------------------------------------------------------------------------------------------------------------
# 8. the transformer
# ---------------------------------------------------------------------------------------------------------------

def transformer_params(source: Source) -> TransformerParams:
    """Architecture from tensor shapes; RoPE axes and theta from a diffusers config.json when there is one."""
    hidden, in_channels = need_shape(source, "img_in.weight")
    head_dim = need_shape(source, "double_blocks.0.img_attn.norm.query_norm.scale")[0]
    mlp_hidden = need_shape(source, "double_blocks.0.img_mlp.2.weight")[1]
    config = source.ckpt.config
    axes = tuple(config.get("axes_dims_rope") or (head_dim // 4,) * 4)
    try:
        return TransformerParams(
            in_channels=in_channels, context_in_dim=need_shape(source, "txt_in.weight")[1], hidden_size=hidden,
            num_heads=hidden // head_dim, depth=count(source, "double_blocks.{}.img_attn.qkv.weight"),
            depth_single_blocks=count(source, "single_blocks.{}.linear1.weight"), mlp_ratio=mlp_hidden / hidden,
            axes_dim=axes, theta=int(config.get("rope_theta", 2000)),
            use_guidance_embed=source.has("guidance_in.in_layer.weight"))
    except ValueError as e:
        raise Flux2Error(f"{source.ckpt.path}: the architecture read from the file is inconsistent ({e}); pass "
                         f"params= explicitly") from None


def variant_hint(source: Source) -> str:
    """A hint for base / KV / distilled: diffusers' model_index.json, else the file or folder names."""
    index = _read_json(source.ckpt.root / "model_index.json") if source.ckpt.root else {}
    if "KV" in index.get("_class_name", ""):
        return "kv"
    if "is_distilled" in index:
        return "distilled" if index["is_distilled"] else "base"
    path = source.ckpt.path.resolve()
    return path.name if path.is_file() else "/".join(path.parts[-3:])


def inspect_transformer(path: str | Path, params: TransformerParams | None = None,
                        variant: str | None = None) -> tuple[TransformerParams, Variant]:
    """The architecture and variant of a transformer checkpoint, from its headers alone (no tensor is read)."""
    return _transformer_spec(_transformer_source(path), params, variant)


def load_transformer(path: str | Path, device=None, dtype: torch.dtype | None = None, *,
                     params: TransformerParams | None = None,
                     variant: str | None = None) -> tuple[Flux2Transformer, Variant]:
    """A FLUX.2 transformer and its variant from a BFL / ComfyUI file or a diffusers folder.

    The architecture comes from tensor shapes (``params`` overrides it, e.g. for the RoPE axes of test models);
    the variant (distilled, base, KV) from the architecture plus diffusers' model_index.json or the file name,
    unless ``variant`` names a registry entry. Default device: cuda if available; dtype: bf16 on cuda, else fp32.
    """
    device, dtype = default_device_dtype(device, dtype)
    source = _transformer_source(path)
    params, chosen = _transformer_spec(source, params, variant)
    model = build_on_meta(lambda: Flux2Transformer(params))
    return assign(model, read_state_dict(source, model.state_dict(), device, dtype)), chosen


def _transformer_source(path) -> Source:
    return open_source(path, "transformer", TRANSFORMER_LAYOUTS, "a FLUX.2 transformer",
                       "Pass a FLUX.2 diffusion model: flux-2-klein-*.safetensors (ComfyUI models/diffusion_models) "
                       "or a diffusers transformer/ folder.")


def _transformer_spec(source: Source, params: TransformerParams | None,
                      variant: str | None) -> tuple[TransformerParams, Variant]:
    params = params or transformer_params(source)
    if not variant:
        return params, variant_for_params(params, variant_hint(source))
    chosen = get_variant(variant)
    if chosen.params.hidden_size != params.hidden_size or chosen.params.context_in_dim != params.context_in_dim:
        raise Flux2Error(f"variant {variant!r} is {chosen.params.hidden_size} wide with {chosen.params.context_in_dim}"
                         f"-wide text input, but {source.ckpt.path} is {params.hidden_size} / "
                         f"{params.context_in_dim}; leave the variant on auto or pick the matching one")
    return params, chosen


# ---------------------------------------------------------------------------------------------------------------
# 9. the autoencoder
# ---------------------------------------------------------------------------------------------------------------

def autoencoder_params(source: Source) -> AutoEncoderParams:
    """Architecture from tensor shapes; GroupNorm groups and BatchNorm eps from a diffusers config.json if any."""
    ch, in_channels = need_shape(source, "encoder.conv_in.weight")[:2]
    levels = count(source, "encoder.down.{}.block.0.conv1.weight")
    config = source.ckpt.config
    return AutoEncoderParams(
        in_channels=in_channels, ch=ch, out_ch=need_shape(source, "decoder.conv_out.weight")[0],
        ch_mult=tuple(need_shape(source, f"encoder.down.{i}.block.0.conv1.weight")[0] // ch for i in range(levels)),
        num_res_blocks=count(source, "encoder.down.0.block.{}.conv1.weight"),
        z_channels=need_shape(source, "decoder.conv_in.weight")[1],
        num_groups=int(config.get("norm_num_groups", 32)), bn_eps=float(config.get("batch_norm_eps", 1e-4)))


def load_autoencoder(path: str | Path, device=None, dtype: torch.dtype | None = None) -> AutoEncoder:
    """The FLUX.2 autoencoder from BFL ``ae.safetensors``, ComfyUI ``flux2-vae.safetensors`` or a diffusers folder.

    Default device: cuda if available; dtype: bf16 on cuda, else fp32 (BFL runs the AE in fp32: pass float32).
    """
    device, dtype = default_device_dtype(device, dtype)
    source = open_source(path, "vae", AUTOENCODER_LAYOUTS, "a FLUX.2 autoencoder",
                         "The FLUX.2 autoencoder is ae.safetensors (FLUX.2-dev repo) or ComfyUI's flux2-vae.safetensors.")
    if not source.has("bn.running_mean"):
        raise Flux2Error(f"{source.ckpt.path} is {describe(source.ckpt)}; FLUX.2 needs its own autoencoder with the "
                         f"latent BatchNorm: ae.safetensors from FLUX.2-dev or ComfyUI's flux2-vae.safetensors")
    params = autoencoder_params(source)
    model = build_on_meta(lambda: AutoEncoder(params))
    return assign(model, read_state_dict(source, model.state_dict(), device, dtype))


# ---------------------------------------------------------------------------------------------------------------
# 10. the text encoder
# ---------------------------------------------------------------------------------------------------------------

TEXT_ENCODER_LAYOUTS = [Layout("Hugging Face Qwen3", "layers.0.self_attn.q_norm.weight", same_names)]
ENCODER_FILES = {QWEN3_4B.name: "Qwen3-4B text encoder (qwen_3_4b.safetensors)",
                 QWEN3_8B.name: "Qwen3-8B text encoder (qwen_3_8b.safetensors or qwen_3_8b_fp8mixed.safetensors)",
                 "mistral-small-3.2": "Mistral-Small-3.2 text encoder"}


def load_text_encoder(path: str | Path, device=None, dtype: torch.dtype | None = None, *,
                      tokenizer=None) -> PromptEncoder:
    """The Qwen3 prompt encoder from a Hugging Face / diffusers ``text_encoder/`` folder or a ComfyUI file.

    Only what FLUX.2 uses is read: the embedding and decoder layers 0..26 (hidden states 9, 18, 27); later layers,
    the final norm and ``lm_head`` stay on disk. The tokenizer is ``tokenizer`` if given, else the one in the folder
    or a sibling ``tokenizer/`` folder, else the built-in Qwen3 tokenizer. Default device: cuda if available; dtype:
    bf16 on cuda, else fp32.
    """
    device, dtype = default_device_dtype(device, dtype)
    source = open_source(path, "text_encoder", TEXT_ENCODER_LAYOUTS, "a Qwen3 text encoder",
                         "FLUX.2 Klein 4B needs Qwen3-4B (qwen_3_4b.safetensors), Klein 9B needs Qwen3-8B.")
    last = max(QWEN3_4B.output_layers)
    read = TensorReader(source, device)
    state = {key: _cast(read(key), dtype) for key in sorted(source.keys)
             if key != "norm.weight" and not (key.startswith("layers.") and int(key.split(".")[1]) >= last)}
    if tokenizer is None and source.ckpt.path.is_dir():
        tokenizer = load_tokenizer(source.ckpt.files[0].parent)
    try:
        return build_qwen3_encoder(state, config=source.ckpt.config or None, device=device, dtype=dtype,
                                   tokenizer=tokenizer)
    except Flux2Error as e:
        raise Flux2Error(f"{source.ckpt.path}: {e} ({source.describe()})") from None


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def check_text_encoder_fits(variant: Variant, encoder: PromptEncoder) -> None:
    """Raise a Flux2Error unless the encoder's embeddings (3 x hidden) are the width the transformer takes."""
    hidden = encoder.model.embed_tokens.weight.shape[1]
    needed = variant.params.context_in_dim
    if 3 * hidden == needed:
        return
    title = {"klein-4b": "FLUX.2 Klein 4B", "klein-9b": "FLUX.2 Klein 9B", "klein-9b-kv": "FLUX.2 Klein 9B KV",
             "klein-base-4b": "FLUX.2 Klein Base 4B", "klein-base-9b": "FLUX.2 Klein Base 9B",
             "dev": "FLUX.2 [dev]"}.get(variant.name, f"a FLUX.2 model taking {needed}-wide text embeddings")
    wanted = ENCODER_FILES.get(variant.text_encoder.name, f"text encoder with hidden size {needed // 3}")
    raise Flux2Error(f"this is {title}; it needs the {wanted}, but you gave {qwen3_name(hidden)} encoder (hidden "
                     f"{hidden}, so {3 * hidden}-wide embeddings where the model takes {needed}). Load the matching "
                     f"text encoder")
