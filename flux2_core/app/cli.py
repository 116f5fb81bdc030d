"""``flux2-klein`` / ``python -m flux2_core``: PNGs from a prompt (``generate``, the default) or ``queue``. Weights
come from ``--models`` or explicit paths, which win; every PNG carries its settings as JSON (tEXt ``parameters``).
Under torchrun, ``--parallel`` "sequence" spreads each pass over the ranks, "data" gives each rank a share of images.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
import time
from functools import partial
from pathlib import Path

from ..errors import Flux2Error
from ..families import FAMILIES, VARIANTS, check_size_for_any, runnable_variants
from ..sampling.inpaint import MASK_READINGS
from .models_folder import find_weights, search_models, variant_option
from .option_types import dtype_option, number_option
from .outputs import check_folder, write_new

DEMO_SIZE = 256
# --offload: (text encoder, transformer blocks) as pipeline.load_models' offload_encoder and offload_blocks take them
OFFLOAD = {"auto": ("auto", "auto"), "none": (False, False), "encoder": (True, False), "blocks": (True, True)}
YES_NO = {"auto": "auto", "yes": True, "no": False}


# --int8's choices -> load_transformer's int8
INT8_CHOICES = {None: False, "rows": True, "convrot": "convrot"}

def program() -> str:
    return "python -m flux2_core" if Path(sys.argv[0]).parts[-2:] == ("flux2_core", "__main__.py") else "flux2-klein"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=program(), formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [generate] --prompt TEXT [options]\n       %(prog)s queue WORKFLOW.json [--server HOST:PORT] "
              "[options]",
        description="FLUX.2 Klein: PNGs from a prompt and optional reference images.",
        epilog="commands:\n"
               "  generate  the default: make PNGs on this machine, with the options above\n"
               "  queue     send an API-format workflow (workflows/api/*.json) to a running ComfyUI\n"
               "            and download its images; its options: %(prog)s queue --help")
    p.add_argument("--prompt", required=True, action="append",
                   help="what to generate (or how to edit the references); repeat for several prompts, each making "
                        "--batch images")
    p.add_argument("--ref", action="append", default=[], metavar="IMG", help="a reference image (repeatable)")
    p.add_argument("--boxes", metavar="FILE.json",
                   help="FLUX 3 Image Klein: where objects go, a JSON list of boxes [{\"desc\": \"a red kite\", "
                        "\"bbox\": [y_min, x_min, y_max, x_max]}] in 0-1 of the picture's height and width")
    p.add_argument("--upsample", nargs="?", const="", metavar="FOLDER",
                   help="FLUX 3 Image Klein: rewrite each prompt with BFL's prompt upsampler first (BFL recommends "
                        "it), as it would for these references and boxes; FOLDER is its Hugging Face folder (default: "
                        "the one holding system_prompts.json under --models)")
    p.add_argument("--width", type=number_option("--width", whole=True),
                   help="pixels, a multiple of 16 (default: the first reference's, else 1024)")
    p.add_argument("--height", type=number_option("--height", whole=True),
                   help="pixels, a multiple of 16 (default: the first reference's, else 1024)")
    p.add_argument("--steps", type=number_option("--steps", whole=True),
                   help="sampling steps (default: the model's, 4 distilled / 50 base)")
    p.add_argument("--cfg", type=number_option("--cfg"),
                   help="guidance scale for base models (default 4; distilled models ignore it)")
    p.add_argument("--negative", default="", help="negative prompt for base models with CFG (default empty)")
    p.add_argument("--cache", type=number_option("--cache", 0.0, 1.0, hint="0 turns the step cache off"), default=0.0,
                   metavar="THRESHOLD",
                   help="step cache: reuse the last velocity on steps where the latent has barely moved, skipping "
                        "model calls; 0 is off (default), higher skips more, at some cost in detail (it is how much the "
                        "model's output may be predicted to change and still be reused). For many-step runs (base "
                        "models, FLUX 3)")
    p.add_argument("--seed", type=number_option("--seed", whole=True),
                   help="seed of the first image; image i uses seed + i (default: random)")
    p.add_argument("--batch", type=number_option("--batch", whole=True), default=1,
                   help="number of images (default 1)")
    p.add_argument("--image", metavar="IMG", help="image-to-image: start from this image")
    p.add_argument("--mask", metavar="MASK", help="inpainting: repaint the white areas of this mask over --image, keep "
                                                "the black ones (grey blends), the same size as the image; how a mask "
                                                "with transparency is read: --mask-reading")
    p.add_argument("--mask-reading", choices=list(MASK_READINGS), default="auto",
                   help="grey: white = repaint; alpha: transparent = repaint (as ComfyUI's mask editor draws a mask); "
                        "auto (default): grey for a mask without transparency, and for one with transparency the "
                        "reading both give, else a refusal asking which (white strokes on a transparent layer mean "
                        "the opposite in the two)")
    p.add_argument("--expand", metavar="L,T,R,B",
                   help="outpainting: add LEFT,TOP,RIGHT,BOTTOM pixels around --image (each rounded up to a multiple "
                        "of 16) and paint them, fading into the image over 32 pixels so the seam is repainted too "
                        "(the image itself is kept: its latent stays the image's); the output is the whole canvas")
    p.add_argument("--strength", type=number_option("--strength"), default=1.0,
                   help="image-to-image and inpainting denoise strength in (0, 1] (default 1)")
    p.add_argument("--out", default="output", help="folder for the PNGs (default output/); existing files are kept, "
                   "a taken name gets -1, -2, ...")
    p.add_argument("--models", metavar="DIR", help="ComfyUI's models folder (the one holding diffusion_models/, "
                   "text_encoders/ and vae/): the weights are looked up there by their usual names")
    p.add_argument("--transformer", metavar="PATH", help="FLUX.2 Klein diffusion model file (.safetensors or .gguf) or "
                   "diffusers folder")
    p.add_argument("--text-encoder", metavar="PATH", help="Qwen3 text encoder file (.safetensors or .gguf) or folder")
    p.add_argument("--ae", metavar="PATH", help="FLUX.2 autoencoder file (flux2-vae.safetensors / ae.safetensors; "
                   "BFL's full_encoder_small_decoder.safetensors decodes faster)")
    p.add_argument("--decoder", metavar="PATH",
                   help="a decoder on its own (BFL's small_decoder.safetensors, about 44%% fewer parameters, visually "
                        "the same pictures) to decode with instead of the autoencoder's own; the autoencoder (--ae or "
                        "--models) still encodes and gives the latent statistics")
    p.add_argument("--variant", type=variant_option, metavar="NAME",
                   help=f"model variant: {', '.join(v.name for v in runnable_variants())} (default: detected from the "
                        f"weights; in a --models folder holding several models, the first of these found, and the "
                        f"run names the others)")
    p.add_argument("--device", help="cuda, cuda:1, cpu, ... (default: cuda if available)")
    p.add_argument("--dtype", type=dtype_option, metavar="{auto,bfloat16,float16,float32}",
                   help="transformer and text-encoder compute dtype (bf16, fp16 and fp32 name them too; default, auto: "
                        "what the device runs fast: bfloat16 on "
                        "NVIDIA GPUs from Ampere on and on CPUs with AMX or AVX-512 BF16; float16 for the transformer "
                        "on Volta / Turing GPUs such as the T4 and RTX 20xx; else float32). A bf16 or fp16 file's "
                        "weights stay 16-bit where the compute dtype is wider, cast per layer as it runs"),
    p.add_argument("--bfl-noise", action="store_true",
                   help="draw noise like the reference CLI (bf16 on the device) instead of float32 on the CPU")
    p.add_argument("--fp8", nargs="?", choices=["auto", "yes", "no"], const="yes", default="auto",
                   help="transformer weights in fp8 (e4m3, one scale per row), computed in the --dtype. --fp8 (yes): "
                        "every block, quantized as it loads: about half the memory of bf16 (Klein 4B: 7.5 -> 3.8 GB), "
                        "images differ slightly. auto (default): an fp8 file's fp8 layers stay fp8, with its own "
                        "scales. no: an fp8 file is dequantized to the --dtype")
    p.add_argument("--int8", nargs="?", choices=["rows", "convrot"], const="rows", default=None,
                   help="transformer block weights in int8 (one scale per row; convrot: in ConvRot's rotated basis, "
                        "which keeps outlier-heavy weights more exact), quantized as they load from any file "
                        "(bf16, fp8, GGUF): about half the memory of bf16; multiplied in int8 with the activations "
                        "quantized per token (comfy-kitchen's int8_linear) on NVIDIA GPUs from Turing on (RTX 20xx, "
                        "30xx, A100: no fp8 tensor cores needed) and on CPUs with VNNI or AMX in float32, else computed in the "
                        "--dtype; images differ slightly")
    p.add_argument("--fp8-matmul", choices=["auto", "yes", "no"], default="auto",
                   help="multiply fp8 weights in fp8 (torch._scaled_mm: activations quantized per token; faster, "
                        "results differ slightly). auto (default): whenever the weights are fp8 and the GPU has fp8 "
                        "tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell) with bfloat16 compute")
    p.add_argument("--compile-decoder", action="store_true",
                   help="torch.compile the autoencoder's decoder: the first picture of each size pays the compile, "
                        "later ones decode faster; worth it for many pictures of one size")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the transformer blocks: the first step pays the compile (about a minute on a "
                        "GPU, several on a CPU), later steps of the same size run faster; worth it for many steps or "
                        "a large --batch, not for one quick image")
    p.add_argument("--offload", choices=list(OFFLOAD), default="auto",
                   help="what waits in CPU memory so that a smaller GPU suffices. none: everything on the GPU. "
                        "encoder: the text encoder rests on the CPU between prompts (Qwen3-4B about 6 GB, 8B about "
                        "12 GB in bf16), costing a copy to the GPU for each new prompt. blocks: that, and the "
                        "transformer's blocks that do not fit beside the working memory of a --width x --height "
                        "image (default 1024^2) stay in pinned CPU memory and are copied to the GPU as they run, "
                        "every step (Klein 9B on a 12 GB card; slower, more so without --fp8). auto (default): on "
                        "CUDA, each only when the free memory is short. Not used with --demo")
    p.add_argument("--offload-encoder", choices=["auto", "yes", "no"],
                   help="the text encoder alone, overriding --offload's choice for it: yes rests it on the CPU, no "
                        "keeps it on the GPU, auto when free memory is short")
    p.add_argument("--lora", action="append", default=[], metavar="FILE[:STRENGTH]",
                   help="apply a LoRA / LoKr / LoHa / DoRA file (ai-toolkit, kohya/musubi, diffusers/PEFT, ComfyUI, "
                        "LyCORIS formats) with a strength (default 1); repeat for several. Merged into full-precision "
                        "weights (no cost per step), run beside fp8 ones. Prints what each file matched")
    p.add_argument("--lora-merge", action="store_true",
                   help="merge the LoRAs into fp8 weights too (dequantized, patched and quantized again: no cost per "
                        "step, one more fp8 rounding) instead of running them beside the fp8 weights")
    p.add_argument("--parallel", choices=["sequence", "data"], default="sequence",
                   help="under torchrun --nproc-per-node N (one process per GPU): sequence (default) spreads every "
                        "image over the N processes, for one large image sooner; the number of attention heads must be "
                        "divisible by N (Klein 4B: 24 heads, 9B: 32). data: each process makes its share of the images "
                        "(prompts x --batch) with its own copy of the models")
    p.add_argument("--demo", action="store_true",
                   help="tiny built-in RANDOM weights: checks the install, makes noise-like pictures")
    return p


# --- progress and output ---------------------------------------------------------------------------------------------

class Progress:
    """tqdm when installed, else a line rewritten in place (stderr)."""

    def __init__(self):
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        self.tqdm, self.bar = tqdm, None

    def __call__(self, step) -> None:
        if self.tqdm is not None:
            if self.bar is None:
                self.bar = self.tqdm(total=step.total, desc="sampling", unit="step", file=sys.stderr)
            self.bar.update(1)
            if step.index + 1 == step.total:
                self.bar.close()
                self.bar = None
            return
        end = "\n" if step.index + 1 == step.total else ""
        print(f"\rsampling: step {step.index + 1}/{step.total} (sigma {step.sigma_next:.3f})", end=end,
              file=sys.stderr, flush=True)


def save_png(image, file, parameters: dict) -> None:
    """uint8 [H, W, 3] -> PNG (into an open binary file) with ``parameters`` as JSON in a tEXt chunk."""
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text("parameters", json.dumps(parameters, ensure_ascii=False))
    info.add_text("Software", "flux2-klein-engine")
    Image.fromarray(image.numpy()).save(file, format="PNG", pnginfo=info)


def open_image(path: str):
    """--ref / --image files: bounded, upright, 16-bit scaled RGB (``references.open_image``)."""
    from ..sampling.references import open_image as decode

    image = decode(path)
    note_first_frame(path)
    return image


def open_mask(path: str):
    """--mask: bounded and upright, its transparency kept (``inpaint.mask_levels`` reads it)."""
    from ..sampling.references import open_picture

    image = open_picture(path)
    note_first_frame(path)
    return image


def note_first_frame(path: str) -> None:
    """An animation or a multi-page file gives its first frame, and says so."""
    from PIL import Image

    with Image.open(path) as picture:               # read already: only the frame count is looked up here
        frames = getattr(picture, "n_frames", 1)
        # a phone's JPEG with a multi-picture block (a preview, a gain map) opens as MPO: one photo, nothing to say
        frames = 1 if picture.format == "MPO" else frames
    if frames > 1:
        print(f"note: {path} holds {frames} frames (an animation or a multi-page file); the first is used",
              file=sys.stderr)


# --- the command --------------------------------------------------------------------------------------------------

def check_early(args, refs) -> None:
    """The engine's own rules, checked before loading weights (minutes), with the option's name in front."""
    from .. import latents
    from ..sampling import euler, inpaint, schedules
    from ..sampling.references import check_count, check_reference

    family = early_family(args)
    rules = [(["--width", "--height"], lambda: args.width is None and args.height is None or latents.latent_size(
                 *(latents.PIXELS_PER_LATENT if side is None else side for side in (args.height, args.width)))),
             (["--steps"], lambda: args.steps is None or schedules.check_steps(args.steps)),
             (["--width", "--height", "--steps"], lambda: None in (args.width, args.height) or check_schedule(
                 family, args.steps, args.width, args.height)),
             (["--cfg"], lambda: args.cfg is None or euler.check_cfg(args.cfg)),
             (["--seed", "--batch"], lambda: euler.check_seed(0 if args.seed is None else args.seed, args.batch)),
             (["--strength"], lambda: schedules.check_strength(args.strength, args.image is not None)),
             (["--mask"], lambda: inpaint.check_source(args.mask is not None, args.image is not None)),
             (["--expand"], lambda: args.expand is None or inpaint.parse_expand(args.expand)),
             (["--expand"], lambda: args.expand is None or inpaint.check_outpaint(args.image is not None,
                                                                                  args.mask is not None))]
    for options, rule in rules:
        try:
            rule()
        except Flux2Error as e:
            raise Flux2Error(f"{'/'.join(options)}: {e}") from None
    if args.demo and args.decoder:
        raise Flux2Error("--decoder replaces the decoder of a real autoencoder; --demo has none: leave one out")
    if args.int8 and args.fp8 == "yes":
        raise Flux2Error("--int8 and --fp8 both choose how the blocks' weights are stored: pick one")
    if family is not None:              # else the load that follows says what is wrong with the files
        fit = family.references
        given = references_given(args, refs)
        inpainted = given.inpainted
        try:
            check_count(given, fit, family.title)
        except Flux2Error as e:
            raise Flux2Error(f"--ref{' / --image' if inpainted else ''}: {e}") from None
        for i, ref in enumerate(refs):
            check_reference(ref, i, fit)
    for path, _strength in map(lora_argument, args.lora):
        if not Path(path).expanduser().is_file():
            raise Flux2Error(f"--lora {path}: no such file; give the path of a .safetensors LoRA, optionally with "
                             f":STRENGTH (e.g. --lora style.safetensors:0.8)")


def check_schedule(family, steps: int | None, width: int, height: int) -> None:
    """The family that runs (None: any family) makes a picture of this size: its schedule serves it and no side is
    past its ``largest_side``. Without --steps, asked at 4 steps: a size that breaks at 4 breaks at any default."""
    from .. import latents

    tokens = math.prod(latents.latent_size(height, width))
    for each in [family] if family is not None else FAMILIES.values():
        each.schedule(steps or 4, tokens)
    if family is not None:
        family.check_size(width, height)
    else:
        check_size_for_any(width, height)


def early_family(args):
    """The model family the command will run, from --variant or the file's headers; None where not yet known."""
    from ..families import family_of

    if args.variant or args.demo:
        from .demo import demo_variant

        return family_of(demo_variant(args.variant) if args.demo else VARIANTS[args.variant])
    try:
        from ..weights import inspect_transformer

        path = find_weights(args.models, None, args.transformer, args.text_encoder, args.ae)[0]
        return family_of(inspect_transformer(path)[1])
    except Flux2Error:
        return None


def read_layout(path: str | None):
    """--boxes FILE.json -> the boxes (``boxes.read_boxes``), read and checked before any model loads."""
    from ..families.flux3.boxes import EXAMPLE, read_boxes
    from ..user_json import read_json_file

    if path is None:
        return None
    layout = read_json_file(Path(path).expanduser(), list,
                            f"give a UTF-8 JSON file that holds a list of boxes such as {EXAMPLE}", "the --boxes file")
    return read_boxes(layout, f"the boxes in {path}")


def references_given(args, refs):
    """The --ref pictures, plus --image where --mask or --expand inpaint it (reference 1)."""
    from ..families import ReferenceCount

    return ReferenceCount(len(refs), inpainted=args.image is not None and (args.mask is not None
                                                                          or args.expand is not None))


def check_rows_early(args, refs, layout_file: str | None) -> None:
    """Each prompt's layout rows checked against the references the model will be given, before any model loads."""
    from ..families.flux3.boxes import check_rows, rows_read

    given = references_given(args, refs)
    for prompt in args.prompt:
        check_rows(rows_read(prompt, args.boxes or []), given, f"--boxes {layout_file}" if args.boxes else "--prompt")


def lora_argument(text: str) -> tuple[str, float]:
    """--lora FILE[:STRENGTH] -> (file, strength); a strength is a number after the last colon (so C:\\x works)."""
    from ..checks import REAL_TEXT, parse_number

    path, _, strength = text.rpartition(":")
    if path and strength.strip().lower().lstrip("+-") in ("nan", "inf", "infinity"):
        raise Flux2Error(f"--lora {path}: the strength must be a finite number, got {strength}")
    if not path or not REAL_TEXT.fullmatch(strength.strip()):
        return text, 1.0
    return path, parse_number(strength, f"--lora {path}: the strength")


def report_streaming(model, compiled: bool) -> None:
    from ..runtime.memory import GIB
    from ..runtime.offload import streamed_blocks, streaming

    streamed = streamed_blocks(model)
    if not streamed:
        return
    total = len(model.blocks())
    print(f"note: {len(streamed)} of {total} transformer blocks ({streaming(model).streamed_bytes / GIB:.1f} GiB) do "
          f"not fit the GPU and are copied from CPU memory at every step (--offload)", file=sys.stderr)
    if compiled:
        print("note: --compile compiles only the blocks that stay on the GPU; the streamed blocks run uncompiled",
              file=sys.stderr)


def generate_command(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    out = check_folder(args.out, "--out")          # before anything slow: a wrong --out must not cost a generation
    from ..pipeline import DEFAULT_SIZE
    from ..sampling.references import MAX_IMAGE_PIXELS, grid_size

    refs = [open_image(p) for p in args.ref]
    image = open_image(args.image) if args.image else None
    check_early(args, refs)
    layout_file, args.boxes = args.boxes, read_layout(args.boxes)
    check_rows_early(args, refs, layout_file)
    mask = open_mask(args.mask) if args.mask else None
    if image is not None:                # before any model loads (a mask is fitted to the image: the image decides)
        grid_size(*image.size, f"--image {args.image}")
    if args.expand:                      # outpainting: the canvas and its mask become the image and the mask
        from ..sampling import inpaint

        def served(width: int, height: int) -> None:
            try:
                check_schedule(early_family(args), args.steps, width, height)
            except Flux2Error as e:
                raise Flux2Error(f"--expand: the expanded canvas, {width}x{height} px, is the picture made, and {e}; "
                                 f"expand less, or shrink the image first") from None

        # the canvas is the picture made; its size is checked before it is made
        canvas = inpaint.expand_canvas(image, inpaint.parse_expand(args.expand), max_pixels=MAX_IMAGE_PIXELS,
                                       check=served)
        image, mask = canvas.image, canvas.mask
    sp = join_ranks(args)
    upsampled = [{} for _ in args.prompt]
    if args.upsample is not None:
        if sp is not None:
            raise Flux2Error("--upsample runs once, before the ranks share the work: upsample in a single process "
                             "first (its answer is printed), then pass that prompt to the ranks")
        args.prompt, args.boxes, upsampled = upsample_prompts(args, refs)
    seed = shared_seed(args.seed, sp)
    sequence = sp is not None and args.parallel == "sequence"
    if sequence and not sp.driver:
        return follow(args, sp)
    width, height = args.width, args.height
    if args.demo and not refs and image is None:
        width, height = width or DEMO_SIZE, height or DEMO_SIZE
    started = time.time()
    try:
        models, files = load_for_command(args, sp.device if sp else args.device, (width or DEFAULT_SIZE,
                                                                                  height or DEFAULT_SIZE))
        if sequence:
            from ..runtime.parallel import attach

            attach(models.transformer, sp)
            files["parallel"] = f"sequence, {sp.world} ranks"
        share = (sp.rank, sp.world) if sp is not None and not sequence else (0, 1)
        jobs = image_jobs(len(args.prompt), args.batch, seed, *share)
        made = 0
        for index, first, count in jobs:
            result = models_generate(models, args, args.prompt[index], first, count, refs, image, mask, width, height)
            if "cache" in result.settings:
                from ..sampling.step_cache import CacheReport

                print(CacheReport(**result.settings["cache"]).line(), file=sys.stderr)
            name = f"flux2_p{index + 1}_{{}}.png" if len(args.prompt) > 1 else "flux2_{}.png"
            for img, img_seed in zip(result.images, result.seeds):
                parameters = {**result.settings, "seed": img_seed, **files, **upsampled[index]}
                parameters.pop("batch")
                print(write_new(out, name.format(img_seed), partial(save_png, img, parameters=parameters)))
            made += len(result.seeds)
    finally:
        if sequence:
            sp.stop()                    # the followers return; then the group closes
        elif sp is not None:
            from ..runtime.parallel import leave

            leave()
    where = f" (rank {sp.rank} of {sp.world})" if sp is not None and not sequence else ""
    print(f"{made} image(s) in {out}{where} ({time.time() - started:.1f}s)", file=sys.stderr)
    return 0


def find_upsampler_folder(models: str | None) -> Path:
    """--upsample without a folder: the one folder under --models (at most two levels down) with system_prompts.json."""
    from ..upsampler.model import PROMPTS_FILE, upsamplers_under

    if not models:
        raise Flux2Error("--upsample: give the upsampler's folder (--upsample FOLDER), or --models with it inside")
    root = Path(models).expanduser()
    found = upsamplers_under(root)
    if not found:
        raise Flux2Error(f"--upsample: no folder under {root} holds {PROMPTS_FILE} (the prompt upsampler's); download "
                         "BFL's upsampler folder there, or name it: --upsample FOLDER")
    if len(found) > 1:
        raise Flux2Error(f"--upsample: {len(found)} prompt upsampler folders under {root} "
                         f"({', '.join(str(f) for f in found)}); name the one to use: --upsample FOLDER")
    return found[0]


def upsample_prompts(args, refs) -> tuple[list[str], list, list[dict]]:
    """Each prompt through the upsampler, freed before the image models load: (prompts, boxes left, what each PNG
    records of it)."""
    import gc

    import torch

    from ..sampling.request import check_layout
    from ..upsampler.model import PromptUpsampler, check_request

    family = early_family(args)
    if family is not None:
        try:
            check_layout(args.boxes, family, family.title)
        except Flux2Error as e:
            raise Flux2Error(f"--boxes: {e}") from None
    for prompt in args.prompt:
        check_request(prompt, len(refs), args.boxes)
    folder = Path(args.upsample).expanduser() if args.upsample else find_upsampler_folder(args.models)
    print(f"loading the prompt upsampler {folder.name}", file=sys.stderr)
    upsampler = PromptUpsampler(folder, device=args.device, dtype=getattr(torch, args.dtype) if args.dtype else None)
    prompts, records = [], []
    for prompt in args.prompt:
        answer = upsampler(prompt, refs, boxes=args.boxes)
        print(f"upsampled ({answer.tokens} tokens): {answer.prompt}", file=sys.stderr)
        prompts.append(answer.prompt)
        records.append({"upsampled_from": prompt, "upsampler": folder.name})
    del upsampler
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return prompts, [], records


def load_for_command(args, device, size: tuple[int, int]):
    """(the models, LoRAs applied and optimized as asked; what the PNGs say about them)."""
    import torch

    from ..pipeline import apply_adapters, load_models, optimize_transformer
    from ..storage.matmul import choose_matmuls
    from ..storage.protocol import census
    from ..weights import storage_outcome

    offload, offload_blocks = encoder_offload(args), OFFLOAD[args.offload][1]
    if args.demo:
        from .demo import demo_models

        print("DEMO MODE: tiny built-in RANDOM weights. The pictures are noise; this only checks that every stage "
              "runs. Use --models or --transformer/--text-encoder/--ae for real images.")
        models, files = demo_models(args.variant, device or "cpu"), {"weights": "demo (random)"}
    else:
        found, files = search_models(args.models, args.variant, args.transformer, args.text_encoder, args.ae), {}
        for note in found.notes:                 # the other models in the folder, files that could not be read
            print(f"note: {note}", file=sys.stderr)
        paths = found.paths
        dtype = getattr(torch, args.dtype) if args.dtype else None
        fp8, int8 = {"auto": None, "yes": True, "no": False}[args.fp8], INT8_CHOICES[args.int8]
        # from the headers: an --int8 / --fp8 that changes nothing says so
        outcome = storage_outcome(paths[0], variant=args.variant, fp8=fp8, int8=int8)
        print(f"loading {paths[0].name}, {paths[1].name}, {paths[2].name}{f'; {outcome.line()}' if outcome else ''}",
              file=sys.stderr)
        models = load_models(*paths, device=device, dtype=dtype, variant=args.variant, fp8=fp8, int8=int8,
                             offload_encoder=offload, offload_blocks=offload_blocks, size=size, decoder=args.decoder)
        files |= {"transformer": paths[0].name, "text_encoder": paths[1].name, "ae": paths[2].name}
        if dtype is None:             # the family's rule on this device (devices.model_dtype), as load_models took it
            from ..weights import transformer_dtype

            chosen = transformer_dtype(paths[0], models.device)
            print(f"computing in {chosen.name}: {chosen.why}", file=sys.stderr)
            files["dtype"] = f"{chosen.name} ({chosen.why})"
        else:
            files["dtype"] = f"{args.dtype} (--dtype)"
        if args.decoder:
            files["decoder"] = Path(args.decoder).name
    optimize_transformer(models, fp8=args.demo and args.fp8 == "yes", int8=args.demo and INT8_CHOICES[args.int8])  # files: on load
    if args.lora:
        loras = [lora_argument(a) for a in args.lora]
        for line in apply_adapters(models, loras, merge=True if args.lora_merge else None):
            print(f"LoRA {line}", file=sys.stderr)
        files["loras"] = [{"file": Path(path).name, "strength": strength} for path, strength in loras]
    optimize_transformer(models, compile=args.compile)                          # after the LoRAs: a compiled graph
    if args.compile_decoder:
        from ..runtime.compile import compile_decoder

        compile_decoder(models.autoencoder)
    report_streaming(models.transformer, args.compile)
    stored = [kind for kind in census(models.transformer) if kind != "float"]
    if stored:
        files["transformer_weights"] = "+".join(stored)          # e.g. "fp8", "Q4_K+Q6_K", "int8"
    matmuls = choose_matmuls(models.transformer, models.device, models.transformer.dtype,
                             fp8=YES_NO[args.fp8_matmul])
    for note in matmuls.notes:
        print(note, file=sys.stderr)
    files |= matmuls.record()                   # every quantized kind with a matmul of its own: on or off
    return models, files


def encoder_offload(args):
    """Where the text encoder rests: --offload-encoder, else what --offload says for it."""
    return OFFLOAD[args.offload][0] if args.offload_encoder is None else YES_NO[args.offload_encoder]


def models_generate(models, args, prompt: str, seed: int, batch: int, refs, image, mask, width, height):
    from ..pipeline import generate

    return generate(models, prompt, references=refs, width=width, height=height, steps=args.steps, cfg=args.cfg,
                    negative=args.negative, seed=seed, batch=batch, image=image, mask=mask,
                    mask_reading=args.mask_reading, strength=args.strength,
                    boxes=args.boxes, cache=args.cache,
                    bfl_cuda_noise=args.bfl_noise, offload_encoder=encoder_offload(args), callback=Progress(),
                    warn=lambda note: print(f"note: {note}", file=sys.stderr, flush=True))


# --- several processes (torchrun) -----------------------------------------------------------------------------------

def join_ranks(args):
    """``parallel.SequenceParallel`` under torchrun, else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from ..runtime import parallel

    if args.compile:
        raise Flux2Error("--compile does not run across several processes yet: leave it out under torchrun")
    if args.parallel == "sequence" and args.offload == "blocks":
        raise Flux2Error("--offload blocks does not run across several processes: the ranks already share the "
                         "transformer's work; leave it out, or use --parallel data")
    # data parallel needs the group only to agree on the seed: gloo, whatever the devices
    return parallel.start_from_env(args.device, backend="gloo" if args.parallel == "data" else None)


def shared_seed(seed: int | None, sp) -> int:
    """--seed, or a random one; every rank takes rank 0's."""
    import torch
    import torch.distributed as dist

    seed = seed if seed is not None else random.randrange(2 ** 31)
    if sp is None:
        return seed
    value = torch.tensor([seed], dtype=torch.int64, device=sp.device if dist.get_backend() == "nccl" else "cpu")
    dist.broadcast(value, 0)
    return int(value.item())


def image_jobs(prompts: int, batch: int, seed: int, rank: int = 0, world: int = 1) -> list[tuple[int, int, int]]:
    """(prompt index, first seed, count) of this rank's contiguous share of every prompt's ``batch`` images."""
    from ..runtime.parallel import shares

    items = [(prompt, seed + i) for prompt in range(prompts) for i in range(batch)]
    sizes = shares(len(items), world)
    items = items[sum(sizes[:rank]):sum(sizes[:rank + 1])]
    jobs: list[tuple[int, int, int]] = []
    for prompt, item_seed in items:
        if jobs and jobs[-1][0] == prompt and jobs[-1][1] + jobs[-1][2] == item_seed:
            jobs[-1] = (prompt, jobs[-1][1], jobs[-1][2] + 1)
        else:
            jobs.append((prompt, item_seed, 1))
    return jobs


def follow(args, sp) -> int:
    """A sequence-parallel follower: the transformer alone, loaded as the driver's, serving its passes."""
    from ..adapters.lora import read_adapter
    from ..adapters.patching import set_adapters
    from ..runtime import parallel
    from ..runtime.followers import TransformerSource
    from ..storage.matmul import choose_matmuls

    if args.demo:
        from ..families import family_of
        from .demo import demo_transformer, demo_variant

        model = demo_transformer(sp.device)
        quantizable = family_of(demo_variant()).quantizable
        if args.fp8 == "yes":
            from ..storage.quant import quantize_transformer

            quantize_transformer(model, quantizable)
        if args.int8:
            from ..storage.int8 import quantize_blocks

            quantize_blocks(model, quantizable, convrot=args.int8 == "convrot")
        choose_matmuls(model, sp.device, model.dtype, fp8=YES_NO[args.fp8_matmul])
    else:                           # as the followers ComfyUI's process starts load
        path = find_weights(args.models, args.variant, args.transformer, args.text_encoder, args.ae)[0]
        source = TransformerSource.of(path, args.dtype, {"auto": None, "yes": True, "no": False}[args.fp8],
                                      args.variant, int8=INT8_CHOICES[args.int8])
        model = source.load(sp.device, fp8_matmul=YES_NO[args.fp8_matmul])
    if args.lora:
        read = [(read_adapter(path, model.params), strength) for path, strength in map(lora_argument, args.lora)]
        set_adapters(model, [(patch, s) for a, s in read for patch in a.patches], merge=True if args.lora_merge else None)
    parallel.serve(model, sp)
    parallel.leave()
    return 0


@contextlib.contextmanager
def denormals_flushed():
    """Subnormals (e.g. SiLU of a large negative gate) slow CPU matmuls 10-100x; flushed, nothing visible changes."""
    import torch

    was = torch.tensor([1e-39]).mul(1.0).item() == 0.0
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(was)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["queue"]:
        from .queue_command import main as queue_main

        return queue_main(argv[1:], prog=f"{program()} queue")
    if argv[:1] == ["generate"]:
        argv = argv[1:]
    elif argv and not argv[0].startswith("-"):
        print(f"{program()}: unknown command {argv[0]!r}; use generate (the default) or queue (see --help)",
              file=sys.stderr)
        return 2
    try:
        with denormals_flushed():
            return generate_command(argv)
    except Flux2Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except MemoryError as e:       # the estimates refuse most sizes first; what slips past ends here, not a traceback
        print(f"error: out of memory ({e or 'CPU'}): use a smaller size, batch or fewer references, or --offload "
              "blocks / --fp8 on a GPU", file=sys.stderr)
        return 2
    except RuntimeError as e:
        if not any(text in str(e).lower() for text in ("out of memory", "can't allocate memory")):
            raise
        print(f"error: out of memory ({str(e).splitlines()[0]}): use a smaller size, batch or fewer references, or "
              "--offload blocks / --fp8 on a GPU", file=sys.stderr)
        return 2
