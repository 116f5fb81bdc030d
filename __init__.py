"""FLUX.2 Klein for ComfyUI: the pack's entry point.

ComfyUI imports this folder as a custom-node pack and calls ``comfy_entrypoint`` (the V3 node API). There is
deliberately no NODE_CLASS_MAPPINGS: ComfyUI registers only V1 mappings when a pack has both. The engine is
``flux2_core`` (plain PyTorch); the nodes are in ``nodes/``; ``web/`` holds the browser extension. This file imports
nothing at module level, so it also imports on its own (as pytest does with the folder's __init__.py).
"""

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    from pathlib import Path

    from .nodes.install_check import install_problems, problems_message

    # Before any import that could fail: ComfyUI logs this message and lists the pack as IMPORT FAILED (which
    # ComfyUI-Manager offers to fix) instead of showing a bare ModuleNotFoundError.
    problems = install_problems(Path(__file__).resolve().parent)
    if problems:
        raise ImportError(problems_message(Path(__file__).resolve().parent, problems))

    # imported here: only ComfyUI has comfy_api and server
    from .nodes import routes
    from .nodes.extension import Flux2KleinExtension

    routes.register()         # POST /flux2_klein/tokens: the exact prompt token count for the web extension
    return Flux2KleinExtension()
