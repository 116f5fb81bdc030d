"""Loaders: the transformer, the Qwen3 text encoder and the autoencoder, from ComfyUI's model folders.

Each accepts every layout flux2_core.weights loads (BFL / ComfyUI single files, fp8 files, ComfyUI's quantized files,
GGUF files, diffusers folders) and hands the model on under ComfyUI's model management (nodes/host.py).
"""

from __future__ import annotations

from comfy_api.latest import io, ui

from ..flux2_core import weights
from ..flux2_core.runtime.followers import TransformerSource
from ..flux2_core.storage.ggml_layers import gguf_types
from ..flux2_core.storage.matmul import choose_matmuls
from ..flux2_core.storage.protocol import FLOAT_KINDS, census
from . import host, types

DTYPE_TOOLTIP = ("Compute dtype. auto: bfloat16 on GPUs that run it well, else float32. A bf16 / fp16 file's weights "
                 "stay 16-bit under float32, cast per layer; fp8 files are dequantized to this dtype on load.")
FP8 = "fp8_e4m3fn"
INT8 = "int8"
INT8_CONVROT = "int8_convrot"
INT8_CHOICES = {INT8: True, INT8_CONVROT: "convrot"}          # -> weights.load_transformer's int8
MODEL_DTYPE_TOOLTIP = ("Compute dtype. auto: what ComfyUI picks for FLUX.2 on this device (bfloat16 on GPUs from "
                       "Ampere on, float16 on Volta / Turing such as the T4, float32 on CPUs and older GPUs; "
                       "--fp16-unet / --bf16-unet / --force-fp32 apply); FLUX 3 Image Klein runs in bfloat16 or "
                       "float32 only, so auto gives it float32 where FLUX.2 would take float16; the layers an fp8 "
                       "file stores in fp8 stay fp8, with the file's scales. bfloat16 / float16 / float32: computed in that dtype (fp8 files "
                       "dequantized). A bf16 / fp16 file's weights stay 16-bit under a wider dtype, cast per layer "
                       f"(half the memory of float32). float16 clamps the residual streams as ComfyUI does. {FP8}: every block's weights in fp8 "
                       "(about half the memory of bfloat16), quantized as they load, computed in the auto dtype; "
                       "results differ slightly. fp8 layers multiply in fp8 on GPUs with fp8 tensor cores (Ada, "
                       f"Hopper, Blackwell; the node says whether). {INT8}: every block's weights in int8 (about "
                       "half the memory of bfloat16, from any file: bf16, fp8 or GGUF), quantized as they load; "
                       "multiplied in int8 with the activations quantized per token on NVIDIA GPUs from Turing on "
                       "(RTX 20xx / 30xx, A100: no fp8 tensor cores needed; through ComfyUI's comfy-kitchen), else "
                       f"computed in the auto dtype; results differ slightly. {INT8_CONVROT}: the same in ConvRot's "
                       "rotated basis, which keeps weights with outlier channels more exact. ComfyUI's quantized "
                       "files (int8 / int8 ConvRot, NVFP4, MXFP8, W4A4, mixed) keep their layers as stored whatever the "
                       "dtype, which is what they compute in. "
                       "Models holding quantized layers are loaded whole, never partially. GGUF files keep their quantized layers as the file's blocks, dequantized to the "
                       "compute dtype at each use (the node says which types); their other tensors take this dtype.")


NO_DECODER = "none (its own)"
AE_DTYPE_TOOLTIP = ("auto follows ComfyUI's VAE dtype (bfloat16 on recent GPUs, else float32; --fp32-vae forces "
                    "float32). The reference runs the autoencoder in float32.")


def stored_note(model, matmuls=None) -> str:
    """'40 layers in int8 (int8 matmul: ...), 8 layers in w4a8 (w4a8 matmul in its own format: ...), 12 layers in
    nvfp4 (dequantized as they run), ' for the quantized layers a model holds (GGUF blocks aside: ``gguf_note``):
    each kind with its ``MatmulChoice`` note."""
    kinds, gguf = census(model), gguf_types(model)
    return "".join(f"{n} layers in {kind} ({(matmuls and matmuls.note_for(kind)) or 'dequantized as they run'}), "
                   for kind, n in kinds.items() if kind not in FLOAT_KINDS and kind not in gguf)


def dtype_input(extra=(), tooltip: str = DTYPE_TOOLTIP) -> io.Combo.Input:
    return io.Combo.Input("dtype", options=[*host.DTYPE_CHOICES, *extra], default="auto", tooltip=tooltip)


def gguf_note(model) -> str:
    """'15 layers GGUF Q4_K/Q6_K, ' for a model keeping GGUF blocks, else ''."""
    types = gguf_types(model)
    return f"{sum(types.values())} layers GGUF {'/'.join(types)}, " if types else ""


class ModelLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Flux2KleinModelLoader", display_name="Klein Load Model", search_aliases=types.SEARCH_ALIASES,
            category=f"{types.CATEGORY}/loaders",
            description="Loads a FLUX.2 Klein transformer (4B, 9B, 9B-KV, base) from models/diffusion_models (or "
                        "models/unet), safetensors or GGUF, or a FLUX 3 Image Klein transformer (distilled or base, "
                        "BF16 safetensors). The model and variant are read from the weights and the file name "
                        "('base' / 'kv' in the name).",
            inputs=[io.Combo.Input("model_name", options=host.model_choices("diffusion_models"),
                                   tooltip="A flux-2-klein-*.safetensors or flux3-image-klein*.safetensors file (BFL or "
                                           "ComfyUI, fp8 too), a FLUX.2 Klein GGUF "
                                           "(flux-2-klein-4b-Q4_K_M.gguf: Q8_0 ... Q2_K) or a diffusers folder, under "
                                           "models/diffusion_models or models/unet (and ComfyUI-GGUF's unet_gguf "
                                           "paths)."),
                    dtype_input([FP8, INT8, INT8_CONVROT], MODEL_DTYPE_TOOLTIP)],
            outputs=[types.Model.Output(display_name="model", tooltip="The transformer and its variant.")])

    @classmethod
    def execute(cls, model_name: str, dtype: str) -> io.NodeOutput:
        load_device, offload_device = host.devices("transformer")
        fp8, int8 = {"auto": None, FP8: True}.get(dtype, False), INT8_CHOICES.get(dtype, False)   # load_transformer's
        path = host.resolve("diffusion_models", model_name)
        dtype = host.pick_dtype("auto" if dtype in (FP8, *INT8_CHOICES) else dtype, "transformer", load_device,
                                *weights.stored_dtype(path), supported=weights.transformer_family_at(path).dtypes)
        model, variant = weights.load_transformer(path, offload_device, dtype, fp8=fp8, int8=int8)
        kinds = census(model)
        matmuls = choose_matmuls(model, load_device, dtype)
        kind = "CFG" if variant.uses_cfg else "distilled"
        stored = stored_note(model, matmuls)
        kept = "".join(f"{kinds[k]} layers kept in {k}, computed in " for k in ("bf16", "fp16") if kinds.get(k))
        outcome = weights.storage_outcome(path, fp8=fp8, int8=int8)     # the core's words for what the option did
        info = (f"{variant.name} ({kind}; defaults: {variant.default_steps} steps, cfg {variant.default_cfg}), "
                f"{stored}{gguf_note(model)}{kept}{host.dtype_name(dtype)}{f'; {outcome.line()}' if outcome else ''}")
        managed = host.manage(model, model, "transformer", dtype, variant=variant,
                              full_load=bool(stored))
        managed.recipe = TransformerSource.of(path, host.dtype_name(dtype), fp8, int8=int8)
        return io.NodeOutput(managed, ui=ui.PreviewText(info))


class TextEncoderLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Flux2KleinTextEncoderLoader", display_name="Klein Load Text Encoder", search_aliases=types.SEARCH_ALIASES,
            category=f"{types.CATEGORY}/loaders",
            description="Loads the Qwen3 text encoder from models/text_encoders (or models/clip), safetensors or "
                        "GGUF: Qwen3-4B for Klein 4B, Qwen3-8B for Klein 9B, Qwen3-VL-4B for FLUX 3 Image Klein (known "
                        "from its folder's config or its text tower's names). Only the layers the model reads are "
                        "(FLUX.2: up to hidden state 27; FLUX 3: 32).",
            inputs=[io.Combo.Input("text_encoder_name", options=host.model_choices("text_encoders"),
                                   tooltip="qwen_3_4b.safetensors / qwen_3_8b*.safetensors (ComfyUI files, fp8 too), "
                                           "qwen3vl_4b.safetensors (FLUX 3 Image Klein's), "
                                           "a llama.cpp Qwen3 GGUF (Qwen3-4B-Q4_K_M.gguf: Q8_0 ... Q2_K; its "
                                           "quantized layers stay quantized) or a Hugging Face Qwen3 / Qwen3-VL folder, under "
                                           "models/text_encoders or models/clip (and ComfyUI-GGUF's clip_gguf "
                                           "paths)."),
                    dtype_input()],
            outputs=[types.TextEncoder.Output(display_name="text_encoder", tooltip="The Qwen3 prompt encoder.")])

    @classmethod
    def execute(cls, text_encoder_name: str, dtype: str) -> io.NodeOutput:
        load_device, offload_device = host.devices("text_encoder")
        dtype = host.pick_dtype(dtype, "text_encoder", load_device)
        encoder = weights.load_text_encoder(host.resolve("text_encoders", text_encoder_name), offload_device, dtype)
        stored = stored_note(encoder.model)
        info = f"{encoder.spec.name}, {stored}{gguf_note(encoder.model)}{host.dtype_name(dtype)}"
        managed = host.manage(encoder, encoder.model, "text_encoder", dtype, anchor="embed_tokens",
                              full_load=bool(stored))
        return io.NodeOutput(managed, ui=ui.PreviewText(info))


class AutoEncoderLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Flux2KleinAELoader", display_name="Klein Load Autoencoder", search_aliases=types.SEARCH_ALIASES,
            category=f"{types.CATEGORY}/loaders",
            description="Loads the FLUX.2 autoencoder (flux2-vae.safetensors / ae.safetensors, BFL's "
                        "full_encoder_small_decoder.safetensors or a diffusers vae folder) from models/vae, optionally "
                        "with BFL's small decoder in place of its own. Its latents are ComfyUI's FLUX.2 latents.",
            inputs=[io.Combo.Input("ae_name", options=host.model_choices("vae"),
                                   tooltip="flux2-vae.safetensors (ComfyUI), ae.safetensors (BFL), "
                                           "full_encoder_small_decoder.safetensors (BFL: the small decoder built in) "
                                           "or a diffusers folder, under models/vae."),
                    dtype_input(tooltip=AE_DTYPE_TOOLTIP),
                    io.Combo.Input("decoder", options=[NO_DECODER, *host.model_choices("vae")], default=NO_DECODER,
                                   optional=True,
                                   tooltip="BFL's small_decoder.safetensors (a decoder on its own, about 44% fewer "
                                           "parameters, visually the same pictures, faster decode) to decode with "
                                           "instead of the autoencoder's own; the autoencoder still encodes (edits, "
                                           "image-to-image) and gives the latent statistics.")],
            outputs=[types.AutoEncoder.Output(display_name="ae", tooltip="The FLUX.2 autoencoder.")])

    @classmethod
    def execute(cls, ae_name: str, dtype: str, decoder: str = NO_DECODER) -> io.NodeOutput:
        load_device, offload_device = host.devices("ae")
        dtype = host.pick_dtype(dtype, "ae", load_device)
        ae = weights.load_autoencoder(host.resolve("vae", ae_name), offload_device, dtype,
                                      decoder=None if decoder == NO_DECODER else host.resolve("vae", decoder))
        return io.NodeOutput(host.manage(ae, ae, "ae", dtype, anchor="encoder.conv_in"))
