"""Our models under ComfyUI's dynamic VRAM (``ModelPatcherDynamic``) as far as it runs on a host without a GPU. Run
by test_dynamic_vram.py in ComfyUI's own Python, from the ComfyUI source tree (pytest does not collect it):

    python dynamic_vram_probe.py PACK_DIR TRANSFORMER ENCODER AE GGUF LORA      -> one JSON object on stdout

ModelPatcherDynamic needs comfy-aimdo's native library, which loads only beside a GPU driver, and it hands a CPU
load device to a plain ModelPatcher. So this makes ``CoreModelPatcher`` dynamic as ComfyUI's main.py does where
dynamic VRAM is on, gives the pack a GPU host's devices (the meta device standing in for the GPU, as in
model_management_probe.py), stands in for aimdo's host buffer and virtual address bar with objects that only count,
and runs the host's own loading on our models: ``LoadedModel.model_load``, what load_models_gpu calls for each
model. What the host streams stays on the CPU with room reserved; what it loads whole goes to the meta device.
With PROBE_PATCHER=plain (the host's default patcher), or where the pack keeps plain patchers, it reports the
patchers' classes only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path[0] = os.getcwd()         # ComfyUI's modules, from the source tree we run in (not this script's folder)

import utils.extra_config  # noqa: F401 (ComfyUI's utils package first, as main.py imports it)
from comfy.cli_args import args

args.cpu = True                   # before comfy.model_management is imported

import comfy_aimdo.host_buffer
import comfy_aimdo.model_vbar
import torch

META, CPU = torch.device("meta"), torch.device("cpu")
STREAMED_BYTES = []               # every reservation the host made to stream a layer


class HostBuffer:
    """comfy-aimdo's pinned host buffer, empty: nothing is pinned without a GPU."""

    def __init__(self, *args):
        self.size = 0

    def truncate(self, *args, **kwargs):
        pass


class AddressBar:
    """comfy-aimdo's virtual address bar of a model on the GPU: counts what the host reserves to stream."""

    def __init__(self, size, index):
        self.end = 0

    def alloc(self, size):
        STREAMED_BYTES.append(size)
        self.end += size
        return (self, self.end - size, size)

    def prioritize(self):
        pass

    def loaded_size(self):
        return 0

    def free_memory(self, size):
        return 0


comfy_aimdo.host_buffer.HostBuffer = HostBuffer
comfy_aimdo.model_vbar.ModelVBAR = AddressBar
comfy_aimdo.model_vbar.vbar_unpin = lambda reservation: None

import comfy.model_management as mm
import comfy.model_patcher

# the pack's import as model_management_probe.py (beside this file) does it; its setup is this one's, its main
# does not run
sys.path.append(str(Path(__file__).resolve().parent))
from model_management_probe import import_pack

CASTABLE_TORCH = (torch.nn.Linear, torch.nn.Conv2d, torch.nn.GroupNorm, torch.nn.LayerNorm, torch.nn.Embedding)


def layers(module: torch.nn.Module) -> list[dict]:
    """Each module that holds state of its own: its name, whether it is a torch layer of a kind ComfyUI streams, its
    bytes, whether the host reserved room to stream it, where its tensors are."""
    table = []
    for name, layer in module.named_modules():
        own = {**dict(layer.named_parameters(recurse=False)), **dict(layer.named_buffers(recurse=False))}
        if own:
            table.append({"name": name, "torch_castable": isinstance(layer, CASTABLE_TORCH),
                          "bytes": sum(t.nbytes for t in own.values()), "streamed": hasattr(layer, "_v"),
                          "devices": sorted({str(t.device) for t in own.values()})})
    return table


def load(patcher) -> dict:
    """The host's own load of ``patcher`` to the stand-in GPU, as load_models_gpu makes it."""
    STREAMED_BYTES.clear()
    mm.LoadedModel(patcher).model_load(lowvram_model_memory=0.1)
    return {"patcher": type(patcher).__name__, "dynamic": patcher.is_dynamic(), "size": patcher.model_size(),
            "reserved": sum(STREAMED_BYTES)}


def main() -> None:
    pack_dir, transformer_path, encoder_path, ae_path, gguf_path, lora_path = sys.argv[1:7]
    dynamic = os.environ.get("PROBE_PATCHER", "dynamic") == "dynamic"
    if dynamic:
        comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
    import_pack(Path(pack_dir))
    from flux2_pack.flux2_core import weights
    from flux2_pack.flux2_core.adapters import lora
    from flux2_pack.flux2_core.models.reference_kv import ReferenceKV
    from flux2_pack.flux2_core.models.run_state import run_state
    from flux2_pack.nodes import host
    host.devices = lambda kind: (META, CPU)        # a GPU host's devices, the meta device standing in for the GPU

    model, variant = weights.load_transformer(transformer_path, CPU, torch.float32)
    transformer = host.manage(model, model, "transformer", torch.float32, variant=variant)
    encoder = weights.load_text_encoder(encoder_path, CPU, torch.float32)
    text_encoder = host.manage(encoder, encoder.model, "text_encoder", torch.float32, anchor="embed_tokens")
    ae = weights.load_autoencoder(ae_path, CPU, torch.float32)
    autoencoder = host.manage(ae, ae, "ae", torch.float32, anchor="encoder.conv_in")
    gguf_model, gguf_variant = weights.load_transformer(gguf_path, CPU, torch.float32)
    gguf = host.manage(gguf_model, gguf_model, "transformer", torch.float32, variant=gguf_variant)
    g = torch.Generator().manual_seed(0)
    kv = ReferenceKV([(torch.randn(1, 2, 16, 32, generator=g), torch.randn(1, 2, 16, 32, generator=g))], 16)
    kv_patcher = host.manage_reference_kv(kv)
    marked = sum(hasattr(m, "comfy_cast_weights") and not isinstance(m, CASTABLE_TORCH) for m in gguf_model.modules())
    try:                            # what ComfyUI's TorchCompileModel asks of a MODEL under dynamic VRAM
        transformer.patcher.clone(disable_dynamic=True)
        plain_copy = "made"
    except Exception as error:      # noqa: BLE001 - the message is what the test reads
        plain_copy = f"{type(error).__name__}: {error}"
    report = {"patchers": {name: type(p).__name__ for name, p in [
        ("transformer", transformer.patcher), ("text_encoder", text_encoder.patcher), ("ae", autoencoder.patcher),
        ("gguf", gguf.patcher), ("reference_kv", kv_patcher)]}, "gguf_marked": marked, "plain_copy": plain_copy}
    if not transformer.patcher.is_dynamic():        # the plain patchers every other real-host test runs
        print(json.dumps(report))
        return

    adapter = lora.read_adapter(lora_path, model.params)
    transformer = dataclasses.replace(transformer, adapters=(
        lora.AdapterUse(Path(lora_path).name, adapter.digest(), 0.8, True, adapter),))   # merge asked
    report["transformer"] = {**load(transformer.patcher), "layers": layers(model),
                             "partially_loaded": host.partially_loaded(transformer)}
    streamed = {n: t.clone() for n, t in model.state_dict().items() if t.device == CPU}
    transformer.use_adapters(model, lambda a: a.patches)
    applied = run_state(model).adapters
    report["adapters"] = {"merged": len(applied.merged), "branches": len(applied.hooks),
                          "targets": len({p.target for p in adapter.patches}), "cpu_tensors": len(streamed),
                          "cpu_tensors_unchanged": all(torch.equal(model.state_dict()[n], t)
                                                       for n, t in streamed.items())}
    report["text_encoder"] = {**load(text_encoder.patcher), "layers": layers(encoder.model),
                              "runs_on": str(encoder.device)}
    report["ae"] = {**load(autoencoder.patcher), "layers": layers(ae)}

    before = str(kv_patcher.model.kv().blocks[0][0].device)
    loaded = load(kv_patcher)
    on_device = str(kv_patcher.model.kv().blocks[0][0].device)
    kv_patcher.partially_unload(CPU, 1e32)          # what the host does when it needs the memory back
    report["reference_kv"] = {**loaded, "before": before, "loaded_on": on_device,
                              "after_unload": str(kv_patcher.model.kv().blocks[0][0].device),
                              "same_values": torch.equal(kv_patcher.model.kv().blocks[0][0], kv.blocks[0][0])}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
