"""The types every family's variants are made of (``Variant``, ``TextEncoderSpec``, ``AttentionShape``) and the
autoencoder they share. Each family's values are under ``families/``; the registry is ``families.VARIANTS``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .prompt_padding import PromptPadding


class AttentionShape:
    """What every family's parameters derive from hidden_size, num_heads, mlp_ratio and axes_dim, checked on init."""
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


@dataclass(frozen=True)
class TextEncoderSpec:
    """A prompt encoder as a family reads it; every family states each of the fields without a default."""
    name: str               # "qwen3-4b", "qwen3-8b", "mistral-small-3.2"
    hidden_size: int        # one layer's width
    output_layers: tuple[int, ...]   # the hidden states read, concatenated along the width
    max_length: int         # the most tokens a prompt keeps (longer ones are cut)
    template: str           # the text the prompt is put in ("{prompt}" marks where) before tokenizing
    padding: PromptPadding  # the rows each prompt is padded to, and its pads' RoPE positions
    model: str              # "qwen3" or "qwen3-vl" (its text tower); a file saying it is the other is refused
    title: str              # the model as messages name it: "Qwen3-4B", "Qwen3-VL-4B-Instruct"
    reader: str             # who reads it, as messages name it: "FLUX.2 Klein 4B", "FLUX 3 Image Klein"
    files: tuple[str, ...]  # usual file names (ComfyUI text_encoders/), for finding weights
    gguf_stem: str          # GGUF files are named <stem>-<quant>.gguf
    rope_theta: float       # the encoder's RoPE base where its file has no config.json to say it
    # whether a file that does not say which model it is reads as this one: Qwen3-4B and Qwen3-VL-4B's text tower
    # have the same shapes, so only the family asking can decide
    unmarked: bool
    loadable: bool          # False: no loader here reads it (FLUX.2 [dev]'s Mistral), so its variants cannot run

    @property
    def width(self) -> int:
        """The embeddings' width (the model's context_in_dim)."""
        return len(self.output_layers) * self.hidden_size

    @property
    def wanted(self) -> str:
        """The encoder as a message asks for it: its model and its usual file names."""
        return f"{self.title} text encoder" + (f" ({' or '.join(self.files)})" if self.files else "")

    def reads(self, model: str | None) -> bool:
        """Whether a file saying it is ``model`` ("qwen3", "qwen3-vl"; None: it says nothing) is read with this spec."""
        return model == self.model if model is not None else self.unmarked


@dataclass(frozen=True)
class Variant:
    name: str
    params: object                     # its architecture, an instance of its family's ``params_type``
    text_encoder: TextEncoderSpec
    default_steps: int
    default_cfg: float
    guidance_distilled: bool           # True: one forward per step, no CFG (cfg is ignored)
    use_kv_cache: bool = False         # 9B-KV: references at t=0, self-attending, K/V cached
    files: tuple[str, ...] = field(default=())   # usual file names; the first one's stem names its GGUF files
    title: str = ""                    # what messages call it ("FLUX.2 Klein 9B KV"); custom variants have none
    family: str = field(kw_only=True)  # its model family (``families.FAMILIES``): every variant names its own

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


FLUX2_AE = AutoEncoderParams()   # the FLUX.2 autoencoder: every family so far works in its latent space
