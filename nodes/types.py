"""Our node types. Models travel as our own types (each carries a ``host.Managed``); everything else uses
ComfyUI's types (IMAGE, LATENT, CONDITIONING, SIGMAS) so our nodes mix with ComfyUI's FLUX.2 nodes."""

from comfy_api.latest import io

Model = io.Custom("FLUX2_KLEIN_MODEL")                  # Managed(Flux2Transformer) + its Variant
TextEncoder = io.Custom("FLUX2_KLEIN_TEXT_ENCODER")     # Managed(PromptEncoder)
AutoEncoder = io.Custom("FLUX2_KLEIN_AE")               # Managed(AutoEncoder)
Boxes = io.Custom("FLUX2_KLEIN_BOXES")                  # list[families.flux3.boxes.Box]: a layout

CATEGORY = "Klein (FLUX.2, FLUX 3)"     # the menu names both families the nodes serve
# what a search of the node menu for either family finds on the nodes that serve both
SEARCH_ALIASES = ["FLUX 3", "FLUX 3 Image Klein", "FLUX.2", "FLUX.2 Klein", "flux3", "flux2"]
META = "flux2_klein"      # our key in a CONDITIONING entry's dict: what encoded the prompt, token counts
