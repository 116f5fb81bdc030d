"""Weight storage: the protocol every storage class of a model's layers answers (``protocol.py``) and the int8 (W8A8)
storage (``int8.py``); float, fp8 and GGUF storage are ``linear.py``, ``quant.py`` and ``ggml_layers.py``."""
