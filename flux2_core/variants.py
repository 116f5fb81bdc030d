"""Model variants: architecture parameters plus sampling defaults, in one registry.

Real checkpoints use the entries of ``VARIANTS``; tests build tiny ``TransformerParams`` /
``AutoEncoderParams`` with any hidden size, depth or RoPE axes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from .errors import Flux2Error


class AttentionShape:
    """What a transformer's parameters derive from hidden_size, num_heads, mlp_ratio and axes_dim (every family's
    parameter dataclass has them), checked when they are made."""
    hidden_size: int
    num_heads: int
    mlp_ratio: float
    axes_dim: tuple[int, ...]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if sum(self.axes_dim) != self.head_dim:
            raise ValueError(f"RoPE axes {self.axes_dim} must sum to head_dim {self.head_dim}")


@dataclass(frozen=True)
class TransformerParams(AttentionShape):
    in_channels: int = 128             # patchified latent channels (32 AE channels x 2 x 2)
    context_in_dim: int = 7680         # 3 x text-encoder hidden size (layers 9, 18, 27 concatenated)
    hidden_size: int = 3072
    num_heads: int = 24
    depth: int = 5                     # double-stream blocks
    depth_single_blocks: int = 20
    mlp_ratio: float = 3.0
    axes_dim: tuple[int, ...] = (32, 32, 32, 32)   # RoPE dims per id axis (t, h, w, l); sums to head_dim
    theta: int = 2000
    use_guidance_embed: bool = False   # FLUX.2-dev only


@dataclass(frozen=True)
class Flux3Params(AttentionShape):
    """FLUX 3 Image Klein's transformer: per-mode early blocks (image, references, text), then single blocks over each
    sample's joint sequence [image, references, text] with per-mode modulation; every block one parallel attention + MLP
    under one modulation and one gate."""
    in_channels: int = 128             # patchified latent channels (the FLUX.2 autoencoder's)
    context_in_dim: int = 20480        # 8 x Qwen3-VL-4B's 2560 (layers 4, 8, ..., 32 stacked per token)
    hidden_size: int = 3072
    num_heads: int = 24
    depth: int = 5                     # early blocks per mode
    depth_single_blocks: int = 28
    mlp_ratio: float = 3.0
    axes_dim: tuple[int, ...] = (32, 32, 32, 32)   # RoPE dims per id axis (t, h, w, l); sums to head_dim
    theta: int = 10000
    flow_map: bool = False             # the distilled model: it is also told the time each step goes to
    use_guidance_embed: bool = False   # (no FLUX 3 model has one; read by the code around every family)


@dataclass(frozen=True)
class AutoEncoderParams:
    in_channels: int = 3
    ch: int = 128
    out_ch: int = 3
    ch_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    z_channels: int = 32
    num_groups: int = 32               # GroupNorm groups (eps 1e-6)
    bn_eps: float = 1e-4               # latent BatchNorm
    # the decoder's block channels where they are not the encoder's: BFL's small decoder has (96, 192, 384, 384)
    decoder_channels: tuple[int, ...] | None = None

    @property
    def encoder_chans(self) -> tuple[int, ...]:
        """The encoder's block channels, shallowest first: (128, 256, 512, 512) for FLUX.2's AE."""
        return tuple(self.ch * m for m in self.ch_mult)

    @property
    def decoder_chans(self) -> tuple[int, ...]:
        """The decoder's block channels, shallowest first (the encoder's unless ``decoder_channels`` says)."""
        return self.decoder_channels or self.encoder_chans

    @property
    def downscale(self) -> int:
        """Pixels per latent cell before the 2x2 patchify (8 for the real AE)."""
        return 2 ** (len(self.ch_mult) - 1)


# Qwen3's chat template for one user turn with the generation prompt, thinking off (what transformers'
# apply_chat_template(..., add_generation_prompt=True, enable_thinking=False) renders)
QWEN3_TEMPLATE = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


# Qwen3-VL's chat template for one user turn with the generation prompt (it has no thinking block)
QWEN3_VL_TEMPLATE = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True)
class TextEncoderSpec:
    name: str               # "qwen3-4b", "qwen3-8b", "mistral-small-3.2"
    hidden_size: int        # one layer's width
    output_layers: tuple[int, ...] = (9, 18, 27)   # the hidden states read, concatenated along the width
    max_length: int = 512
    files: tuple[str, ...] = ()   # usual file names (ComfyUI text_encoders/), for finding weights
    gguf_stem: str = ""           # GGUF files are named <stem>-<quant>.gguf (llama.cpp / unsloth: Qwen3-4B-Q4_K_M.gguf)
    template: str = QWEN3_TEMPLATE   # the text the prompt is put in ("{prompt}" marks where) before tokenizing
    pad_multiple: int = 0    # 0: every prompt padded (or cut) to max_length tokens; else each prompt alone padded to
                             # a multiple of this (at most max_length): prompts of one batch may differ in length
    pad_position: int | None = None   # the RoPE position pad tokens take (None: they go on counting)
    rope_theta: float = 1_000_000.0   # the encoder's RoPE base where its file has no config.json to say it
    model: str = "qwen3"     # the language model it reads: "qwen3" or "qwen3-vl" (its text tower); files that say
                             # which they are are refused for the other
    title: str = "Qwen3"     # the model as messages name it: "Qwen3-4B", "Qwen3-VL-4B-Instruct"
    reader: str = "FLUX.2 Klein"   # who reads it, as messages name it: "FLUX.2 Klein 4B", "FLUX 3 Image Klein"
    # a file that does not say which language model it is (no config, no tower names, a name that says neither) is
    # read as this one: Qwen3-4B and Qwen3-VL-4B's text tower have the same shapes, so only the family asking can
    # decide. FLUX.2's Qwen3 files have always been read so; a Qwen3-VL file says what it is (its tower's names, its
    # config, its GGUF architecture, ComfyUI's name), so FLUX 3 refuses one that does not
    unmarked: bool = True
    loadable: bool = True    # False: no loader here reads it (FLUX.2 [dev]'s Mistral), so its variants cannot run

    @property
    def width(self) -> int:
        """The width of the embeddings it gives: one layer's hidden size for each layer read (the model's
        context_in_dim)."""
        return len(self.output_layers) * self.hidden_size

    @property
    def wanted(self) -> str:
        """The encoder as a message asks for it: its model and its usual file names."""
        return f"{self.title} text encoder" + (f" ({' or '.join(self.files)})" if self.files else "")

    def reads(self, model: str | None) -> bool:
        """Whether a file saying it is ``model`` ("qwen3", "qwen3-vl"; None: it says nothing) is read with this spec."""
        return model == self.model if model is not None else self.unmarked


QWEN3_4B = TextEncoderSpec("qwen3-4b", 2560, files=("qwen_3_4b.safetensors",), gguf_stem="Qwen3-4B",
                           title="Qwen3-4B", reader="FLUX.2 Klein 4B")
QWEN3_8B = TextEncoderSpec("qwen3-8b", 4096, files=("qwen_3_8b.safetensors", "qwen_3_8b_fp8mixed.safetensors"),
                           gguf_stem="Qwen3-8B", title="Qwen3-8B", reader="FLUX.2 Klein 9B")
MISTRAL_SMALL = TextEncoderSpec("mistral-small-3.2", 5120, output_layers=(10, 20, 30), model="mistral",
                                title="Mistral-Small-3.2", reader="FLUX.2 [dev]", loadable=False)
QWEN3_VL_4B = TextEncoderSpec("qwen3-vl-4b", 2560, output_layers=(4, 8, 12, 16, 20, 24, 28, 32), max_length=4096,
                              files=("qwen3vl_4b.safetensors", "qwen3vl_4b_int8_convrot.safetensors"), gguf_stem="Qwen3-VL-4B-Instruct",
                              template=QWEN3_VL_TEMPLATE, pad_multiple=80, pad_position=1, rope_theta=5_000_000.0,
                              model="qwen3-vl", title="Qwen3-VL-4B-Instruct", reader="FLUX 3 Image Klein",
                              unmarked=False)


@dataclass(frozen=True)
class Variant:
    name: str
    params: TransformerParams
    text_encoder: TextEncoderSpec
    default_steps: int
    default_cfg: float
    guidance_distilled: bool           # True: one forward per step, no CFG (cfg is ignored)
    use_kv_cache: bool = False         # 9B-KV: references at t=0, self-attending, K/V cached
    files: tuple[str, ...] = field(default=())   # usual file names, for finding weights (the first one's stem,
                                                 # plus -<quant>.gguf, names its GGUF files: flux-2-klein-4b-Q4_K_M.gguf)
    title: str = ""                    # what messages call it ("FLUX.2 Klein 9B KV"); custom variants have none
    family: str = "flux2"              # its model family (``families.FAMILIES``)

    @property
    def gguf_stem(self) -> str:
        return self.files[0].removesuffix(".safetensors") if self.files else ""

    @property
    def uses_cfg(self) -> bool:
        return not self.guidance_distilled

    @property
    def edition(self) -> str:
        """"base" (CFG), "kv" (9B-KV references) or "distilled": the releases of one architecture."""
        return "base" if self.uses_cfg else "kv" if self.use_kv_cache else "distilled"


KLEIN_4B = TransformerParams(context_in_dim=7680, hidden_size=3072, num_heads=24, depth=5, depth_single_blocks=20)
KLEIN_9B = TransformerParams(context_in_dim=12288, hidden_size=4096, num_heads=32, depth=8, depth_single_blocks=24)
FLUX3_KLEIN = Flux3Params(flow_map=True)
FLUX3_KLEIN_BASE = Flux3Params()
DEV = TransformerParams(context_in_dim=15360, hidden_size=6144, num_heads=48, depth=8, depth_single_blocks=48,
                        use_guidance_embed=True)

VARIANTS: dict[str, Variant] = {v.name: v for v in [
    Variant("klein-4b", KLEIN_4B, QWEN3_4B, 4, 1.0, True, title="FLUX.2 Klein 4B",
            files=("flux-2-klein-4b.safetensors", "flux-2-klein-4b-fp8.safetensors")),
    Variant("klein-9b", KLEIN_9B, QWEN3_8B, 4, 1.0, True, title="FLUX.2 Klein 9B",
            files=("flux-2-klein-9b.safetensors", "flux-2-klein-9b-fp8.safetensors")),
    Variant("klein-9b-kv", KLEIN_9B, QWEN3_8B, 4, 1.0, True, use_kv_cache=True, title="FLUX.2 Klein 9B KV",
            files=("flux-2-klein-9b-kv.safetensors", "flux-2-klein-9b-kv-fp8.safetensors")),
    Variant("klein-base-4b", KLEIN_4B, QWEN3_4B, 50, 4.0, False, title="FLUX.2 Klein Base 4B",
            files=("flux-2-klein-base-4b.safetensors", "flux-2-klein-base-4b-fp8.safetensors")),
    Variant("klein-base-9b", KLEIN_9B, QWEN3_8B, 50, 4.0, False, title="FLUX.2 Klein Base 9B",
            files=("flux-2-klein-base-9b.safetensors", "flux-2-klein-base-9b-fp8.safetensors")),
    Variant("dev", DEV, MISTRAL_SMALL, 50, 4.0, True, title="FLUX.2 [dev]", files=("flux2-dev.safetensors",)),
    # FLUX 3 Image Klein: the distilled "flow map" (16 steps, no CFG) and the base (50 steps, CFG 3.5 as the
    # reference pipeline's default)
    Variant("flux3-klein", FLUX3_KLEIN, QWEN3_VL_4B, 16, 1.0, True, title="FLUX 3 Image Klein",
            files=("flux3-image-klein.safetensors", "flux3-image-klein-int8-convrot.safetensors",
                   "flux3-image-klein-bf16.safetensors"), family="flux3"),
    Variant("flux3-klein-base", FLUX3_KLEIN_BASE, QWEN3_VL_4B, 50, 3.5, False, title="FLUX 3 Image Klein Base",
            files=("flux3-image-klein-base.safetensors", "flux3-image-klein-base-int8-convrot.safetensors",
                   "flux3-image-klein-base-bf16.safetensors"), family="flux3"),
]}

FLUX2_AE = AutoEncoderParams()


def get_variant(name: str) -> Variant:
    try:
        return VARIANTS[name]
    except KeyError:
        raise Flux2Error(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}") from None


def runnable_variants() -> list[Variant]:
    """The variants this engine runs from files (those whose text encoder it reads), in the registry's order: the
    order a models folder's search tries them in."""
    return [v for v in VARIANTS.values() if v.text_encoder.loadable]


def runnable_variant(name: str) -> Variant:
    """The variant called ``name``, refused (listing the variants run) where there is none or it cannot run here."""
    known = ", ".join(v.name for v in runnable_variants())
    variant = VARIANTS.get(name) if isinstance(name, str) else None
    if variant is None:
        raise Flux2Error(f"unknown variant {name!r}; the variants run here: {known}")
    if not variant.text_encoder.loadable:
        raise Flux2Error(f"{variant.title} ({name}) does not run here: its text encoder, {variant.text_encoder.title}, "
                         f"is not one this engine reads; the variants run here: {known}")
    return variant


def _same_architecture(a: TransformerParams, b: TransformerParams) -> bool:
    """Equal in every field but the RoPE axes (a file does not record them; tests use other splits)."""
    return all(getattr(a, f.name) == getattr(b, f.name) for f in fields(a) if f.name != "axes_dim")


def variant_for_params(params: TransformerParams, hint: str = "") -> Variant:
    """The registry entry whose architecture matches ``params``.

    Base, distilled and KV checkpoints share one architecture, so ``hint`` (usually the file name) decides
    between them: "base" picks the base model, "kv" the KV model. Small (test) architectures get a variant
    named "custom" with the defaults of the hinted edition.
    """
    hint = hint.lower()
    edition = "base" if "base" in hint else "kv" if "kv" in hint else "distilled"
    for v in VARIANTS.values():
        if type(v.params) is not type(params) or not _same_architecture(v.params, params):
            continue
        if v.name == "dev" or v.edition == edition:
            return v
    template = VARIANTS[{"base": "klein-base-4b", "kv": "klein-9b-kv", "distilled": "klein-4b"}[edition]]
    layers = template.text_encoder.output_layers
    encoder = TextEncoderSpec("custom", params.context_in_dim // len(layers), layers)
    return replace(template, name="custom", params=params, text_encoder=encoder, files=(), title="")
