"""FLUX.2's releases: Klein 4B / 9B (distilled, base, 9B-KV) and dev, their transformers' parameters, their text
encoders (Qwen3-4B / 8B, Mistral Small for dev) in Qwen3's chat template, and which release a file is."""

from __future__ import annotations

from dataclasses import fields, replace

from ...prompt_padding import ToMaxLength
from ...variants import TextEncoderSpec, Variant
from .. import registry
from .transformer import TransformerParams

# Qwen3's chat template for one user turn with the generation prompt, thinking off (what transformers'
# apply_chat_template(..., add_generation_prompt=True, enable_thinking=False) renders)
QWEN3_TEMPLATE = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"

# every prompt 512 tokens (right padded or cut), hidden states 9, 18, 27 concatenated
PADDING = ToMaxLength()
QWEN3_LAYERS = (9, 18, 27)


def qwen3_spec(name: str, hidden_size: int, title: str, reader: str, files: tuple[str, ...],
               gguf_stem: str) -> TextEncoderSpec:
    """A Qwen3 encoder as FLUX.2 reads it: RoPE base 1e6 where a file has no config, and a file that says nothing of
    which model it is read as Qwen3 (FLUX.2's Qwen3 files have always been read so)."""
    return TextEncoderSpec(name, hidden_size, QWEN3_LAYERS, 512, QWEN3_TEMPLATE, PADDING, "qwen3", title, reader,
                           files, gguf_stem, rope_theta=1_000_000.0, unmarked=True, loadable=True)


QWEN3_4B = qwen3_spec("qwen3-4b", 2560, "Qwen3-4B", "FLUX.2 Klein 4B", files=("qwen_3_4b.safetensors",),
                      gguf_stem="Qwen3-4B")
QWEN3_8B = qwen3_spec("qwen3-8b", 4096, "Qwen3-8B", "FLUX.2 Klein 9B",
                      files=("qwen_3_8b.safetensors", "qwen_3_8b_fp8mixed.safetensors"), gguf_stem="Qwen3-8B")
MISTRAL_SMALL = TextEncoderSpec("mistral-small-3.2", 5120, (10, 20, 30), 512, QWEN3_TEMPLATE, PADDING, "mistral",
                                "Mistral-Small-3.2", "FLUX.2 [dev]", files=(), gguf_stem="", rope_theta=1_000_000.0,
                                unmarked=True, loadable=False)

KLEIN_4B = TransformerParams(context_in_dim=7680, hidden_size=3072, num_heads=24, depth=5, depth_single_blocks=20)
KLEIN_9B = TransformerParams(context_in_dim=12288, hidden_size=4096, num_heads=32, depth=8, depth_single_blocks=24)
DEV = TransformerParams(context_in_dim=15360, hidden_size=6144, num_heads=48, depth=8, depth_single_blocks=48,
                        use_guidance_embed=True)

VARIANTS = (
    Variant("klein-4b", KLEIN_4B, QWEN3_4B, 4, 1.0, True, title="FLUX.2 Klein 4B", family="flux2",
            files=("flux-2-klein-4b.safetensors", "flux-2-klein-4b-fp8.safetensors")),
    Variant("klein-9b", KLEIN_9B, QWEN3_8B, 4, 1.0, True, title="FLUX.2 Klein 9B", family="flux2",
            files=("flux-2-klein-9b.safetensors", "flux-2-klein-9b-fp8.safetensors")),
    Variant("klein-9b-kv", KLEIN_9B, QWEN3_8B, 4, 1.0, True, use_kv_cache=True, title="FLUX.2 Klein 9B KV",
            family="flux2", files=("flux-2-klein-9b-kv.safetensors", "flux-2-klein-9b-kv-fp8.safetensors")),
    Variant("klein-base-4b", KLEIN_4B, QWEN3_4B, 50, 4.0, False, title="FLUX.2 Klein Base 4B", family="flux2",
            files=("flux-2-klein-base-4b.safetensors", "flux-2-klein-base-4b-fp8.safetensors")),
    Variant("klein-base-9b", KLEIN_9B, QWEN3_8B, 50, 4.0, False, title="FLUX.2 Klein Base 9B", family="flux2",
            files=("flux-2-klein-base-9b.safetensors", "flux-2-klein-base-9b-fp8.safetensors")),
    Variant("dev", DEV, MISTRAL_SMALL, 50, 4.0, True, title="FLUX.2 [dev]", family="flux2",
            files=("flux2-dev.safetensors",)),
)
# the release a small (test) architecture's custom variant takes its defaults from, by edition
EDITION_DEFAULTS = {"base": "klein-base-4b", "kv": "klein-9b-kv", "distilled": "klein-4b"}


def _same_architecture(a: TransformerParams, b: TransformerParams) -> bool:
    """Equal in every field but the RoPE axes (a file does not record them; tests use other splits)."""
    return all(getattr(a, f.name) == getattr(b, f.name) for f in fields(a) if f.name != "axes_dim")


def variant_for_params(params: TransformerParams, hint: str = "") -> Variant:
    """The registered release whose architecture matches ``params`` (the registry's entries, which tests may give
    other sizes).

    Base, distilled and KV checkpoints share one architecture, so ``hint`` (usually the file name) decides
    between them: "base" picks the base model, "kv" the KV model. Small (test) architectures get a variant
    named "custom" with the defaults of the hinted edition.
    """
    hint = hint.lower()
    edition = "base" if "base" in hint else "kv" if "kv" in hint else "distilled"
    for v in registry.VARIANTS.values():
        if type(v.params) is not type(params) or not _same_architecture(v.params, params):
            continue
        if v.params.use_guidance_embed or v.edition == edition:      # dev has one edition
            return v
    template = registry.VARIANTS[EDITION_DEFAULTS[edition]]
    encoder = qwen3_spec("custom", params.context_in_dim // len(QWEN3_LAYERS), "Qwen3", "FLUX.2 Klein", (), "")
    return replace(template, name="custom", params=params, text_encoder=encoder, files=(), title="")
