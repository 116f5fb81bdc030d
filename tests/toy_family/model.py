"""The toy's model: it works on the latent grid directly (no tokens, no RoPE): per cell,
    v = out(silu(inp(x) + text(mean of the prompt's own rows) + t + mean of the references' values))
with four bias-free linears made by ``Layers`` (so every storage kind can hold them). Its references are K/V-style,
as a KV edition's: ``reference_kv`` runs them once through ``toy_ref`` into one block's (k, v) ([B, 1, Lref, hidden]
each, k = v), and every step reads those values; references joined as tokens are refused."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flux2_core.errors import Flux2Error
from flux2_core.families import MemoryInputs
from flux2_core.models.layers import Layers
from flux2_core.models.reference_kv import ReferenceKV


@dataclass(frozen=True)
class ToyParams:
    context_in_dim: int = 96         # the prompt embeddings' width (the demo's Qwen3: 3 layers x 32)
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
        self.toy_ref = layers.linear("toy_ref", params.channels, params.hidden)

    def blocks(self) -> list[nn.Module]:
        return []

    @property
    def device(self) -> torch.device:
        return self.toy_in.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.toy_in.weight.dtype

    def reference_kv(self, ref: Tensor, ref_ids: Tensor) -> ReferenceKV:
        """ref [B, Lref, C] -> one block's (k, v), each [B, 1, Lref, hidden]."""
        values = self.toy_ref(ref)[:, None]
        return ReferenceKV([(values, values)], ref.shape[1])

    def forward(self, x: Tensor, t: Tensor, txt: Tensor, txt_lengths: list[int] | None = None,
                kv: ReferenceKV | None = None) -> Tensor:
        """x [n, C, h, w], t [n], txt [n, L, D] (sample i's first ``txt_lengths[i]`` rows its own), kv: the references'
        (batch 1 or n) -> v [n, C, h, w]"""
        if txt_lengths is None:
            text = txt.mean(1)
        else:
            own = torch.arange(txt.shape[1], device=txt.device)[None, :] < torch.tensor(txt_lengths, device=txt.device)[:, None]
            text = (txt * own[..., None]).sum(1) / own.sum(1, keepdim=True)
        cells = x.permute(0, 2, 3, 1)                                         # [n, h, w, C]
        hidden = self.toy_in(cells) + self.toy_text(text)[:, None, None] + t[:, None, None, None]
        if kv is not None:
            hidden = hidden + kv.blocks[0][1].mean(2)[:, 0, None, None]          # [1 or n, 1, 1, hidden]
        return self.toy_out(F.silu(hidden)).permute(0, 3, 1, 2)


def condition(model: ToyModel, txt: Tensor, h: int, w: int, *, ref=None, ref_ids=None, ref_kv=None, guidance=None,
              txt_lengths=None):
    if ref is not None:
        raise Flux2Error("the toy model takes references only as K/V (its variant is a KV edition)")
    return lambda x, t, t_next: model(x, t, txt, txt_lengths, ref_kv)


def read_params(file) -> ToyParams:
    hidden, channels = file.shape("toy_in.weight")
    return ToyParams(context_in_dim=file.shape("toy_text.weight")[1], channels=channels, hidden=hidden)


def memory(params: ToyParams) -> MemoryInputs:
    return MemoryInputs(peak_values=3 * params.hidden, table_bytes=0, hidden=params.hidden, kv_layers=1)
