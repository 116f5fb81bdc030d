"""AE encode (IMAGE -> LATENT) and decode (LATENT -> IMAGE).

The latents are ComfyUI's FLUX.2 latents ([B, 128, H/16, W/16]: the VAE mean, 2x2-patchified, normalised by the
latent BatchNorm), so ComfyUI's VAEEncode / VAEDecode with flux2-vae.safetensors read and write the same tensors.
"""

from __future__ import annotations

import torch
from comfy_api.latest import io

from ..flux2_core.runtime import memory
from ..flux2_core.sampling import references
from . import host, types


class AEEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Flux2KleinAEEncode", display_name="Klein AE Encode", search_aliases=types.SEARCH_ALIASES,
            category=f"{types.CATEGORY}/latent",
            description="Encodes images into FLUX.2 latents (for image-to-image). Sides that are not multiples of 16 "
                        "are centre-cropped to the nearest multiple below, as ComfyUI's VAE Encode does.",
            inputs=[types.AutoEncoder.Input("ae", tooltip="The FLUX.2 autoencoder."),
                    io.Image.Input("image", tooltip="Images to encode (a batch gives a batch of latents).")],
            outputs=[io.Latent.Output(display_name="latent", tooltip="LATENT [B, 128, H/16, W/16].")])

    @classmethod
    def execute(cls, ae: host.Managed, image: torch.Tensor) -> io.NodeOutput:
        left, top, width, height = references.grid_crop(image.shape[2], image.shape[1], "the image to encode")
        pixels = image[:, top:top + height, left:left + width, :3].movedim(-1, 1) * 2 - 1    # [B, 3, H, W] in [-1, 1]
        ae.ready(memory.encode_bytes(ae.core, 1, height, width))
        with torch.no_grad():
            latents = [ae.core.encode(item[None]).to(host.intermediate_device()) for item in pixels]
        return io.NodeOutput({"samples": torch.cat(latents)})


class AEDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Flux2KleinAEDecode", display_name="Klein AE Decode", search_aliases=types.SEARCH_ALIASES,
            category=f"{types.CATEGORY}/latent",
            description="Decodes FLUX.2 latents into images (clamped to [-1, 1], then mapped to 0..1).",
            inputs=[types.AutoEncoder.Input("ae", tooltip="The FLUX.2 autoencoder."),
                    io.Latent.Input("latent", tooltip="FLUX.2 latents from the denoiser (or any FLUX.2 sampler).")],
            outputs=[io.Image.Output(display_name="image", tooltip="IMAGE [B, H, W, 3] in 0..1.")])

    @classmethod
    def execute(cls, ae: host.Managed, latent) -> io.NodeOutput:
        samples = latent["samples"]
        host.check_interrupt()
        h, w = samples.shape[-2:]
        device = ae.ready(memory.decode_bytes(ae.core, 1, h, w))
        tile = memory.decode_tile(ae.core, 1, h, w, host.free_memory(ae, device))        # None: in one piece
        with torch.no_grad():
            images = [ae.core.decode(z[None], tile).float().clamp(-1, 1).to(host.intermediate_device()) for z in samples]
        return io.NodeOutput((torch.cat(images).movedim(1, -1) + 1) / 2)
