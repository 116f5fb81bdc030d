"""Conditioning: the prompt (Qwen3 embeddings) and reference images (AE latents), as ComfyUI CONDITIONING.

A CONDITIONING is a list of [embeds [B, 512, 3*D], dict]. References go in the dict under ``reference_latents``
(a list of [1, 128, h, w] latents, as ComfyUI's ReferenceLatent stores them), so our nodes and ComfyUI's mix both
ways; reference i gets RoPE time offset t = 10 * (i + 1) in our denoiser and in ComfyUI's FLUX.2 model alike.

ComfyUI re-runs a node whenever an input upstream changed; our process-wide caches make that cheap: prompt embeddings
(``PROMPTS``: a prompt that comes back after other edits is not encoded again) and reference latents (``LATENTS``: a
new prompt re-runs the reference node, but the same image is not encoded again). A hit loads no model.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from comfy_api.latest import io, ui
from PIL import Image

from ..flux2_core.digests import image_digest
from ..flux2_core.errors import Flux2Error
from ..flux2_core.families import FAMILIES, ReferenceCount, encoder_for, family_of_encoder
from ..flux2_core.families.flux3.boxes import rows_read
from ..flux2_core.runtime import cache, memory
from ..flux2_core.sampling import references
from ..flux2_core.sampling.request import boxed_prompt
from . import host, types

log = logging.getLogger("flux2_klein")
SOURCES = "flux2_klein_reference_images"   # our key beside reference_latents: the images we encoded (None: not ours)


class PromptEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Flux2KleinPromptEncode", display_name="Klein Prompt Encode", search_aliases=types.SEARCH_ALIASES,
            category=f"{types.CATEGORY}/conditioning",
            description="Encodes a prompt with the text encoder into conditioning: FLUX.2's Qwen3 gives 512 tokens "
                        "(hidden states 9/18/27), FLUX 3's Qwen3-VL the prompt padded to a multiple of 80 tokens "
                        "(hidden states 4, 8, ..., 32; at most 4096). Shows the token count; text beyond the limit "
                        "(template included) is cut.",
            inputs=[types.TextEncoder.Input("text_encoder", tooltip="From Klein Load Text Encoder."),
                    io.String.Input("prompt", multiline=True, dynamic_prompts=True,
                                    tooltip="What to draw, or for an edit what to change. Empty for the negative of "
                                            "base models."),
                    types.Boxes.Input("boxes", optional=True,
                                      tooltip="FLUX 3 only: where objects go, from FLUX 3 Klein Layout (the boxes "
                                              "follow the prompt as the model reads them).")],
            outputs=[io.Conditioning.Output(display_name="conditioning",
                                            tooltip="ComfyUI CONDITIONING: embeddings [1, tokens, layers x hidden].")])

    @classmethod
    def execute(cls, text_encoder: host.Managed | None, prompt: str, boxes: list | None = None) -> io.NodeOutput:
        if text_encoder is None:
            raise Flux2Error("no text encoder came in: a Klein LoRA node passes one on only when a text "
                             "encoder is connected to its own text_encoder input")
        encoder, misses = text_encoder.core, PROMPTS.cache.misses
        family = family_of_encoder(encoder.spec)                 # the model this prompt is for, by its encoder
        text = boxed_prompt(prompt, boxes or [], family, f"{family.title} (its {encoder.spec.name} text encoder)")
        out = PROMPTS.encode(LoadOnMiss(text_encoder), [text])
        tokens, dropped, limit = out.token_counts[0], out.dropped[0], encoder.spec.max_length
        # the rows the model reads: Denoise checks their "from" against the references it is given
        meta = {"encoder": encoder.spec.name, "family": family.name, "tokens": tokens, "dropped": dropped,
                "rows": rows_read(prompt, boxes or [])}
        # pooled_output None: FLUX.2 has no pooled vector, but ComfyUI's FLUX models read the key.
        conditioning = [[out.embeds, {"pooled_output": None, types.META: meta}]]
        info = f"{tokens} / {limit} tokens"
        if dropped:
            info += f": {dropped} tokens beyond {limit} were cut off"
            log.warning("%s prompt has %d tokens; the last %d (beyond %d) were cut off", family.title, tokens, dropped,
                        limit)
        if PROMPTS.cache.misses == misses:
            info += " (cached)"
        return io.NodeOutput(conditioning, ui=ui.PreviewText(info))


class ManagedPromptCache(cache.PromptCache):
    """cache.PromptCache for encoders under ComfyUI's model management: keyed by ``host.Managed.key`` (the weights
    as loaded), not by where the weights are now, which changes as ComfyUI loads and offloads the encoder."""

    def encoder_key(self, encoder: LoadOnMiss) -> tuple:
        return encoder.managed.key + (encoder.spec,)


class LoadOnMiss:
    """A managed text encoder as the prompt cache sees it: loaded onto its device only to encode what the cache
    lacks; embeddings are handed out on ComfyUI's intermediate device."""

    def __init__(self, managed: host.Managed):
        self.managed, self.spec, self.device = managed, managed.core.spec, host.intermediate_device()

    def encode(self, prompts: list[str]):
        self.managed.ready()
        self.managed.use_adapters(self.managed.core.model, lambda adapter: adapter.text_encoder_patches)
        return self.managed.core.encode(prompts)


PROMPTS = ManagedPromptCache(storage="cpu")


class Reference(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Flux2KleinReference", display_name="Klein Reference Image", search_aliases=types.SEARCH_ALIASES,
            category=f"{types.CATEGORY}/conditioning",
            description="Adds reference images for editing: each image is prepared as the reference implementation "
                        "of the prompt's model does, encoded, and appended to the conditioning's reference latents. "
                        "FLUX.2: at most 2024x2024 pixels when it is the only reference, 1024x1024 each when there "
                        "are several, centre-cropped to multiples of 16. FLUX 3: one alone fitted to 4 MP and its "
                        "border reflected out to multiples of 16; several at 1 MP each, centre-cropped; at most 10. "
                        "Chain it for more references; a batch adds one reference per image.",
            inputs=[io.Conditioning.Input("conditioning", tooltip="The prompt conditioning (positive)."),
                    io.Image.Input("image", tooltip="Reference image(s); for FLUX.2 each side at least 64 px and an "
                                                            "aspect of at most 8:1 (FLUX 3: any size and "
                                                            "aspect)."),
                    types.AutoEncoder.Input("ae", tooltip="The FLUX.2 autoencoder.")],
            outputs=[io.Conditioning.Output(display_name="conditioning",
                                            tooltip="The conditioning with the references appended.")])

    @classmethod
    def execute(cls, conditioning, image: torch.Tensor, ae: host.Managed) -> io.NodeOutput:
        first = conditioning[0][1]
        latents, sources = list(first.get("reference_latents", [])), list(first.get(SOURCES, []))
        sources += [None] * (len(latents) - len(sources))       # latents appended by other nodes have no source
        new = [to_pil(item) for item in image]
        meta = first.get(types.META, {})
        # ComfyUI's own prompts carry no family: theirs is the family of a Qwen3 file that says nothing (FLUX.2)
        family = FAMILIES[meta["family"]] if "family" in meta else family_of_encoder(encoder_for(None))
        fit = family.references
        count = len(latents) + len(new)
        # a graph's inpainting adds its picture here as a reference, if at all: it is counted among the latents
        references.check_count(ReferenceCount(count), fit, family.title)
        if len(latents) == 1 and new and sources[0] is not None:
            latents[0] = encode(ae, sources[0], count, 0, fit)   # the first of several: prepared as one of them
        latents += [encode(ae, im, count, len(latents) + i, fit) for i, im in enumerate(new)]
        sources += new
        out = [[embeds, {**d, "reference_latents": latents, SOURCES: sources}] for embeds, d in conditioning]
        return io.NodeOutput(out)


def to_pil(image: torch.Tensor) -> Image.Image:
    """One ComfyUI IMAGE item [H, W, C] in 0..1 -> RGB PIL image (exact for images that came from 8-bit files)."""
    if image.ndim != 3 or image.shape[-1] < 3:
        raise Flux2Error(f"a reference image must be [H, W, 3] (a ComfyUI IMAGE), got {list(image.shape)}")
    pixels = (image[..., :3].float().clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
    return Image.fromarray(np.ascontiguousarray(pixels))


def encode(ae: host.Managed, image: Image.Image, count: int, index: int, fit) -> torch.Tensor:
    """The reference preparation of reference ``index`` of ``count`` (``fit``: the family's), then its latent
    [1, 128, h, w] (from ``LATENTS`` when this autoencoder has encoded these pixels before)."""
    prepared = references.prepare_one(image, count, index, fit)
    key = ae.key + (image_digest([prepared]),)
    latent = LATENTS.get(key)
    if latent is None:
        ae.ready(memory.encode_bytes(ae.core, 1, prepared.height, prepared.width))
        with torch.no_grad():
            latent = ae.core.encode(references.image_to_tensor(prepared)).cpu()
        LATENTS.put(key, latent)
    return latent.to(host.intermediate_device(), copy=True)        # a copy: the cached one stays as it is


LATENTS = cache.LRUCache(max_items=16, max_bytes=256 << 20, size=lambda latent: latent.nbytes)   # on the CPU
