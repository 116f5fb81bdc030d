"""FLUX.2 Klein for ComfyUI: the pack's entry point.

ComfyUI imports this folder as a custom-node pack and calls ``comfy_entrypoint`` (the V3 node API). There is
deliberately no NODE_CLASS_MAPPINGS: ComfyUI registers only V1 mappings when a pack has both. The engine is
``flux2_core`` (plain PyTorch); the nodes are in ``nodes/``; ``web/`` holds the browser extension.
"""

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    # imported here: only ComfyUI has comfy_api and server
    from .nodes import routes
    from .nodes.extension import Flux2KleinExtension

    routes.register()         # POST /flux2_klein/tokens: the exact prompt token count for the web extension
    return Flux2KleinExtension()
