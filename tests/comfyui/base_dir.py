"""The base directory of a test ComfyUI: tiny random models in its model folders (GGUF ones too), input pictures, the
stand-ins the workflows name, the pack in custom_nodes, settings that keep the browser's first-run dialog away, and
an extra_model_paths.yaml registering ComfyUI-GGUF's folders (host.ComfyServer passes it to the server).

    files, images = build_base(base, pack)       # pack: the folder to place as custom_nodes/<PACK_FOLDER>
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from flux2_core.app.demo import random_weights
from flux2_core.families.flux2.transformer import TransformerParams
from flux2_core.models.autoencoder import AutoEncoder
from flux2_core.variants import AutoEncoderParams
from tests.comfyui.host import PACK_FOLDER

ROOT = Path(__file__).resolve().parents[2]

# The tiny transformer must also load in ComfyUI's own FLUX.2 model (for the native-graph comparison), which
# fixes heads of 128 = 4 RoPE axes of 32; context_in_dim is 3 x the tiny Qwen3's hidden size (32).
HOST_TRANSFORMER = TransformerParams(in_channels=128, context_in_dim=96, hidden_size=128, num_heads=1, depth=1,
                                     depth_single_blocks=2, axes_dim=(32, 32, 32, 32))
# Two heads of 64 for the parallel node's test (2 ranks must divide the heads); ours alone loads it
TWO_HEADS = TransformerParams(in_channels=128, context_in_dim=96, hidden_size=128, num_heads=2, depth=1,
                              depth_single_blocks=2, axes_dim=(16, 16, 16, 16))
WORKFLOW_MODELS = {"model_name": ("diffusion_models", "transformer"), "text_encoder_name": ("text_encoders", "text_encoder"),
                   "ae_name": ("vae", "ae"), "lora_name": ("loras", "lora")}    # loader input -> (folder, tiny file)
LOUD = 3e4                     # the "loud" transformer's scale (see build_models)
GGUF_ROLE = "{}_gguf"          # the role of a tiny GGUF stand-in: "transformer_gguf" for a workflow's .gguf model
FILES = {"transformer": "flux-2-klein-tiny.safetensors", "transformer_base": "flux-2-klein-base-tiny.safetensors",
         "transformer_kv": "flux-2-klein-9b-kv-tiny.safetensors",
         "transformer_fp8": "flux-2-klein-tiny-fp8mixed.safetensors",
         "transformer_nvfp4": "flux-2-klein-tiny-nvfp4.safetensors",
         "transformer_bf16": "flux-2-klein-tiny-bf16.safetensors",
         "transformer_loud": "flux-2-klein-tiny-loud.safetensors",
         "transformer_two_heads": "flux-2-klein-tiny-two-heads.safetensors",
         "transformer_two_heads_kv": "flux-2-klein-9b-kv-tiny-two-heads.safetensors",
         "text_encoder": "qwen_3_tiny.safetensors", "ae": "flux2-vae-tiny.safetensors",
         "small_decoder": "small_decoder-tiny.safetensors",
         "ae_full": "flux2-vae-full-size-random.safetensors", "lora": "flux2-klein-tiny-lora.safetensors",
         "lora_kohya": "flux2-klein-tiny-lora-kohya.safetensors",
         "lora_diffusers": "flux2-klein-tiny-lora-diffusers.safetensors",
         "lora_lokr": "flux2-klein-tiny-lokr.safetensors", "lora_te": "flux2-klein-tiny-lora-with-te.safetensors",
         # GGUF: the tiny models quantized, their dequantized values as safetensors (what the GGUF ones must compute),
         # and the GGUF files again in ComfyUI's other folders for them (see write_gguf_models)
         "transformer_gguf": "flux-2-klein-tiny-Q4_0.gguf",
         "transformer_gguf_values": "flux-2-klein-tiny-gguf-dequantized.safetensors",
         "text_encoder_gguf": "Qwen3-tiny-Q4_0.gguf",
         "text_encoder_gguf_values": "qwen_3_tiny-gguf-dequantized.safetensors",
         "transformer_gguf_unet": "gguf/flux-2-klein-tiny-unet-Q4_0.gguf",
         "transformer_gguf_extra": "flux-2-klein-tiny-extra-Q4_0.gguf",
         "text_encoder_gguf_extra": "Qwen3-tiny-extra-Q4_0.gguf",
         # FLUX 3 Image Klein: the distilled and base transformers behind ComfyUI's prefix, a Qwen3-VL text tower as
         # one file (known as Qwen3-VL by its name)
         "transformer_flux3": "flux3-image-klein-tiny.safetensors",
         "transformer_flux3_base": "flux3-image-klein-base-tiny.safetensors",
         "text_encoder_flux3": "qwen3vl_tiny.safetensors"}
# a workflow's model file -> the role of its stand-in, where the name says which family's file it is
FAMILY_ROLES = (("flux3-image-klein-base", "transformer_flux3_base"), ("flux3-image-klein", "transformer_flux3"),
                ("qwen3vl", "text_encoder_flux3"))
# ComfyUI-GGUF's folders as that pack registers them (the paths of ComfyUI's folders), each with a path of its own
EXTRA_PATHS = """comfyui-gguf:
    unet_gguf: |
        models/diffusion_models
        models/unet_gguf
    clip_gguf: |
        models/text_encoders
        models/clip_gguf
"""


def write_tiny_models(models: Path) -> dict[str, str]:
    """Random weights in ComfyUI's model folders: BFL transformer (also as a base, a KV and an fp8mixed model),
    ComfyUI Qwen3 file, BFL autoencoders (tiny, and one of the real size). Returns {role: file name}."""
    from flux2_core.families.flux2.files import quantizable
    from tests.tiny.adapters import (
        adapter_state_dict,
        lora_state_dict,
        module_shapes,
        random_lokr,
        random_lora,
        save_adapter,
    )
    from tests.tiny.autoencoder import (
        TINY_AE_DIFFUSERS_CONFIG,
        bfl_state_dict,
        build_diffusers_autoencoder,
        save_bfl_autoencoder,
    )
    from tests.tiny.layouts import comfy_fp8, comfy_quant
    from tests.tiny.text_encoder import build_tiny_qwen3, save_comfyui_text_encoder
    from tests.tiny.transformer import random_bfl_transformer_state_dict, save_bfl_transformer

    for folder in ("diffusion_models", "text_encoders", "vae"):
        (models / folder).mkdir(parents=True, exist_ok=True)
    transformer = random_bfl_transformer_state_dict(HOST_TRANSFORMER, seed=1)
    save_bfl_transformer(transformer, models / "diffusion_models" / FILES["transformer"])
    save_bfl_transformer(random_bfl_transformer_state_dict(TWO_HEADS, seed=4),
                         models / "diffusion_models" / FILES["transformer_two_heads"])
    os.link(models / "diffusion_models" / FILES["transformer_two_heads"],
            models / "diffusion_models" / FILES["transformer_two_heads_kv"])
    # the same weights under "base" and "kv" names: the variant (CFG, distilled, KV) comes from the file name
    for role in ("transformer_base", "transformer_kv"):
        os.link(models / "diffusion_models" / FILES["transformer"], models / "diffusion_models" / FILES[role])
    # and in bfloat16, as BFL and ComfyUI publish Klein; and "loud": the text stream's MLP and the single blocks'
    # output scaled up, so that in float16 the residual streams outgrow 65504 (what ComfyUI's fp16 clamps are for)
    save_bfl_transformer({k: v.to(torch.bfloat16) for k, v in transformer.items()},
                         models / "diffusion_models" / FILES["transformer_bf16"])
    save_bfl_transformer({k: v * LOUD if k.endswith(("txt_mlp.2.weight", "linear2.weight")) else v
                          for k, v in transformer.items()}, models / "diffusion_models" / FILES["transformer_loud"])
    # and as ComfyUI's "fp8mixed" files: the blocks' linear weights float8 with per-tensor scales, named in metadata
    blocks = [k.removesuffix(".weight") for k, v in transformer.items() if v.ndim == 2
              and quantizable(k.removesuffix(".weight"))]
    fp8, meta = comfy_fp8(transformer, blocks)
    save_file({k: v.contiguous() for k, v in fp8.items()}, str(models / "diffusion_models" / FILES["transformer_fp8"]),
              metadata=meta)
    # and in nvfp4, by comfy-kitchen's own quantizer, as ComfyUI's quantized files are (their .comfy_quant objects)
    save_file(comfy_quant(transformer, blocks, "nvfp4"), str(models / "diffusion_models" / FILES["transformer_nvfp4"]))
    qwen = build_tiny_qwen3(seed=2)
    save_comfyui_text_encoder(qwen, models / "text_encoders" / FILES["text_encoder"])
    save_bfl_autoencoder(build_diffusers_autoencoder(seed=3), models / "vae" / FILES["ae"])
    # BFL's small decoder, tiny: a decoder on its own (keys without "decoder."), narrower than the tiny AE's
    small = build_diffusers_autoencoder(seed=5, config={**TINY_AE_DIFFUSERS_CONFIG,
                                                        "decoder_block_out_channels": (32, 32, 32, 32)})
    save_file({k.removeprefix("decoder."): v for k, v in bfl_state_dict(small).items() if k.startswith("decoder.")},
              str(models / "vae" / FILES["small_decoder"]))
    save_file(full_size_autoencoder(seed=4), str(models / "vae" / FILES["ae_full"]))
    # an ai-toolkit LoRA (diffusion_model. + lora_A/lora_B, no alpha), a format both ComfyUI and we read
    (models / "loras").mkdir(parents=True, exist_ok=True)
    targets = ["double_blocks.0.img_attn.qkv", "double_blocks.0.txt_mlp.0", "single_blocks.0.linear1",
               "single_blocks.1.linear2"]
    lora = random_lora(HOST_TRANSFORMER, targets, rank=4, seed=6)
    save_adapter(lora_state_dict(lora, "ai-toolkit")[0], models / "loras" / FILES["lora"])
    # and in other formats both read: kohya with alpha, diffusers (split q/k/v), LyCORIS LoKr on BFL names
    save_adapter(lora_state_dict(random_lora(HOST_TRANSFORMER, targets, rank=4, seed=7), "kohya", alpha=2.0)[0],
                 models / "loras" / FILES["lora_kohya"])
    save_adapter(lora_state_dict(random_lora(HOST_TRANSFORMER, targets, rank=4, seed=8), "diffusers")[0],
                 models / "loras" / FILES["lora_diffusers"])
    shapes = module_shapes(HOST_TRANSFORMER)
    lokr = {m: random_lokr(shapes[m], ("w2",) if i % 2 else (), seed=9 + i) | {"alpha": torch.tensor(1.0)}
            for i, m in enumerate(targets)}
    save_adapter(adapter_state_dict(lokr, "diffusion_model."), models / "loras" / FILES["lora_lokr"])
    # one that trains the text encoder too (ComfyUI-style text_encoders. keys on two Qwen3 layers)
    te_shapes = {k.removeprefix("model."): v.shape for k, v in qwen.state_dict().items()}
    g = torch.Generator().manual_seed(13)
    te_lora = lora_state_dict(random_lora(HOST_TRANSFORMER, targets[:2], rank=4, seed=12), "ai-toolkit")[0]
    for layer in ("layers.8.self_attn.q_proj", "layers.20.mlp.down_proj"):
        out, inp = te_shapes[layer + ".weight"]
        te_lora[f"text_encoders.qwen3_4b.transformer.model.{layer}.lora_A.weight"] = torch.randn(4, inp, generator=g)
        te_lora[f"text_encoders.qwen3_4b.transformer.model.{layer}.lora_B.weight"] = 0.5 * torch.randn(out, 4,
                                                                                                        generator=g)
    save_adapter(te_lora, models / "loras" / FILES["lora_te"])
    write_gguf_models(models, transformer, qwen)
    write_flux3_models(models)
    return dict(FILES)


def write_flux3_models(models: Path) -> None:
    from dataclasses import replace

    from tests.tiny.flux3 import TINY_QWEN3_VL_TEXT, random_flux3_state_dict, tiny_flux3
    from tests.tiny.text_encoder import build_tiny_qwen3, save_comfyui_text_encoder

    for role, flow_map in (("transformer_flux3", True), ("transformer_flux3_base", False)):
        params = replace(tiny_flux3(flow_map), context_in_dim=8 * TINY_QWEN3_VL_TEXT["hidden_size"])
        save_file({"model.diffusion_model." + k: v for k, v in random_flux3_state_dict(params, seed=6).items()},
                  str(models / "diffusion_models" / FILES[role]))
    save_comfyui_text_encoder(build_tiny_qwen3(3, TINY_QWEN3_VL_TEXT), models / "text_encoders" / FILES["text_encoder_flux3"])


def write_gguf_models(models: Path, transformer: dict[str, torch.Tensor], qwen) -> None:
    """The tiny transformer and Qwen3 as GGUF files, each with two quant types as real files have (a Q4_K_M mixes
    Q4_K and Q6_K): Q4_0, and Q8_0 for the transformer's single blocks and the encoder's embedding; beside each, its
    dequantized values as a safetensors file. The GGUF files also go where else users keep them: models/unet (in a
    subfolder, and under the name they have in diffusion_models: to be listed once) and the folders of EXTRA_PATHS."""
    from gguf import GGMLQuantizationType as T

    from tests.tiny.gguf import dit_types, encoder_types, hf_names, llama_cpp_names, qwen3_tokens, save_gguf
    from tests.tiny.text_encoder import comfyui_state_dict
    from tests.tiny.transformer import save_bfl_transformer

    def dit(name: str, shape: tuple) -> T:
        return dit_types(T.Q8_0 if name.startswith("single_blocks.") else T.Q4_0)(name, shape)

    dit_file = models / "diffusion_models" / FILES["transformer_gguf"]
    te_file = models / "text_encoders" / FILES["text_encoder_gguf"]
    _, values = save_gguf(transformer, dit_file, dit)
    save_bfl_transformer(values, models / "diffusion_models" / FILES["transformer_gguf_values"])
    hf = comfyui_state_dict(qwen)
    _, values = save_gguf(llama_cpp_names(hf), te_file, encoder_types(T.Q4_0), arch="qwen3",
                          tokens=qwen3_tokens(qwen.config.vocab_size))
    save_file(hf_names(values, hf), str(models / "text_encoders" / FILES["text_encoder_gguf_values"]))
    for source, target in [(dit_file, models / "unet" / FILES["transformer_gguf"]),
                           (dit_file, models / "unet" / FILES["transformer_gguf_unet"]),
                           (dit_file, models / "unet_gguf" / FILES["transformer_gguf_extra"]),
                           (te_file, models / "clip_gguf" / FILES["text_encoder_gguf_extra"])]:
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(source, target)


def full_size_autoencoder(seed: int) -> dict[str, torch.Tensor]:
    """Random weights of the real FLUX.2 autoencoder architecture (84 M parameters, bfloat16, BFL keys): ComfyUI's
    VAELoader builds a fixed architecture, so mixing its VAE nodes with ours needs the full size."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoEncoder(AutoEncoderParams()).state_dict().items()}
    sd = random_weights(shapes, torch.Generator().manual_seed(seed))     # the demo's init rule
    return {k: v if v.dtype == torch.int64 else v.to(torch.bfloat16) for k, v in sd.items()}


def stage_workflow_files(base: Path, files: dict[str, str], pictures: list[str]) -> None:
    """Give every model file and input image that workflows/api/*.json name a tiny stand-in, under its own name.

    Hard links, not symlinks: the loaders read the variant hint ('base') from the file's own name.
    """
    stand_ins = itertools.cycle(pictures)
    for path in sorted((ROOT / "workflows" / "api").glob("*.json")):
        for node in json.loads(path.read_text()).values():
            for name, value in node["inputs"].items():
                if name in WORKFLOW_MODELS:
                    folder, role = WORKFLOW_MODELS[name]
                    role = GGUF_ROLE.format(role) if value.lower().endswith(".gguf") else role
                    role = next((r for start, r in FAMILY_ROLES if value.lower().startswith(start)), role)
                    target = base / "models" / folder / value
                    if not target.exists():
                        os.link(base / "models" / folder / files[role], target)
                elif node["class_type"] == "LoadImage" and name == "image":
                    target = base / "input" / value
                    if not target.exists() and "inpaint" in value:      # an image with a transparent hole: a mask
                        write_inpaint_image(base / "input" / next(stand_ins), target)
                    elif not target.exists():
                        shutil.copyfile(base / "input" / next(stand_ins), target)


def write_input_images(folder: Path) -> list[str]:
    """Three small random reference pictures of different sizes and aspect ratios."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    names = []
    for i, (w, h) in enumerate([(128, 96), (96, 128), (112, 112)], start=1):
        name = f"tiny_ref_{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / name)
        names.append(name)
    return names


def write_inpaint_image(source: Path, target: Path) -> None:
    """``source`` with alpha: its middle third transparent, which Load Image gives as the mask (1 - alpha)."""
    from PIL import Image

    image = Image.open(source).convert("RGBA")
    w, h = image.size
    alpha = Image.new("L", (w, h), 255)
    alpha.paste(0, (w // 3, h // 3, 2 * w // 3, 2 * h // 3))
    image.putalpha(alpha)
    image.save(target)


def build_base(base: Path, pack: Path, link: bool = True) -> tuple[dict[str, str], list[str]]:
    """Fill ``base`` for a server: models, inputs, workflow stand-ins, settings, and ``pack`` in custom_nodes (a
    symlink, or the folder itself when ``link`` is False: it is already there). Returns (files by role, input images)."""
    files = write_tiny_models(base / "models")
    images = write_input_images(base / "input")
    stage_workflow_files(base, files, images)
    (base / "custom_nodes").mkdir(exist_ok=True)
    if link:
        (base / "custom_nodes" / PACK_FOLDER).symlink_to(pack, target_is_directory=True)
    settings = base / "user" / "default" / "comfy.settings.json"   # no first-run Templates dialog in the browser
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps({"Comfy.TutorialCompleted": True}))
    (base / "extra_model_paths.yaml").write_text(EXTRA_PATHS)
    return files, images
