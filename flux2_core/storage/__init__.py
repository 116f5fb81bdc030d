"""Weight storage: the protocol every storage class of a model's layers answers (``protocol.py``), the int8 (W8A8)
storage (``int8.py``) and how 8-bit layers multiply (``matmul.py``); float, fp8 and GGUF storage are ``linear.py``,
``quant.py`` and ``ggml_layers.py``."""
