"""How one conditioning reaches the model, the same for the Euler loop and ComfyUI's samplers: the references as
one token pack (``pack_references``), routed one way (``velocity_for``), and the family's ``condition``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from ..families import family_of, family_of_params
from ..variants import Variant
from .references import batched_reference_tokens, reference_tokens

# (x [B, 128, h, w], t [B], t_next [B] or None, in x's dtype) -> v like x; t_next is for flow-map models
Velocity = Callable[[Tensor, Tensor, Tensor | None], Tensor]

# (ref [B, Lref, C], ids [1, Lref, 4], make) -> the references' K/V from the caller's cache, ``make()`` on a miss
KVSource = Callable[[Tensor, Tensor, Callable[[], object]], object]


@dataclass(frozen=True)
class ReferencePack:
    """A run's references: tokens [1 or B, Lref, 128] at ids [1, Lref, 4], or K/V a KV edition made before."""

    tokens: Tensor | None = None
    ids: Tensor | None = None
    kv: object | None = None

    @property
    def count(self) -> int:
        """Reference tokens (0 where there are none, or only their K/V)."""
        return 0 if self.tokens is None else self.tokens.shape[1]

    def __bool__(self) -> bool:
        return self.tokens is not None or self.kv is not None


NO_REFERENCES = ReferencePack()


def pack_references(variant: Variant, latents: list[Tensor], *, batched: bool = False) -> ReferencePack:
    """Reference latents [n or 1, 128, h, w] -> one token pack. ``batched``: ComfyUI's ``ref_latents`` (reference i
    of item b is ``latents[i][b]``)."""
    ids = family_of(variant).reference_ids
    tokens, token_ids = (batched_reference_tokens if batched else reference_tokens)(latents, ids)
    return ReferencePack(tokens, token_ids)


def velocity_for(model: nn.Module, txt: Tensor, h: int, w: int, references: ReferencePack, *,
                 as_kv: bool, guidance: Tensor | None = None, txt_lengths: list[int] | None = None,
                 kv_source: KVSource | None = None) -> Velocity:
    """The model's velocity on the latent grid for one conditioning, the references joined after the image or
    (``as_kv``) attended through K/V made once. The references may wait on the CPU."""
    device, dtype = txt.device, txt.dtype
    ref, ref_ids, kv = references.tokens, references.ids, references.kv
    if ref is not None:
        ref = ref.to(dtype=dtype)
        if as_kv:
            def make():
                return model.reference_kv(ref.to(device), ref_ids.to(device))
            kv = make() if kv_source is None else kv_source(ref, ref_ids, make)
            ref = ref_ids = None
        else:
            ref, ref_ids = ref.to(device), ref_ids.to(device)
    if kv is not None:
        kv = kv.to(device, dtype)
    return family_of_params(model.params).condition(model, txt, h, w, ref=ref, ref_ids=ref_ids, ref_kv=kv,
                                                    guidance=guidance, txt_lengths=txt_lengths)


