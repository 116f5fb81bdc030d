"""Weight files -> our models: file formats, key names and loading; how weights are held at run time is elsewhere
(docs/architecture.md lists both).
"""

from .loading import (
    ENCODER_FILES,
    check_embeddings_fit,
    check_text_encoder_fits,
    default_device_dtype,
    inspect_text_encoder,
    inspect_transformer,
    load_autoencoder,
    load_text_encoder,
    load_transformer,
    storage_outcome,
    stored_dtype,
    text_encoder_spec,
    transformer_bytes,
    transformer_dtype,
    transformer_family_at,
)

__all__ = ["ENCODER_FILES", "check_embeddings_fit", "check_text_encoder_fits", "default_device_dtype", "inspect_text_encoder",
           "inspect_transformer", "load_autoencoder", "load_text_encoder", "load_transformer", "storage_outcome", "stored_dtype",
           "text_encoder_spec", "transformer_bytes", "transformer_dtype", "transformer_family_at"]
