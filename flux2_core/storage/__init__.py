"""How weights are held at run time, each kind one class behind one protocol (``protocol``): float (``linear``), fp8
(``quant``), int8 (``int8``), the packed formats of ComfyUI's quantized files (``packed``), GGUF blocks (``ggml``,
``ggml_layers``); the formats a file stores a layer in, each one object beside the class that holds it
(``stored_format``), collected in one registry (``formats``); how 8-bit layers multiply (``matmul``) and the fused
kernels they use outside compiled code (``kernels``)."""
