"""Weight files -> our models: everything about file formats, nothing about how weights are stored at run time.

    tensors.py       what a file holds (TensorInfo, Checkpoint): data both readers and the key mapping build on
    checkpoint.py    safetensors files: headers read and checked (never unpickled), single files, folders, shards
    gguf_file.py     GGUF files, read with the gguf package made strict
    key_mapping.py   layouts (BFL / diffusers / ComfyUI prefixes) and the key tables onto our (BFL) names
    dequantize.py    the fp8 / nvfp4 formats of files
    loading.py       the loaders below: build on meta, read each key by its recipe, assign; variant detection

Run-time storage is elsewhere: ``layers.py`` (where linear layers are made), ``storage/`` (the protocol, int8),
``linear.py`` (float), ``quant.py`` (fp8), ``ggml_layers.py`` (GGUF blocks), ``patching.py`` (adapters on top),
``offload.py`` (block streaming).

    model, variant = load_transformer("flux-2-klein-4b.safetensors", "cuda", torch.bfloat16)
    encoder = load_text_encoder("qwen_3_4b.safetensors", "cuda", torch.bfloat16)
    ae = load_autoencoder("flux2-vae.safetensors", "cuda", torch.float32)
"""

from .loading import (
    ENCODER_FILES,
    check_text_encoder_fits,
    default_device_dtype,
    inspect_transformer,
    load_autoencoder,
    load_text_encoder,
    load_transformer,
    transformer_bytes,
)

__all__ = ["ENCODER_FILES", "check_text_encoder_fits", "default_device_dtype", "inspect_transformer",
           "load_autoencoder", "load_text_encoder", "load_transformer", "transformer_bytes"]
