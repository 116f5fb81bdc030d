"""Our denoiser inside ComfyUI against flux2_core called directly, and against ComfyUI's native FLUX.2 sampler.

Same tiny weights, prompt, seed and sigmas everywhere, float32 on CPU. The first comparison must be exact up to
float32 rounding (the node is a thin wrapper); the second runs ComfyUI's own FLUX.2 model (comfy.ldm.flux) and
Euler sampler on our conditioning, so it checks that our latents, references and RoPE ids mean what ComfyUI's mean.
The measured differences are printed (run pytest with -s to see them).
"""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from flux2_core import pipeline
from flux2_core.storage import quant
from flux2_core.storage.protocol import census
from tests.comfyui import graphs

SIZE = {"width": 64, "height": 48}
CASES = {  # name -> graph options; all run ours and the direct engine
    "distilled": {"prompt": "a red fox in the snow", "seed": 3, "steps": 4},
    "base_cfg": {"prompt": "a red fox in the snow", "seed": 4, "steps": 5, "cfg": 4.0, "negative": "",
                 "base": True},
    "one_reference": {"prompt": "make it night", "seed": 5, "steps": 4, "references": 1},
    "three_references": {"prompt": "put them together", "seed": 6, "steps": 3, "references": 3},
    # the step cache: the node skips the steps generate(cache=) skips (some, at this threshold on these weights)
    "base_cfg_step_cache": {"prompt": "a red fox in the snow", "seed": 4, "steps": 24, "cfg": 4.0, "negative": "",
                            "base": True, "cache": 0.9},
}
NATIVE_CASES = ["distilled", "base_cfg", "one_reference", "three_references"]


@pytest.fixture(scope="module")
def direct_models(comfy):
    models = comfy.base / "models"

    def load(transformer):
        return pipeline.load_models(models / "diffusion_models" / transformer,
                                    models / "text_encoders" / comfy.files["text_encoder"],
                                    models / "vae" / comfy.files["ae"], device="cpu", dtype=torch.float32)
    return {"distilled": load(comfy.files["transformer"]), "base": load(comfy.files["transformer_base"])}


def graph_options(comfy, case: dict) -> dict:
    options = {k: v for k, v in case.items() if k not in ("base", "references")}
    options["references"] = comfy.images[:case.get("references", 0)]
    options["model_file"] = comfy.files["transformer_base" if case.get("base") else "transformer"]
    return {**options, **SIZE}


def run_latent(comfy, build, case: dict) -> torch.Tensor:
    run = comfy.client.run(build(comfy.files, **graph_options(comfy, case), output="latent"))
    return graphs.saved_latent(comfy.base, comfy.client.history(run.prompt_id)).float()


def direct(comfy, direct_models, case: dict) -> pipeline.Result:
    references = [Image.open(comfy.base / "input" / name) for name in comfy.images[:case.get("references", 0)]]
    result = pipeline.generate(direct_models["base" if case.get("base") else "distilled"], case["prompt"],
                               references=references, steps=case["steps"], cfg=case.get("cfg", 1.0),
                               negative=case.get("negative", ""), seed=case["seed"], cache=case.get("cache", 0.0),
                               **SIZE)
    assert "cache" not in case or result.settings["cache"]["skipped"] > 0
    return result


def relative(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    diff = (a - b).abs().max().item()
    return diff, diff / b.abs().max().item()


@pytest.mark.parametrize("name", list(CASES))
def test_our_denoiser_in_comfyui_equals_flux2_core(comfy, direct_models, name):
    case = CASES[name]
    ours = run_latent(comfy, graphs.ours, case)
    expected = direct(comfy, direct_models, case).latents
    diff, rel = relative(ours, expected)
    print(f"\n[{name}] ComfyUI node vs flux2_core: max|diff| {diff:.3g} (relative {rel:.3g})")
    assert ours.shape == expected.shape == (1, 128, SIZE["height"] // 16, SIZE["width"] // 16)
    assert rel <= 1e-5


def test_decoded_image_equals_flux2_core(comfy, direct_models):
    case = CASES["distilled"]
    run = comfy.client.run(graphs.ours(comfy.files, **graph_options(comfy, case), output="image"))
    (png,) = comfy.client.image_bytes(run.prompt_id)
    ours = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
    expected = direct(comfy, direct_models, case).images[0].numpy().astype(int)
    assert ours.shape == expected.shape == (SIZE["height"], SIZE["width"], 3)
    assert np.abs(ours - expected).max() <= 1          # the same value, up to rounding at a level boundary


@pytest.mark.parametrize("name", NATIVE_CASES)
def test_comfyui_native_flux2_graph_agrees(comfy, name):
    """ComfyUI's UNETLoader + BasicGuider/CFGGuider + SamplerCustomAdvanced(euler) + RandomNoise on our prompt
    conditioning (with our reference latents) and our sigmas, against our denoiser."""
    case = CASES[name]
    ours = run_latent(comfy, graphs.ours, case)
    native = run_latent(comfy, graphs.native, case)
    diff, rel = relative(native, ours)
    print(f"\n[{name}] ComfyUI native FLUX.2 vs ours: max|diff| {diff:.3g} (relative {rel:.3g})")
    assert rel <= 1e-4


def test_fp8_file_stays_fp8_and_agrees_with_comfyui_native(comfy):
    """An fp8mixed file on dtype auto: our loader keeps its fp8 layers (computed in float32 on this CPU), the result
    equals flux2_core loading the same file, and ComfyUI's own loader and sampler on that file agree."""
    case = CASES["distilled"]
    fp8 = {**graph_options(comfy, case), "model_file": comfy.files["transformer_fp8"]}
    run = comfy.client.run(graphs.ours(comfy.files, **fp8, model_dtype="auto", output="latent"))
    ours = graphs.saved_latent(comfy.base, comfy.client.history(run.prompt_id)).float()
    info = " ".join(str(v) for v in comfy.client.history(run.prompt_id)["outputs"]["1"].get("text", []))
    assert "layers in fp8 (fp8 matmul: off (fp8 matmul needs an NVIDIA GPU; this model runs on cpu)" in info, info
    models = comfy.base / "models"
    direct_fp8 = pipeline.load_models(models / "diffusion_models" / comfy.files["transformer_fp8"],
                                      models / "text_encoders" / comfy.files["text_encoder"],
                                      models / "vae" / comfy.files["ae"], device="cpu", dtype=torch.float32)
    assert quant.count_fp8(direct_fp8.transformer) > 0
    expected = pipeline.generate(direct_fp8, case["prompt"], steps=case["steps"], seed=case["seed"], **SIZE).latents
    diff, rel = relative(ours, expected)
    print(f"\n[fp8mixed] ComfyUI node vs flux2_core: max|diff| {diff:.3g} (relative {rel:.3g})")
    assert rel <= 1e-5

    run = comfy.client.run(graphs.native(comfy.files, **fp8, output="latent"))
    native = graphs.saved_latent(comfy.base, comfy.client.history(run.prompt_id)).float()
    diff, rel = relative(native, ours)
    print(f"[fp8mixed] ComfyUI native FLUX.2 vs ours: max|diff| {diff:.3g} (relative {rel:.3g})")
    assert rel <= 1e-4
    full = run_latent(comfy, graphs.ours, case)             # and fp8 is near the full-precision weights, not equal
    assert 0 < relative(ours, full)[1] < 0.2


def test_nvfp4_file_stays_nvfp4_and_agrees_with_comfyui_native(comfy):
    """A ComfyUI nvfp4 file (comfy-kitchen's layout, .comfy_quant objects) on dtype auto: our loader keeps its nvfp4
    layers as stored, the result equals flux2_core loading the same file, and ComfyUI's own loader and sampler, which
    read nvfp4 through comfy-kitchen, agree."""
    case = CASES["distilled"]
    fp4 = {**graph_options(comfy, case), "model_file": comfy.files["transformer_nvfp4"]}
    run = comfy.client.run(graphs.ours(comfy.files, **fp4, model_dtype="auto", output="latent"))
    ours = graphs.saved_latent(comfy.base, comfy.client.history(run.prompt_id)).float()
    info = " ".join(str(v) for v in comfy.client.history(run.prompt_id)["outputs"]["1"].get("text", []))
    assert "layers in nvfp4 (dequantized as they run)" in info, info
    models = comfy.base / "models"
    direct = pipeline.load_models(models / "diffusion_models" / comfy.files["transformer_nvfp4"],
                                  models / "text_encoders" / comfy.files["text_encoder"],
                                  models / "vae" / comfy.files["ae"], device="cpu", dtype=torch.float32)
    assert census(direct.transformer).get("nvfp4", 0) > 0
    expected = pipeline.generate(direct, case["prompt"], steps=case["steps"], seed=case["seed"], **SIZE).latents
    diff, rel = relative(ours, expected)
    print(f"\n[nvfp4] ComfyUI node vs flux2_core: max|diff| {diff:.3g} (relative {rel:.3g})")
    assert rel <= 1e-5

    run = comfy.client.run(graphs.native(comfy.files, **fp4, output="latent"))
    native = graphs.saved_latent(comfy.base, comfy.client.history(run.prompt_id)).float()
    diff, rel = relative(native, ours)
    print(f"[nvfp4] ComfyUI native FLUX.2 vs ours: max|diff| {diff:.3g} (relative {rel:.3g})")
    assert rel <= 1e-4
    full = run_latent(comfy, graphs.ours, case)             # and nvfp4 is near the full-precision weights, not equal
    assert 0 < relative(ours, full)[1] < 0.5


def test_fp8_option_quantizes_a_full_precision_file(comfy):
    """dtype fp8_e4m3fn on a float file: the blocks quantized while loading, as flux2_core's load_models(fp8=True)."""
    case = CASES["distilled"]
    run = comfy.client.run(graphs.ours(comfy.files, **graph_options(comfy, case), model_dtype="fp8_e4m3fn",
                                       output="latent"))
    ours = graphs.saved_latent(comfy.base, comfy.client.history(run.prompt_id)).float()
    models = comfy.base / "models"
    direct_fp8 = pipeline.load_models(models / "diffusion_models" / comfy.files["transformer"],
                                      models / "text_encoders" / comfy.files["text_encoder"],
                                      models / "vae" / comfy.files["ae"], device="cpu", dtype=torch.float32, fp8=True)
    expected = pipeline.generate(direct_fp8, case["prompt"], steps=case["steps"], seed=case["seed"], **SIZE).latents
    assert relative(ours, expected)[1] <= 1e-5
    assert 0 < relative(ours, run_latent(comfy, graphs.ours, case))[1] < 0.2


def test_a_distilled_model_ignores_cfg_in_the_node_as_in_flux2_core(comfy, direct_models):
    """One guidance rule for both (euler.guidance_for): a distilled model given a negative and cfg 3 runs one pass
    per step in the node, as pipeline.generate does (and BFL's and diffusers' pipelines), and both say so. ComfyUI's
    own CFGGuider, which knows no variants, would run CFG here: this case is ours alone."""
    case = {"prompt": "a red fox in the snow", "seed": 7, "steps": 3, "cfg": 3.0, "negative": ""}
    run = comfy.client.run(graphs.ours(comfy.files, **graph_options(comfy, case), output="latent"))
    ours = graphs.saved_latent(comfy.base, comfy.client.history(run.prompt_id)).float()
    expected = direct(comfy, direct_models, case)
    assert relative(ours, expected.latents)[1] <= 1e-5
    assert any("cfg 3 is ignored" in w for w in expected.warnings)
    assert "cfg 3 is ignored" in " ".join(comfy.client.history(run.prompt_id)["outputs"]["8"]["text"])
    assert torch.equal(ours, run_latent(comfy, graphs.ours, {**case, "cfg": 1.0}))


def test_the_loader_says_how_each_kind_of_quantized_layer_multiplies(comfy):
    """A ComfyUI file holding W4A8 and AWQ W4A16 layers (comfy-kitchen's grouped 4-bit formats): the loader shows the
    note on their matmul (comfy-kitchen's own-format kernels, GPU only: off on this CPU, the weights dequantized), for
    both kinds, and the run goes on."""
    from safetensors.torch import load_file

    from tests.tiny.layouts import save_prefixed, w4_quant

    pytest.importorskip("comfy_kitchen")
    folder = comfy.base / "models" / "diffusion_models"
    weights = load_file(str(folder / comfy.files["transformer"]))
    weights = w4_quant(w4_quant(weights, ["double_blocks.0.img_attn.qkv", "single_blocks.0.linear1"],
                                "asym_w4a8_int8"), ["single_blocks.1.linear1"], "awq_w4a16")
    name = "flux-2-klein-tiny-w4.safetensors"
    save_prefixed(weights, folder / name)
    run = comfy.client.run(graphs.ours(comfy.files, "a red fox", steps=2, model_file=name, model_dtype="auto",
                                       **SIZE))
    info = " ".join(str(v) for v in comfy.client.history(run.prompt_id)["outputs"]["1"].get("text", []))
    assert "2 layers in w4a8" in info and "1 layers in awq" in info, info
    for kind in ("w4a8", "awq"):
        assert f"{kind} matmul in its own format: off (no GPU kernel here); dequantized" in info, info
    assert "dequantized as they run" not in info, info
