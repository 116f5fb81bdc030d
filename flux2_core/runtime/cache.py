"""LRU caches of prompt embeddings and 9B-KV reference K/V, bounded by entries and bytes. Keys hold a
``fingerprint`` of the model, not its ``id``: a reloaded copy of the same weights hits, patched weights miss.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from ..digests import image_digest, tensor_digest
from ..errors import Flux2Error
from ..models.run_state import run_state

SAMPLES_PER_TENSOR = 16   # values read from each end of every tensor for a fingerprint


def fingerprint(module: nn.Module) -> str:
    """A hash of the tensors' names, shapes, dtypes, device and end values (one device-to-host copy), and of the
    applied adapters, which leave the tensors as they are."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(run_state(module).adapter_key).encode())            # adapters applied (patching.set_adapters)
    samples = []
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.device};".encode())
        flat = t.detach().reshape(-1)
        if flat.numel():
            ends = torch.cat([flat[:SAMPLES_PER_TENSOR], flat[-SAMPLES_PER_TENSOR:]])
            samples.append(ends.float())
    if samples:
        h.update(torch.cat(samples).cpu().numpy().tobytes())
    return h.hexdigest()


class LRUCache:
    """``size(value)``: an entry's bytes. An entry larger than ``max_bytes`` on its own is not stored."""

    def __init__(self, max_items: int, max_bytes: int | None, size: Callable[[Any], int]):
        if max_items < 1:
            raise Flux2Error(f"a cache needs room for at least one entry, got max_items={max_items}")
        self.max_items, self.max_bytes, self.size = max_items, max_bytes, size
        self.entries: OrderedDict[Hashable, Any] = OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.entries

    def get(self, key: Hashable) -> Any | None:
        if key not in self.entries:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(key)
        return self.entries[key]

    def put(self, key: Hashable, value: Any) -> None:
        if key in self.entries:
            self.nbytes -= self.size(self.entries.pop(key))
        nbytes = self.size(value)
        if self.max_bytes is not None and nbytes > self.max_bytes:
            return
        self.entries[key] = value
        self.nbytes += nbytes
        while len(self.entries) > self.max_items or (self.max_bytes is not None and self.nbytes > self.max_bytes):
            self._drop_oldest()

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0

    def make_room(self) -> None:
        """Evict until one more fits by count: before making a large value, so the one it replaces is freed first."""
        while self.entries and len(self.entries) >= self.max_items:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, old = self.entries.popitem(last=False)
        self.nbytes -= self.size(old)


# --- prompt embeddings ----------------------------------------------------------------------------------------------

class PromptCache:
    """``storage``: where cached embeddings live (None: the encoder's device)."""

    def __init__(self, max_items: int = 64, max_bytes: int | None = 1 << 30, storage: str | torch.device | None = None):
        self.cache = LRUCache(max_items, max_bytes, size=lambda entry: entry[0].nbytes)
        self.storage = storage

    def encoder_key(self, encoder) -> tuple:
        return (fingerprint(encoder.model), encoder.spec, str(encoder.dtype), str(encoder.device))

    def encode(self, encoder, prompts: Iterable[str], settings: Hashable = ()):
        """``encoder.encode(prompts)``, encoding only the prompts not seen. ``settings``: anything else that changes
        the embeddings."""
        from ..models.text_encoder import PromptEmbeds, stack_rows

        prompts = list(prompts) if not isinstance(prompts, str) else prompts
        if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
            raise Flux2Error(f"prompts must be a list of strings, got {prompts!r}")
        base = self.encoder_key(encoder) + (settings,)
        found = {p: self.cache.get(base + (p,)) for p in dict.fromkeys(prompts)}
        missing = [p for p, entry in found.items() if entry is None]
        if missing:
            out = encoder.encode(missing)
            for i, p in enumerate(missing):
                embeds = out.row(i)
                entry = (embeds.to(self.storage) if self.storage is not None else embeds.clone(),
                         out.token_counts[i], out.dropped[i])
                found[p] = entry
                self.cache.put(base + (p,), entry)
        entries = [found[p] for p in prompts]
        embeds, lengths = stack_rows([e[0] for e in entries])
        return PromptEmbeds(embeds.to(encoder.device), [e[1] for e in entries], [e[2] for e in entries], lengths)

    def warm(self, encoder, prompts: Iterable[str] = ("",), settings: Hashable = ()) -> None:
        """By default the empty negative prompt of CFG (base models)."""
        self.encode(encoder, list(prompts), settings)


# --- 9B-KV reference keys and values --------------------------------------------------------------------------------

def reference_kv_key(model_key: Hashable, ref: Tensor, ref_ids: Tensor) -> tuple:
    return (model_key, tensor_digest(ref, ref_ids), str(ref.dtype), str(ref.device))


class ReferenceKVCache:
    """``model.reference_kv`` results; one 1024^2 reference is about 2 GiB on Klein 9B (bf16)."""

    def __init__(self, max_items: int = 2, max_bytes: int | None = 8 << 30, size=lambda kv: kv.nbytes):
        self.cache = LRUCache(max_items, max_bytes, size=size)

    def get(self, model, ref: Tensor, ref_ids: Tensor, model_key: Hashable | None = None, make=None):
        """The ``ReferenceKV`` for ref [B, Lref, 128] with ids [B, Lref, 4]. ``make()``: what a miss keeps instead."""
        key = reference_kv_key(fingerprint(model) if model_key is None else model_key, ref, ref_ids)
        kv = self.cache.get(key)
        if kv is None:
            self.cache.make_room()
            kv = model.reference_kv(ref, ref_ids) if make is None else make()
            self.cache.put(key, kv)
        return kv

    def holds(self, model_key: Hashable, ref: Tensor, ref_ids: Tensor) -> bool:
        """For a memory estimate: a miss makes new K/V."""
        return reference_kv_key(model_key, ref, ref_ids) in self.cache

    def clear(self) -> None:
        self.cache.clear()

    def get_for_images(self, model, autoencoder, images, dtype: torch.dtype | None, *, encode: Callable):
        """Keyed by the images' pixels and both models' weights, so a hit runs neither model."""
        key = self._images_key(model, autoencoder, images, dtype)
        kv = self.cache.get(key)
        if kv is None:
            ref, ref_ids = encode(autoencoder, images, dtype)
            kv = model.reference_kv(ref, ref_ids)
            self.cache.put(key, kv)
        return kv

    def holds_images(self, model, autoencoder, images, dtype: torch.dtype | None = None) -> bool:
        return self._images_key(model, autoencoder, images, dtype) in self.cache

    @staticmethod
    def _images_key(model, autoencoder, images, dtype) -> tuple:
        return ("images", fingerprint(model), fingerprint(autoencoder), image_digest(images), str(dtype))
