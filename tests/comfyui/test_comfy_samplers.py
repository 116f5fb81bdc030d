"""ComfyUI's own samplers on our engine (FLUX.2 Klein to MODEL) against the same graphs on ComfyUI's native model.

Each pair of graphs differs only in where the MODEL comes from: ComfyUI's UNETLoader (its comfy.ldm.flux model) or
our loader + FLUX.2 Klein to MODEL, on the same tiny weights file. Prompt conditioning (our encoder), references,
noise (ComfyUI's RandomNoise), sigmas, guider and sampler are the same nodes, so the latents must agree to float32
rounding through ComfyUI's samplers and schedulers, CFG and references, and EasyCache.
"""

from __future__ import annotations

import pytest
import torch

from flux2_core.errors import Flux2Error
from tests.comfyui import graphs
from tests.comfyui.graphs import link

SIZE = {"width": 64, "height": 48}
TOLERANCE = 1e-5          # relative to the largest value; ComfyUI's FLUX.2 math and ours differ in float32 rounding


def sampler_graph(comfy, *, engine: bool, prompt: str = "a red fox in the snow", seed: int = 3, steps: int = 4,
                  cfg: float = 1.0, negative: str | None = None, references: int = 0, base: bool = False,
                  sampler: str = "euler", scheduler: str | None = None, ksampler: bool = False,
                  model_file: str | None = None, model_dtype: str = "float32", our_loras=(), comfy_loras=(),
                  easycache: dict | None = None) -> dict:
    """One graph: ComfyUI's sampling nodes on the native model (engine=False) or on ours (engine=True).

    ksampler: KSampler (its scheduler, default "simple") instead of SamplerCustomAdvanced (with ComfyUI's
    BasicScheduler when ``scheduler`` is given, else our Klein Scheduler's sigmas)."""
    files = comfy.files
    model_file = model_file or files["transformer_base" if base else "transformer"]
    graph = graphs.common(files, prompt, seed, SIZE["width"], SIZE["height"], steps, negative,
                          comfy.images[:references], model_file, model_dtype)
    positive = graph.pop("positive")
    if engine:
        model = "1"
        for i, (name, strength) in enumerate(our_loras):
            graph[str(40 + i)] = {"class_type": "Flux2KleinLoRA",
                                  "inputs": {"model": link(model), "lora_name": name, "strength": strength}}
            model = str(40 + i)
        graph["11"] = {"class_type": "Flux2KleinToModel", "inputs": {"model": link(model)}}
    else:
        del graph["1"]
        graph["11"] = {"class_type": "UNETLoader", "inputs": {"unet_name": model_file, "weight_dtype": "default"}}
    model = "11"
    for i, (name, strength) in enumerate(comfy_loras):
        graph[str(50 + i)] = {"class_type": "LoraLoaderModelOnly",
                              "inputs": {"model": link(model), "lora_name": name, "strength_model": strength}}
        model = str(50 + i)
    if easycache is not None:
        graph["16"] = {"class_type": "EasyCache", "inputs": {"model": link(model), **easycache}}
        model = "16"
    if negative is None:                       # ComfyUI's KSampler always takes a negative: an empty prompt here
        graph["5"] = {"class_type": "Flux2KleinPromptEncode", "inputs": {"text_encoder": link("2"), "prompt": ""}}
    graph["15"] = {"class_type": "EmptyFlux2LatentImage", "inputs": {**SIZE, "batch_size": 1}}
    if ksampler:
        graph["8"] = {"class_type": "KSampler", "inputs": {
            "model": link(model), "positive": link(positive), "negative": link("5"), "latent_image": link("15"),
            "seed": seed, "steps": steps, "cfg": cfg, "sampler_name": sampler, "scheduler": scheduler or "simple",
            "denoise": 1.0}}
        return graphs.finish(graph, link("8"), "latent")
    if negative is None:
        graph["12"] = {"class_type": "BasicGuider", "inputs": {"model": link(model), "conditioning": link(positive)}}
    else:
        graph["12"] = {"class_type": "CFGGuider", "inputs": {"model": link(model), "positive": link(positive),
                                                             "negative": link("5"), "cfg": cfg}}
    sigmas = link("7")
    if scheduler is not None:
        graph["17"] = {"class_type": "BasicScheduler", "inputs": {"model": link(model), "scheduler": scheduler,
                                                                  "steps": steps, "denoise": 1.0}}
        sigmas = link("17")
    graph["13"] = {"class_type": "KSamplerSelect", "inputs": {"sampler_name": sampler}}
    graph["14"] = {"class_type": "RandomNoise", "inputs": {"noise_seed": seed}}
    graph["8"] = {"class_type": "SamplerCustomAdvanced",
                  "inputs": {"noise": link("14"), "guider": link("12"), "sampler": link("13"), "sigmas": sigmas,
                             "latent_image": link("15")}}
    return graphs.finish(graph, link("8"), "latent")


def latent(comfy, graph: dict) -> torch.Tensor:
    run = comfy.client.run(graph)
    return graphs.saved_latent(comfy.base, comfy.client.history(run.prompt_id)).float()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def compare(comfy, name: str, **options) -> tuple[torch.Tensor, torch.Tensor]:
    ours, native = latent(comfy, sampler_graph(comfy, engine=True, **options)), \
        latent(comfy, sampler_graph(comfy, engine=False, **options))
    rel = relative(ours, native)
    print(f"\n[{name}] ComfyUI sampler on our MODEL vs on its native model: relative {rel:.3g}")
    assert ours.shape == native.shape == (1, 128, SIZE["height"] // 16, SIZE["width"] // 16)
    assert torch.isfinite(ours).all()
    assert rel <= TOLERANCE
    return ours, native


CASES = {
    "euler-distilled": {},
    "euler-base-cfg": {"base": True, "cfg": 4.0, "negative": "", "steps": 5, "seed": 4},
    "euler-one-reference": {"references": 1, "prompt": "make it night", "seed": 5},
    "euler-three-references": {"references": 3, "prompt": "put them together", "seed": 6, "steps": 3},
    "dpmpp_2m-distilled": {"sampler": "dpmpp_2m"},
    "dpmpp_2m-base-cfg": {"sampler": "dpmpp_2m", "base": True, "cfg": 4.0, "negative": "", "steps": 6},
    "res_multistep-distilled": {"sampler": "res_multistep"},
    "res_multistep-base-cfg-reference": {"sampler": "res_multistep", "base": True, "cfg": 3.0, "negative": "",
                                         "references": 1, "steps": 6},
    "euler-beta-scheduler": {"scheduler": "beta", "steps": 6},
    "ksampler-euler-simple": {"ksampler": True},
    "ksampler-dpmpp_2m-beta-cfg": {"ksampler": True, "sampler": "dpmpp_2m", "scheduler": "beta", "base": True,
                                   "cfg": 4.0, "negative": "", "steps": 6},
    "ksampler-res_multistep-three-references": {"ksampler": True, "sampler": "res_multistep", "references": 3,
                                                "steps": 5},
}


@pytest.mark.parametrize("name", list(CASES))
def test_comfyui_samplers_on_our_model_equal_the_native_model(comfy, name):
    compare(comfy, name, **CASES[name])


def test_sampler_choice_matters(comfy):
    """The comparisons above could not pass by ignoring the sampler: euler and dpmpp_2m differ on our MODEL."""
    euler = latent(comfy, sampler_graph(comfy, engine=True, base=True, cfg=4.0, negative="", steps=6))
    dpmpp = latent(comfy, sampler_graph(comfy, engine=True, base=True, cfg=4.0, negative="", steps=6,
                                        sampler="dpmpp_2m"))
    assert relative(euler, dpmpp) > 1e-3


def test_euler_on_our_model_equals_our_denoise_node(comfy):
    """ComfyUI's euler over our sigmas on our MODEL is our Denoise node's Euler loop: the same latent."""
    ours = latent(comfy, sampler_graph(comfy, engine=True, seed=7))
    node = comfy.client.run(graphs.ours(comfy.files, "a red fox in the snow", seed=7, steps=4, output="latent", **SIZE))
    denoised = graphs.saved_latent(comfy.base, comfy.client.history(node.prompt_id)).float()
    assert relative(ours, denoised) <= 1e-5


def test_easycache_works_on_our_model_as_on_the_native_one(comfy):
    """ComfyUI's EasyCache (a DIFFUSION_MODEL wrapper that skips model calls) on our MODEL: it skips (the result
    differs from the run without it) and agrees with EasyCache on the native model."""
    options = {"steps": 10, "base": True, "cfg": 3.0, "negative": "",
               "easycache": {"reuse_threshold": 3.0, "start_percent": 0.1, "end_percent": 0.9, "verbose": True}}
    cached, _ = compare(comfy, "easycache", **options)
    full = latent(comfy, sampler_graph(comfy, engine=True, **{k: v for k, v in options.items() if k != "easycache"}))
    assert relative(cached, full) > 1e-3


def test_our_step_cache_beside_easycache_at_the_same_threshold(comfy):
    """A 24-step CFG run, uncached (ComfyUI's euler on our MODEL, which equals our Denoise node), then ComfyUI's
    EasyCache on our MODEL and our Denoise node's step cache at the same thresholds (EasyCache's window set to ours:
    the first 15% and last 5% of the steps always run). Printed: the steps each skipped (from the server's log) and
    the latent's difference from the uncached one. Both skip, and both move further from the uncached latent as they
    skip more."""
    import re

    options = {"steps": 24, "base": True, "cfg": 4.0, "negative": "", "seed": 9}
    full = latent(comfy, sampler_graph(comfy, engine=True, **options))
    rows = []
    for threshold in (0.8, 1.0):
        start = len(comfy.server.log())
        easy = latent(comfy, sampler_graph(comfy, engine=True, **options, easycache={
            "reuse_threshold": threshold, "start_percent": 0.15, "end_percent": 0.95, "verbose": False}))
        node = comfy.client.run(graphs.ours(comfy.files, "a red fox in the snow", seed=9, steps=24, cfg=4.0,
                                            negative="", output="latent", model_file=comfy.files["transformer_base"],
                                            cache=threshold, **SIZE))
        ours = graphs.saved_latent(comfy.base, comfy.client.history(node.prompt_id)).float()
        log = comfy.server.log()[start:]
        easy_skipped = int(re.search(r"EasyCache - skipped (\d+)/24 steps", log).group(1))
        our_skipped = int(re.search(rf"step cache {threshold:g}: (\d+) of 24 model calls skipped", log).group(1))
        rows.append((threshold, easy_skipped, relative(easy, full), our_skipped, relative(ours, full)))
        print(f"\n[step cache {threshold:g}] EasyCache skipped {easy_skipped}/24, max|diff| {rows[-1][2]:.3g} of the "
              f"uncached; ours skipped {our_skipped}/24, {rows[-1][4]:.3g}")
    for (_, easy_low, easy_err_low, ours_low, ours_err_low), (_, easy_high, easy_err_high, ours_high, ours_err_high) \
            in [rows]:
        assert 0 < ours_low <= ours_high and 0 < easy_low <= easy_high
        assert 0 < ours_err_low <= ours_err_high and 0 < easy_err_low <= easy_err_high


@pytest.mark.parametrize("role, dtype", [("transformer_fp8", "auto"), ("transformer_gguf", "auto"),
                                         ("transformer", "int8")])
def test_quantized_storage_is_kept_through_the_model_output(comfy, role, dtype):
    """fp8 and GGUF files, and int8 storage, run as they are stored through the MODEL: ComfyUI's euler on it equals
    our Denoise node on the same file and dtype, and differs from the float weights."""
    file = comfy.files[role]
    ours = latent(comfy, sampler_graph(comfy, engine=True, model_file=file, model_dtype=dtype, seed=8))
    node = comfy.client.run(graphs.ours(comfy.files, "a red fox in the snow", seed=8, steps=4, output="latent",
                                        model_file=file, model_dtype=dtype, **SIZE))
    denoised = graphs.saved_latent(comfy.base, comfy.client.history(node.prompt_id)).float()
    assert relative(ours, denoised) <= 1e-5
    full = latent(comfy, sampler_graph(comfy, engine=True, seed=8))
    assert relative(ours, full) > 1e-4


def test_a_kv_model_keeps_its_reference_kv_scheme_through_the_model_output(comfy):
    """9B-KV through the MODEL: ComfyUI's euler runs the references as the KV scheme (K/V computed once, at t = 0,
    without text), equal to our Denoise node on the same file, and unlike the joint references of the same weights
    loaded as a plain model (ComfyUI's native model knows only the joint scheme)."""
    kv_file = comfy.files["transformer_kv"]
    ours = latent(comfy, sampler_graph(comfy, engine=True, model_file=kv_file, references=1, seed=11))
    node = comfy.client.run(graphs.ours(comfy.files, "a red fox in the snow", seed=11, steps=4, output="latent",
                                        model_file=kv_file, references=comfy.images[:1], **SIZE))
    denoised = graphs.saved_latent(comfy.base, comfy.client.history(node.prompt_id)).float()
    assert relative(ours, denoised) <= 1e-5
    joint = latent(comfy, sampler_graph(comfy, engine=True, references=1, seed=11))
    assert relative(ours, joint) > 1e-4


def test_our_lora_node_before_the_model_output_equals_comfyuis_lora_on_the_native_model(comfy):
    lora = comfy.files["lora"]
    ours = latent(comfy, sampler_graph(comfy, engine=True, seed=9, our_loras=[(lora, 0.8)]))
    native = latent(comfy, sampler_graph(comfy, engine=False, seed=9, comfy_loras=[(lora, 0.8)]))
    assert relative(ours, native) <= TOLERANCE
    plain = latent(comfy, sampler_graph(comfy, engine=True, seed=9))
    assert relative(ours, plain) > 1e-3          # the LoRA took effect (and was taken off again afterwards:)
    assert torch.equal(plain, latent(comfy, sampler_graph(comfy, engine=True, seed=9, our_loras=[(lora, 0.0)])))


def test_comfyuis_lora_loader_on_our_model_is_refused_with_the_fix(comfy):
    graph = sampler_graph(comfy, engine=True, seed=10, comfy_loras=[(comfy.files["lora"], 0.8)])
    with pytest.raises(Flux2Error, match="put the LoRA on with Klein LoRA before FLUX.2 Klein to MODEL"):
        comfy.client.run(graph)
    # nothing was left behind: the same model without the LoRA loader still equals the native model
    compare(comfy, "after the refusal", seed=10)
