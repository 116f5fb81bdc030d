"""The token split of a sequence-parallel pass and the trades around attention: what a model's maths sees of the ranks
its passes are spread over (the ranks themselves, their store and their calls are ``runtime/parallel.py``'s).

Everything but attention works token by token, so each rank runs it on its share of the tokens. Around attention
two all-to-alls swap the split: q, k, v [B, H, l_r, D] -> [B, H/P, L, D] -> out back to [B, H, l_r, D] (RoPE is
already applied and there is no mask, so key order is free). Image velocities are gathered after the final layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


def shares(n: int, world: int) -> tuple[int, ...]:
    """7 over 3 -> (3, 2, 2)."""
    base, extra = divmod(n, world)
    return tuple(base + (r < extra) for r in range(world))


@dataclass(frozen=True)
class TokenShards:

    group: object
    rank: int
    txt: tuple[int, ...]     # text tokens held by each rank
    rest: tuple[int, ...]    # image (then joint reference) tokens held by each rank

    @property
    def world(self) -> int:
        return len(self.txt)

    @property
    def lengths(self) -> list[int]:
        return [t + s for t, s in zip(self.txt, self.rest)]

    def local_txt(self, x: Tensor) -> Tensor:
        """x [B, Ltxt, ...]."""
        return x.narrow(1, sum(self.txt[:self.rank]), self.txt[self.rank])

    def local_rest(self, x: Tensor) -> Tensor:
        """x [B, Lrest, ...]."""
        return x.narrow(1, sum(self.rest[:self.rank]), self.rest[self.rank])

    def image_shares(self, n_img: int) -> list[int]:
        """The image tokens are the first ``n_img`` of the rest."""
        starts = [sum(self.rest[:r]) for r in range(self.world)]
        return [max(0, min(n, n_img - start)) for n, start in zip(self.rest, starts)]

    def heads_from_tokens(self, x: Tensor) -> Tensor:
        """[B, H, l_r, D] (all heads of this rank's tokens) -> [B, H/P, L, D] (this rank's heads of all tokens)."""
        batch, heads, local, dim = x.shape
        mine = heads // self.world
        send = x.reshape(batch, self.world, mine, local, dim).transpose(0, 1).contiguous()   # [P, B, H/P, l_r, D]
        sizes = [batch * mine * n * dim for n in self.lengths]
        got = x.new_empty(sum(sizes))
        dist.all_to_all_single(got, send.view(-1), output_split_sizes=sizes,
                               input_split_sizes=[send[0].numel()] * self.world, group=self.group)
        return torch.cat([part.view(batch, mine, n, dim) for part, n in zip(got.split(sizes), self.lengths)], dim=2)

    def tokens_from_heads(self, x: Tensor) -> Tensor:
        """[B, H/P, L, D] -> [B, H, l_r, D]."""
        batch, mine, _, dim = x.shape
        local = self.lengths[self.rank]
        send = torch.cat([part.reshape(-1) for part in x.split(self.lengths, dim=2)])
        got = x.new_empty(self.world * batch * mine * local * dim)
        dist.all_to_all_single(got, send, output_split_sizes=[batch * mine * local * dim] * self.world,
                               input_split_sizes=[batch * mine * n * dim for n in self.lengths], group=self.group)
        return got.view(self.world, batch, mine, local, dim).transpose(0, 1).reshape(batch, self.world * mine, local, dim)

    def gather(self, x: Tensor, sizes: list[int]) -> Tensor:
        """Every rank's x [B, sizes[r], C] -> [B, sum(sizes), C] in rank order, on every rank."""
        batch, _, channels = x.shape
        most = max(sizes)
        padded = x.new_zeros(batch, most, channels)
        padded[:, :x.shape[1]] = x
        got = x.new_empty(self.world * batch, most, channels)
        # torch 2.13 renamed all_gather_into_tensor; older builds (as on many GPU machines) have only that name
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(got, padded, group=self.group)
        return torch.cat([part[:, :n] for part, n in zip(got.view(self.world, batch, most, channels), sizes)], dim=1)
