"""A second model family through our nodes, in ComfyUI's own Python. Run by test_families.py from the ComfyUI source
tree (pytest does not collect it):

    python family_probe.py PACK_DIR TOY_FILE TEXT_ENCODER AE        -> one JSON object on stdout

The toy family (tests/toy_family/: a family package of its own) is registered in the pack's registry; then our
nodes run as ComfyUI's executor calls them (loader, prompt encode, noise, scheduler (the model's own), Denoise with CFG,
decode), and the
engine runs the same files through ``pipeline.generate``; then with a reference (Reference node), which the toy takes as K/V made once: two
Denoise runs, the second reusing them. The report holds both sides' differences, the reference passes and what FLUX.2
Klein to MODEL says of the toy's model.
"""

from __future__ import annotations

import importlib.util
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
from PIL import Image

PROMPT, NEGATIVE, SEED, WIDTH, HEIGHT, STEPS, CFG = "a red fox", "", 4, 48, 32, 3, 2.5


def load_module(name: str, path: Path, package: bool = False):
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=[str(path.parent)]
                                                  if package else None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_node(node, **inputs) -> tuple:
    """A V3 node's outputs, its execute called as ComfyUI's executor calls it (a locked clone, inference mode)."""
    return node_output(node, **inputs).args


def node_output(node, **inputs):
    """A V3 node's NodeOutput (its outputs and what it shows, ``ui``), called as ``run_node`` calls it."""
    from comfy_api.internal import make_locked_method_func

    node.VALIDATE_CLASS()
    with torch.inference_mode():
        return make_locked_method_func(node, "execute", node.PREPARE_CLASS_CLONE(None))(**inputs)


def main() -> None:
    pack_dir, toy_file, encoder_file, ae_file = (Path(a) for a in sys.argv[1:5])
    load_module("flux2_pack", pack_dir / "__init__.py", package=True)
    from flux2_pack.flux2_core import families, pipeline
    from flux2_pack.flux2_core.errors import Flux2Error
    from flux2_pack.flux2_core.sampling import schedules
    from flux2_pack.nodes import autoencoder, comfy_model, conditioning, loaders
    from flux2_pack.nodes.denoise import Denoise
    from flux2_pack.nodes.noise import Noise
    from flux2_pack.nodes.scheduler import Scheduler

    # the toy imports the engine as ``flux2_core``: the pack's own modules under that name, so it registers there
    for name, module in list(sys.modules.items()):
        if name.startswith("flux2_pack.flux2_core"):
            sys.modules[name.removeprefix("flux2_pack.")] = module
    toy = load_module("toy_family", pack_dir / "tests" / "toy_family" / "__init__.py", package=True)

    families.register(toy.TOY)
    import folder_paths

    for folder, path in (("diffusion_models", toy_file), ("text_encoders", encoder_file), ("vae", ae_file)):
        folder_paths.add_model_folder_path(folder, str(path.parent), is_default=True)

    (model,) = run_node(loaders.ModelLoader, model_name=toy_file.name, dtype="float32")
    (encoder,) = run_node(loaders.TextEncoderLoader, text_encoder_name=encoder_file.name, dtype="float32")
    (ae,) = run_node(loaders.AutoEncoderLoader, ae_name=ae_file.name, dtype="float32")
    (positive,) = run_node(conditioning.PromptEncode, text_encoder=encoder, prompt=PROMPT)
    (negative,) = run_node(conditioning.PromptEncode, text_encoder=encoder, prompt=NEGATIVE)
    (noise,) = run_node(Noise, seed=SEED, width=WIDTH, height=HEIGHT, batch_size=1)
    # the Scheduler's model's own with the toy's model connected (the toy, registered after the node's options were
    # listed, has no option of its own there): what Denoise runs with, and the toy's schedule by its name
    (sigmas,) = run_node(Scheduler, steps=STEPS, schedule=schedules.MODELS_OWN, rho=2.0, width=WIDTH,
                         height=HEIGHT, model=model)
    (named,) = run_node(Scheduler, steps=STEPS, schedule=toy.TOY.schedule_name, rho=2.0, width=WIDTH,
                        height=HEIGHT)
    (latent,) = run_node(Denoise, model=model, positive=positive, negative=negative, noise=noise,
                         sigmas=sigmas, cfg=CFG, denoise=1.0)
    (image,) = run_node(autoencoder.AEDecode, ae=ae, latent=latent)
    try:
        run_node(comfy_model.ToComfyModel, model=model)
        to_model = ""
    except Flux2Error as e:
        to_model = str(e)

    models = pipeline.load_models(toy_file, encoder_file, ae_file, device="cpu", dtype=torch.float32)
    expected = pipeline.generate(models, PROMPT, negative=NEGATIVE, cfg=CFG, width=WIDTH, height=HEIGHT, seed=SEED,
                                 steps=STEPS)
    pixels = (image[0] * 255).round().to(torch.uint8)

    # a reference: the toy takes it as K/V, made by its reference pass once and reused by the second Denoise
    picture = Image.fromarray(torch.randint(0, 256, (64, 96, 3), generator=torch.Generator().manual_seed(1),
                                            dtype=torch.uint8).numpy())
    (edit,) = run_node(conditioning.Reference, conditioning=positive, ae=ae,
                       image=torch.from_numpy(np.asarray(picture)).float().div(255)[None])
    passes = []
    make = model.core.reference_kv
    model.core.reference_kv = lambda ref, ids: passes.append(list(ref.shape)) or make(ref, ids)
    edited = [run_node(Denoise, model=model, positive=edit, negative=negative, noise=noise, sigmas=sigmas,
                       cfg=CFG, denoise=1.0)[0]["samples"] for _ in range(2)]
    expected_edit = pipeline.generate(models, PROMPT, negative=NEGATIVE, cfg=CFG, width=WIDTH, height=HEIGHT,
                                      seed=SEED, steps=STEPS, references=[picture])
    print(json.dumps({
        "model": type(model.core).__name__, "variant": model.variant.name, "holder": type(model.patcher.model).__name__,
        "latents_max_diff": (latent["samples"] - expected.latents).abs().max().item(),
        "latents_max": expected.latents.abs().max().item(),
        "pixels_max_diff": (pixels.int() - expected.images[0].int()).abs().max().item(),
        "edit_max_diffs": [(e - expected_edit.latents).abs().max().item() for e in edited],
        "edit_max": expected_edit.latents.abs().max().item(),
        "edit_changed": (expected_edit.latents - expected.latents).abs().max().item(),
        "reference_passes": passes, "to_model": to_model, "sigmas": sigmas.tolist(), "named_sigmas": named.tolist(),
        "listed": toy.TOY.schedule_name in schedules.SCHEDULES}))


if __name__ == "__main__":
    main()
