"""ComfyUI's dynamic VRAM with our models, read from ComfyUI's own code and run through it as far as a host without a
GPU can (dynamic_vram_probe.py: the host's ModelPatcherDynamic and loading, comfy-aimdo's native parts stood in by
counters, the meta device for the GPU).

What ModelPatcherDynamic asks of a model (comfy/model_patcher.py at v0.33.0): layers marked ``comfy_cast_weights``
(comfy.ops classes) over 16 KB stream from RAM, everything else is loaded whole and put back on unload; it refuses
full loads, forced weight patches and pinning, and it streams the weights as stored, so whoever writes a weight in
place makes its cached copies stale. Expected here: on v0.33.0 our float models get the host's dynamic patcher,
our torch layers stream by that rule, the rest (norms, anchors) load whole, a LoRA writes no weight,
the reference K/V come back to RAM on unload; on v0.12.1, whose opt-in dynamic patcher keeps unstreamed weights on
the CPU, our models keep the plain patcher as before. A model whose weights are buffers (GGUF blocks, fp8, int8,
packed formats), which the dynamic patcher would copy whole at every load, keeps the plain patcher on every host; a
plain copy of a dynamic Klein MODEL (what ComfyUI's TorchCompileModel asks) is refused with what to do.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from tests.comfyui.host import PACK_FOLDER

HERE = Path(__file__).resolve().parent
SMALL = 16 * 1024            # ModelPatcherDynamic.load: layers of this many bytes or fewer are loaded whole
ANCHORS = {"text_encoder": "embed_tokens", "ae": "encoder.conv_in"}      # plain layers our encoders run beside
KINDS = ("transformer", "text_encoder", "ae", "gguf", "reference_kv")


def host_version(comfy_dir: Path) -> tuple[int, ...]:
    text = (comfy_dir / "comfyui_version.py").read_text()
    return tuple(int(part) for part in re.search(r'__version__ = "([\d.]+)"', text).group(1).split("."))


def probe(comfy, patcher: str) -> dict:
    models, files = comfy.base / "models", comfy.files
    paths = [models / "diffusion_models" / files["transformer"], models / "text_encoders" / files["text_encoder"],
             models / "vae" / files["ae"], models / "diffusion_models" / files["transformer_gguf"],
             models / "loras" / files["lora"]]
    result = subprocess.run([comfy.server.python, str(HERE / "dynamic_vram_probe.py"),
                             str(comfy.base / "custom_nodes" / PACK_FOLDER), *map(str, paths)],
                            cwd=comfy.server.comfy_dir, capture_output=True, text=True, timeout=600, check=False,
                            env=dict(os.environ, PYTHONPATH=str(comfy.server.stubs), PROBE_PATCHER=patcher))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_our_models_stream_under_dynamic_vram_as_the_hosts_own(comfy):
    report = probe(comfy, "dynamic")
    if host_version(comfy.server.comfy_dir) < (0, 33, 0):
        assert set(report["patchers"].values()) == {"ModelPatcher"}, report["patchers"]
        assert report["gguf_marked"] > 0               # as on every plain host: GGUF layers stream by the mark
        return
    plain = {"gguf"}          # weights held in buffers (GGUF blocks): the plain patcher, streaming them by the mark
    assert {k: v for k, v in report["patchers"].items() if k not in plain} == dict.fromkeys(
        set(KINDS) - plain, "ModelPatcherDynamic") and report["patchers"]["gguf"] == "ModelPatcher", report["patchers"]
    assert report["plain_copy"].startswith("Flux2Error: this ComfyUI node needs a fresh copy of the model")
    for kind in ("transformer", "text_encoder", "ae"):
        loaded = report[kind]
        streamed = [layer for layer in loaded["layers"] if layer["streamed"]]
        for layer in loaded["layers"]:
            streams = layer["torch_castable"] and layer["bytes"] > SMALL and layer["name"] != ANCHORS.get(kind)
            assert layer["streamed"] == streams, (kind, layer)
            assert layer["devices"] == (["cpu"] if streams else ["meta"]), (kind, layer)
        assert loaded["reserved"] >= sum(layer["bytes"] for layer in streamed)
        assert streamed or kind == "text_encoder", kind      # the tiny encoder's layers are all small
    assert report["transformer"]["partially_loaded"]          # Klein Compile then compiles in pieces
    assert report["text_encoder"]["runs_on"] == "meta"         # its anchor loaded whole: it computes on the GPU
    assert report["gguf_marked"] > 0

    adapters = report["adapters"]                              # the LoRA asked to merge: it runs beside the weights
    assert adapters["merged"] == 0 and adapters["branches"] == adapters["targets"] > 0
    assert adapters["cpu_tensors"] > 0 and adapters["cpu_tensors_unchanged"]

    kv = report["reference_kv"]
    assert (kv["before"], kv["loaded_on"], kv["after_unload"]) == ("cpu", "meta", "cpu") and kv["same_values"]


def test_without_dynamic_vram_our_models_keep_the_plain_patcher(comfy):
    """The host's default patcher where dynamic VRAM is off (--disable-dynamic-vram, a CPU, other GPUs)."""
    report = probe(comfy, "plain")
    assert set(report["patchers"]) == set(KINDS) and set(report["patchers"].values()) == {"ModelPatcher"}
    assert report["gguf_marked"] > 0

