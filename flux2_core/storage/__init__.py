"""How weights are held at run time, each kind one class behind one protocol (``protocol``): float (``linear``), fp8
(``quant``), int8 (``int8``), GGUF blocks (``ggml``, ``ggml_layers``); how 8-bit layers multiply (``matmul``) and the
fused kernels they use outside compiled code (``kernels``)."""
