"""The Scheduler node: a family's sigmas (SIGMAS) for a size and step count."""

from __future__ import annotations

import math

import torch
from comfy_api.latest import io

from ..flux2_core import latents
from ..flux2_core.families import family_of
from ..flux2_core.sampling import schedules
from . import host, types
from .noise import SIZE


class Scheduler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Flux2KleinScheduler", display_name="Klein Scheduler", search_aliases=types.SEARCH_ALIASES,
            category=f"{types.CATEGORY}/sampling",
            description=f"The noise levels (SIGMAS) of each step, from 1 to 0. {schedules.MODELS_OWN}: the schedule of "
                        "the connected model's family (connect the model: FLUX.2 Klein's or FLUX 3 Image Klein's); "
                        "flux2: FLUX.2's, shifted by an empirical mu that depends on the image size and the step "
                        "count; flux3: FLUX 3 Image Klein's; linear: evenly spaced; power: (1 - i/steps) ** rho. The "
                        "image size comes from the latent (connect the noise), or from width and height sockets where "
                        "no latent is connected.",
            inputs=[io.Int.Input("steps", default=4, min=1, max=200,
                                 tooltip="Denoising steps: 4 for distilled FLUX.2 Klein, 16 for distilled FLUX 3 "
                                         "Image Klein, about 50 for the base models (the loader shows its "
                                         "model's)."),
                    io.Combo.Input("schedule", options=list(schedules.SCHEDULES), default=schedules.MODELS_OWN,
                                   tooltip=f"Which schedule (see above); {schedules.MODELS_OWN} needs the model "
                                           "connected."),
                    io.Float.Input("rho", default=2.0, min=0.1, max=10.0, step=0.1,
                                   tooltip="Exponent of the power schedule (1 = linear); the others ignore it."),
                    io.Latent.Input("latent", optional=True,
                                    tooltip="The image size comes from this latent: connect the noise."),
                    # sockets, not widgets: the size is set once, on the noise; these serve graphs without a latent
                    io.Int.Input("width", **SIZE, optional=True, force_input=True,
                                 tooltip="Image width in pixels, where no latent is connected."),
                    io.Int.Input("height", **SIZE, optional=True, force_input=True,
                                 tooltip="Image height in pixels, where no latent is connected."),
                    # last: a saved workflow's links name an input by its position
                    types.Model.Input("model", optional=True,
                                      tooltip=f"The model the sigmas are for: {schedules.MODELS_OWN} is its family's "
                                              "schedule (the other schedules ignore it).")],
            outputs=[io.Sigmas.Output(display_name="sigmas", tooltip="steps + 1 noise levels, 1 ... 0.")])

    @classmethod
    def validate_inputs(cls, steps=None, schedule=None, rho=None, latent=host.UNCONNECTED, width=host.UNCONNECTED,
                        height=host.UNCONNECTED, model=host.UNCONNECTED):
        # the schedule itself is made at queue time too: a size whose flux2 schedule breaks is refused there; the
        # model's own waits for the model (a link: which family it is shows only when the graph runs)
        if latent is host.UNCONNECTED and host.UNCONNECTED in (width, height):
            return "connect the latent (the noise), or give both width and height"
        sizes = {} if latent is not host.UNCONNECTED else {"width": width, "height": height}

        def made_here():
            schedules.check_model_for(schedule, model is not host.UNCONNECTED)
            if latent is host.UNCONNECTED and schedule != schedules.MODELS_OWN:
                schedules.named_schedule(schedule, steps, math.prod(latents.latent_size(height, width)), rho)
        return host.validate(cls, {"steps": steps, "schedule": schedule, "rho": rho} | sizes, made_here)

    @classmethod
    def execute(cls, steps: int, schedule: str, rho: float, latent=None, width: int | None = None,
                height: int | None = None, model: host.Managed | None = None) -> io.NodeOutput:
        h, w = latent["samples"].shape[-2:] if latent is not None else latents.latent_size(height, width)
        family = family_of(model.variant) if model is not None else None
        return io.NodeOutput(torch.tensor(schedules.named_schedule(schedule, steps, h * w, rho, family),
                                          dtype=torch.float32))
