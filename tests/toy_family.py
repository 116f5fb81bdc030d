"""A toy second model family: a registry entry and its model, nothing else, to show that the code around a model
(generate, the Euler loop and CFG, the plan, the memory estimate, quantized storage) holds no FLUX.2 assumption.

The toy works on the latent grid directly (no tokens, no RoPE): per cell,
    v = out(silu(inp(x) + text(mean of the prompt tokens) + t))
with three bias-free linears made by ``Layers`` (so every storage kind can hold them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flux2_core.errors import Flux2Error
from flux2_core.families import AdapterNaming, Family, MemoryInputs
from flux2_core.key_tables import Layout, same_names
from flux2_core.models.layers import Layers
from flux2_core.variants import TextEncoderSpec, Variant


@dataclass(frozen=True)
class ToyParams:
    context_in_dim: int = 96         # the prompt embeddings' width (the demo's Qwen3: 3 layers x 32)
    use_guidance_embed: bool = False
    num_heads: int = 1               # no attention: nothing to spread over ranks
    channels: int = 128
    hidden: int = 16

    @property
    def hidden_size(self) -> int:
        return self.hidden


class ToyModel(nn.Module):
    def __init__(self, params: ToyParams, layers: Layers | None = None):
        super().__init__()
        layers = layers or Layers()
        self.params = params
        self.toy_in = layers.linear("toy_in", params.channels, params.hidden)
        self.toy_text = layers.linear("toy_text", params.context_in_dim, params.hidden)
        self.toy_out = layers.linear("toy_out", params.hidden, params.channels)

    def blocks(self) -> list[nn.Module]:
        return []

    @property
    def device(self) -> torch.device:
        return self.toy_in.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.toy_in.weight.dtype

    def forward(self, x: Tensor, t: Tensor, txt: Tensor) -> Tensor:
        """x [n, C, h, w], t [n], txt [n, L, D] -> v [n, C, h, w]"""
        cells = x.permute(0, 2, 3, 1)                                         # [n, h, w, C]
        hidden = self.toy_in(cells) + self.toy_text(txt.mean(1))[:, None, None] + t[:, None, None, None]
        return self.toy_out(F.silu(hidden)).permute(0, 3, 1, 2)


def condition(model: ToyModel, txt: Tensor, h: int, w: int, *, ref=None, ref_ids=None, ref_kv=None, guidance=None,
              txt_lengths=None):
    if ref is not None or ref_kv is not None:
        raise Flux2Error("the toy model takes no references")
    return lambda x, t, t_next: model(x, t, txt)


def read_params(file) -> ToyParams:
    hidden, channels = file.shape("toy_in.weight")
    return ToyParams(context_in_dim=file.shape("toy_text.weight")[1], channels=channels, hidden=hidden)


def variant_for(params: ToyParams, hint: str) -> Variant:
    return Variant("toy", params, TextEncoderSpec("demo", params.context_in_dim // 3), default_steps=3,
                   default_cfg=1.0, guidance_distilled=False, title="Toy", family="toy")


TOY = Family(name="toy", params_type=ToyParams, title="Toy",
             layouts=(Layout("toy", "toy_in.weight", same_names),), lookalikes=(), gguf_archs=(),
             files_hint="toy.safetensors", read_params=read_params,
             build=ToyModel, quantizable=lambda name: name == "toy_out", variant_for=variant_for,
             condition=condition,
             memory=lambda p: MemoryInputs(peak_values=3 * p.hidden, table_bytes=0, hidden=p.hidden, kv_layers=0),
             schedule="flux2",
             adapters=AdapterNaming(groups=(("toy layers", "toy_"),), models={16: "the toy"}, lookalikes=(), other_depths=(),
                                    shape_hint=lambda module, found, hidden: ""))
