"""Our LATENT is ComfyUI's FLUX.2 latent: our autoencoder nodes and ComfyUI's VAE nodes mix both ways.

ComfyUI's VAELoader builds the real FLUX.2 autoencoder architecture (no tiny variant), so this uses random weights
of the real size (84 M parameters) that both loaders read from the same file.
"""

import io

import numpy as np
from PIL import Image

from tests.comfyui import graphs


def test_our_ae_nodes_and_comfyui_vae_nodes_mix_both_ways(comfy):
    ae = comfy.files["ae_full"]
    prompt = {
        "1": {"class_type": "LoadImage", "inputs": {"image": comfy.images[0]}},
        "2": {"class_type": "VAELoader", "inputs": {"vae_name": ae}},
        "3": {"class_type": "Flux2KleinAELoader", "inputs": {"ae_name": ae, "dtype": "float32"}},
        "4": {"class_type": "VAEEncode", "inputs": {"pixels": ["1", 0], "vae": ["2", 0]}},
        "5": {"class_type": "Flux2KleinAEEncode", "inputs": {"ae": ["3", 0], "image": ["1", 0]}},
        "6": {"class_type": "SaveLatent", "inputs": {"samples": ["4", 0], "filename_prefix": "native"}},
        "7": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": "ours"}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["2", 0]}},           # ours -> native
        "9": {"class_type": "Flux2KleinAEDecode", "inputs": {"ae": ["3", 0], "latent": ["4", 0]}},   # native -> ours
        "10": {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": "native_decode"}},
        "11": {"class_type": "SaveImage", "inputs": {"images": ["9", 0], "filename_prefix": "our_decode"}},
    }
    run = comfy.client.run(prompt)
    entry = comfy.client.history(run.prompt_id)
    latents = graphs.saved_latents(comfy.base, entry)
    native, ours = latents["6"].float(), latents["7"].float()
    width, height = Image.open(comfy.base / "input" / comfy.images[0]).size
    assert native.shape == ours.shape == (1, 128, height // 16, width // 16)
    diff = (native - ours).abs().max().item()
    print(f"\nVAEEncode vs Flux2KleinAEEncode: max|diff| {diff:.3g} (relative {diff / native.abs().max().item():.3g})")
    assert diff <= 1e-4 * native.abs().max().item()

    def picture(node):
        (image,) = entry["outputs"][node]["images"]
        return np.asarray(Image.open(io.BytesIO(comfy.client.download(image))).convert("RGB")).astype(int)

    cross_native, cross_ours = picture("10"), picture("11")
    assert cross_native.shape == cross_ours.shape == (height, width, 3)
    assert np.abs(cross_native - cross_ours).max() <= 1      # same picture, up to 8-bit rounding
    assert cross_native.std() > 5                            # and not a flat one


def test_the_autoencoder_loader_decodes_with_a_small_decoder_as_the_engine_does(comfy):
    """Flux2KleinAELoader's decoder input (BFL's small decoder, a decoder on its own): AE Decode's picture is the
    engine's decode of the same latent with weights.load_autoencoder(ae, decoder=...), to 8-bit rounding; the
    encoder stays the autoencoder's."""
    import torch

    from flux2_core import weights

    ae, small = comfy.files["ae"], comfy.files["small_decoder"]
    prompt = {
        "1": {"class_type": "LoadImage", "inputs": {"image": comfy.images[0]}},
        "2": {"class_type": "Flux2KleinAELoader", "inputs": {"ae_name": ae, "dtype": "float32", "decoder": small}},
        "3": {"class_type": "Flux2KleinAEEncode", "inputs": {"ae": ["2", 0], "image": ["1", 0]}},
        "4": {"class_type": "Flux2KleinAEDecode", "inputs": {"ae": ["2", 0], "latent": ["3", 0]}},
        "5": {"class_type": "SaveLatent", "inputs": {"samples": ["3", 0], "filename_prefix": "small"}},
        "6": {"class_type": "SaveImage", "inputs": {"images": ["4", 0], "filename_prefix": "small_decode"}},
    }
    run = comfy.client.run(prompt)
    entry = comfy.client.history(run.prompt_id)
    latent = graphs.saved_latents(comfy.base, entry)["5"].float()
    vae = comfy.base / "models" / "vae"
    engine = weights.load_autoencoder(vae / ae, "cpu", torch.float32, decoder=vae / small)
    assert engine.params.decoder_chans == (32, 32, 32, 32)
    with torch.no_grad():
        expected = ((engine.decode(latent).clamp(-1, 1) + 1) / 2 * 255)[0].permute(1, 2, 0).numpy()
    (image,) = entry["outputs"]["6"]["images"]
    got = np.asarray(Image.open(io.BytesIO(comfy.client.download(image))).convert("RGB")).astype(float)
    assert got.shape == expected.shape and np.abs(got - expected).max() <= 1
    assert got.std() > 5
