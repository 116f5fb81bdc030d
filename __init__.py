"""FLUX.2 Klein for ComfyUI: the pack's entry point.

ComfyUI imports this folder as a custom-node pack and calls ``comfy_entrypoint`` (the V3 node API). There is
deliberately no NODE_CLASS_MAPPINGS: ComfyUI registers only V1 mappings when a pack has both. The engine is
``flux2_core`` (plain PyTorch); the nodes are in ``nodes/``; ``web/`` holds the browser extension.
"""

from pathlib import Path

from .nodes.install_check import install_problems, problems_message

WEB_DIRECTORY = "./web"

_PACK_DIR = Path(__file__).resolve().parent
_PROBLEMS = install_problems(_PACK_DIR)
if _PROBLEMS:
    # Before any import that would fail: ComfyUI logs this message (and IMPORT FAILED) instead of a bare
    # ModuleNotFoundError, and ComfyUI-Manager offers its fix for a pack that failed to import.
    raise ImportError(problems_message(_PACK_DIR, _PROBLEMS))


async def comfy_entrypoint():
    # imported here: only ComfyUI has comfy_api and server
    from .nodes import routes
    from .nodes.extension import Flux2KleinExtension

    routes.register()         # POST /flux2_klein/tokens: the exact prompt token count for the web extension
    return Flux2KleinExtension()
