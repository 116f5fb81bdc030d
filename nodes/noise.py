"""The Noise node: a seed's start noise as a LATENT ({"samples": [B, 128, H/16, W/16]}, ComfyUI's FLUX.2 latent
space), read as the model's family reads its draw where Denoise meets the model."""

from __future__ import annotations

from comfy_api.latest import io

from ..flux2_core import latents
from ..flux2_core.sampling import euler
from . import host, types

SIZE = {"default": 1024, "min": 16, "max": 8192, "step": 16}


class Noise(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Flux2KleinNoise", display_name="Klein Noise", search_aliases=types.SEARCH_ALIASES,
            category=f"{types.CATEGORY}/sampling",
            description="Gaussian starting noise for an image of width x height. Item i of a batch is drawn with "
                        "seed + i on the CPU, so it equals a single image made with that seed, on any device. A model "
                        "whose reference reads its noise another way (FLUX 3 Image Klein: in token order) reads this "
                        "draw that way in the Denoise node, so a seed gives the picture the command line gives.",
            inputs=[io.Int.Input("seed", default=0, min=0, max=2**53 - 1, control_after_generate=True,
                                 tooltip="Random seed; item i of the batch uses seed + i."),
                    io.Int.Input("width", **SIZE, tooltip="Image width in pixels (a multiple of 16)."),
                    io.Int.Input("height", **SIZE, tooltip="Image height in pixels (a multiple of 16)."),
                    io.Int.Input("batch_size", default=1, min=1, max=64, tooltip="Images to make at once."),
                    io.Latent.Input("latent", optional=True,
                                    tooltip="Take width and height from this latent instead (image-to-image).")],
            outputs=[io.Latent.Output(display_name="noise", tooltip="LATENT noise [batch, 128, height/16, width/16].")])

    @classmethod
    def validate_inputs(cls, width=None, height=None, latent=host.UNCONNECTED):
        # when the prompt is queued, before any node runs (see host.validate)
        return host.validate(cls, {"width": width, "height": height},
                             lambda: latent is not host.UNCONNECTED or latents.latent_size(height, width))

    @classmethod
    def execute(cls, seed: int, width: int, height: int, batch_size: int, latent=None) -> io.NodeOutput:
        if latent is not None:
            height, width = (latents.PIXELS_PER_LATENT * n for n in latent["samples"].shape[-2:])
        noise = euler.make_noise(batch_size, height, width, seed, device=host.intermediate_device())
        return io.NodeOutput({"samples": noise, DRAWN: noise})


DRAWN = "flux2_klein_drawn"   # our key beside a Noise node's samples: the very tensor it drew (the seed's draw)
