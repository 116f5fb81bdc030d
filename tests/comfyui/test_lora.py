"""Klein LoRA in the real server: our node chain against flux2_core with the same LoRA applied, against
ComfyUI's own LoraLoaderModelOnly on ComfyUI's native FLUX.2 model, strength 0, and the weights restored for a run
without it. The LoRA is an ai-toolkit file (diffusion_model. + lora_A/lora_B), which both read."""

from __future__ import annotations

import pytest
import torch

from flux2_core import pipeline
from tests.comfyui import graphs

CASE = {"prompt": "a red fox in the snow, lora test", "seed": 8, "steps": 3, "width": 64, "height": 48}


def latent(comfy, graph) -> tuple[torch.Tensor, dict]:
    """(saved latent, outputs) of a prompt whose denoiser (node 8) really ran, not served from ComfyUI's cache."""
    run = comfy.client.run(graph)
    assert not any("8" in m["nodes"] for m in run.of_type("execution_cached")), "the denoiser did not run"
    entry = comfy.client.history(run.prompt_id)
    return graphs.saved_latent(comfy.base, entry).float(), entry["outputs"]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def direct(comfy, lora: str, strength: float, transformer: str | None = None, merge=None) -> torch.Tensor:
    """The CASE's latent from flux2_core itself, on the server's files, with the LoRA applied to both models."""
    models = comfy.base / "models"
    loaded = pipeline.load_models(models / "diffusion_models" / (transformer or comfy.files["transformer"]),
                                  models / "text_encoders" / comfy.files["text_encoder"],
                                  models / "vae" / comfy.files["ae"], device="cpu", dtype=torch.float32)
    pipeline.apply_adapters(loaded, [(models / "loras" / lora, strength)], merge=merge)
    return pipeline.generate(loaded, CASE["prompt"], steps=CASE["steps"], seed=CASE["seed"], width=CASE["width"],
                             height=CASE["height"]).latents


def test_lora_node_equals_the_engine_and_comfyuis_lora_loader(comfy):
    lora = comfy.files["lora"]
    other = {**CASE, "prompt": CASE["prompt"] + ", again"}
    plain_other, _ = latent(comfy, graphs.ours(comfy.files, **other, output="latent"))
    plain, _ = latent(comfy, graphs.ours(comfy.files, **CASE, output="latent"))
    ours, outputs = latent(comfy, graphs.ours(comfy.files, **CASE, loras=[(lora, 0.8)], output="latent"))
    (info,) = outputs["40"]["text"]
    assert info.startswith(f"{lora}: lora (") and "double blocks 4, single blocks 4" in info, info
    assert relative(ours, plain) > 1e-3                                  # the LoRA changed the result

    expected = direct(comfy, lora, 0.8)
    print(f"\nLoRA node vs flux2_core: relative {relative(ours, expected):.3g}")
    assert relative(ours, expected) <= 1e-5

    native, _ = latent(comfy, graphs.native(comfy.files, **CASE, loras=[(lora, 0.8)], output="latent"))
    print(f"LoRA node vs ComfyUI's LoraLoaderModelOnly + native FLUX.2: relative {relative(ours, native):.3g}")
    assert relative(native, ours) <= 1e-4

    zero, _ = latent(comfy, graphs.ours(comfy.files, **CASE, loras=[(lora, 0.0)], output="latent"))
    assert torch.equal(zero, plain)                                      # strength 0: exactly the model without it
    stacked, _ = latent(comfy, graphs.ours(comfy.files, **CASE, loras=[(lora, 0.5), (lora, 0.3)], output="latent"))
    assert relative(stacked, ours) <= 1e-5                               # 0.5 + 0.3 stacked = 0.8 once
    back, _ = latent(comfy, graphs.ours(comfy.files, **other, output="latent"))
    assert torch.equal(back, plain_other)                                # the weights came back bit for bit


@pytest.mark.parametrize("file", ["lora_kohya", "lora_diffusers", "lora_lokr"])
def test_other_formats_equal_comfyuis_lora_loader(comfy, file):
    """kohya/musubi with alpha (scale alpha/rank), diffusers/PEFT names with split q/k/v (row slices of our fused
    weights), and a LyCORIS LoKr (one factor decomposed: alpha/rank applies; full factors: it does not)."""
    lora = comfy.files[file]
    plain, _ = latent(comfy, graphs.ours(comfy.files, **CASE, output="latent"))
    ours, outputs = latent(comfy, graphs.ours(comfy.files, **CASE, loras=[(lora, 1.0)], output="latent"))
    assert "single blocks" in outputs["40"]["text"][0] and "matched nothing" not in outputs["40"]["text"][0]
    native, _ = latent(comfy, graphs.native(comfy.files, **CASE, loras=[(lora, 1.0)], output="latent"))
    print(f"\n{file}: LoRA node vs ComfyUI's LoraLoaderModelOnly: relative {relative(ours, native):.3g}")
    assert relative(ours, plain) > 1e-3 and relative(native, ours) <= 1e-4


def test_text_encoder_layers_apply_through_the_nodes_text_encoder_output(comfy):
    """A LoRA that also trains Qwen3: with the text encoder connected to the LoRA node and the prompt encoded by its
    text_encoder output, both parts apply and the result equals flux2_core applying the file to both models."""
    lora = comfy.files["lora_te"]
    graph = graphs.ours(comfy.files, **CASE, loras=[(lora, 0.7)], output="latent")
    graph["40"]["inputs"]["text_encoder"] = graphs.link("2")
    graph["4"]["inputs"]["text_encoder"] = graphs.link("40", 1)
    ours, outputs = latent(comfy, graph)
    assert "text encoder 4" in outputs["40"]["text"][0], outputs["40"]["text"][0]
    model_only, outputs = latent(comfy, graphs.ours(comfy.files, **CASE, loras=[(lora, 0.7)], output="latent"))
    assert "text-encoder modules are not applied" in outputs["40"]["text"][0]
    assert relative(ours, model_only) > 1e-3                             # the text-encoder part did something

    expected = direct(comfy, lora, 0.7)
    print(f"\nLoRA with text-encoder layers, node vs flux2_core: relative {relative(ours, expected):.3g}")
    assert relative(ours, expected) <= 1e-5


def test_fp8_model_takes_a_branch_or_merges_when_asked(comfy):
    """On ComfyUI's fp8mixed file (kept fp8): the LoRA runs beside the fp8 weights, or is merged into them when the
    node is asked to; each equals flux2_core doing the same on that file."""
    lora, fp8 = comfy.files["lora"], comfy.files["transformer_fp8"]
    for merge in (False, True):
        graph = graphs.ours(comfy.files, **CASE, loras=[(lora, 0.8)], model_file=fp8, model_dtype="auto",
                            output="latent")
        graph["40"]["inputs"]["merge_into_fp8"] = merge
        ours, _ = latent(comfy, graph)
        expected = direct(comfy, lora, 0.8, transformer=fp8, merge=True if merge else None)
        print(f"\nfp8 model, LoRA {'merged' if merge else 'as a branch'}: node vs flux2_core "
              f"{relative(ours, expected):.3g}")
        assert relative(ours, expected) <= 1e-5
