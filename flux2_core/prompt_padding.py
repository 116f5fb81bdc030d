"""How a text encoder pads a prompt's tokens: one small protocol (``PromptPadding``) with the two rules our encoders
use; a ``TextEncoderSpec`` holds one, and ``models/text_encoder.py`` asks it instead of reading numbers of its own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


class PromptPadding(Protocol):
    """The rows a prompt of ``tokens`` tokens is given (at most the spec's ``max_length``: longer prompts are cut)
    and the RoPE positions of a padded batch."""

    per_prompt: bool     # each prompt padded alone (a batch's rows may differ in length), else all to one length

    def length(self, tokens: int, max_length: int) -> int:
        """The padded length of one prompt of ``tokens`` tokens (its chat template included)."""

    def positions(self, mask: Tensor) -> Tensor:
        """RoPE positions [B, L] from the attention mask [B, L] (1: a token, 0: a pad)."""


@dataclass(frozen=True)
class ToMaxLength:
    """Every prompt padded (or cut) to max_length tokens; pads go on counting positions."""

    per_prompt = False

    def length(self, tokens: int, max_length: int) -> int:
        return max_length

    def positions(self, mask: Tensor) -> Tensor:
        return torch.arange(mask.shape[1]).expand_as(mask)


@dataclass(frozen=True)
class ToMultiple:
    """Each prompt padded alone to the next multiple of ``multiple`` (at most max_length); its pads take the RoPE
    position ``pad_position`` (None: they go on counting)."""

    multiple: int
    pad_position: int | None = None
    per_prompt = True

    def length(self, tokens: int, max_length: int) -> int:
        return min(-(-tokens // self.multiple) * self.multiple, max_length)

    def positions(self, mask: Tensor) -> Tensor:
        index = torch.arange(mask.shape[1]).expand_as(mask)
        if self.pad_position is None:
            return index
        return torch.where(mask.bool(), index, torch.full_like(index, self.pad_position))
