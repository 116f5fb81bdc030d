"""LoRA-style adapters: files read into patches (``lora``, ``formats``) and applied to a model's weights
(``patching``)."""
