"""The list of our nodes, as the ComfyExtension that the pack's comfy_entrypoint returns."""

from comfy_api.latest import ComfyExtension, io

from .adapters import LoRA
from .autoencoder import AEDecode, AEEncode
from .boxes import Layout, LayoutFromBoxes
from .comfy_model import ToComfyModel
from .compile import Compile
from .conditioning import PromptEncode, Reference
from .denoise import Denoise
from .loaders import AutoEncoderLoader, ModelLoader, TextEncoderLoader
from .noise import Noise
from .parallel import Parallel
from .scheduler import Scheduler
from .upsampler import Upsampler

NODES = [ModelLoader, TextEncoderLoader, AutoEncoderLoader, LoRA, Layout, Upsampler, PromptEncode, Reference, Noise, Scheduler, Denoise,
         AEEncode, AEDecode, Compile, Parallel, ToComfyModel]
# nodes listed where the host has the io types they take (ComfyUI's bounding boxes: v0.15.0 on); absent on the floor
NEEDS_TYPES = {LayoutFromBoxes: "BoundingBox"}


class Flux2KleinExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return NODES + [node for node, name in NEEDS_TYPES.items() if hasattr(io, name)]
