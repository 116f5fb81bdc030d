"""Writes the pack's workflows: a UI file (``<name>.json``, shown in ComfyUI's template browser) and its API twin
(``api/<name>.json``, for POST /prompt and the headless client) from one description per workflow below.

    python workflows/build.py --server 127.0.0.1:8188      # a running ComfyUI with this pack installed

The node definitions (widget order, socket types, display names) are read from the server's /object_info, so the
UI files match what the frontend itself would save. The template browser lists only ``workflows/*.json``; the API
twins live one folder down so they do not show up there as broken templates.
"""

from __future__ import annotations

import argparse
import json
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
PACK = "flux2-klein-engine"
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
HF = "https://huggingface.co"
MODELS = {   # file -> (folder, download URL); the files ComfyUI's own FLUX.2 Klein templates use, and unsloth's GGUFs
    "flux-2-klein-4b.safetensors": ("diffusion_models",
                                    f"{HF}/Comfy-Org/flux2-klein/resolve/main/split_files/diffusion_models/flux-2-klein-4b.safetensors"),
    "flux-2-klein-base-4b.safetensors": ("diffusion_models", (f"{HF}/Comfy-Org/flux2-klein/resolve/main/split_files/"
                                                             "diffusion_models/flux-2-klein-base-4b.safetensors")),
    "qwen_3_4b.safetensors": ("text_encoders",
                              f"{HF}/Comfy-Org/flux2-klein/resolve/main/split_files/text_encoders/qwen_3_4b.safetensors"),
    "flux2-vae.safetensors": ("vae", f"{HF}/Comfy-Org/flux2-dev/resolve/main/split_files/vae/flux2-vae.safetensors"),
    "flux-2-klein-4b-Q4_K_M.gguf": ("diffusion_models",
                                    f"{HF}/unsloth/FLUX.2-klein-4B-GGUF/resolve/main/flux-2-klein-4b-Q4_K_M.gguf"),
    "Qwen3-4B-Q4_K_M.gguf": ("text_encoders", f"{HF}/unsloth/Qwen3-4B-GGUF/resolve/main/Qwen3-4B-Q4_K_M.gguf"),
    # FLUX 3 Image Klein: BFL's ComfyUI files, named by their release page (the download link is on that page)
    "flux3-image-klein.safetensors": ("diffusion_models", f"{HF}/black-forest-labs/flux-3-image-klein-comfy"),
    "qwen3vl_4b.safetensors": ("text_encoders", f"{HF}/black-forest-labs/flux-3-image-klein-comfy"),
}
MODEL_INPUTS = ("model_name", "text_encoder_name", "ae_name")


def frontend_checks(file: str) -> bool:
    """Whether a model file goes in its loader's ``properties.models``, where the frontend checks it is there (and
    offers the download when not). It checks against ComfyUI's own file lists, which leave .gguf files out (no
    folder's extension set has .gguf), so it would call a GGUF file missing even when it is in place: GGUF files
    are named in the workflow's note only, with their download URL; so are files known by a release page rather
    than a file's own link (the frontend would download the page)."""
    return not file.lower().endswith(".gguf") and "/resolve/" in MODELS[file][1]


# --- the workflows: node id -> Node; an input (id, slot) is a link, anything else a widget ----------------------------
#
# The layout follows the pipeline left to right, one column per stage, and keeps every link in the open: a link
# runs from an output (a node's right side) to an input further right, and the long ones run in lanes no node
# covers (the model along the top, the autoencoder between the prompt and the noise). A link drawn between two
# columns bends over a quarter of its length at each end, so a link that must climb or drop does so in the gap just
# before its target; the edits' Reference nodes, which would sit in the path of the noise and the schedule to the
# denoiser, go below the prompt, just above the autoencoder lane (their images below it), and the noise and the
# schedule above the prompt. Positions are the top left of a node's body; its title bar is the TITLE units above.

TITLE = 30                   # the frontend's title bar height
SLOT = 20                    # the height of a socket row; socket i is at y + 14 + 20 i
SIZES = {"Flux2KleinLayout": (320, 170), "Flux2KleinModelLoader": (280, 82), "Flux2KleinTextEncoderLoader": (280, 82),
         "Flux2KleinAELoader": (280, 82), "Flux2KleinLoRA": (280, 126), "Flux2KleinPromptEncode": (380, 190),
         "Flux2KleinNoise": (220, 154), "Flux2KleinScheduler": (220, 150), "Flux2KleinDenoise": (260, 182),
         "Flux2KleinAEDecode": (220, 46), "Flux2KleinAEEncode": (220, 46), "Flux2KleinReference": (240, 66),
         "LoadImage": (260, 300), "SaveImage": (280, 340), "MarkdownNote": (280, 300), "SetLatentNoiseMask": (220, 46),
         "ImagePadForOutpaint": (220, 174), "Flux2KleinToModel": (300, 26), "ConditioningZeroOut": (200, 26),
         "EmptyFlux2LatentImage": (270, 106), "KSampler": (315, 262)}
STAGES = {"load": "Load models", "lora": "LoRA", "model": "To MODEL", "image": "Input image",
          "references": "Reference images", "prompt": "Prompt", "noise": "Noise and schedule", "denoise": "Denoise",
          "decode": "Decode and save"}
COLUMNS = {"load": 0, "prompt": 340, "noise": 340}         # x of the stages that every workflow places alike
GROUP_COLOR = "#3f789e"
AE_LANE = 400                # the autoencoder loader's y: its link to the decoder runs level at this height
EDIT_LANE, REF3_LANE = 680, 820   # the autoencoder lanes (its output's y) of the one- and three-reference edits


@dataclass(frozen=True)
class Node:
    cls: str
    inputs: dict
    stage: str
    pos: tuple[int, int]
    title: str | None = None
    size: tuple[int, int] | None = None

    @property
    def box(self) -> tuple[int, int]:
        return self.size or SIZES[self.cls]


def loaders(model: str, text_encoder: str = "qwen_3_4b.safetensors", prompt_y: int = 150, ae_y: int = AE_LANE) -> dict:
    return {1: Node("Flux2KleinModelLoader", {"model_name": model, "dtype": "auto"}, "load", (0, 0)),
            2: Node("Flux2KleinTextEncoderLoader", {"text_encoder_name": text_encoder, "dtype": "auto"}, "load",
                    (0, prompt_y)),
            3: Node("Flux2KleinAELoader", {"ae_name": "flux2-vae.safetensors", "dtype": "auto",
                                           "decoder": "none (its own)"}, "load", (0, ae_y))}


def sampler(positive, cfg=1.0, steps=4, negative=None, latent=None, denoise=1.0, noise_latent=None, seed=42,
            model=(1, 0), noise_at=(360, 560), scheduler_at=None, scheduler_latent=(5, 0), denoise_x=950,
            ae_y=AE_LANE, save_at=None, schedule="flux2", prefix="flux2-klein") -> dict:
    """Noise and schedule (the noise at noise_at, the scheduler below and right of it unless scheduler_at says),
    the denoiser at the top of its column (its model input level with the model loader's output), and decode + save
    on the autoencoder lane (save_at moves the saver, which may sit higher than the decoder)."""
    denoise_inputs = {"model": model, "positive": positive, "noise": (5, 0), "sigmas": (6, 0), "cfg": cfg,
                      "denoise": denoise, "cache": 0.0}
    denoise_inputs |= {"negative": negative} if negative else {}
    denoise_inputs |= {"latent": latent} if latent else {}
    noise_inputs = {"seed": seed, "width": 1024, "height": 1024, "batch_size": 1}
    noise_inputs |= {"latent": noise_latent} if noise_latent else {}
    x, y = noise_at
    decode_x = denoise_x + SIZES["Flux2KleinDenoise"][0] + 50
    save_x = decode_x + SIZES["Flux2KleinAEDecode"][0] + 40
    return {5: Node("Flux2KleinNoise", noise_inputs, "noise", (x, y)),
            6: Node("Flux2KleinScheduler", {"steps": steps, "schedule": schedule, "rho": 2.0,
                                            "latent": scheduler_latent}, "noise",
                    scheduler_at or (x + SIZES["Flux2KleinNoise"][0] + 30, y + 90)),
            7: Node("Flux2KleinDenoise", denoise_inputs, "denoise", (denoise_x, 0)),
            8: Node("Flux2KleinAEDecode", {"ae": (3, 0), "latent": (7, 0)}, "decode", (decode_x, ae_y)),
            9: Node("SaveImage", {"images": (8, 0), "filename_prefix": prefix}, "decode",
                    save_at or (save_x, ae_y))}


def prompt(text: str, node: int = 4, y: int = 150, title: str = "Positive prompt", height: int | None = None,
           width: int | None = None, x: int = COLUMNS["prompt"], boxes=None) -> dict:
    size = (width or SIZES["Flux2KleinPromptEncode"][0], height or SIZES["Flux2KleinPromptEncode"][1])
    inputs = {"text_encoder": (2, 0), "prompt": text} | ({"boxes": boxes} if boxes else {})
    return {node: Node("Flux2KleinPromptEncode", inputs, "prompt", (x, y), title, size if (height or width) else None)}


def reference(node: int, image_node: int, file: str, conditioning, image_at: tuple[int, int],
              reference_at: tuple[int, int], number: int = 0) -> dict:
    """A Load Image (in the reference images' group) and its Reference node (in the prompt's group: it adds the
    image to the conditioning); number > 0 titles them "Reference image <number>" and "Reference <number>"."""
    suffix = f" {number}" if number else ""
    return {image_node: Node("LoadImage", {"image": file}, "references", image_at, f"Reference image{suffix}"),
            node: Node("Flux2KleinReference", {"conditioning": conditioning, "image": (image_node, 0), "ae": (3, 0)},
                       "prompt", reference_at, f"Reference{suffix}")}


WORKFLOWS = {
    "flux2-klein-text-to-image": {
        "title": "Text to image",
        "what": "Makes an image from a prompt with the distilled FLUX.2 Klein 4B, in 4 steps without classifier-free "
                "guidance (cfg 1, no negative prompt).",
        "nodes": loaders("flux-2-klein-4b.safetensors") | prompt(
            "A red fox sitting in fresh snow at dawn, soft golden light, photorealistic, shallow depth of field")
        | sampler((4, 0))},
    "flux2-klein-base-text-to-image": {
        "title": "Text to image with the base model",
        "what": "Makes an image from a prompt with FLUX.2 Klein Base 4B, the undistilled model: 50 steps with "
                "classifier-free guidance (cfg 4) against a negative prompt.",
        "nodes": loaders("flux-2-klein-base-4b.safetensors", ae_y=520) | prompt(
            "A cozy reading nook by a rainy window, warm lamp light, watercolor illustration", height=150)
        | prompt("blurry, low quality, distorted, watermark, text", node=10, y=360, title="Negative prompt", height=110)
        | sampler((4, 0), cfg=4.0, steps=50, negative=(10, 0), noise_at=(360, 680), denoise_x=1010, ae_y=520)},
    "flux2-klein-edit": {
        "title": "Edit an image",
        "what": "Edits a photo as the prompt says, with the distilled FLUX.2 Klein 4B: the photo goes in as a "
                "reference image, the prompt says what to change and what to keep.",
        "details": "Put the photo in ComfyUI's input folder as flux2-klein-edit-input.png (or pick any image in the "
                   "Reference image node). Alone, a reference is kept under about 4 megapixels (2024 x 2024) and "
                   "centre-cropped to multiples of 16; the output size is the noise node's.",
        # the noise and schedule above the prompt, so that their links reach the denoiser's top left unobstructed;
        # the reference below the prompt, just above the autoencoder lane, its image below that lane
        "nodes": loaders("flux-2-klein-4b.safetensors", prompt_y=EDIT_LANE - 240, ae_y=EDIT_LANE - 14)
        | prompt("Turn the scene into a snowy winter evening; keep the composition and the people unchanged",
                 y=EDIT_LANE - 240)
        | reference(11, 10, "flux2-klein-edit-input.png", (4, 0), (340, EDIT_LANE + 70), (780, EDIT_LANE - 86))
        | sampler((11, 0), noise_at=(340, 100), scheduler_at=(590, 190), denoise_x=1060, ae_y=EDIT_LANE - 14,
                  save_at=(1630, 400)),
        "note_at": (0, EDIT_LANE + 130), "group_titles": {"references": "Reference image"}},
    "flux2-klein-edit-3-references": {
        "title": "Combine three reference images",
        "what": "Makes one image from three reference images (for example a person, a jacket and a place) as the "
                "prompt describes, with the distilled FLUX.2 Klein 4B.",
        "details": "Put them in ComfyUI's input folder as flux2-klein-reference-1.png, flux2-klein-reference-2.png "
                   "and flux2-klein-reference-3.png (or pick others in the Reference image nodes); the prompt calls "
                   "them image 1, 2 and 3. With several references each is kept under about 1 megapixel "
                   "(1024 x 1024); reference i is told apart by its time offset 10 x i.",
        # as the edit, with the references in a staircase above the autoencoder lane (each lower than the one
        # before, so that the autoencoder's links to the later ones pass under the earlier ones) and their images
        # in a row below the lane
        "nodes": loaders("flux-2-klein-4b.safetensors", prompt_y=REF3_LANE - 380, ae_y=REF3_LANE - 14)
        | prompt("The person from image 1 wearing the jacket from image 2, standing in the place from image 3",
                 y=REF3_LANE - 380, width=300, height=190)
        | reference(11, 10, "flux2-klein-reference-1.png", (4, 0), (340, REF3_LANE + 70), (700, REF3_LANE - 246), 1)
        | reference(13, 12, "flux2-klein-reference-2.png", (11, 0), (620, REF3_LANE + 120), (980, REF3_LANE - 166), 2)
        | reference(15, 14, "flux2-klein-reference-3.png", (13, 0), (900, REF3_LANE + 170), (1260, REF3_LANE - 86), 3)
        | sampler((15, 0), noise_at=(340, 100), scheduler_at=(590, 190), denoise_x=1560, ae_y=REF3_LANE - 14,
                  save_at=(2130, 400)),
        "note_at": (0, REF3_LANE + 130)},
    "flux2-klein-lora": {
        "title": "Text to image with a LoRA",
        "what": "Makes an image from a prompt with the distilled FLUX.2 Klein 4B and a LoRA made for it.",
        "details": "Put the LoRA (ai-toolkit, kohya/musubi, diffusers, ComfyUI or LyCORIS LoKr files) in ComfyUI's "
                   "models/loras folder and pick it in the LoRA node; chain more LoRA nodes for a stack. The node "
                   "shows what the file matched, and the keys that matched nothing.",
        "nodes": loaders("flux-2-klein-4b.safetensors", prompt_y=240, ae_y=480)
        | {12: Node("Flux2KleinLoRA", {"model": (1, 0), "lora_name": "klein-4b-lora.safetensors", "strength": 1.0,
                                       "merge_into_fp8": False}, "lora", (COLUMNS["prompt"], 0))}
        | prompt("A lighthouse on a rocky coast at sunset, dramatic clouds", y=240, height=170)
        | sampler((4, 0), model=(12, 0), noise_at=(360, 640), ae_y=480)},
    "flux2-klein-gguf": {
        "title": "Text to image from GGUF files",
        "what": "Makes an image from a prompt on 6-12 GB graphics cards: the distilled FLUX.2 Klein 4B and its Qwen3-4B "
                "text encoder as GGUF files quantized to Q4_K_M, kept quantized in memory and dequantized as they "
                "compute.",
        "details": "Other quantizations, from Q8_0 to Q2_K, work too (in models/diffusion_models and "
                   "models/text_encoders); the loaders show which types a file holds.",
        "nodes": loaders("flux-2-klein-4b-Q4_K_M.gguf", "Qwen3-4B-Q4_K_M.gguf") | prompt(
            "A cozy mountain cabin under the northern lights, snow on the pines, long exposure photograph")
        | sampler((4, 0))},
    "flux2-klein-image-to-image": {
        "title": "Image to image",
        "what": "Redraws an image toward the prompt with the distilled FLUX.2 Klein 4B: the image is encoded, noised "
                "to the denoise strength (0.6: the last 60% of the steps run) and denoised.",
        "details": "Put the image in ComfyUI's input folder as flux2-klein-img2img-input.png (or pick any image in "
                   "the Input image node); its sides are cropped to multiples of 16 and the output has its size.",
        # the encoded image gives the noise, the schedule and the denoiser their size: the noise and the scheduler
        # stack in one column, each fed by the encoder, below the encoder's link to the denoiser
        "nodes": loaders("flux-2-klein-4b.safetensors") | prompt("An oil painting in the style of the impressionists")
        | {10: Node("LoadImage", {"image": "flux2-klein-img2img-input.png"}, "image", (0, 600), "Input image"),
           11: Node("Flux2KleinAEEncode", {"ae": (3, 0), "image": (10, 0)}, "image", (340, 580))}
        | sampler((4, 0), latent=(11, 0), denoise=0.6, noise_latent=(11, 0), noise_at=(620, 660),
                  scheduler_at=(620, 870), scheduler_latent=(11, 0), denoise_x=900),
        "note_at": (1210, 800)},
    "flux2-klein-inpaint": {
        "title": "Inpaint",
        "what": "Repaints the masked part of an image as the prompt says and keeps the rest, with the distilled "
                "FLUX.2 Klein 4B: the image is encoded, ComfyUI's Set Latent Noise Mask marks the area, and the "
                "denoiser keeps everything outside it, as ComfyUI's own samplers do.",
        "details": "Put the image in ComfyUI's input folder as flux2-klein-inpaint-input.png (or pick any image in the "
                   "Input image node), then right-click the node, Open in MaskEditor, and paint the area to repaint "
                   "(an image's transparent pixels count as painted). Soft mask edges blend. For the model to see "
                   "the whole image while it repaints, add a Klein Reference node with the same image "
                   "between the prompt and the denoiser.",
        # as image-to-image, with the mask set on the encoded image in the noise column, a little below the
        # encoder's row (the mask's link passes under the encoder), the noise and the schedule stacked below it,
        # both sized by the encoded image
        "nodes": loaders("flux-2-klein-4b.safetensors")
        | prompt("A small wooden rowing boat on the water, photorealistic")
        | {10: Node("LoadImage", {"image": "flux2-klein-inpaint-input.png"}, "image", (0, 600), "Input image"),
           11: Node("Flux2KleinAEEncode", {"ae": (3, 0), "image": (10, 0)}, "image", (340, 570)),
           12: Node("SetLatentNoiseMask", {"samples": (11, 0), "mask": (10, 1)}, "noise", (600, 600))}
        | sampler((4, 0), latent=(12, 0), noise_latent=(11, 0), noise_at=(620, 690), scheduler_at=(620, 890),
                  scheduler_latent=(11, 0), denoise_x=900),
        "note_at": (1210, 800)},
    "flux2-klein-outpaint": {
        "title": "Outpaint",
        "what": "Extends an image past its edges with the distilled FLUX.2 Klein 4B: ComfyUI's Pad Image for "
                "Outpainting puts it on a larger canvas and masks the added area, the canvas is encoded, Set Latent "
                "Noise Mask marks that area, and the denoiser paints it and keeps the image; the image also goes in "
                "as a reference.",
        "details": "Put the image in ComfyUI's input folder as flux2-klein-outpaint-input.png (or pick any image in "
                   "the Input image node), set the pixels to add on each side in the pad node (256 left and right "
                   "here), and describe the whole wider picture in the prompt. Keep the four amounts and the image's "
                   "sides multiples of 16, the model's grid, and the canvas is used as it is; otherwise the encoder "
                   "centre-crops it to multiples of 16 and the Denoise node cuts the mask the same way, so a few "
                   "pixels of the edges are lost. feathering (40 pixels) fades the painted area into the image, so the seam "
                   "is repainted too. The original image, not the padded canvas, is also a "
                   "reference (Klein Reference): the model sees the whole picture sharp at every step, so "
                   "what it adds matches its light, style and objects, and it has no grey border to copy. Bypass "
                   "that node (Ctrl+B) to paint from the prompt alone.",
        # as inpainting, with the pad node between the image and the encoder (the image row one node longer) and a
        # Reference right of the prompt, just above the autoencoder lane, fed by the prompt, the image and the AE
        "nodes": loaders("flux-2-klein-4b.safetensors")
        | prompt("A wide panorama of the same scene: the landscape goes on naturally to both sides, same light and "
                 "style, photorealistic")
        | {10: Node("LoadImage", {"image": "flux2-klein-outpaint-input.png"}, "image", (0, 600), "Input image"),
           13: Node("ImagePadForOutpaint", {"image": (10, 0), "left": 256, "top": 0, "right": 256, "bottom": 0,
                                            "feathering": 40}, "image", (330, 640)),
           11: Node("Flux2KleinAEEncode", {"ae": (3, 0), "image": (13, 0)}, "image", (590, 570)),
           12: Node("SetLatentNoiseMask", {"samples": (11, 0), "mask": (13, 1)}, "noise", (850, 600)),
           14: Node("Flux2KleinReference", {"conditioning": (4, 0), "image": (10, 0), "ae": (3, 0)}, "prompt",
                    (750, 300))}
        | sampler((14, 0), latent=(12, 0), noise_latent=(11, 0), noise_at=(870, 690), scheduler_at=(870, 890),
                  scheduler_latent=(11, 0), denoise_x=1050),
        "note_at": (1360, 800), "note_size": (520, 300)},
    "flux2-klein-ksampler": {
        "title": "Text to image with ComfyUI's KSampler",
        "what": "Makes an image from a prompt with the distilled FLUX.2 Klein 4B on this pack's engine, sampled by "
                "ComfyUI's own KSampler: FLUX.2 Klein to MODEL hands the model to ComfyUI as a MODEL (euler, simple "
                "schedule, 4 steps, cfg 1).",
        "details": "For ComfyUI's samplers, schedulers and sampling patches on the engine, with its storage (fp8, "
                   "int8, GGUF): pick any sampler and scheduler in the KSampler, swap it for SamplerCustomAdvanced "
                   "and a guider, or put a patch such as EasyCache between FLUX.2 Klein to MODEL and the sampler. "
                   "Keep cfg at 1 for distilled models: ComfyUI runs classifier-free guidance whenever cfg is not 1, "
                   "distilled models included (twice the model calls, and a picture the model was not trained "
                   "for). At cfg 1 the KSampler skips its negative, so the Negative (zeroed) node, ComfyUI's "
                   "ConditioningZeroOut, fills that socket, as in ComfyUI's own FLUX.2 Klein templates; for a base "
                   "model with cfg above 1, connect a Klein Prompt Encode there instead (empty, or what to "
                   "avoid). Put LoRAs on with Klein LoRA nodes between the model loader and FLUX.2 Klein to "
                   "MODEL: ComfyUI's LoRA loaders on this MODEL are refused. The output size is the Empty Flux 2 "
                   "Latent's width and height.",
        # the MODEL conversion in its own group on the model lane (as the LoRA node sits), the zeroed negative right
        # of the prompt, and the empty latent below it, right under the KSampler: its link climbs in the gap before
        # the KSampler, clear of the negative
        "nodes": loaders("flux-2-klein-4b.safetensors")
        | {11: Node("Flux2KleinToModel", {"model": (1, 0)}, "model", (COLUMNS["prompt"], 0))}
        | prompt("A red fox sitting in fresh snow at dawn, soft golden light, photorealistic, shallow depth of field")
        | {10: Node("ConditioningZeroOut", {"conditioning": (4, 0)}, "prompt", (760, 250), "Negative (zeroed)"),
           12: Node("EmptyFlux2LatentImage", {"width": 1024, "height": 1024, "batch_size": 1}, "noise", (700, 560)),
           7: Node("KSampler", {"model": (11, 0), "positive": (4, 0), "negative": (10, 0), "latent_image": (12, 0),
                                "seed": 42, "steps": 4, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
                                "denoise": 1.0}, "denoise", (1040, 0)),
           8: Node("Flux2KleinAEDecode", {"ae": (3, 0), "latent": (7, 0)}, "decode", (1405, AE_LANE)),
           9: Node("SaveImage", {"images": (8, 0), "filename_prefix": "flux2-klein"}, "decode", (1665, AE_LANE))}},
}

# FLUX 3 Image Klein: the same stages with its files, 16 steps on its own schedule
FLUX3 = ("flux3-image-klein.safetensors", "qwen3vl_4b.safetensors")
FLUX3_FILES = ("Put flux3-image-klein.safetensors (BF16, or BFL's int8) in models/diffusion_models and "
               "qwen3vl_4b.safetensors (the Qwen3-VL-4B text encoder) in models/text_encoders; the autoencoder is "
               "FLUX.2's. The loaders know FLUX 3 by the files' contents, whatever their names.")
LAYOUT_LANE = 440            # the layout workflow's prompt row: its Layout node sits left of the prompt, below this
WORKFLOWS |= {
    "flux3-klein-text-to-image": {
        "title": "FLUX 3 Image Klein: text to image",
        "what": "Makes an image from a prompt with FLUX 3 Image Klein, the distilled model: 16 steps on FLUX 3's "
                "schedule without classifier-free guidance (cfg 1, no negative prompt).",
        "details": FLUX3_FILES + " Long, detailed prompts work best: the prompt is read up to 4096 tokens.",
        "nodes": loaders(*FLUX3) | prompt(
            "A red fox sitting in fresh snow at dawn, soft golden light on its fur, pine forest behind, "
            "photorealistic, shallow depth of field")
        | sampler((4, 0), steps=16, schedule="flux3", prefix="flux3-klein")},
    "flux3-klein-edit-3-references": {
        "title": "FLUX 3 Image Klein: combine three reference images",
        "what": "Makes one image from three reference images as the prompt describes, with FLUX 3 Image Klein "
                "(up to 10 references; 16 steps, no classifier-free guidance).",
        "details": FLUX3_FILES + " Put the pictures in ComfyUI's input folder as flux2-klein-reference-1.png, "
                   "flux2-klein-reference-2.png and flux2-klein-reference-3.png (or pick others in the Reference "
                   "image nodes); the prompt calls them image 1, 2 and 3. With "
                   "several references each is kept under 1 megapixel and centre-cropped to multiples of 16; one "
                   "alone is fitted to 4 megapixels and its border reflected out to multiples of 16. Chain more "
                   "Reference nodes for more, up to 10.",
        "nodes": loaders(*FLUX3, prompt_y=REF3_LANE - 380, ae_y=REF3_LANE - 14)
        | prompt("The person from image 1 wearing the jacket from image 2, standing in the place from image 3",
                 y=REF3_LANE - 380, width=300, height=190)
        | reference(11, 10, "flux2-klein-reference-1.png", (4, 0), (340, REF3_LANE + 70), (700, REF3_LANE - 246), 1)
        | reference(13, 12, "flux2-klein-reference-2.png", (11, 0), (620, REF3_LANE + 120), (980, REF3_LANE - 166), 2)
        | reference(15, 14, "flux2-klein-reference-3.png", (13, 0), (900, REF3_LANE + 170), (1260, REF3_LANE - 86), 3)
        | sampler((15, 0), steps=16, schedule="flux3", prefix="flux3-klein", noise_at=(340, 100),
                  scheduler_at=(590, 190), denoise_x=1560, ae_y=REF3_LANE - 14, save_at=(2130, 400)),
        "note_at": (0, REF3_LANE + 130)},
    "flux3-klein-layout": {
        "title": "FLUX 3 Image Klein: text to image with a layout",
        "what": "Makes an image from a prompt and boxes that say where things go, with FLUX 3 Image Klein: the "
                "Layout node's boxes follow the prompt as the model reads them (16 steps, no classifier-free "
                "guidance).",
        "details": FLUX3_FILES + " Each box is [y_min, x_min, y_max, x_max] in 0-1 of the picture's height and "
                   "width, (0, 0) the top left, with a desc of what goes there; the prompt may name a box by its "
                   "id as <obj_1>.",
        # the prompt moved right, the Layout node left of it under the text encoder's link, its output climbing
        # to the prompt's boxes socket; the noise and the schedule above, as in the edits
        "nodes": loaders(*FLUX3, prompt_y=LAYOUT_LANE, ae_y=LAYOUT_LANE + 240)
        | {16: Node("Flux2KleinLayout", {"boxes": (
            '[{"desc": "a red hot-air balloon", "bbox": [0.08, 0.1, 0.45, 0.4]},\n'
            ' {"desc": "a small white chapel", "bbox": [0.55, 0.6, 0.8, 0.75]},\n'
            ' {"desc": "a lake reflecting the sky", "bbox": [0.8, 0.0, 1.0, 1.0]}]')}, "prompt",
                    (340, LAYOUT_LANE + 50))}
        | prompt("Hot-air balloons over a green valley at sunrise, a chapel on the hillside, mist over the lake, "
                 "photorealistic", y=LAYOUT_LANE, x=700, width=340, boxes=(16, 0))
        | sampler((4, 0), steps=16, schedule="flux3", prefix="flux3-klein", noise_at=(340, 100),
                  scheduler_at=(590, 190), denoise_x=1090, ae_y=LAYOUT_LANE + 240, save_at=(1660, 400)),
        "note_at": (340, LAYOUT_LANE + 330)},     # under the autoencoder's lane, beside its loader
}

# --- the compact workflows: a stage-by-stage workflow with its inner stages packed into one subgraph node ----------
#
# The loaders and the saver stay outside (the files you pick, the image you get); the subgraph node shows the widgets
# people change (ComfyUI's promoted widgets, properties.proxyWidgets), and opens to the stages it packs.

SUBGRAPH_TITLE = 30          # the frontend's subgraph node: title bar, then one row per socket and per widget


LOADERS_AT = {1: (0, 0), 2: (0, 150), 3: (0, 300)}
COMPACT_AT = 340                                  # the subgraph node's x, right of the loaders


def compact(source: str, title: str, subgraph: str, what: str, widgets: list[tuple[int, str]], save_x: int,
            size: tuple[int, int], outside: dict | None = None, at: int = COMPACT_AT) -> dict:
    """``source`` with its inner stages packed into a subgraph node at (at, 0) showing ``widgets``; the loaders (and
    ``outside``: node -> position, e.g. the images) stay outside, the saver right of the node."""
    spec = WORKFLOWS[source]
    moved = LOADERS_AT | (outside or {}) | {9: (save_x, 0)}
    nodes = {i: Node(n.cls, n.inputs, n.stage, moved.get(i, n.pos), n.title, n.size)
             for i, n in spec["nodes"].items()}
    return {"title": title, "what": what, "nodes": nodes,
            "details": " ".join([*([spec["details"]] if "details" in spec else []),
                                 ("Open the subgraph node (the icon at its top right) to see and change every "
                                  f"stage: inside, it is the {source} workflow.")]),
            "pack": {"outside": tuple(sorted(moved)), "widgets": widgets, "name": subgraph, "at": (at, 0),
                     "size": size},
            "group_titles": spec.get("group_titles", {}) | {"decode": "Save"}} | (
        {"note_at": (at, size[1] + 80)} if outside and any(spec["nodes"][i].cls == "LoadImage" for i in outside)
        else {})


TEXT_TO_IMAGE_WIDGETS = [(4, "prompt"), (5, "seed"), (5, "width"), (5, "height"), (6, "steps")]
WORKFLOWS |= {
    "flux2-klein-text-to-image-compact": compact(
        "flux2-klein-text-to-image", "Text to image, compact", "FLUX.2 Klein text to image",
        "The text-to-image workflow with its prompt, noise, schedule, denoising and decoding packed into one "
        "subgraph node that shows the prompt, seed, size and steps.", TEXT_TO_IMAGE_WIDGETS, 830, (420, 330)),
    "flux2-klein-gguf-compact": compact(
        "flux2-klein-gguf", "Text to image from GGUF files, compact", "FLUX.2 Klein text to image",
        "The GGUF text-to-image workflow with its prompt, noise, schedule, denoising and decoding packed into one "
        "subgraph node that shows the prompt, seed, size and steps.", TEXT_TO_IMAGE_WIDGETS, 830, (420, 330)),
    "flux2-klein-lora-compact": compact(
        "flux2-klein-lora", "Text to image with a LoRA, compact", "FLUX.2 Klein text to image",
        "The LoRA text-to-image workflow with its prompt, noise, schedule, denoising and decoding packed into one "
        "subgraph node that shows the prompt, seed, size and steps; the LoRA node stays outside.",
        TEXT_TO_IMAGE_WIDGETS, 1170, (420, 330), {12: (340, 450)}, at=680),
    "flux2-klein-edit-compact": compact(
        "flux2-klein-edit", "Edit an image, compact", "FLUX.2 Klein edit",
        "The edit workflow with its prompt, reference, noise, schedule, denoising and decoding packed into one "
        "subgraph node that shows the prompt, seed, size and steps; the photo to edit is loaded outside.",
        TEXT_TO_IMAGE_WIDGETS, 830, (420, 350), {10: (0, 480)}),
    "flux2-klein-image-to-image-compact": compact(
        "flux2-klein-image-to-image", "Image to image, compact", "FLUX.2 Klein image to image",
        "The image-to-image workflow with its prompt, encoding, noise, schedule, denoising and decoding packed into "
        "one subgraph node that shows the prompt, seed, steps and denoise strength; the image is loaded outside.",
        [(4, "prompt"), (5, "seed"), (6, "steps"), (7, "denoise")], 830, (420, 310), {10: (0, 480)}),
    "flux2-klein-base-text-to-image-compact": compact(
        "flux2-klein-base-text-to-image", "Text to image with the base model, compact", "FLUX.2 Klein base text to image",
        "The base-model text-to-image workflow with its prompts, noise, schedule, denoising and decoding packed into "
        "one subgraph node that shows the prompt, negative prompt, seed, size, steps and cfg.",
        [(4, "prompt"), (10, "prompt"), (5, "seed"), (5, "width"), (5, "height"), (6, "steps"), (7, "cfg")], 830,
        (420, 460)),
    "flux2-klein-edit-3-references-compact": compact(
        "flux2-klein-edit-3-references", "Combine three reference images, compact", "FLUX.2 Klein three references",
        "The three-reference workflow with its reference images, prompt, references, noise, schedule, denoising and "
        "decoding packed into one subgraph node that shows the three images, the prompt, seed, size and steps.",
        [(10, "image"), (12, "image"), (14, "image"), (4, "prompt"), (5, "seed"), (5, "width"), (5, "height"),
         (6, "steps")], 830, (420, 420)),
}

# --- building the two formats --------------------------------------------------------------------------------------


def is_link(value) -> bool:
    return isinstance(value, tuple)


def input_specs(info: dict) -> list[tuple[str, str, dict]]:
    """(name, type, options) of a node class's inputs, in the order the frontend lays them out."""
    specs = []
    for group in ("required", "optional"):
        for name in info["input_order"].get(group, []):
            kind, *rest = info["input"][group][name]
            specs.append((name, "COMBO" if isinstance(kind, list) else kind, rest[0] if rest else {}))
    return specs


def api_prompt(nodes: dict, object_info: dict) -> dict:
    """The API format, as the frontend's graphToPrompt writes it: widget values in widget order, then the links as
    [source id, slot] in socket order."""
    prompt = {}
    for i, node in sorted(nodes.items()):
        cls, inputs = node.cls, node.inputs
        names = [name for name, _, _ in input_specs(object_info[cls]) if name in inputs]
        ordered = [n for n in names if not is_link(inputs[n])] + [n for n in names if is_link(inputs[n])]
        prompt[str(i)] = {"class_type": cls,
                          "inputs": {n: [str(inputs[n][0]), inputs[n][1]] if is_link(inputs[n]) else inputs[n]
                                     for n in ordered},
                          "_meta": {"title": node.title or object_info[cls]["display_name"]}}
    return prompt


def ui_workflow(name: str, spec: dict, object_info: dict) -> dict:
    """The UI (LiteGraph 0.4) format: positioned nodes, socket inputs/outputs, widget values, link tuples."""
    nodes, links, sockets, widgets = spec["nodes"], [], {}, {}
    for i in sorted(nodes):                       # pass 1: each node's sockets and widget values; the links
        cls, inputs = nodes[i].cls, nodes[i].inputs
        sockets[i], widgets[i] = [], []
        for input_name, kind, options in input_specs(object_info[cls]):
            value = inputs.get(input_name)
            if kind in WIDGET_TYPES and not is_link(value) and not options.get("forceInput"):
                widgets[i].append(value if input_name in inputs else options.get("default"))
                widgets[i] += ["randomize"] if options.get("control_after_generate") else []
                widgets[i] += ["image"] if options.get("image_upload") else []
                continue
            link = None
            if is_link(value):
                link = len(links) + 1
                source_type = object_info[nodes[value[0]].cls]["output"][value[1]]
                links.append([link, value[0], value[1], i, len(sockets[i]), source_type])
            sockets[i].append({"name": input_name, "type": kind, "link": link})
    order, ui_nodes = topological(nodes), []
    for i in sorted(nodes):                       # pass 2: the nodes, with the links leaving each output
        node = nodes[i]
        cls, inputs = node.cls, node.inputs
        info = object_info[cls]
        outputs = [{"name": out_name, "type": out_type, "links": [k[0] for k in links if k[1:3] == [i, slot]]}
                   for slot, (out_name, out_type) in enumerate(zip(info["output_name"], info["output"]))]
        ours = cls.startswith("Flux2Klein")
        properties = {"Node name for S&R": cls, "cnr_id": PACK if ours else "comfy-core",
                      "ver": "0.1.0" if ours else "0.12.1"}
        models = [inputs[k] for k in MODEL_INPUTS if k in inputs and frontend_checks(inputs[k])]
        if models:
            properties["models"] = [{"name": m, "url": MODELS[m][1], "directory": MODELS[m][0]} for m in models]
        ui_nodes.append({"id": i, "type": cls, "pos": list(node.pos), "size": list(node.box), "flags": {},
                         "order": order.index(i), "mode": 0, "inputs": sockets[i], "outputs": outputs,
                         "properties": properties, "widgets_values": widgets[i]} | ({"title": node.title} if node.title
                                                                                      else {}))
    note_id = max(nodes) + 1
    lowest = max(n.pos[1] + n.box[1] for n in nodes.values() if n.pos[0] == COLUMNS["load"])
    note = Node("MarkdownNote", {}, "note", spec.get("note_at", (COLUMNS["load"], lowest + TITLE + 50)),
                "Models and files", spec.get("note_size"))
    ui_nodes.append({"id": note_id, "type": note.cls, "pos": list(note.pos), "size": list(note.box), "flags": {},
                     "order": len(nodes), "mode": 0, "inputs": [], "outputs": [], "title": note.title,
                     "properties": {}, "widgets_values": [note_text(spec)]})
    workflow = {"id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"{PACK}/{name}")), "revision": 0,
                "last_node_id": note_id, "last_link_id": len(links), "nodes": ui_nodes, "links": links,
                "groups": groups(list(nodes.values()) + [note], spec.get("group_titles", {})), "config": {},
                "extra": {}, "version": 0.4}
    return packed(name, workflow, spec, object_info) if "pack" in spec else workflow


def packed(name: str, flat: dict, spec: dict, object_info: dict) -> dict:
    """``flat`` with every node but the note and spec["pack"]["outside"] moved into one subgraph: its definition (the
    version 1 format: link objects; -10 and -20 are its input and output nodes) and the node that stands for it. A
    link crossing the border becomes an inner one to or from a subgraph socket and an outer one to or from the node
    (one outer link per source)."""
    pack, nodes = spec["pack"], spec["nodes"]
    inside = {i for i in nodes if i not in pack["outside"]}
    instance = max(n["id"] for n in flat["nodes"]) + 1
    by_id = {n["id"]: n for n in flat["nodes"]}
    inner, outer = [], []
    next_id = len(flat["links"]) + 1
    # the subgraph's sockets, in the order of the outputs that feed them (the loaders' order) or that they feed
    inputs = dict.fromkeys(sorted({(k[1], k[2]) for k in flat["links"] if k[1] not in inside and k[3] in inside}))
    outputs = dict.fromkeys(sorted({(k[1], k[2]) for k in flat["links"] if k[1] in inside and k[3] not in inside}))

    def socket(sockets: dict, key: tuple, kind: str) -> dict:
        if sockets[key] is None:
            label = object_info[nodes[key[0]].cls]["output_name"][key[1]] if sockets is inputs else kind.lower()
            sockets[key] = {"id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"{PACK}/{name}/{key}")), "name": label,
                            "type": kind, "linkIds": [], "localized_name": label}
        return sockets[key]

    for link_id, src, src_slot, dst, dst_slot, kind in flat["links"]:
        if src in inside and dst in inside:
            inner.append({"id": link_id, "origin_id": src, "origin_slot": src_slot, "target_id": dst,
                          "target_slot": dst_slot, "type": kind})
        elif dst in inside:                                   # into the subgraph
            io = socket(inputs, (src, src_slot), kind)
            if not io["linkIds"]:
                outer.append([next_id, src, src_slot, instance, list(inputs).index((src, src_slot)), kind])
                io["outer"], next_id = next_id, next_id + 1
            io["linkIds"].append(link_id)
            inner.append({"id": link_id, "origin_id": -10, "origin_slot": list(inputs).index((src, src_slot)),
                          "target_id": dst, "target_slot": dst_slot, "type": kind})
        elif src in inside:                                   # out of it
            io = socket(outputs, (src, src_slot), kind)
            io["linkIds"].append(link_id)
            inner.append({"id": link_id, "origin_id": src, "origin_slot": src_slot, "target_id": -20,
                          "target_slot": list(outputs).index((src, src_slot)), "type": kind})
            outer.append([next_id, instance, list(outputs).index((src, src_slot)), dst, dst_slot, kind])
            by_id[dst]["inputs"][dst_slot]["link"], next_id = next_id, next_id + 1
        else:
            outer.append([link_id, src, src_slot, dst, dst_slot, kind])
    for (src, src_slot), io in inputs.items():               # the loaders' outputs lead to the node now
        by_id[src]["outputs"][src_slot]["links"] = [k[0] for k in outer if k[1:3] == [src, src_slot]]
    members = [by_id[i] for i in sorted(inside)]
    left = min(n["pos"][0] for n in members) - 200
    right = max(n["pos"][0] + n["size"][0] for n in members) + 80
    middle = (min(n["pos"][1] for n in members) + max(n["pos"][1] + n["size"][1] for n in members)) // 2
    definition = {
        "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"{PACK}/{name}/subgraph")), "version": 1, "revision": 0,
        "state": {"lastGroupId": 0, "lastNodeId": max(inside), "lastLinkId": next_id - 1, "lastRerouteId": 0},
        "config": {}, "name": pack["name"],
        "inputNode": {"id": -10, "bounding": [left, middle - 50, 120, 100]},
        "outputNode": {"id": -20, "bounding": [right, middle - 30, 120, 60]},
        "inputs": [{k: v for k, v in io.items() if k != "outer"} for io in inputs.values()],
        "outputs": list(outputs.values()), "widgets": [], "nodes": members, "links": inner,
        "groups": groups([nodes[i] for i in sorted(inside)], {"decode": "Decode"}), "extra": {}}
    node = {"id": instance, "type": definition["id"], "pos": list(pack["at"]), "size": list(pack["size"]),
            "flags": {}, "order": len(pack["outside"]), "mode": 0, "title": pack["name"],
            "inputs": [{"name": io["name"], "localized_name": io["name"], "type": io["type"], "link": io["outer"]}
                       for io in inputs.values()],
            "outputs": [{"name": io["name"], "localized_name": io["name"], "type": io["type"],
                         "links": [k[0] for k in outer if k[1] == instance]} for io in outputs.values()],
            "properties": {"proxyWidgets": [[str(i), widget] for i, widget in pack["widgets"]]},
            "widgets_values": []}
    outside = [by_id[i] for i in sorted(pack["outside"])] + [n for n in flat["nodes"] if n["type"] == "MarkdownNote"]
    outer.sort()
    return flat | {"nodes": outside + [node], "links": outer, "last_node_id": instance, "last_link_id": next_id - 1,
                   "groups": groups([nodes[i] for i in pack["outside"]], spec.get("group_titles", {})),
                   "definitions": {"subgraphs": [definition]}}


GROUP_PAD, GROUP_TITLE = 16, 40       # around a stage's nodes; the band above them for the group's title


def groups(nodes: list[Node], titles: dict) -> list[dict]:
    """One group per stage, around its nodes (title bars included), in pipeline order; titles overrides STAGES."""
    out = []
    for stage, title in (STAGES | titles).items():
        members = [n for n in nodes if n.stage == stage]
        if not members:
            continue
        left = min(n.pos[0] for n in members) - GROUP_PAD
        top = min(n.pos[1] for n in members) - TITLE - GROUP_TITLE
        right = max(n.pos[0] + n.box[0] for n in members) + GROUP_PAD
        bottom = max(n.pos[1] + n.box[1] for n in members) + GROUP_PAD
        out.append({"id": len(out) + 1, "title": title, "bounding": [left, top, right - left, bottom - top],
                    "color": GROUP_COLOR, "font_size": 24, "flags": {}})
    return out


def model_files(spec: dict) -> list[str]:
    """The model files a workflow loads: diffusion model, text encoder, autoencoder."""
    return [node.inputs[k] for k in MODEL_INPUTS for _, node in sorted(spec["nodes"].items()) if k in node.inputs]


def description(spec: dict) -> str:
    """One paragraph: what the workflow does, and its model files."""
    files = model_files(spec)
    return f"{spec['what']} Model files: {', '.join(files[:-1])} and {files[-1]}."


def note_text(spec: dict) -> str:
    """The workflow's Markdown note: its title and description, how to use it, where each model file goes."""
    lines = [f"### {spec['title']}", "", description(spec), ""]
    lines += [spec["details"], ""] if "details" in spec else []
    lines += ["**Models** (ComfyUI's models folder):", ""]
    lines += [f"* `{MODELS[f][0]}/{f}`" + ("" if frontend_checks(f) else f" ({MODELS[f][1]})")
              for f in model_files(spec)]
    return "\n".join(lines)


README_START, README_END = "<!-- the list below is written by build.py -->", "<!-- end of the list -->"


def readme_list() -> str:
    """workflows/README.md's list of the workflows: file name, title and description (the template browser shows
    only the file name)."""
    rows = [f"| `{name}` | **{spec['title']}**: {description(spec)} |" for name, spec in WORKFLOWS.items()]
    return "\n".join([README_START, "", "| workflow | what it does |", "|---|---|", *rows, "", README_END])


def topological(nodes: dict) -> list[int]:
    done: list[int] = []
    while len(done) < len(nodes):
        for i in sorted(nodes):
            deps = [v[0] for v in nodes[i].inputs.values() if is_link(v)]
            if i not in done and all(d in done for d in deps):
                done.append(i)
    return done


def api_twin(name: str, spec: dict, object_info: dict) -> dict:
    """The API format; a packed workflow's inner nodes are "<subgraph node id>:<id>", as the frontend names them."""
    flat = api_prompt(spec["nodes"], object_info)
    if "pack" not in spec:
        return flat
    instance = ui_workflow(name, spec, object_info)["last_node_id"]
    outside = {str(i) for i in spec["pack"]["outside"]}
    rename = {i: i if i in outside else f"{instance}:{i}" for i in flat}
    return {rename[i]: entry | {"inputs": {k: [rename[v[0]], v[1]] if isinstance(v, list) else v
                                           for k, v in entry["inputs"].items()}} for i, entry in flat.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="127.0.0.1:8188")
    args = parser.parse_args()
    with urllib.request.urlopen(f"http://{args.server}/object_info") as response:
        object_info = json.load(response)
    (HERE / "api").mkdir(exist_ok=True)
    for name, spec in WORKFLOWS.items():
        for path, data in ((HERE / f"{name}.json", ui_workflow(name, spec, object_info)),
                           (HERE / "api" / f"{name}.json", api_twin(name, spec, object_info))):
            path.write_text(json.dumps(data, indent=2) + "\n")
            print("wrote", path.relative_to(HERE.parent))
    readme = HERE / "README.md"
    text = readme.read_text()
    start, end = text.index(README_START), text.index(README_END) + len(README_END)
    readme.write_text(text[:start] + readme_list() + text[end:])
    print("wrote", readme.relative_to(HERE.parent))


if __name__ == "__main__":
    main()
