"""The Qwen3 prompt embedder, as BFL's ``Qwen3Embedder``: the prompt in its spec's template and padding (FLUX.2:
512 tokens), embeds [B, L, layers*D] = the spec's hidden states concatenated per token, un-normed (FLUX.2: 9, 18,
27). Pad tokens are masked as keys but their rows kept. Layers past the deepest read are never built.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..checks import dtype_cause, finite
from ..devices import kept_dtype
from ..errors import Flux2Error
from ..storage.quant import DROPPED_SUFFIXES
from ..storage.request import LayerRequest
from ..storage.stored_format import LayerFormat
from ..variants import TextEncoderSpec
from .layers import Layers
from .qwen3 import Qwen3, Qwen3Params
from .tokenizer import Qwen3Tokenizer, as_qwen3_tokenizer, load_tokenizer


def encoder_needed(spec: TextEncoderSpec | None) -> str:
    """What a message says the encoder must be."""
    if spec is None:
        return "Load the Qwen3 (or Qwen3-VL) text encoder the transformer's family reads"
    return f"{spec.reader} reads the {spec.wanted}"


@dataclass
class PromptEmbeds:
    embeds: torch.Tensor       # [B, L, width] in the model's dtype (L: max_length, or the longest row's own length)
    token_counts: list[int]    # tokens of each rendered prompt (chat template included), before truncation and padding
    dropped: list[int]         # tokens cut off by truncation to max_length (0 when the prompt fits)
    lengths: list[int] | None = None   # each row's own length where rows differ (the rest of a row is zeros)

    def row(self, i: int) -> torch.Tensor:
        """Prompt i's embeddings [1, its length, width]."""
        return self.embeds[i:i + 1, :self.lengths[i]] if self.lengths is not None else self.embeds[i:i + 1]



@dataclass(frozen=True)
class StoredLayer:
    """A linear layer a quantized file keeps in its own format: the format and the layer's tensors by state name."""
    format: LayerFormat
    tensors: dict[str, torch.Tensor]


@dataclass(frozen=True)
class HeldLayers:
    """The storage the loader gave each linear, by module name (its GGML type, the 16-bit dtype it stays in, its
    stored format), answered as a file's facts (``storage.request.LayerFacts``) so the same kinds make the layers."""
    ggml_types: dict[str, int]
    kept: dict[str, torch.dtype]
    stored: dict[str, StoredLayer]

    def stored_format(self, key: str) -> LayerFormat | None:
        layer = self.stored.get(key.removesuffix(".weight"))
        return None if layer is None else layer.format

    def stores_fp8(self, key: str) -> bool:
        return False

    def ggml_type(self, key: str) -> int | None:
        return self.ggml_types.get(key.removesuffix(".weight"))

    def float_dtype(self, key: str) -> torch.dtype | None:
        return self.kept.get(key.removesuffix(".weight"))


def stack_rows(rows: list[torch.Tensor]) -> tuple[torch.Tensor, list[int] | None]:
    """[1 or n, L_i, width] -> [sum of n, max L_i, width] zero-padded, and each row's length (None: all equal)."""
    longest = max(r.shape[1] for r in rows)
    if all(r.shape[1] == longest for r in rows):
        return torch.cat(rows), None
    padded = [torch.nn.functional.pad(r, (0, 0, 0, longest - r.shape[1])) for r in rows]
    return torch.cat(padded), [r.shape[1] for r in rows for _ in range(r.shape[0])]


def render_prompt(prompt: str, template: str) -> str:
    """The prompt in its encoder's template (``TextEncoderSpec.template``)."""
    if not isinstance(prompt, str):
        raise Flux2Error(f"a prompt must be a string, got {type(prompt).__name__}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:    # lone surrogates: bytes that were not UTF-8 (a shell in another encoding)
        raise Flux2Error(f"the prompt is not valid text: character {e.start} stands for a byte that is not UTF-8 "
                         f"({prompt[max(0, e.start - 20):e.start]!r} comes before it); pass the prompt as UTF-8 text "
                         f"(check the terminal's or file's encoding)") from None
    return template.replace("{prompt}", prompt)


def count_prompt_tokens(tokenizer: Qwen3Tokenizer, prompt: str, template: str) -> int:
    """Before truncation: the exact count the web extension shows under the prompt."""
    return len(tokenizer.encode(render_prompt(prompt, template)))


def check_depth(layers: int, spec: TextEncoderSpec) -> None:
    """An encoder must reach the deepest hidden state its spec reads."""
    deepest = max(spec.output_layers)
    if layers < deepest:
        files = f" ({' or '.join(spec.files)})" if spec.files else ""
        read = ", ".join(map(str, spec.output_layers))
        raise Flux2Error(f"the text encoder has {layers} layers, but {spec.reader} reads its hidden states {read} "
                         f"(layer {deepest} the deepest): load the whole {spec.title}{files}, not a pruned one")


class PromptEncoder:

    def __init__(self, model: Qwen3, tokenizer, spec: TextEncoderSpec):
        check_depth(len(model.layers), spec)
        self.model = model
        self.tokenizer = as_qwen3_tokenizer(tokenizer)
        self.spec = spec

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """A GGUF embedding's weight is blocks; it says what its lookups return."""
        return getattr(self.model.embed_tokens, "dtype", self.model.embed_tokens.weight.dtype)

    def lengths(self, counts: list[int]) -> list[int] | None:
        """Each prompt's padded length where the padding is per prompt, else None (one length for all)."""
        padding = self.spec.padding
        return [padding.length(n, self.spec.max_length) for n in counts] if padding.per_prompt else None

    def text_tokens(self, prompts: list[str]) -> int:
        """``tokenize``'s L for these prompts without encoding them (for memory estimates)."""
        if not self.spec.padding.per_prompt:
            return self.spec.padding.length(0, self.spec.max_length)
        return max(self.lengths([count_prompt_tokens(self.tokenizer, p, self.spec.template) for p in prompts]))

    def tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(ids [B, L], attention mask [B, L], untruncated token counts)."""
        if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
            raise Flux2Error(f"prompts must be a list of strings, got {type(prompts).__name__}")
        if not prompts:
            raise Flux2Error("no prompt to encode: pass at least one (an empty string is a valid prompt)")
        texts = [render_prompt(p, self.spec.template) for p in prompts]
        counts = [len(self.tokenizer.encode(t)) for t in texts] if self.spec.padding.per_prompt else None
        length = max(self.lengths(counts)) if counts else self.spec.padding.length(0, self.spec.max_length)
        ids, mask, counts = self.tokenizer.padded(texts, length)
        return torch.tensor(ids), torch.tensor(mask), counts

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> PromptEmbeds:
        ids, mask, counts = self.tokenize(prompts)
        batch, length = ids.shape
        states = self.model(ids.to(self.device), mask.to(self.device), self.spec.output_layers,
                            self.spec.padding.positions(mask).to(self.device))
        layers = torch.stack(states, dim=2)                                                 # [B, L, layers, D]
        embeds = layers.reshape(batch, length, -1)                                          # [B, L, layers*D]
        lengths = self.lengths(counts)
        if lengths is not None:          # rows past a prompt's own length belong to no prompt
            embeds = embeds * (torch.arange(length, device=embeds.device)[None, :, None]
                               < torch.tensor(lengths, device=embeds.device)[:, None, None])
            lengths = lengths if len(set(lengths)) > 1 else None
        # checked here, before any cache keeps them: NaN embeddings make every image from them black
        finite(embeds, "the prompt embeddings", [*dtype_cause(self.dtype, "the text encoder"),
                                                 ("the text encoder's weights hold NaN/inf (a damaged or wrongly "
                                                  "converted file: download it again)")])
        dropped = [max(0, n - self.spec.max_length) for n in counts]
        return PromptEmbeds(embeds, counts, dropped, lengths)


def is_used(key: str, num_layers: int) -> bool:
    """Not the final norm, no layer from num_layers on."""
    return key != "norm.weight" and not (key.startswith("layers.") and int(key.split(".")[1]) >= num_layers)


def qwen3_state_dict(state_dict: dict[str, torch.Tensor], spec: TextEncoderSpec | None = None
                     ) -> dict[str, torch.Tensor]:
    """``Qwen3Model`` key names, whatever prefix comes before ``embed_tokens``; keys outside it (``lm_head``) dropped.
    Quantization scales must have been folded in first.
    """
    embed = [k for k in state_dict if k.endswith("embed_tokens.weight")]
    if len(embed) != 1:
        raise Flux2Error("this is not a Qwen3 text encoder: expected one '…embed_tokens.weight' tensor, found "
                         f"{len(embed)}. {encoder_needed(spec)}")
    prefix = embed[0][: -len("embed_tokens.weight")]
    sd = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    if "layers.0.self_attn.q_norm.weight" not in sd:
        raise Flux2Error("this text encoder has no q_norm in its attention, so it is not Qwen3 (Qwen2.5, Llama and "
                         f"Mistral have none). {encoder_needed(spec)}")
    quantized = [k for k in sd if k.endswith(DROPPED_SUFFIXES)]   # scales beside weights
    if quantized:
        raise Flux2Error(f"the text-encoder weights are quantized ({quantized[0]}, …): dequantize them to a float "
                         "dtype before building the encoder (flux2_core.weights does this for supported formats)")
    return sd


def build_qwen3_model(state_dict: dict[str, torch.Tensor], params: Qwen3Params, num_layers: int, device, dtype,
                      ggml_types: dict[str, int] | None = None, kept: dict[str, torch.dtype] | None = None,
                      stored: dict[str, StoredLayer] | None = None, spec: TextEncoderSpec | None = None) -> Qwen3:
    """Built on meta; the tensors become the parameters (no second copy). ``kept``: linears kept in that 16-bit dtype.
    ``stored``: linears kept in a quantized file's own format, with their tensors."""
    sd = qwen3_state_dict(state_dict, spec)
    keep = {k: v for k, v in sd.items() if is_used(k, num_layers)}
    kept, stored = kept or {}, stored or {}
    narrower = [f"{name} in {wanted}" for name, wanted in kept.items() if kept_dtype(wanted, dtype) != wanted]
    if narrower:
        raise Flux2Error(f"kept asks {', '.join(narrower[:3])}, but a layer stays in a 16-bit dtype only where the "
                         f"compute dtype ({dtype}) is wider; leave those layers out of kept")
    with torch.device("meta"):
        held = HeldLayers(ggml_types or {}, kept, stored)
        model = Qwen3(params, num_layers, Layers(LayerRequest(held, dtype=dtype, quantizable=lambda name: True)), dtype)
    keep = {k: v.to(device=device, dtype=kept.get(k.removesuffix(".weight"), dtype) if v.is_floating_point()
                    else v.dtype) for k, v in keep.items()}
    keep |= {f"{name}.{k}": t.to(device) for name, layer in stored.items() if is_used(f"{name}.weight", num_layers)
             for k, t in layer.tensors.items()}
    misfit = f"the text-encoder weights do not fit Qwen3 ({params.hidden_size} wide, {num_layers} layers)"
    wanted = model.state_dict()                  # shapes on meta: a tensor of another shape named before torch's dump
    wrong = [k for k, v in keep.items() if k in wanted and tuple(v.shape) != tuple(wanted[k].shape)]
    if wrong:
        shown = "; ".join(f"{k} is {list(keep[k].shape)}, not {list(wanted[k].shape)}" for k in wrong[:3])
        raise Flux2Error(f"{misfit}: {len(wrong)} of its tensors have shapes other than the file's other tensors and "
                         f"config imply ({shown}{'; ...' if len(wrong) > 3 else ''}); the file is inconsistent or "
                         f"damaged: download it again")
    try:
        missing, unexpected = model.load_state_dict(keep, strict=False, assign=True)
    except RuntimeError as e:   # a shape differs from the config
        raise Flux2Error(f"{misfit}: {e}") from e
    if missing or unexpected:
        raise Flux2Error(f"{misfit}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.eval().requires_grad_(False)


def build_qwen3_encoder(state_dict: dict[str, torch.Tensor], config=None, device="cpu", dtype=torch.bfloat16,
                        tokenizer=None, *, spec: TextEncoderSpec,
                        ggml_types: dict[str, int] | None = None, kept: dict[str, torch.dtype] | None = None,
                        stored: dict[str, StoredLayer] | None = None) -> PromptEncoder:
    """``config``: ``Qwen3Params``, a config.json dict, or None to read it from the shapes. ``ggml_types``: module
    name -> GGML type of GGUF layers.
    """
    if config is None:
        params = Qwen3Params.from_state_dict(qwen3_state_dict(state_dict, spec), rope_theta=spec.rope_theta)
    else:
        params = config if isinstance(config, Qwen3Params) else Qwen3Params.from_config(config)
    if spec.hidden_size != params.hidden_size:     # another size of the model the spec reads (tests, or a mistake
        spec = replace(spec, name="custom", hidden_size=params.hidden_size)   # the transformer's check then names)
    check_depth(params.num_layers, spec)          # before building: Qwen3 cannot make layers the file lacks
    model = build_qwen3_model(state_dict, params, max(spec.output_layers), device, dtype, ggml_types, kept, stored,
                              spec)
    return PromptEncoder(model, tokenizer if tokenizer is not None else load_tokenizer(), spec)
