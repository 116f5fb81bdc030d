"""GGUF files in the real server: the loaders list them from every folder users keep them in, a GGUF graph gives the
image of the same graph on safetensors files holding the GGUF's dequantized values, a wrong file is refused with a
clear message, and ComfyUI's model management loads and streams GGUF layers as it does its own castable layers.

The tiny GGUF files are base_dir.write_gguf_models' (Q4_0, and Q8_0 for the transformer's single blocks and the
encoder's embedding), also in models/unet and in ComfyUI-GGUF's unet_gguf / clip_gguf folders (base_dir.EXTRA_PATHS).
The expectations are read from the files themselves with the gguf package.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from PIL import Image

from flux2_core.errors import Flux2Error
from tests.comfyui import graphs
from tests.comfyui.host import PACK_FOLDER

HERE = Path(__file__).resolve().parent
FLOATS = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
CASE = {"prompt": "a red fox in the snow, gguf test", "seed": 9, "steps": 3, "width": 64, "height": 48}
ENCODER_LAYERS = 27            # the Qwen3 layers FLUX.2 reads (hidden states up to 27): the loader leaves the rest


def options(comfy, node: str, name: str) -> list[str]:
    return comfy.client.get_json(f"/object_info/{node}")[node]["input"]["required"][name][1]["options"]


def ggufs_under(models: Path, *folders: str) -> list[str]:
    """Every .gguf file under the folders, as a loader names it (relative to its folder), each name once."""
    return sorted({str(p.relative_to(models / folder)) for folder in folders
                   for p in (models / folder).rglob("*.gguf")})


def quantized(path: Path, used=lambda name: True) -> list:
    """The GGUF's quantized tensors (those a loader keeps as blocks) that ``used`` picks by name."""
    return [t for t in GGUFReader(path).tensors if GGMLQuantizationType(t.tensor_type) not in FLOATS and used(t.name)]


def gguf_info(tensors) -> str:
    """The loader's note for a model holding these tensors as blocks: '<count> layers GGUF <types by name>'."""
    names = sorted({GGMLQuantizationType(t.tensor_type).name for t in tensors})
    return f"{len(tensors)} layers GGUF {'/'.join(names)}"


def encoder_layer_used(name: str) -> bool:
    return name == "token_embd.weight" or (name.startswith("blk.") and int(name.split(".")[1]) < ENCODER_LAYERS)


def image_of(comfy, graph: dict) -> tuple[np.ndarray, dict]:
    """(the saved picture as int RGB, the prompt's outputs) of a graph run in the server."""
    run = comfy.client.run(graph)
    (png,) = comfy.client.image_bytes(run.prompt_id)
    picture = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
    return picture, comfy.client.history(run.prompt_id)["outputs"]


def test_loaders_list_gguf_files_from_every_folder_once(comfy):
    models, files = comfy.base / "models", comfy.files
    listed = options(comfy, "Flux2KleinModelLoader", "model_name")
    assert [f for f in listed if f.endswith(".gguf")] == ggufs_under(models, "diffusion_models", "unet", "unet_gguf")
    assert {files["transformer_gguf"], files["transformer_gguf_unet"], files["transformer_gguf_extra"]} <= set(listed)
    assert files["transformer"] in listed and files["transformer_gguf_values"] in listed     # safetensors still there
    assert listed == sorted(set(listed))           # sorted, and the file in both diffusion_models and unet once
    encoders = options(comfy, "Flux2KleinTextEncoderLoader", "text_encoder_name")
    assert [f for f in encoders if f.endswith(".gguf")] == ggufs_under(models, "text_encoders", "clip_gguf")
    assert {files["text_encoder_gguf"], files["text_encoder_gguf_extra"]} <= set(encoders)
    assert encoders == sorted(set(encoders))
    assert not [f for f in options(comfy, "Flux2KleinAELoader", "ae_name") if f.endswith(".gguf")]


@pytest.fixture(scope="module")
def dequantized_image(comfy):
    """The CASE's picture from safetensors files holding the GGUF files' dequantized values."""
    graph = graphs.ours(comfy.files, **CASE, model_file=comfy.files["transformer_gguf_values"],
                        text_encoder_file=comfy.files["text_encoder_gguf_values"])
    return image_of(comfy, graph)[0]


@pytest.mark.parametrize("transformer,encoder", [("transformer_gguf", "text_encoder_gguf"),
                                                 ("transformer_gguf_unet", "text_encoder_gguf_extra"),
                                                 ("transformer_gguf_extra", "text_encoder_gguf")])
def test_gguf_graph_gives_the_image_of_its_dequantized_values(comfy, dequantized_image, transformer, encoder):
    """From models/diffusion_models, a models/unet subfolder and the unet_gguf / clip_gguf folders alike."""
    files, models = comfy.files, comfy.base / "models"
    ours, outputs = image_of(comfy, graphs.ours(files, **CASE, model_file=files[transformer],
                                                text_encoder_file=files[encoder]))
    assert ours.shape == dequantized_image.shape == (CASE["height"], CASE["width"], 3)
    assert np.abs(ours - dequantized_image).max() <= 1        # the same value, up to rounding at a level boundary
    (model_info,) = outputs["1"]["text"]
    assert gguf_info(quantized(models / "diffusion_models" / files["transformer_gguf"])) in model_info, model_info
    (encoder_info,) = outputs["2"]["text"]
    expected = gguf_info(quantized(models / "text_encoders" / files["text_encoder_gguf"], encoder_layer_used))
    assert expected in encoder_info, encoder_info


@pytest.mark.parametrize("node,folder,wrong,says", [
    ("1", "diffusion_models", "text_encoder_gguf", "is a GGUF of a Qwen3 language model (text encoder)"),
    ("2", "text_encoders", "transformer_gguf", "is a GGUF of a FLUX transformer")])
def test_a_wrong_gguf_file_is_refused_with_what_it_is(comfy, node, folder, wrong, says):
    """A text encoder GGUF picked in the model loader and a transformer GGUF in the text encoder loader: ComfyUI's
    execution error carries our message (what the file is, what to pick instead), not a traceback."""
    models, name = comfy.base / "models", f"misplaced-{comfy.files[wrong]}"
    home = "text_encoders" if wrong == "text_encoder_gguf" else "diffusion_models"
    os.link(models / home / comfy.files[wrong], models / folder / name)
    try:
        chosen = {"model_file": name} if node == "1" else {"text_encoder_file": name}
        graph = graphs.ours(comfy.files, **CASE, **chosen)
        with pytest.raises(Flux2Error) as error:
            comfy.client.run(graph)
    finally:
        (models / folder / name).unlink()
    message = str(error.value)
    assert message.startswith(f"node {node} (") and "Flux2Error" in message and name in message, message
    assert says in message and "Traceback" not in message and 'File "' not in message, message


def test_comfyui_loads_and_streams_gguf_layers_like_its_own(comfy):
    """ComfyUI never loads a model partially to a CPU load device, as this server has, so the low-VRAM path runs in
    ComfyUI's Python outside the server (model_management_probe.py: ModelPatcher.load with a GPU's budget, the meta
    device standing in for the GPU). GGUF layers are counted by their blocks and moved when the model fits; under a
    short budget some move and the rest stay behind marked for streaming, as castable layers do, and the model
    computes what it computes loaded whole; a GGUF encoder runs where its embedding is."""
    models, files = comfy.base / "models", comfy.files
    transformer = models / "diffusion_models" / files["transformer_gguf"]
    encoder = models / "text_encoders" / files["text_encoder_gguf"]
    result = subprocess.run([comfy.server.python, str(HERE / "model_management_probe.py"),
                             str(comfy.base / "custom_nodes" / PACK_FOLDER), str(transformer), str(encoder)],
                            cwd=comfy.server.comfy_dir, env=dict(os.environ, PYTHONPATH=str(comfy.server.stubs)),
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads(result.stdout.splitlines()[-1])

    blocks = quantized(transformer)
    floats = [t for t in GGUFReader(transformer).tensors if GGMLQuantizationType(t.tensor_type) in FLOATS]
    fits = report["transformer_fits"]          # the file's blocks as they are, its other tensors in float32
    assert fits["size"] == sum(int(t.n_bytes) for t in blocks) + 4 * sum(int(t.n_elements) for t in floats)
    assert fits["sampling_bytes"] == 4 * 10000     # beside them, ComfyUI's FLUX.2 sampling's sigma table
    assert fits["loaded"] == fits["bytes_moved"] == fits["size"] and fits["tensors_left"] == 0 and not fits["lowvram"]
    assert fits["gguf_moved"] == fits["gguf_layers"] == len(blocks)

    short = report["transformer_short"]        # half the model's size
    assert short["lowvram"] and 0 < short["loaded"] == short["bytes_moved"] < short["size"]
    assert 0 < short["gguf_moved"] < short["gguf_layers"] and short["gguf_left_marked"] == short["gguf_left"]
    assert report["transformer_short_computes_the_same"]

    fits = report["encoder_fits"]
    assert fits["runs_on"] == "meta" and fits["tensors_left"] == 0 and fits["loaded"] == fits["size"]
    assert fits["gguf_layers"] == len(quantized(encoder, encoder_layer_used))
    nothing = report["encoder_none_fits"]      # --novram: every layer left, streamed; the encoder runs on the CPU
    assert nothing["runs_on"] == "cpu" and nothing["loaded"] == 0 and nothing["lowvram"]
    assert nothing["gguf_left_marked"] == nothing["gguf_layers"]
    assert report["encoder_none_fits_computes_the_same"]


def test_lora_on_a_gguf_model_equals_the_engine(comfy):
    """The Klein LoRA node on a GGUF transformer (LoRA branches beside the blocks, flux2_core.adapters.patching) gives
    what flux2_core gives with the same file and LoRA; the GGUF model without it comes back bit for bit."""
    from tests.comfyui.test_lora import CASE as LORA_CASE
    from tests.comfyui.test_lora import direct, latent, relative

    lora, gguf = comfy.files["lora"], comfy.files["transformer_gguf"]
    other = {**LORA_CASE, "prompt": LORA_CASE["prompt"] + ", gguf"}
    plain, _ = latent(comfy, graphs.ours(comfy.files, **other, model_file=gguf, output="latent"))
    ours, _ = latent(comfy, graphs.ours(comfy.files, **LORA_CASE, model_file=gguf, loras=[(lora, 0.8)],
                                        output="latent"))
    expected = direct(comfy, lora, 0.8, transformer=gguf)
    print(f"\nLoRA on a GGUF model, node vs flux2_core: relative {relative(ours, expected):.3g}")
    assert relative(ours, expected) <= 1e-5
    back, _ = latent(comfy, graphs.ours(comfy.files, **other, model_file=gguf, output="latent"))
    assert torch.equal(back, plain)
    with_lora, _ = latent(comfy, graphs.ours(comfy.files, **other, model_file=gguf, loras=[(lora, 0.8)],
                                             output="latent"))
    assert relative(with_lora, plain) > 1e-3                    # the LoRA changes this prompt's result
