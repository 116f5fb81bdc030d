"""FLUX 3 Image Klein through our nodes, in ComfyUI's own Python. Run by test_flux3_nodes.py from the ComfyUI source
tree (pytest does not collect it):

    python flux3_probe.py PACK_DIR TRANSFORMER TEXT_ENCODER_FOLDER AE CFG [edit]   -> one JSON object on stdout

Our nodes run as ComfyUI's executor calls them (the three loaders, Prompt Encode for the prompt and an empty negative,
Noise, a fresh Scheduler's default (the model's own: FLUX 3's schedule), Denoise, which draws FLUX 3's noise from the Noise node's seed, AE Decode), and the
engine runs the same files through ``pipeline.generate``. The report holds both sides' differences and what FLUX.2
Klein to MODEL says of the model. ``edit``: the prompt carries boxes (the Layout node) and two Reference nodes in a
chain add two pictures; Denoise runs after the first (one reference, on its padded canvas) and after the second (two,
the first prepared again as one of several), each against generate with the same references and boxes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path[0] = os.getcwd()         # ComfyUI's modules, from the source tree we run in (not this script's folder)

import utils.extra_config  # noqa: F401  (ComfyUI's utils package first, as main.py does)
from comfy.cli_args import args

args.cpu = True                   # before comfy.model_management is imported: devices() gives the CPU

import numpy as np
import torch

# a prompt of more than 80 tokens: the base model's CFG pairs it (160) with the empty negative (80)
PROMPT = ("a red fox in the snow at dusk, pine trees heavy with frost behind it, its breath a small cloud, the last "
          "light orange on the ridge, tracks winding back across the field to a fence half buried in drifts, ") * 2
NEGATIVE, SEED, WIDTH, HEIGHT, STEPS = "", 4, 64, 48, 3
BOXES = [{"desc": "a red fox", "bbox": [0.3, 0.2, 0.9, 0.6]},
         {"id": "tree", "desc": "a pine from the first picture", "from": "ref_image_0", "src_bbox": [0.0, 0.0, 1.0, 0.5],
          "tgt_bbox": [0.0, 0.6, 1.0, 1.0]}]


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from family_probe import load_module, run_node

    pack_dir, transformer, encoder, ae_file = (Path(a) for a in sys.argv[1:5])
    cfg, edit = float(sys.argv[5]), sys.argv[6:] == ["edit"]
    load_module("flux2_pack", pack_dir / "__init__.py", package=True)
    import folder_paths
    from flux2_pack.flux2_core import pipeline
    from flux2_pack.flux2_core.errors import Flux2Error
    from flux2_pack.nodes import autoencoder, boxes, comfy_model, conditioning, loaders
    from flux2_pack.nodes.denoise import Denoise
    from flux2_pack.nodes.noise import Noise
    from flux2_pack.nodes.scheduler import Scheduler

    for folder, path in (("diffusion_models", transformer), ("text_encoders", encoder), ("vae", ae_file)):
        folder_paths.add_model_folder_path(folder, str(path.parent), is_default=True)

    (model,) = run_node(loaders.ModelLoader, model_name=transformer.name, dtype="float32")
    (text_encoder,) = run_node(loaders.TextEncoderLoader, text_encoder_name=encoder.name, dtype="float32")
    (ae,) = run_node(loaders.AutoEncoderLoader, ae_name=ae_file.name, dtype="float32")
    (layout,) = run_node(boxes.Layout, boxes=json.dumps(BOXES)) if edit else (None,)
    (positive,) = run_node(conditioning.PromptEncode, text_encoder=text_encoder, prompt=PROMPT, boxes=layout)
    (negative,) = run_node(conditioning.PromptEncode, text_encoder=text_encoder, prompt=NEGATIVE)
    (noise,) = run_node(Noise, seed=SEED, width=WIDTH, height=HEIGHT, batch_size=1)
    # a fresh Scheduler's schedule (its default option) with the model connected: what Denoise runs with
    schedule = next(i for i in Scheduler.define_schema().inputs if i.id == "schedule")
    (sigmas,) = run_node(Scheduler, steps=STEPS, schedule=schedule.default, rho=2.0, width=WIDTH,
                         height=HEIGHT, model=model)
    (named,) = run_node(Scheduler, steps=STEPS, schedule="flux3", rho=2.0, width=WIDTH, height=HEIGHT)
    pictures = [picture(80, 50, 1), picture(40, 72, 2)] if edit else []
    conditionings = [positive]
    for p in pictures:                                    # one Reference node per picture, chained
        conditionings += run_node(conditioning.Reference, conditioning=conditionings[-1], ae=ae,
                                  image=torch.from_numpy(np.asarray(p)).float().div(255)[None])
    models = pipeline.load_models(transformer, encoder, ae_file, device="cpu", dtype=torch.float32)
    runs = []
    for count, positive in enumerate(conditionings[1:] if edit else conditionings, start=int(edit)):
        (latent,) = run_node(Denoise, model=model, positive=positive, negative=negative, noise=noise,
                             sigmas=sigmas, cfg=cfg, denoise=1.0)
        (image,) = run_node(autoencoder.AEDecode, ae=ae, latent=latent)
        expected = pipeline.generate(models, PROMPT, negative=NEGATIVE, cfg=cfg, width=WIDTH, height=HEIGHT,
                                     seed=SEED, steps=STEPS, references=pictures[:count], boxes=BOXES if edit else None)
        pixels = (image[0] * 255).round().to(torch.uint8)
        runs.append({"references": count, "latents_max_diff": (latent["samples"] - expected.latents).abs().max().item(),
                     "latents_max": expected.latents.abs().max().item(),
                     "pixels_max_diff": (pixels.int() - expected.images[0].int()).abs().max().item(),
                     "cfg": expected.settings["cfg"]})
    try:
        run_node(comfy_model.ToComfyModel, model=model)
        to_model = ""
    except Flux2Error as e:
        to_model = str(e)
    try:                                      # float16 by name: FLUX 3 runs in bfloat16 or float32 only
        run_node(loaders.ModelLoader, model_name=transformer.name, dtype="float16")
        float16 = ""
    except Flux2Error as e:
        float16 = str(e)
    print(json.dumps({
        "model": type(model.core).__name__, "variant": model.variant.name, "encoder": text_encoder.core.spec.model,
        "tokens": [positive[0][0].shape[1], negative[0][0].shape[1]],
        "reference_shapes": [list(t.shape) for t in conditionings[-1][0][1].get("reference_latents", [])],
        "runs": runs, "to_model": to_model, "float16": float16, "schedule_default": schedule.default, "sigmas": sigmas.tolist(),
        "named_sigmas": named.tolist()}))


def picture(width: int, height: int, seed: int):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy())


if __name__ == "__main__":
    main()
