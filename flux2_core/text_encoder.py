"""The Qwen3 prompt embedder: chat template, 512 tokens, hidden states 9/18/27 of a Qwen3 truncated to 27 layers.

What BFL's ``Qwen3Embedder`` and diffusers' ``Flux2KleinPipeline._get_qwen3_prompt_embeds`` do, per prompt:

    text = "<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n"
    ids, mask = tokenizer(text, padding="max_length", truncation=True, max_length=512)   # right pad/truncate
    hs = qwen3(ids, mask, positions 0..511).hidden_states     # hs[k]: output of decoder layer k-1, no final norm
    embeds = cat(hs[9], hs[18], hs[27]) per token             # [512, 3*D], layer-major

Pad tokens are masked as keys inside Qwen3 (causal + key-padding mask), but their rows are computed and kept: the
FLUX.2 transformer sees all 512 tokens. Layers 28..36 and the final norm never matter, so the model is built with
27 decoder layers only and the final norm replaced by an identity.

    encoder = build_qwen3_encoder(state_dict, device="cuda", dtype=torch.bfloat16)
    out = encoder.encode(["a cat", ""])        # out.embeds [2, 512, 7680] for Qwen3-4B
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
from torch import nn

from .checks import dtype_cause, finite
from .errors import Flux2Error
from .layers import Layers
from .tokenizer import load_tokenizer
from .variants import QWEN3_4B, QWEN3_8B, TextEncoderSpec

# Known Qwen3 sizes, by hidden width.
SPECS_BY_HIDDEN = {QWEN3_4B.hidden_size: QWEN3_4B, QWEN3_8B.hidden_size: QWEN3_8B}


@dataclass
class PromptEmbeds:
    embeds: torch.Tensor       # [B, max_length, 3*D] in the model's dtype
    token_counts: list[int]    # tokens of each rendered prompt (chat template included), before truncation and padding
    dropped: list[int]         # tokens cut off by truncation to max_length (0 when the prompt fits)


def render_prompt(tokenizer, prompt: str) -> str:
    """The prompt in Qwen3's chat template, as the text encoder reads it:
    "<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n"."""
    if not isinstance(prompt, str):
        raise Flux2Error(f"a prompt must be a string, got {type(prompt).__name__}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:    # lone surrogates: bytes that were not UTF-8 (a shell in another encoding)
        raise Flux2Error(f"the prompt is not valid text: character {e.start} stands for a byte that is not UTF-8 "
                         f"({prompt[max(0, e.start - 20):e.start]!r} comes before it); pass the prompt as UTF-8 text "
                         f"(check the terminal's or file's encoding)") from None
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)


def count_prompt_tokens(tokenizer, prompt: str) -> int:
    """Tokens of the rendered prompt (chat template included) before truncation to 512: PromptEmbeds.token_counts,
    and the exact count the web extension shows under the prompt."""
    return len(tokenizer(render_prompt(tokenizer, prompt))["input_ids"])


class PromptEncoder:
    """Turns prompts into FLUX.2 text embeddings with a (truncated) transformers ``Qwen3Model``."""

    def __init__(self, model: nn.Module, tokenizer, spec: TextEncoderSpec):
        deepest = max(spec.output_layers)
        if len(model.layers) < deepest:
            raise Flux2Error(f"the text encoder has {len(model.layers)} layers, {spec.name} needs {deepest}")
        if len(model.layers) == deepest and not isinstance(model.norm, nn.Identity):
            # transformers applies the final norm to the last hidden state; ours must be the raw layer output.
            raise Flux2Error(f"a Qwen3 with exactly {deepest} layers must have its final norm replaced by "
                             "nn.Identity(); build it with build_qwen3_encoder")
        self.model = model
        self.tokenizer = tokenizer
        self.spec = spec

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (a GGUF embedding's weight is blocks; it says what its lookups return)."""
        return getattr(self.model.embed_tokens, "dtype", self.model.embed_tokens.weight.dtype)

    def tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(ids [B, L], attention mask [B, L], untruncated token counts), each prompt tokenized on its own."""
        if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
            raise Flux2Error(f"prompts must be a list of strings, got {type(prompts).__name__}")
        if not prompts:
            raise Flux2Error("no prompt to encode: pass at least one (an empty string is a valid prompt)")
        ids, mask, counts = [], [], []
        for prompt in prompts:
            tokens = self.tokenizer(render_prompt(self.tokenizer, prompt), padding="max_length", truncation=True,
                                    max_length=self.spec.max_length, return_tensors="pt")
            ids.append(tokens["input_ids"])
            mask.append(tokens["attention_mask"])
            counts.append(count_prompt_tokens(self.tokenizer, prompt))
        return torch.cat(ids), torch.cat(mask), counts

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> PromptEmbeds:
        ids, mask, counts = self.tokenize(prompts)
        batch, length = ids.shape
        positions = torch.arange(length, device=self.device).expand(batch, length)   # 0..511, pads included
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), position_ids=positions,
                         output_hidden_states=True, use_cache=False)
        layers = torch.stack([out.hidden_states[k] for k in self.spec.output_layers], dim=2)   # [B, L, 3, D]
        embeds = layers.reshape(batch, length, -1)                                          # [B, L, 3*D]
        # checked here, before any cache keeps them: NaN embeddings make every image from them black
        finite(embeds, "the prompt embeddings", [*dtype_cause(self.dtype, "the text encoder"),
                                                 ("the text encoder's weights hold NaN/inf (a damaged or wrongly "
                                                  "converted file: download it again)")])
        dropped = [max(0, n - self.spec.max_length) for n in counts]
        return PromptEmbeds(embeds, counts, dropped)


def is_used(key: str, num_layers: int) -> bool:
    """Whether FLUX.2 uses this Qwen3 weight (a key without prefix): not the final norm, no layer from num_layers on."""
    return key != "norm.weight" and not (key.startswith("layers.") and int(key.split(".")[1]) >= num_layers)


def qwen3_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with ``Qwen3Model`` key names (``embed_tokens.weight``, ``layers.N.…``, ``norm.weight``).

    Accepts any prefix before ``embed_tokens``: Hugging Face ``Qwen3ForCausalLM`` files and ComfyUI's
    ``qwen_3_4b.safetensors`` / ``qwen_3_8b_fp8mixed.safetensors`` use ``model.``, a bare ``Qwen3Model`` none, a ComfyUI
    all-in-one checkpoint ``text_encoders.qwen3_4b.transformer.model.``. Keys outside the prefix (``lm_head``) are
    dropped. Quantization scales must have been folded into the weights by the loader first.
    """
    embed = [k for k in state_dict if k.endswith("embed_tokens.weight")]
    if len(embed) != 1:
        raise Flux2Error("this is not a Qwen3 text encoder: expected one '…embed_tokens.weight' tensor, found "
                         f"{len(embed)}. FLUX.2 Klein needs Qwen3-4B (Klein 4B) or Qwen3-8B (Klein 9B)")
    prefix = embed[0][: -len("embed_tokens.weight")]
    sd = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    if "layers.0.self_attn.q_norm.weight" not in sd:
        raise Flux2Error("this text encoder has no q_norm in its attention, so it is not Qwen3 (Qwen2.5, Llama and "
                         "Mistral have none). FLUX.2 Klein needs Qwen3-4B (Klein 4B) or Qwen3-8B (Klein 9B)")
    from .weights.dequantize import DROPPED_SUFFIXES  # here: the weights package imports this module

    quantized = [k for k in sd if k.endswith(DROPPED_SUFFIXES)]   # scales beside weights
    if quantized:
        raise Flux2Error(f"the text-encoder weights are quantized ({quantized[0]}, …): dequantize them to a float "
                         "dtype before building the encoder (flux2_core.weights does this for supported formats)")
    return sd


def qwen3_config_from_state_dict(state_dict: dict[str, torch.Tensor]):
    """A ``Qwen3Config`` read from tensor shapes (for files without config.json).

    head_dim is the length of q_norm.weight, so the head counts follow from q_proj / k_proj. rope_theta (1e6), the
    norm eps (1e-6) and the context length are Qwen3-4B/8B's, which no shape reveals.
    """
    from transformers import Qwen3Config

    tied = not any(k.endswith("lm_head.weight") for k in state_dict)
    sd = qwen3_state_dict(state_dict)
    vocab, hidden = sd["embed_tokens.weight"].shape
    head_dim = sd["layers.0.self_attn.q_norm.weight"].shape[0]
    layers = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("layers."))
    return Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, head_dim=head_dim,
        num_attention_heads=sd["layers.0.self_attn.q_proj.weight"].shape[0] // head_dim,
        num_key_value_heads=sd["layers.0.self_attn.k_proj.weight"].shape[0] // head_dim,
        intermediate_size=sd["layers.0.mlp.gate_proj.weight"].shape[0],
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=tied,
        hidden_act="silu", attention_bias=False,
    )


def build_qwen3_model(state_dict: dict[str, torch.Tensor], config, num_layers: int, device, dtype,
                      ggml_types: dict[str, int] | None = None) -> nn.Module:
    """A transformers ``Qwen3Model`` with the first ``num_layers`` decoder layers of ``state_dict`` and no final norm.

    Built on the meta device with our layers (``layers.Layers.adopt``: float, or GGUF blocks for the layers
    ``ggml_types`` names, by module name); the tensors, moved to ``device`` (floats cast to ``dtype``, blocks as they
    are), then become the parameters themselves (no second copy). Deeper layers and the final norm are not touched.
    """
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Model, Qwen3RotaryEmbedding

    if config.num_hidden_layers < num_layers:
        raise Flux2Error(f"the text encoder has {config.num_hidden_layers} layers, FLUX.2 needs at least {num_layers} "
                         "(its hidden states 9, 18 and 27): use the full Qwen3-4B / Qwen3-8B")
    config = copy.deepcopy(config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    config._attn_implementation = "sdpa"

    sd = qwen3_state_dict(state_dict)
    keep = {k: v for k, v in sd.items() if is_used(k, num_layers)}
    with torch.device("meta"):
        model = Qwen3Model(config)
    model.norm = nn.Identity()     # hidden state 27 is the raw output of layer 27, never normed
    # our layers: oneDNN matmuls for float32 on CPU (linear.py), GGUF blocks dequantized as they run (ggml_layers.py)
    Layers(ggml=(ggml_types or {}).get).adopt(model, dtype)
    keep = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in keep.items()}
    misfit = f"the text-encoder weights do not fit Qwen3 ({config.hidden_size} wide, {num_layers} layers)"
    try:
        missing, unexpected = model.load_state_dict(keep, strict=False, assign=True)
    except RuntimeError as e:   # a shape differs from the config
        raise Flux2Error(f"{misfit}: {e}") from e
    if missing or unexpected:
        raise Flux2Error(f"{misfit}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    # The rotary table is a non-persistent buffer, so it is still on meta: compute it on the real device.
    model.rotary_emb = Qwen3RotaryEmbedding(config).to(device)
    return model.eval().requires_grad_(False)


def build_qwen3_encoder(state_dict: dict[str, torch.Tensor], config=None, device="cpu", dtype=torch.bfloat16,
                        tokenizer=None, spec: TextEncoderSpec | None = None,
                        ggml_types: dict[str, int] | None = None) -> PromptEncoder:
    """A ``PromptEncoder`` from a Qwen3 state dict (any key layout ``qwen3_state_dict`` accepts).

    ``config``: a ``Qwen3Config``, a config.json dict, or None to read it from the shapes (float tensors only; GGUF
    blocks need it given). ``tokenizer``: None for the built-in Qwen3 tokenizer. ``ggml_types``: the layers given as
    GGUF blocks (module name -> GGML type). ``spec``: None picks Qwen3-4B / 8B by width (other widths get the same layers, 9/18/27).
    """
    from transformers import Qwen3Config

    if config is None:
        config = qwen3_config_from_state_dict(state_dict)
    elif isinstance(config, dict):
        config = Qwen3Config.from_dict(config)
    if spec is None:
        spec = SPECS_BY_HIDDEN.get(config.hidden_size) or replace(QWEN3_4B, name="custom", hidden_size=config.hidden_size)
    model = build_qwen3_model(state_dict, config, max(spec.output_layers), device, dtype, ggml_types)
    return PromptEncoder(model, tokenizer if tokenizer is not None else load_tokenizer(), spec)
