"""The stages of a generation as plain functions, one per node: compose them as a graph does. ``generate`` is
these stages composed, plus its checks of the whole request, its caches and its memory policy.

    embeds = encode_prompt(models, "a red fox in the snow")
    noise = make_noise(models, seed=1, width=1024, height=768)
    latents = denoise(models, noise, embeds, schedule(models, 1024, 768))
    images = decode(models, latents)                    # uint8 [1, 768, 1024, 3]

Each takes the ``Models`` of ``load_models``; the family's behaviour follows the models passed in.
"""

from __future__ import annotations

import torch
from PIL import Image
from torch import Tensor

from .errors import Flux2Error
from .families import family_of
from .families.flux3.boxes import read_boxes
from .latents import latent_size
from .models.text_encoder import PromptEmbeds
from .runtime import memory
from .sampling import euler
from .sampling.conditioning import NO_REFERENCES, ReferencePack, pack_references
from .sampling.references import as_pil, center_crop_16, image_to_tensor, reference_latents
from .sampling.request import boxed_prompt
from .sampling.run import Hooks, prepare_run


@torch.no_grad()
def encode_prompt(models, prompt: str, negative: str | None = None, boxes=None) -> PromptEmbeds:
    """The prompt (row 0) and, for CFG, the negative (row 1); ``boxes``: a FLUX 3 layout appended to the prompt."""
    family, variant = family_of(models.variant), models.variant
    text = boxed_prompt(prompt, read_boxes(boxes or []), family, variant.title or family.title)
    return models.prompt_encoder.encode([text] if negative is None else [text, negative])


@torch.no_grad()
def make_noise(models, seed: int, width: int, height: int, batch: int = 1, bfl_cuda_noise: bool = False) -> Tensor:
    """float32 [batch, 128, height/16, width/16] on the models' device, item i from seed + i."""
    return euler.make_noise(batch, height, width, seed, device=models.device, bfl_cuda_noise=bfl_cuda_noise,
                            reading=family_of(models.variant).noise)


def schedule(models, width: int, height: int, steps: int | None = None) -> list[float]:
    """The family's sigmas for ``steps`` (default: the variant's) at this size, ending at 0."""
    h, w = latent_size(height, width)
    return family_of(models.variant).schedule(models.variant.default_steps if steps is None else steps, h * w)


@torch.no_grad()
def encode_references(models, images) -> ReferencePack:
    """Reference pictures (PIL or uint8 arrays) sized as the family sizes them, encoded, as the transformer's tokens."""
    if not images:
        return NO_REFERENCES
    latents = reference_latents(models.autoencoder, list(images), None, family_of(models.variant).references)
    return pack_references(models.variant, latents)


@torch.no_grad()
def encode_image(models, image, width: int | None = None, height: int | None = None) -> Tensor:
    """The picture to edit, cropped to the 16-px grid (resized where a size is given) -> [1, 128, h, w]."""
    picture = center_crop_16(as_pil(image).convert("RGB"), "the image to edit")
    size = (width or picture.width, height or picture.height)
    if picture.size != size:
        picture = picture.resize(size, Image.Resampling.LANCZOS)
    return models.autoencoder.encode(image_to_tensor(picture)).to(models.device)


@torch.no_grad()
def denoise(models, noise: Tensor, embeds: PromptEmbeds, sigmas: list[float], *, cfg: float | None = None,
            references: ReferencePack = NO_REFERENCES, start: Tensor | None = None, strength: float = 1.0,
            callback=None) -> Tensor:
    """Euler from ``noise`` over ``sigmas`` -> latents (cfg default: the variant's); ``start`` + ``strength``:
    image-to-image."""
    variant, model = models.variant, models.transformer
    run = prepare_run(model, variant, sigmas, variant.default_cfg if cfg is None else cfg, strength=strength,
                      image=start is not None, references=bool(references))
    if run.cfg and embeds.embeds.shape[0] < 2:
        raise Flux2Error(f"{variant.title or variant.name} guides with CFG at cfg {run.plan.guidance.scale:g}, and the "
                         f"embeddings hold no negative prompt: encode one (encode_prompt(models, prompt, \"\") for an "
                         f"empty one), or pass cfg=1")
    return run(noise, embeds.row(0), embeds.row(1) if run.cfg else None, references=references, start=start,
               hooks=Hooks(callback=callback), dtype=model.dtype)


@torch.no_grad()
def decode(models, latents: Tensor) -> Tensor:
    """[B, 128, h, w] -> uint8 [B, 16h, 16w, 3], item by item, in tiles where one piece does not fit."""
    ae, (h, w) = models.autoencoder, latents.shape[-2:]
    tile = memory.decode_tile(ae, 1, h, w, memory.free_memory(models.device))       # None: in one piece
    return torch.cat([to_uint8(ae.decode(latents[i:i + 1], tile)) for i in range(latents.shape[0])])


def to_uint8(x: Tensor) -> Tensor:
    """[B, 3, H, W] in about [-1, 1] -> uint8 [B, H, W, 3], truncating like the reference's .byte()."""
    return (127.5 * (x.float().clamp(-1, 1) + 1)).to(torch.uint8).permute(0, 2, 3, 1).cpu()
