"""API-format graphs for the real-host tests: ours (every stage one of our nodes) and ComfyUI's native FLUX.2 sampler.

Both share the loaders, the prompt encode and the noise of our pack, so the two samplers see identical inputs.

    prompt = ours(files, "a red fox", seed=1, width=64, height=64, steps=4)                 # -> SaveImage
    prompt = ours(files, "a red fox", output="latent")                                      # -> SaveLatent
    prompt = ours(files, "a red fox", model_file=files["transformer_fp8"], model_dtype="auto")
    prompt = native(files, "a red fox", output="latent")          # UNETLoader + BasicGuider/CFGGuider + SamplerCustomAdvanced
    prompt = ours(files, "a red fox", loras=[(files["lora"], 0.8)])    # Klein LoRA nodes (native: LoraLoaderModelOnly)
    prompt = ours(files, "a red fox", model_file=files["transformer_gguf"],
                  text_encoder_file=files["text_encoder_gguf"])
"""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file


def link(node: str, slot: int = 0) -> list:
    return [node, slot]


def common(files: dict, prompt: str, seed: int, width: int, height: int, steps: int, negative: str | None,
           references: list[str], model_file: str | None, model_dtype: str = "float32",
           text_encoder_file: str | None = None) -> dict:
    """Loaders, prompt(s), references, noise and schedule: ids 1..9 (+ 20.. for references)."""
    graph = {
        "1": {"class_type": "Flux2KleinModelLoader",
              "inputs": {"model_name": model_file or files["transformer"], "dtype": model_dtype}},
        "2": {"class_type": "Flux2KleinTextEncoderLoader",
              "inputs": {"text_encoder_name": text_encoder_file or files["text_encoder"], "dtype": "float32"}},
        "3": {"class_type": "Flux2KleinAELoader", "inputs": {"ae_name": files["ae"], "dtype": "float32"}},
        "4": {"class_type": "Flux2KleinPromptEncode", "inputs": {"text_encoder": link("2"), "prompt": prompt}},
        "6": {"class_type": "Flux2KleinNoise", "inputs": {"seed": seed, "width": width, "height": height,
                                                          "batch_size": 1}},
        "7": {"class_type": "Flux2KleinScheduler", "inputs": {"steps": steps, "width": width, "height": height,
                                                              "schedule": "flux2", "rho": 2.0}},
    }
    if negative is not None:
        graph["5"] = {"class_type": "Flux2KleinPromptEncode", "inputs": {"text_encoder": link("2"), "prompt": negative}}
    positive = "4"
    for i, image in enumerate(references):
        load, ref = str(20 + 2 * i), str(21 + 2 * i)
        graph[load] = {"class_type": "LoadImage", "inputs": {"image": image}}
        graph[ref] = {"class_type": "Flux2KleinReference",
                      "inputs": {"conditioning": link(positive), "image": link(load), "ae": link("3")}}
        positive = ref
    graph["positive"] = positive          # popped by the callers
    return graph


def finish(graph: dict, latent_node: list, output: str) -> dict:
    if output == "latent":
        graph["9"] = {"class_type": "SaveLatent", "inputs": {"samples": latent_node, "filename_prefix": "flux2test"}}
    else:
        graph["9"] = {"class_type": "Flux2KleinAEDecode", "inputs": {"ae": link("3"), "latent": latent_node}}
        graph["10"] = {"class_type": "SaveImage", "inputs": {"images": link("9"), "filename_prefix": "flux2test"}}
    return graph


def ours(files: dict, prompt: str, *, seed: int = 1, width: int = 64, height: int = 64, steps: int = 4,
         cfg: float = 1.0, negative: str | None = None, references=(), output: str = "image",
         model_file: str | None = None, model_dtype: str = "float32", loras=(),
         text_encoder_file: str | None = None, cache: float | None = None) -> dict:
    graph = common(files, prompt, seed, width, height, steps, negative, list(references), model_file, model_dtype,
                   text_encoder_file)
    positive = graph.pop("positive")
    model = "1"
    for i, (name, strength) in enumerate(loras):             # Klein LoRA nodes, chained
        graph[str(40 + i)] = {"class_type": "Flux2KleinLoRA",
                              "inputs": {"model": link(model), "lora_name": name, "strength": strength}}
        model = str(40 + i)
    inputs = {"model": link(model), "positive": link(positive), "noise": link("6"), "sigmas": link("7"), "cfg": cfg,
              "denoise": 1.0}
    if negative is not None:
        inputs["negative"] = link("5")
    if cache is not None:
        inputs["cache"] = cache
    graph["8"] = {"class_type": "Flux2KleinDenoise", "inputs": inputs}
    return finish(graph, link("8"), output)


def native(files: dict, prompt: str, *, seed: int = 1, width: int = 64, height: int = 64, steps: int = 4,
           cfg: float = 1.0, negative: str | None = None, references=(), output: str = "latent",
           model_file: str | None = None, loras=()) -> dict:
    """ComfyUI's own FLUX.2 model and Euler sampler on our conditioning and sigmas.

    The noise is ComfyUI's RandomNoise on an empty FLUX.2 latent: torch.manual_seed(seed) then a CPU float32
    randn, the same numbers as our Noise node draws for batch 1.
    """
    graph = common(files, prompt, seed, width, height, steps, negative, list(references), model_file)
    positive = graph.pop("positive")
    del graph["1"]
    graph["11"] = {"class_type": "UNETLoader",
                   "inputs": {"unet_name": model_file or files["transformer"], "weight_dtype": "default"}}
    model = "11"
    for i, (name, strength) in enumerate(loras):             # ComfyUI's own LoRA loader, chained
        graph[str(40 + i)] = {"class_type": "LoraLoaderModelOnly",
                              "inputs": {"model": link(model), "lora_name": name, "strength_model": strength}}
        model = str(40 + i)
    if negative is None:
        graph["12"] = {"class_type": "BasicGuider", "inputs": {"model": link(model), "conditioning": link(positive)}}
    else:
        graph["12"] = {"class_type": "CFGGuider", "inputs": {"model": link(model), "positive": link(positive),
                                                             "negative": link("5"), "cfg": cfg}}
    graph["13"] = {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}}
    graph["14"] = {"class_type": "RandomNoise", "inputs": {"noise_seed": seed}}
    graph["15"] = {"class_type": "EmptyFlux2LatentImage", "inputs": {"width": width, "height": height, "batch_size": 1}}
    graph["8"] = {"class_type": "SamplerCustomAdvanced",
                  "inputs": {"noise": link("14"), "guider": link("12"), "sampler": link("13"), "sigmas": link("7"),
                             "latent_image": link("15")}}
    return finish(graph, link("8"), output)


def inpaint(files: dict, prompt: str, image: str, mask: str, size: tuple[int, int], *, seed: int, steps: int,
            split: int = 0,
            cfg: float = 1.0, negative: str | None = None, references=(), model_file: str | None = None,
            encode: str = "ours") -> dict:
    """Our Denoise and ComfyUI's native sampler on one masked LATENT, in one graph; SaveLatent "ours" (id 60),
    "native" (61) and the masked latent itself (62).

    encode: how the LATENT gets its noise_mask (``mask``, an input file read by LoadImageMask's red channel, over
    ``image``, whose (width, height) is ``size``): "ours" (Flux2KleinAEEncode + SetLatentNoiseMask), "conditioning"
    (InpaintModelConditioning) or "vae_inpaint" (VAEEncodeForInpaint), the last two with ComfyUI's own VAE on the
    full-size AE file. split > 0 runs
    the last steps from there: our Denoise at denoise (steps - split) / steps, the native sampler on SplitSigmas.
    """
    width, height = size
    graph = common(files, prompt, seed, width, height, steps, negative, list(references), model_file)
    positive = link(graph.pop("positive"))
    graph["50"] = {"class_type": "LoadImage", "inputs": {"image": image}}
    graph["51"] = {"class_type": "LoadImageMask", "inputs": {"image": mask, "channel": "red"}}
    if encode == "ours":
        graph["52"] = {"class_type": "Flux2KleinAEEncode", "inputs": {"ae": link("3"), "image": link("50")}}
        graph["53"] = {"class_type": "SetLatentNoiseMask", "inputs": {"samples": link("52"), "mask": link("51")}}
        latent = link("53")
    else:
        graph["54"] = {"class_type": "VAELoader", "inputs": {"vae_name": files["ae_full"]}}
        if encode == "conditioning":
            graph["53"] = {"class_type": "InpaintModelConditioning",
                           "inputs": {"positive": positive, "negative": positive, "pixels": link("50"),
                                      "vae": link("54"), "mask": link("51"), "noise_mask": True}}
            positive, latent = link("53", 0), link("53", 2)
        else:
            graph["53"] = {"class_type": "VAEEncodeForInpaint", "inputs": {"pixels": link("50"), "vae": link("54"),
                                                                          "mask": link("51"), "grow_mask_by": 6}}
            latent = link("53")
    sigmas = link("7")
    if split:
        graph["55"] = {"class_type": "SplitSigmas", "inputs": {"sigmas": sigmas, "step": split}}
        sigmas = link("55", 1)
    inputs = {"model": link("1"), "positive": positive, "noise": link("6"), "sigmas": link("7"), "cfg": cfg,
              "denoise": (steps - split) / steps, "latent": latent}
    graph["56"] = {"class_type": "Flux2KleinDenoise", "inputs": inputs}
    graph["57"] = {"class_type": "UNETLoader",
                   "inputs": {"unet_name": model_file or files["transformer"], "weight_dtype": "default"}}
    if negative is None:
        graph["58"] = {"class_type": "BasicGuider", "inputs": {"model": link("57"), "conditioning": positive}}
    else:
        inputs["negative"] = link("5")
        graph["58"] = {"class_type": "CFGGuider", "inputs": {"model": link("57"), "positive": positive,
                                                             "negative": link("5"), "cfg": cfg}}
    graph["59"] = {"class_type": "SamplerCustomAdvanced",
                   "inputs": {"noise": link("14"), "guider": link("58"), "sampler": link("13"), "sigmas": sigmas,
                              "latent_image": latent}}
    graph["13"] = {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}}
    graph["14"] = {"class_type": "RandomNoise", "inputs": {"noise_seed": seed}}
    for node, source in (("60", link("56")), ("61", link("59")), ("62", latent)):
        graph[node] = {"class_type": "SaveLatent", "inputs": {"samples": source, "filename_prefix": f"inpaint{node}"}}
    return graph


def saved_latents(base: Path, history_entry: dict) -> dict:
    """{node id: tensor} of what the SaveLatent nodes wrote (safetensors files under the server's output folder)."""
    out = {}
    for node, outputs in history_entry["outputs"].items():
        for record in outputs.get("latents", []):
            out[node] = load_file(str(base / "output" / record["subfolder"] / record["filename"]))["latent_tensor"]
    return out


def saved_latent(base: Path, history_entry: dict):
    """The tensor of the one SaveLatent node of a prompt."""
    (latent,) = saved_latents(base, history_entry).values()
    return latent
