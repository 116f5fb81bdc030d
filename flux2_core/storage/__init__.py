"""Weight storage: the protocol (``protocol.py``), int8 (``int8.py``), 8-bit matmul choice (``matmul.py``); float,
fp8 and GGUF storage are ``linear.py``, ``quant.py`` and ``ggml_layers.py``."""
