"""Tiny models written as GGUF files the way users get them, with the ``gguf`` package as the independent side.

    path, values = save_gguf(state_dict, tmp / "flux-2-klein-tiny-Q8_0.gguf", dit_types(Q8_0), arch="flux")
    path, values = save_gguf(llama_cpp_names(sd), tmp / "Qwen3-tiny-Q4_K.gguf", encoder_types(Q4_K), arch="qwen3",
                             tokens=vocabulary())

``values`` is every tensor as the file holds it, in float32 by ``gguf.quants.dequantize`` (the reference any loader
must reproduce): save it as safetensors to get "the float model with the dequantized weights".

Which tensors get quantized follows the converters users' files come from (city96's convert.py + llama.cpp's
quantize for DiTs, llama.cpp for Qwen3): 1-D tensors and tensors of <= 1024 values stay F32; a DiT's embedders and
final layer stay F16; everything else takes the asked type, or F16 where a row is not whole blocks. gguf can quantize
only Q8_0/Q5_x/Q4_x itself; K-quant files are random blocks with sane fp16 scales, which is what a test needs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUFWriter, quants
from gguf import GGMLQuantizationType as T

HAND_QUANTIZED = {T.Q8_0, T.Q5_0, T.Q5_1, T.Q4_0, T.Q4_1, T.BF16, T.F16, T.F32}
# byte offsets of the fp16 scale fields in one K-quant block (the rest is random): d / dmin
K_SCALES = {T.Q6_K: (208,), T.Q5_K: (0, 2), T.Q4_K: (0, 2), T.Q3_K: (108,), T.Q2_K: (80, 82)}
DIT_KEPT_F16 = ("img_in.", "txt_in.", "time_in.", "guidance_in.", "final_layer.")


def dit_types(qtype: T) -> Callable[[str, tuple], T]:
    """A DiT file's tensor types: ``qtype`` for the block and modulation weights (ComfyUI-GGUF / unsloth files)."""
    def choose(name: str, shape: tuple) -> T:
        if len(shape) < 2 or np.prod(shape) <= 1024:
            return T.F32
        if name.removeprefix("model.diffusion_model.").startswith(DIT_KEPT_F16):
            return T.F16
        return qtype if shape[-1] % GGML_QUANT_SIZES[qtype][0] == 0 else T.F16
    return choose


def encoder_types(qtype: T, embedding: T = T.Q8_0) -> Callable[[str, tuple], T]:
    """A Qwen3 GGUF's tensor types: ``qtype`` for the layers, ``embedding`` for token_embd (llama.cpp)."""
    def choose(name: str, shape: tuple) -> T:
        if len(shape) < 2 or np.prod(shape) <= 1024:
            return T.F32
        chosen = embedding if name == "token_embd.weight" else qtype
        return chosen if shape[-1] % GGML_QUANT_SIZES[chosen][0] == 0 else T.F16
    return choose


def random_k_blocks(rows: int, cols: int, qtype: T, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row bytes] of random K-quant blocks whose fp16 scales are small and finite."""
    block, size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for i, offset in enumerate(K_SCALES[qtype]):
        low, high = (-0.02, 0.02) if i == 0 else (0.0, 0.02)          # d signed, dmin >= 0 as quantizers write
        scale = rng.uniform(low, high, size=len(data)).astype(np.float16)
        data[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, -1)


def encode(tensor: torch.Tensor, qtype: T, rng: np.random.Generator) -> np.ndarray:
    """The bytes (or typed array) GGUFWriter takes for ``tensor`` stored as ``qtype``."""
    values = tensor.detach().float().numpy()
    if qtype == T.F32:
        return values
    if qtype == T.F16:
        return values.astype(np.float16)
    if qtype in HAND_QUANTIZED:
        return quants.quantize(values, qtype)
    return random_k_blocks(int(np.prod(values.shape[:-1])), values.shape[-1], qtype, rng)


def save_gguf(state_dict: dict[str, torch.Tensor], path: str | Path, types: Callable[[str, tuple], T],
              arch: str | None = "flux", tokens: list[str] | None = None, seed: int = 0,
              values: bool = True) -> tuple[Path, dict[str, torch.Tensor]]:
    """Write ``state_dict`` (names as the file should have them) as a GGUF; returns the path and every tensor's
    float32 value as stored (``gguf.quants.dequantize``; {} with ``values=False``, for big benchmark models).
    ``arch=None`` writes no architecture field, as stable-diffusion.cpp does; ``tokens`` goes in
    ``tokenizer.ggml.tokens``."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), arch or "none")
    if arch is None:
        writer.kv_data[0].pop("general.architecture")
    if tokens is not None:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(tokens)
    stored = {}
    for name, tensor in state_dict.items():
        qtype = types(name, tuple(tensor.shape))
        data = encode(tensor, qtype, rng)
        writer.add_tensor(name, data, raw_dtype=qtype if qtype not in (T.F32, T.F16) else None)
        if values:
            value = np.array(quants.dequantize(data, qtype), dtype=np.float32)
            stored[name] = torch.from_numpy(value).reshape(tensor.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path), stored


LLAMA_CPP = [(r"model\.embed_tokens\.weight", "token_embd.weight"), (r"model\.norm\.weight", "output_norm.weight"),
             (r"lm_head\.weight", "output.weight")] + [
    (rf"model\.layers\.(\d+)\.{hf}\.weight", rf"blk.\1.{ours}.weight") for hf, ours in [
        ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"), ("self_attn.q_proj", "attn_q"),
        ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
        ("self_attn.q_norm", "attn_q_norm"), ("self_attn.k_norm", "attn_k_norm"), ("mlp.gate_proj", "ffn_gate"),
        ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down")]]


def llama_cpp_name(key: str) -> str:
    """A Hugging Face Qwen3ForCausalLM key under llama.cpp's tensor name (written from llama.cpp's naming for Qwen3;
    no q/k permutation)."""
    return next(re.sub(pattern, name, key) for pattern, name in LLAMA_CPP if re.fullmatch(pattern, key))


def llama_cpp_names(hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {llama_cpp_name(key): tensor for key, tensor in hf_state_dict.items()}


def hf_names(llama_values: dict[str, torch.Tensor], hf_keys) -> dict[str, torch.Tensor]:
    """``llama_values`` back under the Hugging Face keys they came from (to save the dequantized values as a
    safetensors Qwen3)."""
    return {key: llama_values[llama_cpp_name(key)] for key in hf_keys}


def qwen3_tokens(vocab_size: int) -> list[str]:
    """The ``tokenizer.ggml.tokens`` of a Qwen3 GGUF with ``vocab_size`` rows: Qwen3's own tokens by id (what
    llama.cpp writes; the loader checks them against the built-in tokenizer), padding names for the spare rows."""
    from flux2_core.models.tokenizer import build_qwen3_tokenizer

    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    for token, i in build_qwen3_tokenizer().get_vocab().items():
        tokens[i] = token
    return tokens
