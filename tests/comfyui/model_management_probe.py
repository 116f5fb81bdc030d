"""Our GGUF models under ComfyUI's ModelPatcher.load as a GPU loads them, on a host without one. Run by test_gguf.py
in ComfyUI's own Python, from the ComfyUI source tree (pytest does not collect it):

    python model_management_probe.py PACK_DIR TRANSFORMER ENCODER        -> one JSON object on stdout

ComfyUI never loads partially to a CPU load device (load_models_gpu gives it a full load), so this calls
ModelPatcher.load itself with what load_models_gpu passes on a GPU with normal VRAM: a memory budget and
full_load=False. The meta device stands in for the GPU (the only second device a CPU host has): what ComfyUI moves
goes there, what it leaves stays on the CPU. A load to the CPU itself with the same budget shows the model still
computes what a whole load computes with ComfyUI's lowvram marks set.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

sys.path[0] = os.getcwd()         # ComfyUI's modules, from the source tree we run in (not this script's folder)

# ComfyUI's utils package first, as main.py does: ComfyUI's nodes.py puts comfy/ first on sys.path, where
# comfy/utils.py would shadow it for the server module
import utils.extra_config  # noqa: F401
from comfy.cli_args import args

args.cpu = True                   # before comfy.model_management is imported: devices() gives the CPU

import torch

META, CPU = torch.device("meta"), torch.device("cpu")


def import_pack(folder: Path):
    """The pack as ComfyUI imports it: a package from its folder (the nodes use relative imports)."""
    spec = importlib.util.spec_from_file_location("flux2_pack", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["flux2_pack"] = module
    spec.loader.exec_module(module)
    return module


def placement(managed, ggml_layers) -> dict:
    """Where ComfyUI put the model's weights after a load to META, and what it counted."""
    patcher = managed.patcher
    # a transformer's holder is ComfyUI's FLUX.2 model: its sampling's sigma table is no weight, and ComfyUI loads
    # it with the model object, not layer by layer; the rest is ours
    state = {k: v for k, v in patcher.model.state_dict().items() if not k.startswith("model_sampling.")}
    gguf = [m for m in patcher.model.modules() if isinstance(m, ggml_layers)]
    left = [m for m in gguf if m.weight.device == CPU]
    sampling = getattr(patcher.model, "model_sampling", None)
    sampling_bytes = 0 if sampling is None else sum(t.nbytes for t in sampling.state_dict().values())
    return {"size": patcher.model_size() - sampling_bytes, "loaded": patcher.model.model_loaded_weight_memory,
            "sampling_bytes": sampling_bytes,
            "lowvram": bool(patcher.model.model_lowvram),
            "bytes_moved": sum(t.nbytes for t in state.values() if t.device == META),
            "tensors_left": sum(t.device == CPU for t in state.values()),
            "runs_on": str(getattr(managed.core, "device", "")),       # the text encoder: where its anchor is
            "gguf_layers": len(gguf), "gguf_moved": len(gguf) - len(left),
            "gguf_left_marked": sum(bool(getattr(m, "comfy_cast_weights", False)) for m in left), "gguf_left": len(left)}


def main() -> None:
    pack_dir, transformer_path, encoder_path = sys.argv[1:4]
    pack = import_pack(Path(pack_dir))
    from flux2_pack.flux2_core import weights
    from flux2_pack.flux2_core.models import rope
    from flux2_pack.flux2_core.storage.ggml_layers import GGMLEmbedding, GGMLLinear
    from flux2_pack.nodes import host
    ggml_layers = (GGMLLinear, GGMLEmbedding)

    def transformer():
        model, variant = weights.load_transformer(transformer_path, CPU, torch.float32)
        return host.manage(model, model, "transformer", torch.float32, variant=variant)

    def encoder():
        core = weights.load_text_encoder(encoder_path, CPU, torch.float32)
        return host.manage(core, core.model, "text_encoder", torch.float32, anchor="embed_tokens")

    def loaded(make, device, budget_of):
        managed = make()
        managed.patcher.load(device, lowvram_model_memory=budget_of(managed.patcher.model_size()), full_load=False)
        return managed

    g = torch.Generator().manual_seed(0)
    params = transformer().core.params
    inputs = (torch.randn(1, 12, params.in_channels, generator=g), rope.image_ids(1, 3, 4), torch.tensor([0.7]),
              torch.randn(1, 8, params.context_in_dim, generator=g), rope.text_ids(1, 8))

    def run(managed):
        with torch.no_grad():
            return managed.core(*inputs)

    def encode(managed):
        return managed.core.encode(["a red fox in the snow"]).embeds

    roomy, short, tiny = (lambda size: 2 * size), (lambda size: size // 2), (lambda size: 0.1)    # --novram: 0.1
    whole = transformer()
    whole.patcher.load(CPU, full_load=True)
    whole_encoder = encoder()
    whole_encoder.patcher.load(CPU, full_load=True)
    report = {
        "transformer_fits": placement(loaded(transformer, META, roomy), ggml_layers),
        "transformer_short": placement(loaded(transformer, META, short), ggml_layers),
        "encoder_fits": placement(loaded(encoder, META, roomy), ggml_layers),
        "encoder_none_fits": placement(loaded(encoder, META, tiny), ggml_layers),
        "transformer_short_computes_the_same": torch.equal(run(loaded(transformer, CPU, short)), run(whole)),
        "encoder_none_fits_computes_the_same": torch.equal(encode(loaded(encoder, CPU, tiny)), encode(whole_encoder)),
        "pack": pack.__name__,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
