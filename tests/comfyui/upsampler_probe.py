"""The prompt upsampler node in ComfyUI's own Python. Run by test_upsampler_node.py from the ComfyUI source tree
(pytest does not collect it):

    python upsampler_probe.py PACK_DIR UPSAMPLERS_DIR   -> one JSON object on stdout

UPSAMPLERS_DIR is registered as a models/prompt_upsamplers path. The node runs as ComfyUI's executor calls it: a
request with the Layout node's boxes (and with a box past the picture's edge), and an edit with a picture on image_1 and a batch of two on image_2 (three
pictures). The report holds what the node lists, answers and shows, what Prompt Encode says when the same boxes come to it
again, and what an interrupt raises.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path[0] = os.getcwd()         # ComfyUI's modules, from the source tree we run in (not this script's folder)

import utils.extra_config  # noqa: F401  (ComfyUI's utils package first, as main.py does)
from comfy.cli_args import args

args.cpu = True                   # before comfy.model_management is imported: the CPU

import torch

PROMPT = "a red fox in the snow"
BOXES = [{"desc": "a kite", "bbox": [0.1, 0.05, 0.6, 0.4]}]


def picture(width: int, height: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).float().div(255)


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from family_probe import load_module, node_output, run_node

    pack_dir, upsamplers = Path(sys.argv[1]), Path(sys.argv[2])
    load_module("flux2_pack", pack_dir / "__init__.py", package=True)
    import comfy.model_management as mm
    import folder_paths
    from flux2_pack.flux2_core.errors import Flux2Error
    from flux2_pack.nodes import boxes, conditioning, host, loaders, upsampler

    folder_paths.add_model_folder_path(host.UPSAMPLER_FOLDER, str(upsamplers), is_default=True)
    choices = host.upsampler_choices()
    (layout,) = run_node(boxes.Layout, boxes=json.dumps(BOXES))
    (text,) = run_node(upsampler.Upsampler, upsampler=choices[0], prompt=PROMPT, boxes=layout)
    (edit,) = run_node(upsampler.Upsampler, upsampler=choices[0], prompt=PROMPT, image_1=picture(90, 60, 1)[None],
                       image_2=torch.stack([picture(40, 64, 2), picture(40, 64, 3)]))
    # a box reaching past the picture's edge, drawn to it: the node says so, as the Layout node does
    wide = [{"id": "sun", "desc": "the sun", "bbox": [-0.1, 0.7, 0.3, 1.2]}]
    (wide_layout,) = run_node(boxes.Layout, boxes=json.dumps(wide))
    wide_shown = node_output(upsampler.Upsampler, upsampler=choices[0], prompt=PROMPT, boxes=wide_layout).ui.as_dict()
    shown = node_output(upsampler.Upsampler, upsampler=choices[0], prompt=PROMPT, boxes=layout).ui.as_dict()
    encoder = sys.argv[3] if len(sys.argv) > 3 else None
    twice = ""
    if encoder:
        folder_paths.add_model_folder_path("text_encoders", str(Path(encoder).parent), is_default=True)
        (text_encoder,) = run_node(loaders.TextEncoderLoader, text_encoder_name=Path(encoder).name, dtype="float32")
        try:
            run_node(conditioning.PromptEncode, text_encoder=text_encoder, prompt=text, boxes=layout)
        except Flux2Error as e:
            twice = str(e)
    mm.interrupt_current_processing(True)
    try:
        run_node(upsampler.Upsampler, upsampler=choices[0], prompt="a cat")
        interrupted = ""
    except mm.InterruptProcessingException as e:
        interrupted = type(e).__name__
    finally:
        mm.interrupt_current_processing(False)
    print(json.dumps({"choices": choices, "text": text, "edit": edit, "twice": twice, "interrupted": interrupted,
                      "wide_shown": "\n".join(wide_shown["text"]), "shown": "\n".join(shown["text"])}))


if __name__ == "__main__":
    main()
