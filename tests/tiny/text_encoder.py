"""A tiny random Qwen3 text encoder for tests, saved the ways users have it: diffusers folders or one ComfyUI file.

The real Qwen3-4B is 2560 wide with 36 layers; the tiny one is 32 wide with 28 layers (the fewest for which
hidden_states[27] is still an un-normed layer output, as in the real model), keeps the real vocabulary size
(151,936 rows, so every Qwen3 token id is valid) and Qwen3's attention shape (GQA with q/k RMSNorm, head_dim 16).

    te = build_tiny_qwen3()                                       # Qwen3ForCausalLM, eval, float32, CPU
    save_diffusers_text_encoder(te, tmp, tokenizer)               # tmp/text_encoder/ + tmp/tokenizer/
    save_comfyui_text_encoder(te, tmp / "qwen_3_tiny.safetensors")   # one file, HF key names, no lm_head
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

TINY_QWEN3_CONFIG = {
    "vocab_size": 151936, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 28,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "tie_word_embeddings": True,
}


def build_tiny_qwen3(seed: int = 0, config: dict | None = None):
    """A random ``Qwen3ForCausalLM`` (``TINY_QWEN3_CONFIG`` by default) in eval mode, float32, on CPU.

    Every matrix is re-drawn from N(0, 0.2) (transformers' 0.02 would make all layers near-identities); every RMSNorm
    weight is 1 + 0.1 N(0, 1), so no norm is trivial. The global RNG is untouched. Takes well under a second.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(Qwen3Config(**(config or TINY_QWEN3_CONFIG), attn_implementation="sdpa"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1 + 0.1 * torch.randn_like(p))
                else:
                    p.normal_(0.0, 0.2)
    return model.eval().requires_grad_(False)


def comfyui_state_dict(model, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a ComfyUI repackaged Qwen3 file: Hugging Face names (``model.layers.N…``), no tied lm_head.

    ``prefix`` goes before every key, e.g. ``"text_encoders.qwen3_4b.transformer."`` for an all-in-one checkpoint.
    """
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return {prefix + k: v for k, v in sd.items()}


def save_comfyui_text_encoder(model, path: str | Path, dtype: torch.dtype | None = None, prefix: str = "") -> Path:
    """Write the model as one safetensors file in ComfyUI's layout (see ``comfyui_state_dict``); returns the path."""
    sd = comfyui_state_dict(model, prefix)
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    save_file(sd, str(path))
    return Path(path)


def save_diffusers_text_encoder(model, root: str | Path, tokenizer=None) -> Path:
    """Write ``root/text_encoder/`` (config.json + model.safetensors) and, given a tokenizer, ``root/tokenizer/``.

    This is how a diffusers FLUX.2 Klein repository stores its Qwen3. Returns the ``text_encoder`` folder.
    """
    root = Path(root)
    model.save_pretrained(root / "text_encoder")
    if tokenizer is not None:
        tokenizer.save_pretrained(root / "tokenizer")
    return root / "text_encoder"
