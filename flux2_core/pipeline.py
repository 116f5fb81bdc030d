"""The whole generation composed from the stages: prompt, noise [B,128,h,w], sigmas and references -> Euler
denoise -> AE decode -> uint8 images [B,H,W,3].

Defaults are the reference's (size from the input image, else the first reference, else 1024; batch item i uses
seed + i). Everything that can be refused is refused before any model runs. The caches never change results.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image
from torch import Tensor

from . import stages
from .devices import check_cpu_dtype, compute_dtype, dtype_named
from .errors import Flux2Error
from .families import family_of, family_of_params
from .families.family import Transformer
from .families.flux3.boxes import rows
from .models.autoencoder import AutoEncoder
from .models.reference_kv import ReferenceKV
from .models.run_state import run_state
from .models.text_encoder import PromptEmbeds, PromptEncoder
from .runtime import memory
from .runtime.cache import PromptCache, ReferenceKVCache
from .runtime.offload import place, stream_blocks, streamed_blocks
from .sampling import inpaint
from .sampling.conditioning import NO_REFERENCES, ReferencePack, pack_references
from .sampling.references import encode_references, reference_latents
from .sampling.request import DEFAULT_SIZE, Request, read_request
from .sampling.run import DenoiseRun, Hooks, prepare_run
from .storage.int8 import quantize_blocks
from .storage.matmul import choose_matmuls
from .storage.protocol import call_bytes
from .variants import Variant

# Beyond these ``generate`` warns first: Klein is trained up to about 4 megapixels; 200 steps is the Scheduler node's
# maximum.
LARGE_PIXELS = 2048 * 2048
LARGE_STEPS = 200


@dataclass
class Models:
    transformer: Transformer        # any family's (families.family.Transformer)
    variant: Variant
    autoencoder: AutoEncoder
    prompt_encoder: PromptEncoder
    # Reused across generate calls (None: no caching). The reference K/V stay on the device (~2 GiB per 1024^2 on 9B).
    prompt_cache: PromptCache | None = field(default_factory=lambda: PromptCache(storage="cpu"))
    reference_cache: ReferenceKVCache | None = field(default_factory=lambda: ReferenceKVCache(max_items=1))

    @property
    def device(self) -> torch.device:
        """The text encoder runs there too (it may rest on the CPU in between)."""
        return self.transformer.device


def load_models(transformer, text_encoder, autoencoder, *, device=None, dtype: torch.dtype | None = None,
                variant: str | None = None, fp8: bool | None = None, int8: bool | str = False, offload_encoder="auto",
                offload_blocks=False, size: tuple[int, int] = (DEFAULT_SIZE, DEFAULT_SIZE), decoder=None) -> Models:
    """Loads the three models. dtype None: what the device computes fast (the AE stays float32).
    offload_encoder: the text encoder rests on the CPU between encodes (True, or "auto" unless it fits beside the
    transformer). offload_blocks: stream the blocks that do not fit from CPU memory (True or "auto").
    """
    from . import weights

    dtype = dtype_named(dtype)                  # "fp16", "bf16", ...; anything else is refused
    if dtype is not None and str(device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu"):
        check_cpu_dtype(dtype)                  # refused before anything loads, not in the first attention
    cpu, stream, asked = torch.device("cpu"), False, dtype
    if offload_blocks is not False:            # decided from the headers: streamed weights are read to the CPU only
        device, _ = weights.default_device_dtype(device, torch.float32)
        dtype = dtype or weights.transformer_dtype(transformer, device).dtype
        _, planned = weights.inspect_transformer(transformer, variant=variant)
        stream = memory.should_stream(offload_blocks, device, memory.working_memory(planned, size, dtype),
                                      lambda: weights.transformer_bytes(transformer, dtype, variant=variant, fp8=fp8,
                                                                        int8=int8))
    model, chosen = weights.load_transformer(transformer, cpu if stream else device, dtype, variant=variant, fp8=fp8,
                                             int8=int8)
    if not stream:
        device, dtype = model.device, model.dtype          # as the transformer resolved them
    choose_matmuls(model, device, dtype)          # the fastest matmuls of its fp8 / int8 layers on this device
    needed = memory.working_memory(chosen, size, dtype) + call_bytes(model, dtype)
    # the encoder's own default where none is asked: float16 may suit the transformer (with its clamps), not Qwen3
    encoder = weights.load_text_encoder(text_encoder, cpu if device.type == "cuda" else device,
                                        asked or compute_dtype(device, fp16=False).dtype,
                                        spec=chosen.text_encoder)
    weights.check_text_encoder_fits(chosen, encoder)
    rest_choice = True if stream and offload_encoder == "auto" else offload_encoder   # blocks need the memory more
    if not memory.should_offload(rest_choice, encoder, device, needed):
        encoder.model.to(device)
    ae = weights.load_autoencoder(autoencoder, device, torch.float32, decoder=decoder)
    if stream:
        stream_blocks(model, device, memory.weight_budget(memory.free_memory(device), needed))
    models = Models(model, chosen, ae, encoder)
    if chosen.uses_cfg:
        models.prompt_cache.warm(EncoderOnCall(encoder, device, encoder.device, aside=model))
    return models


def optimize_transformer(models: Models, *, fp8: bool = False, int8: bool | str = False,
                         compile: bool = False) -> Models:
    """Quantizes / compiles a loaded model in place. With compile, the first step at each new size pays for it."""
    from .runtime import compile as compiling
    from .storage import quant

    if (fp8 or int8) and streamed_blocks(models.transformer):    # new layers would leave the old streamed copies
        raise Flux2Error("the transformer's blocks are streamed: quantize before streaming (load the file with "
                         "fp8=True / int8=True, --fp8 / --int8), or unstream it first (offload.unstream)")
    applied = run_state(models.transformer).adapters
    if (fp8 or int8) and applied is not None and (applied.merged or applied.hooks):
        # quantizing merged weights would make the adapters impossible to take off again
        raise Flux2Error("the transformer has LoRAs applied: quantize first, then apply them (optimize_transformer "
                         "before apply_adapters), or remove them first (apply_adapters(models, []))")
    quantizable = family_of_params(models.transformer.params).quantizable
    if fp8:
        quant.quantize_transformer(models.transformer, quantizable)
    if int8:
        quantize_blocks(models.transformer, quantizable, convrot=int8 == "convrot")
    if fp8 or int8:
        choose_matmuls(models.transformer, models.device, models.transformer.dtype)
    if compile:
        compiling.compile_blocks(models.transformer)
    return models


def apply_adapters(models: Models, files: Sequence[tuple[str | Path, float]], merge: bool | None = None) -> list[str]:
    """Replaces any adapters applied before ([]: none). Returns one match report line per adapter."""
    from .adapters.lora import read_adapter
    from .adapters.patching import set_adapters

    encoder = models.prompt_encoder.model
    shapes = {name: t.shape for name, t in encoder.state_dict().items()}
    read = [(read_adapter(path, models.variant.params, shapes), float(strength)) for path, strength in files]
    key = tuple((a.name, a.digest(), strength) for a, strength in read if strength != 0)
    set_adapters(models.transformer, [(p, s) for a, s in read for p in a.patches], key, merge)
    set_adapters(encoder, [(p, s) for a, s in read for p in a.text_encoder_patches], key, merge)
    return [f"{a.report.summary()} (strength {s:g})" for a, s in read]


# --- the text encoder: cache and offload ----------------------------------------------------------------------------

class EncoderOnCall:
    """The text encoder resting on ``rest``, visiting ``device`` only to encode. ``aside`` (the transformer) moves out
    while it visits when the two do not fit together (Klein 9B's 18 GB + 16 GB on a 24 GB card).
    """

    def __init__(self, encoder: PromptEncoder, device: torch.device, rest: torch.device,
                 aside: torch.nn.Module | None = None, free=None):
        self.encoder, self.run_device, self.rest, self.aside = encoder, device, rest, aside
        self.free = free
        self.model, self.spec = encoder.model, encoder.spec
        self.model.to(rest)

    @property
    def device(self) -> torch.device:
        return self.encoder.device

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.dtype

    def must_make_room(self) -> bool:
        if self.aside is None or self.rest == self.run_device:
            return False
        return memory.must_make_room(self.model, self.run_device, self.free)

    def encode(self, prompts: list[str]) -> PromptEmbeds:
        aside = self.must_make_room()
        if aside:
            place(self.aside, self.rest)
        self.model.to(self.run_device)
        try:
            return self.encoder.encode(prompts)
        finally:
            self.model.to(self.rest)
            if aside:
                place(self.aside, self.run_device)


def encode_prompts(models: Models, prompts: list[str], offload: bool) -> PromptEmbeds:
    """Embeddings [len(prompts), 512, C]; the encoder runs only for prompts the cache does not hold."""
    device = models.device
    rest = torch.device("cpu") if offload else device
    encoder = EncoderOnCall(models.prompt_encoder, device, rest, aside=models.transformer)
    if models.prompt_cache is None:
        return encoder.encode(prompts)
    return models.prompt_cache.encode(encoder, prompts)


def large_work(width: int, height: int, steps: int) -> list[str]:
    notes = []
    if width * height > LARGE_PIXELS:
        notes.append(f"{width}x{height} is {width * height / 1e6:.1f} megapixels per image, beyond the ~4 that FLUX.2 "
                     f"Klein is trained for: this takes long and may repeat or break up its composition; generating "
                     f"at 1-4 MP and upscaling usually looks better")
    if steps > LARGE_STEPS:
        notes.append(f"{steps} steps is far more than these models need (distilled Klein: 4, base: 50); each step is "
                     f"a full transformer pass, so this run takes {steps / 50:.0f}x as long as 50 steps")
    return notes


@dataclass
class Result:
    images: Tensor                 # uint8 [B, H, W, 3]
    latents: Tensor                # float32 [B, 128, H/16, W/16], the denoised latents before decoding
    seeds: list[int]               # the seed of each image
    settings: dict                 # what was used (for metadata): prompt, size, steps, cfg, seed, ...
    warnings: list[str] = field(default_factory=list)


@torch.no_grad()
def generate(models: Models, prompt: str, *, references=(), width: int | None = None, height: int | None = None,
             steps: int | None = None, cfg: float | None = None, negative: str = "", seed: int = 0, batch: int = 1,
             sigmas: list[float] | None = None, image: Image.Image | None = None, strength: float = 1.0,
             mask: Image.Image | None = None, mask_reading: str = "auto", boxes=None,
             reference_kv: ReferenceKV | None = None, noise: Tensor | None = None, bfl_cuda_noise: bool = False,
             cache: float = 0.0, offload_encoder="auto", callback=None, warn=None) -> Result:
    """references: PIL images. sigmas overrides steps. image + strength: image-to-image; with ``mask``: inpainting
    (``mask_reading``: "auto", "alpha" or "grey"). noise: explicit [batch, 128, H/16, W/16]. cache: the step cache's
    threshold (0: off). callback(Step) after every step; warn(text) as each warning arises (all also in
    ``Result.warnings``).
    """
    variant, model, ae, device = models.variant, models.transformer, models.autoencoder, models.device
    warnings = []

    def say(note: str) -> None:
        warnings.append(note)
        if warn is not None:
            warn(note)

    # the request and its run, every setting checked before any model runs
    ask = read_request(variant, prompt, references=references, width=width, height=height, steps=steps,
                       sigmas=sigmas, image=image, strength=strength, mask=mask, boxes=boxes, batch=batch, say=say,
                       mask_reading=mask_reading)
    if ask.masked and reference_kv is not None:
        raise Flux2Error("inpainting adds the source image as reference 1, which a precomputed reference_kv does not "
                         "hold: leave reference_kv out")
    run = prepare_run(model, variant, ask.sigmas, variant.default_cfg if cfg is None else cfg, strength=ask.strength,
                      image=ask.init is not None, references=bool(ask.references) or ask.masked, cache=cache)
    for note in [run.plan.guidance.note, *large_work(ask.width, ask.height, run.plan.steps)]:
        if note:
            say(note)
    if noise is not None:
        ask.checked_noise(noise, batch)
    kept_kv = reference_kv is not None or (not ask.masked and models.reference_cache is not None and
                                           models.reference_cache.holds_images(model, ae, ask.references, model.dtype))
    embeds = encode_for_run(models, ask, run, negative, batch, kept_kv, offload_encoder, say)
    noise = (stages.make_noise(models, seed, ask.width, ask.height, batch, bfl_cuda_noise) if noise is None else
             noise.to(device, torch.float32))
    start, pack, blend = start_and_references(models, ask, noise, run.plan.reference_kv, reference_kv)
    latents = run(noise, embeds.row(0), embeds.row(1) if run.cfg else None, references=pack, start=start,
                  inpaint=blend, hooks=Hooks(callback=callback), dtype=model.dtype)
    return decoded(models, ask, latents, seed, run_settings(ask, run, prompt, negative, seed, batch, variant),
                   warnings)


def run_settings(ask: Request, run: DenoiseRun, prompt: str, negative: str, seed: int, batch: int,
                 variant: Variant) -> dict:
    """What a run used, for the image's metadata (the size is the decoded one's: ``decoded``)."""
    settings = {"prompt": prompt, "negative": negative if run.cfg else None, "width": ask.width,
                "height": ask.height, "steps": run.plan.steps, "cfg": run.plan.guidance.scale, "seed": seed,
                "batch": batch, "variant": variant.name, "references": len(ask.references),
                "strength": ask.strength if ask.init is not None else None, "mask": ask.masked,
                "sigmas": [round(s, 6) for s in run.sigmas]}
    return settings | ({"boxes": rows(ask.layout)} if ask.layout else {}) | ({"cache": run.cache.report().record()}
                                                                             if run.cache else {})


def encode_for_run(models: Models, ask: Request, run: DenoiseRun, negative: str, batch: int, kept_kv: bool,
                   offload_encoder, say) -> PromptEmbeds:
    """The prompt (and negative under CFG) encoded; the largest stage checked to fit before anything allocates."""
    ae, device, (h, w), dtype = models.autoencoder, models.device, ask.grid, models.transformer.dtype
    prompts = [ask.text, negative] if run.cfg else [ask.text]
    needed = run.need(batch, h, w, dtype, text_tokens=models.prompt_encoder.text_tokens(prompts),
                      ref_tokens=ask.reference_tokens, new_kv=not kept_kv)
    embeds = encode_prompts(models, prompts, memory.should_offload(offload_encoder, models.prompt_encoder, device,
                                                                   needed))
    if embeds.dropped[0]:
        say(f"the prompt is {embeds.token_counts[0]} tokens; the last {embeds.dropped[0]} were cut off "
            f"(the limit is {models.prompt_encoder.spec.max_length} including the chat template)")
    encodes = [memory.encode_bytes(ae, 1, im.height, im.width) for im in [ask.init, *ask.references] if im]
    memory.check_memory(device, max([needed, memory.least_decode_bytes(ae, h, w), *encodes]),
                        f"generating {batch} x {ask.width}x{ask.height}"
                        f"{f' with {len(ask.references)} references' if ask.references else ''}")
    return embeds


def start_and_references(models: Models, ask: Request, noise: Tensor, as_kv: bool,
                         given_kv: ReferenceKV | None) -> tuple[Tensor | None, ReferencePack, inpaint.Inpaint | None]:
    """(the picture to edit [1, 128, h, w] or None, the references, inpainting's blend or None). Inpainting puts the
    picture first among the references and is never cached (the cache keys on reference pictures)."""
    ae, model, family = models.autoencoder, models.transformer, family_of(models.variant)
    start = None if ask.init is None else stages.encode_image(models, ask.init, ask.width, ask.height)
    if ask.masked:
        latents = reference_latents(ae, ask.references, ask.reference_count, family.references)
        pack = pack_references(models.variant, [start, *latents])
        return start, pack, inpaint.Inpaint(start, noise, ask.mask, inpaint.AFTER_STEP)
    if as_kv and given_kv is None and models.reference_cache is not None:
        given_kv = models.reference_cache.get_for_images(
            model, ae, ask.references, model.dtype, encode=lambda ae, images, dtype: encode_references(
                ae, images, dtype, ids=family.reference_ids, fit=family.references))
    if given_kv is not None:
        return start, ReferencePack(kv=given_kv), None
    if not ask.references:
        return start, NO_REFERENCES, None
    return start, pack_references(models.variant, reference_latents(ae, ask.references, None, family.references)), None


def decoded(models: Models, ask: Request, latents: Tensor, seed: int, settings: dict, warnings: list[str]) -> Result:
    """The latents [B, 128, h, w] decoded, a padded reference's box cropped out."""
    images, width, height = stages.decode(models, latents), ask.width, ask.height
    if ask.crop is not None:
        left, top, right, bottom = ask.crop
        images, width, height = images[:, top:bottom, left:right], right - left, bottom - top
    settings = settings | {"width": width, "height": height}
    return Result(images, latents.float(), [seed + i for i in range(latents.shape[0])], settings, warnings)
