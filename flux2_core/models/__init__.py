"""The networks: the FLUX.2 transformer, the autoencoder and the Qwen3 prompt encoder, built layer by layer through
``layers.Layers``, with what a run adds to a loaded model (``run_state``) and its sequence-parallel passes."""
