"""The Qwen3 prompt embedder: chat template, 512 tokens, hidden states 9/18/27 of a Qwen3 truncated to 27 layers.

What BFL's ``Qwen3Embedder`` and diffusers' ``Flux2KleinPipeline._get_qwen3_prompt_embeds`` do, per prompt:

    text = "<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n"
    ids, mask = tokenizer.padded([text], 512)                 # right pad (<|endoftext|>) / truncate
    hs = qwen3(ids, mask, positions 0..511)                   # hs[k]: output of decoder layer k (from 1), no norm
    embeds = cat(hs[9], hs[18], hs[27]) per token             # [512, 3*D], layer-major

Pad tokens are masked as keys inside Qwen3 (causal + key-padding mask), but their rows are computed and kept: the
FLUX.2 transformer sees all 512 tokens. Layers 28..36 and the final norm never matter, so the model (``qwen3.py``)
is built with 27 decoder layers and no final norm.

    encoder = build_qwen3_encoder(state_dict, device="cuda", dtype=torch.bfloat16)
    out = encoder.encode(["a cat", ""])        # out.embeds [2, 512, 7680] for Qwen3-4B
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .checks import dtype_cause, finite
from .errors import Flux2Error
from .layers import Layers
from .qwen3 import Qwen3, Qwen3Params
from .tokenizer import Qwen3Tokenizer, as_qwen3_tokenizer, load_tokenizer
from .variants import QWEN3_4B, QWEN3_8B, TextEncoderSpec

# Known Qwen3 sizes, by hidden width.
SPECS_BY_HIDDEN = {QWEN3_4B.hidden_size: QWEN3_4B, QWEN3_8B.hidden_size: QWEN3_8B}


@dataclass
class PromptEmbeds:
    embeds: torch.Tensor       # [B, max_length, 3*D] in the model's dtype
    token_counts: list[int]    # tokens of each rendered prompt (chat template included), before truncation and padding
    dropped: list[int]         # tokens cut off by truncation to max_length (0 when the prompt fits)


def render_prompt(prompt: str) -> str:
    """The prompt in Qwen3's chat template, as the text encoder reads it (one user message, the generation prompt,
    thinking off: what ``apply_chat_template(..., add_generation_prompt=True, enable_thinking=False)`` renders)."""
    if not isinstance(prompt, str):
        raise Flux2Error(f"a prompt must be a string, got {type(prompt).__name__}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:    # lone surrogates: bytes that were not UTF-8 (a shell in another encoding)
        raise Flux2Error(f"the prompt is not valid text: character {e.start} stands for a byte that is not UTF-8 "
                         f"({prompt[max(0, e.start - 20):e.start]!r} comes before it); pass the prompt as UTF-8 text "
                         f"(check the terminal's or file's encoding)") from None
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def count_prompt_tokens(tokenizer: Qwen3Tokenizer, prompt: str) -> int:
    """Tokens of the rendered prompt (chat template included) before truncation to 512: PromptEmbeds.token_counts,
    and the exact count the web extension shows under the prompt."""
    return len(tokenizer.encode(render_prompt(prompt)))


class PromptEncoder:
    """Turns prompts into FLUX.2 text embeddings with a truncated Qwen3 (``qwen3.Qwen3``)."""

    def __init__(self, model: Qwen3, tokenizer, spec: TextEncoderSpec):
        deepest = max(spec.output_layers)
        if len(model.layers) < deepest:
            raise Flux2Error(f"the text encoder has {len(model.layers)} layers, {spec.name} needs {deepest}")
        self.model = model
        self.tokenizer = as_qwen3_tokenizer(tokenizer)
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
        ids, mask, counts = self.tokenizer.padded([render_prompt(p) for p in prompts], self.spec.max_length)
        return torch.tensor(ids), torch.tensor(mask), counts

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> PromptEmbeds:
        ids, mask, counts = self.tokenize(prompts)
        batch, length = ids.shape
        states = self.model(ids.to(self.device), mask.to(self.device), self.spec.output_layers)
        layers = torch.stack(states, dim=2)                                                 # [B, L, 3, D]
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


def build_qwen3_model(state_dict: dict[str, torch.Tensor], params: Qwen3Params, num_layers: int, device, dtype,
                      ggml_types: dict[str, int] | None = None) -> Qwen3:
    """Our ``Qwen3`` with the first ``num_layers`` decoder layers of ``state_dict`` (no final norm).

    Built on the meta device with the layers ``layers.Layers`` makes (float, or GGUF blocks for the layers
    ``ggml_types`` names, by module name); the tensors, moved to ``device`` (floats cast to ``dtype``, blocks as they
    are), then become the parameters themselves (no second copy). Deeper layers and the final norm are not read.
    """
    sd = qwen3_state_dict(state_dict)
    keep = {k: v for k, v in sd.items() if is_used(k, num_layers)}
    with torch.device("meta"):
        model = Qwen3(params, num_layers, Layers(ggml=(ggml_types or {}).get), dtype)
    keep = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in keep.items()}
    misfit = f"the text-encoder weights do not fit Qwen3 ({params.hidden_size} wide, {num_layers} layers)"
    try:
        missing, unexpected = model.load_state_dict(keep, strict=False, assign=True)
    except RuntimeError as e:   # a shape differs from the config
        raise Flux2Error(f"{misfit}: {e}") from e
    if missing or unexpected:
        raise Flux2Error(f"{misfit}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.eval().requires_grad_(False)


def build_qwen3_encoder(state_dict: dict[str, torch.Tensor], config=None, device="cpu", dtype=torch.bfloat16,
                        tokenizer=None, spec: TextEncoderSpec | None = None,
                        ggml_types: dict[str, int] | None = None) -> PromptEncoder:
    """A ``PromptEncoder`` from a Qwen3 state dict (any key layout ``qwen3_state_dict`` accepts).

    ``config``: ``qwen3.Qwen3Params``, a config.json dict (or an object with its names, e.g. a transformers
    Qwen3Config), or None to read it from the shapes. ``tokenizer``: None for the built-in Qwen3 tokenizer.
    ``ggml_types``: the layers given as GGUF blocks (module name -> GGML type). ``spec``: None picks Qwen3-4B / 8B
    by width (other widths get the same layers, 9/18/27).
    """
    if config is None:
        params = Qwen3Params.from_state_dict(qwen3_state_dict(state_dict))
    else:
        params = config if isinstance(config, Qwen3Params) else Qwen3Params.from_config(config)
    if spec is None:
        spec = SPECS_BY_HIDDEN.get(params.hidden_size) or replace(QWEN3_4B, name="custom", hidden_size=params.hidden_size)
    model = build_qwen3_model(state_dict, params, max(spec.output_layers), device, dtype, ggml_types)
    return PromptEncoder(model, tokenizer if tokenizer is not None else load_tokenizer(), spec)
