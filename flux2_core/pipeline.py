"""The whole generation, composed from the stages (used by the CLI, the nodes and the tests):

    prompt(s) -> PromptEncoder -> embeds ─┐
    seed -> noise [B,128,h,w] ────────────┤
    steps, size -> sigmas ────────────────┼─> denoise (Euler) -> latent -> AE decode -> uint8 images [B,H,W,3]
    references -> prep -> AE -> tokens ───┘

    models = load_models("flux-2-klein-4b.safetensors", "qwen_3_4b.safetensors", "flux2-vae.safetensors")
    result = generate(models, "a red fox in snow", width=1024, height=768, seed=1)
    result.images        # uint8 [1, 768, 1024, 3]
    again = generate(models, "a red fox in snow", seed=2)   # the prompt's embeddings come from models.prompt_cache

Choices (the reference's, unless said otherwise):
* Output size: ``width``/``height``; a missing one comes from the input image, else from the first reference after
  its preprocessing (capped and cropped to multiples of 16), else 1024. Sizes that are not multiples of 16 are an
  error (no silent snapping).
* Steps and CFG default to the variant's (4 / 1.0 distilled, 50 / 4.0 base). What cfg does is
  ``sampling.guidance_for``'s rule, the same as the Denoise node's: CFG for base models with cfg != 1; distilled Klein
  ignores cfg (with a warning); FLUX.2-dev feeds it to the guidance embedding.
* Noise: item i of a batch uses seed + i (so it equals a single run with that seed).
* Image-to-image: ``image`` with ``strength`` in (0, 1]; see ``schedules.truncate_for_strength``. A strength below 1
  without an image is an error (``schedules.check_strength``).
* Inpainting: ``image`` with a ``mask`` (white = repaint, black = keep; grey blends) and a ``strength``, as diffusers'
  Flux2KleinInpaintPipeline: the source is reference image 1 (before ``references``) and is blended back outside the
  mask after every step (``inpaint.py``, AFTER_STEP), so the latent there ends exactly at the source's.
* Refused before the work starts, with a message (Flux2Error): non-finite or out-of-range numbers (cfg, strength,
  sigmas), sizes whose schedule breaks (``schedules.flux2_schedule``), and sizes whose working memory
  (``memory.denoiser_memory``, the AE's encodes and least decode) exceeds what the device has free. NaN or inf in the prompt
  embeddings, the denoised latents or the decoded images stop the run (``checks.finite``): no black image comes out.
  Very large work (``large_work``) is announced through ``warn`` before it starts.
* The transformer computes in its weights' dtype; the autoencoder in its own (float32 like the reference).
* Images: clamp(-1, 1), then (127.5 * (x + 1)) truncated to uint8, as the reference CLI does.

Repeated calls in one process reuse work through the caches ``Models`` carries (``cache.py``; None turns one off):
``prompt_cache`` keeps prompt embeddings (a repeated prompt, and the empty negative of CFG models, which
``load_models`` encodes up front, skip the text encoder); ``reference_cache`` keeps 9B-KV reference keys/values by
the reference images' pixels (a repeated edit of the same references skips their AE encode and reference pass).
Results are identical with and without the caches.

Text-encoder offload (``offload_encoder``): True keeps the encoder on the CPU between encodes and moves it to the
device only to encode a prompt the cache does not hold; "auto" does so on CUDA when the free memory, counted as if
the encoder were on the device, is less than the denoiser's working memory (``memory.denoiser_memory``). ``load_models``
applies the same rule when loading, so an offloaded encoder is never on the device before it encodes; when the
encoder and the transformer do not fit the device together, the transformer waits on the CPU during the encode.

Block streaming (``load_models(offload_blocks=)``, ``offload.py``): a transformer that does not fit the device beside
the working memory is read into CPU memory; its embedders, modulations, final layer and the blocks that fit go to the
device, the other blocks visit it one at a time as they run. ``generate`` runs the same way on such a model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image
from torch import Tensor

from . import inpaint, memory
from .autoencoder import AutoEncoder
from .cache import PromptCache, ReferenceKVCache
from .errors import Flux2Error
from .latents import LATENT_CHANNELS, latent_size
from .offload import place, stream_blocks, streamed_blocks
from .plan import plan_denoise
from .references import (
    as_pil,
    center_crop_16,
    encode_references,
    image_to_tensor,
    prepare_references,
    reference_latents,
    reference_tokens,
)
from .runtime import run_state
from .sampling import add_noise, denoise, make_noise
from .schedules import check_strength, flux2_schedule
from .storage.int8 import quantize_blocks
from .storage.matmul import choose_matmuls
from .storage.protocol import call_bytes
from .text_encoder import PromptEmbeds, PromptEncoder
from .transformer import Flux2Transformer, ReferenceKV
from .variants import Variant

DEFAULT_SIZE = 1024
# Beyond these a run is very large and ``generate`` says so first: Klein is trained up to about 4 megapixels (a
# single 2024^2 reference, the largest default size, stays below), and 200 steps is the Scheduler node's maximum
# (distilled Klein uses 4, base 50).
LARGE_PIXELS = 2048 * 2048
LARGE_STEPS = 200


@dataclass
class Models:
    transformer: Flux2Transformer
    variant: Variant
    autoencoder: AutoEncoder
    prompt_encoder: PromptEncoder
    # What repeated generate calls reuse (None: no caching). Embeddings are kept on the CPU; the reference K/V of
    # the last edit stay on the device (about 2 GiB for one 1024^2 reference on Klein 9B in bf16).
    prompt_cache: PromptCache | None = field(default_factory=lambda: PromptCache(storage="cpu"))
    reference_cache: ReferenceKVCache | None = field(default_factory=lambda: ReferenceKVCache(max_items=1))

    @property
    def device(self) -> torch.device:
        """Where the transformer runs (its embedders stay there when blocks stream); the text encoder runs there too
        (it may rest on the CPU in between)."""
        return self.transformer.img_in.weight.device


def load_models(transformer, text_encoder, autoencoder, *, device=None, dtype: torch.dtype | None = None,
                variant: str | None = None, fp8: bool | None = None, int8: bool = False, offload_encoder="auto",
                offload_blocks=False, size: tuple[int, int] = (DEFAULT_SIZE, DEFAULT_SIZE), decoder=None) -> Models:
    """Load the three models from files or folders (any layout ``weights`` reads) and check they fit together.

    dtype: the transformer's and text encoder's (default bf16 on CUDA, float32 on CPU); the AE stays float32.
    fp8: the transformer's weight storage (``weights.load_transformer``: None keeps an fp8 file's fp8 layers, True
    stores every block in fp8, False none); int8: every block in int8 instead (``storage/int8.py``). fp8 and int8
    layers multiply in 8 bits where that is the faster path on the device (``storage.matmul.choose_matmuls``). decoder: a decoder file (BFL's small decoder) that decodes instead of
    the autoencoder's own (``weights.load_autoencoder``). offload_encoder: where the text encoder is loaded to rest: True the
    CPU, False the device, "auto" (on CUDA) the CPU unless it fits beside the transformer with the working memory of
    a ``size`` (width, height) image to spare; it never visits the device before its first encode. offload_blocks
    (``memory.should_stream``): True, or "auto" when the transformer and that working memory do not fit the free memory,
    reads the transformer into CPU memory and streams the blocks that do not fit (``offload.py``); with
    offload_encoder "auto" the encoder then rests on the CPU. CFG (base) models get the empty negative prompt encoded
    into the prompt cache right away.
    """
    from . import weights

    cpu, stream = torch.device("cpu"), False
    if offload_blocks is not False:            # decided from the headers: streamed weights are read to the CPU only
        device, dtype = weights.default_device_dtype(device, dtype)
        _, planned = weights.inspect_transformer(transformer, variant=variant)
        stream = memory.should_stream(offload_blocks, device, memory.working_memory(planned, size, dtype),
                                      lambda: weights.transformer_bytes(transformer, dtype, variant=variant, fp8=fp8,
                                                                        int8=int8))
    model, chosen = weights.load_transformer(transformer, cpu if stream else device, dtype, variant=variant, fp8=fp8,
                                             int8=int8)
    if not stream:
        device, dtype = model.img_in.weight.device, model.img_in.weight.dtype      # as the transformer resolved them
    choose_matmuls(model, device, dtype)          # the fastest matmuls of its fp8 / int8 layers on this device
    needed = memory.working_memory(chosen, size, dtype) + call_bytes(model, dtype)
    encoder = weights.load_text_encoder(text_encoder, cpu if device.type == "cuda" else device, dtype)
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


def optimize_transformer(models: Models, *, fp8: bool = False, int8: bool = False, compile: bool = False) -> Models:
    """Opt-in transformer speed-ups, in place: ``fp8`` / ``int8`` store the blocks' weights in fp8 (``quant.py``) or
    int8 (``storage/int8.py``; half the memory of bf16, computed in the model's dtype, results differ slightly; for a
    model already in memory; files load straight to them with ``load_models(fp8=True)`` / ``int8=True``);
    ``compile`` compiles the blocks with torch.compile (``compile.py``; the first step of each new image size pays
    the compile)."""
    from . import compile as compiling
    from . import quant

    if (fp8 or int8) and streamed_blocks(models.transformer):    # new layers would leave the old streamed copies
        raise Flux2Error("the transformer's blocks are streamed: quantize before streaming (load the file with "
                         "fp8=True / int8=True, --fp8 / --int8), or unstream it first (offload.unstream)")
    applied = run_state(models.transformer).adapters
    if (fp8 or int8) and applied is not None and (applied.merged or applied.hooks):
        # the new layers would be made from the merged weights, and the adapters could never be taken off them again
        raise Flux2Error("the transformer has LoRAs applied: quantize first, then apply them (optimize_transformer "
                         "before apply_adapters), or remove them first (apply_adapters(models, []))")
    if fp8:
        quant.quantize_transformer(models.transformer)
    if int8:
        quantize_blocks(models.transformer, quant.in_blocks)
    if fp8 or int8:
        choose_matmuls(models.transformer, models.device, models.transformer.img_in.weight.dtype)
    if compile:
        compiling.compile_blocks(models.transformer)
    return models


def apply_adapters(models: Models, files: Sequence[tuple[str | Path, float]], merge: bool | None = None) -> list[str]:
    """Read adapter files (LoRA, LoKr, ... any format ``adapters.read_adapter`` knows) for these models and apply them
    with their strengths, replacing any applied before (an empty list: the models as loaded). Transformer patches go
    to the transformer, text-encoder patches to the text encoder (``patching.set_adapters``; ``merge`` as there).
    Returns each adapter's match report, one line each; the caches key their entries by the applied set."""
    from .adapters import read_adapter
    from .patching import set_adapters

    encoder = models.prompt_encoder.model
    shapes = {name: t.shape for name, t in encoder.state_dict().items()}
    read = [(read_adapter(path, models.variant.params, shapes), float(strength)) for path, strength in files]
    key = tuple((a.name, a.digest(), strength) for a, strength in read if strength != 0)
    set_adapters(models.transformer, [(p, s) for a, s in read for p in a.patches], key, merge)
    set_adapters(encoder, [(p, s) for a, s in read for p in a.text_encoder_patches], key, merge)
    return [f"{a.report.summary()} (strength {s:g})" for a, s in read]


# --- the text encoder: cache and offload ----------------------------------------------------------------------------

class EncoderOnCall:
    """The text encoder as the prompt cache sees it: it rests on ``rest`` (the CPU when offloaded, else ``device``)
    and visits ``device`` only to encode what the cache does not hold. The cache key is the encoder's where it
    rests, so it stays the same from one call to the next.

    aside: a module (the transformer) that steps aside to ``rest`` while the encoder visits when both do not fit
    the device at once (``memory.must_make_room``): Klein 9B's 18 GB
    transformer and 16 GB encoder take turns on a 24 GB card, as ComfyUI's model management would have them.
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
    """Embeddings [len(prompts), 512, C] from the prompt cache, the encoder run (on the models' device) only for
    prompts it does not hold; with ``offload`` the encoder rests on the CPU afterwards (and the transformer steps
    aside while it encodes if the two do not fit the device together)."""
    device = models.device
    rest = torch.device("cpu") if offload else device
    encoder = EncoderOnCall(models.prompt_encoder, device, rest, aside=models.transformer)
    if models.prompt_cache is None:
        return encoder.encode(prompts)
    return models.prompt_cache.encode(encoder, prompts)


def large_work(width: int, height: int, steps: int) -> list[str]:
    """What ``generate`` says before very large work (more than LARGE_PIXELS per image, more than LARGE_STEPS)."""
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


def to_uint8(x: Tensor) -> Tensor:
    """Decoded images [B, 3, H, W] (about [-1, 1]) -> uint8 [B, H, W, 3], truncating like the reference's .byte()."""
    return (127.5 * (x.float().clamp(-1, 1) + 1)).to(torch.uint8).permute(0, 2, 3, 1).cpu()


def output_size(width: int | None, height: int | None, sources: list[Image.Image]) -> tuple[int, int]:
    """(width, height): given values first, then the first of ``sources`` (input image, references), else 1024."""
    base = sources[0].size if sources else (DEFAULT_SIZE, DEFAULT_SIZE)
    return (base[0] if width is None else width), (base[1] if height is None else height)


@torch.no_grad()
def generate(models: Models, prompt: str, *, references=(), width: int | None = None, height: int | None = None,
             steps: int | None = None, cfg: float | None = None, negative: str = "", seed: int = 0, batch: int = 1,
             sigmas: list[float] | None = None, image: Image.Image | None = None, strength: float = 1.0,
             mask: Image.Image | None = None,
             reference_kv: ReferenceKV | None = None, noise: Tensor | None = None, bfl_cuda_noise: bool = False,
             offload_encoder="auto", callback=None, warn=None) -> Result:
    """Generate ``batch`` images for ``prompt`` (see the module docstring for every default).

    references: PIL images (any number). sigmas: a custom schedule (overrides steps). image/strength:
    image-to-image; with ``mask`` (an image over ``image``; white = repaint): inpainting. reference_kv: precomputed
    K/V of these references (KV models; else models.reference_cache is used). noise: an explicit
    [batch, 128, H/16, W/16] start noise instead of the seeded one. offload_encoder: "auto", True or False (see the
    module docstring). callback(Step) runs after every step. warn(text) gets each warning as it arises (they are also
    in ``Result.warnings``), so a caller can show them before the work.
    """
    variant, model, ae = models.variant, models.transformer, models.autoencoder
    device, dtype = models.device, model.img_in.weight.dtype
    if not isinstance(prompt, str):
        raise Flux2Error(f"prompt must be a string, got {type(prompt).__name__}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise Flux2Error(f"batch must be a whole number >= 1, got {batch!r}")
    warnings = []

    def say(note: str) -> None:
        warnings.append(note)
        if warn is not None:
            warn(note)

    # sizes, schedule, guidance: every setting checked before any model runs
    masked = mask is not None
    inpaint.check_source(masked, image is not None)
    if masked and reference_kv is not None:
        raise Flux2Error("inpainting adds the source image as reference 1, which a precomputed reference_kv does not "
                         "hold: leave reference_kv out")
    refs = prepare_references(references, len(references) + masked) if references else []
    source = as_pil(image) if image is not None else None
    init = center_crop_16(source.convert("RGB"), "the image to edit") if image is not None else None
    strength = check_strength(strength, init is not None)           # before the sizes, which read the image
    width, height = output_size(width, height, [im for im in [init, *refs] if im is not None])
    h, w = latent_size(height, width)
    if sigmas is None:
        sigmas = flux2_schedule(variant.default_steps if steps is None else steps, h * w)
    plan = plan_denoise(variant, sigmas, variant.default_cfg if cfg is None else cfg, strength=strength,
                        image=init is not None)
    sigmas, rule = plan.sigmas, plan.guidance
    for note in [rule.note, *large_work(width, height, plan.steps)]:
        if note:
            say(note)
    if masked:                      # the mask on the latent grid, [1, 1, h, w]
        pixels, notes = inpaint.image_mask(mask, source, (width, height))
        latent_mask = inpaint.latent_mask(pixels, batch, h, w)[0]
        for note in [*notes, inpaint.mask_note(pixels, latent_mask)]:
            if note:
                say(note)
    if noise is not None and tuple(noise.shape) != (batch, LATENT_CHANNELS, h, w):
        raise Flux2Error(f"noise must be [{batch}, {LATENT_CHANNELS}, {h}, {w}] for batch {batch} at {width}x{height}, "
                         f"got {list(noise.shape)}")

    # prompt(s): [prompt] or [prompt, negative] from the prompt cache; the encoder rests where the denoise leaves
    # room (KV models: a reference pass makes the K/V unless given or cached; inpainting's are never cached)
    ref_tokens = sum(math.prod(latent_size(im.height, im.width)) for im in refs) + (h * w if masked else 0)
    kv = variant.use_kv_cache and (bool(refs) or masked)
    cache = models.reference_cache
    new_kv = kv and reference_kv is None and (masked or cache is None or not cache.holds_images(model, ae, refs, dtype))
    needed = memory.denoiser_memory(model, variant, batch, h, w, dtype, ref_tokens=ref_tokens, cfg=rule.cfg,
                                    text_tokens=models.prompt_encoder.spec.max_length, new_reference_kv=new_kv)
    offload = memory.should_offload(offload_encoder, models.prompt_encoder, device, needed)
    embeds = encode_prompts(models, [prompt, negative] if rule.cfg else [prompt], offload)
    if embeds.dropped[0]:
        say(f"the prompt is {embeds.token_counts[0]} tokens; the last {embeds.dropped[0]} were cut off "
            f"(the limit is {models.prompt_encoder.spec.max_length} including the chat template)")
    txt, negative_txt = embeds.embeds[:1], (embeds.embeds[1:] if rule.cfg else None)

    # memory: the largest stage must fit beside the weights, checked before the noise, the encodes and the denoiser
    # allocate (the encoder now rests where it will stay during the denoise)
    encodes = [memory.encode_bytes(ae, 1, im.height, im.width) for im in ([init] if init else []) + refs]
    memory.check_memory(device, max([needed, memory.least_decode_bytes(ae, h, w), *encodes]),
                        f"generating {batch} x {width}x{height}{f' with {len(refs)} references' if refs else ''}")

    # noise
    if noise is None:
        noise = make_noise(batch, height, width, seed, device=device, bfl_cuda_noise=bfl_cuda_noise)
    noise = noise.to(device, torch.float32)

    # start latent
    if init is not None:
        if init.size != (width, height):
            init = init.resize((width, height), Image.Resampling.LANCZOS)
        start = ae.encode(image_to_tensor(init)).to(device)                  # [1, 128, h, w]
        x = add_noise(start, noise, sigmas[0])
    else:
        x = noise

    # references (KV models: their K/V from the cache, which skips the AE encode and the reference pass on a hit;
    # inpainting: the source latent first, and no cache, which keys on reference images)
    if kv and reference_kv is None and models.reference_cache is not None and not masked:
        reference_kv = models.reference_cache.get_for_images(model, ae, refs, dtype)
    ref = ref_ids = blend = None
    if masked:
        ref, ref_ids = reference_tokens([start, *reference_latents(ae, refs, len(refs) + 1)])
        blend = inpaint.Inpaint(start, noise, latent_mask, inpaint.AFTER_STEP)
    elif refs and reference_kv is None:
        ref, ref_ids = encode_references(ae, refs, dtype)

    latents = denoise(model, x.to(dtype), sigmas, txt, negative_txt=negative_txt, cfg=rule.scale,
                      ref=ref, ref_ids=ref_ids, ref_kv=reference_kv, kv=kv, guidance=rule.embedded, inpaint=blend,
                      callback=callback)

    tile = memory.decode_tile(ae, 1, h, w, memory.free_memory(device))       # None: in one piece
    images = torch.cat([to_uint8(ae.decode(latents[i:i + 1], tile)) for i in range(batch)])
    settings = {"prompt": prompt, "negative": negative if rule.cfg else None, "width": width, "height": height,
                "steps": len(sigmas) - 1, "cfg": rule.scale, "seed": seed, "batch": batch, "variant": variant.name,
                "references": len(refs), "strength": strength if init is not None else None, "mask": masked,
                "sigmas": [round(s, 6) for s in sigmas]}
    return Result(images, latents.float(), [seed + i for i in range(batch)], settings, warnings)


