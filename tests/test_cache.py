"""Prompt-embedding and reference-KV caches: hits skip the model, results equal an uncached run, keys separate what
must differ (weights, settings, references), and the LRU bounds hold. The models run in the device mode's dtype and
device (``tests/device.py``)."""

from __future__ import annotations

import pytest
import torch

from flux2_core.digests import tensor_digest
from flux2_core.families.flux2 import FLUX2
from flux2_core.families.flux2.transformer import Flux2Transformer
from flux2_core.models import rope
from flux2_core.runtime.cache import LRUCache, PromptCache, ReferenceKVCache, fingerprint
from tests.device import DEVICE, DTYPE, to
from tests.tiny.transformer import TINY_TRANSFORMER, random_bfl_transformer_state_dict


def count_calls(module: torch.nn.Module) -> list[int]:
    """A one-element list counting the forward calls of ``module``."""
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.fixture(scope="module")
def encoder():
    """A real PromptEncoder: the built-in Qwen3 tokenizer and a random 28-layer, 32-wide Qwen3."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Model

    from flux2_core.families.flux2.variants import QWEN3_4B
    from flux2_core.models.text_encoder import build_qwen3_encoder

    config = Qwen3Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=28,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        sd = {k: 0.2 * torch.randn_like(v) for k, v in Qwen3Model(config).state_dict().items()}
    return build_qwen3_encoder(sd, config, device=DEVICE, dtype=DTYPE, spec=QWEN3_4B)


def test_prompt_cache_skips_the_encoder_and_returns_what_it_would(encoder):
    calls = count_calls(encoder.model)
    cache = PromptCache()
    direct = encoder.encode(["a red fox", "a cat"])
    assert calls[0] == 1

    first = cache.encode(encoder, ["a red fox", "a cat"])
    assert calls[0] == 2
    again = cache.encode(encoder, ["a cat", "a red fox", "a cat"])     # all hits, any order, repeats allowed
    assert calls[0] == 2
    assert cache.cache.hits == 2                                      # looked up once per distinct prompt
    torch.testing.assert_close(first.embeds, direct.embeds, rtol=0, atol=1e-6)
    torch.testing.assert_close(again.embeds, direct.embeds[[1, 0, 1]], rtol=0, atol=1e-6)
    assert again.token_counts == [direct.token_counts[i] for i in (1, 0, 1)]
    assert again.dropped == [0, 0, 0]

    cache.encode(encoder, ["a cat", "a dog"])                          # only the new prompt is encoded
    assert calls[0] == 3 and len(cache.cache) == 3


def test_empty_negative_is_precomputed(encoder):
    calls = count_calls(encoder.model)
    cache = PromptCache(storage="cpu")
    cache.warm(encoder)
    assert calls[0] == 1
    neg = cache.encode(encoder, [""])
    assert calls[0] == 1
    torch.testing.assert_close(neg.embeds, encoder.encode([""]).embeds, rtol=0, atol=1e-6)


def test_prompt_cache_keys_on_weights_and_settings(encoder):
    calls = count_calls(encoder.model)
    cache = PromptCache()
    cache.encode(encoder, ["x"])
    cache.encode(encoder, ["x"], settings=("lora", 0.5))               # other settings: a miss
    assert calls[0] == 2
    weight = encoder.model.layers[3].mlp.down_proj.weight
    saved = weight[0, :2].clone()
    with torch.no_grad():
        weight.view(-1)[-1] += 1.0                                     # weights patched in place (a LoRA): a miss
    try:
        patched = cache.encode(encoder, ["x"])
        assert calls[0] == 3
        torch.testing.assert_close(patched.embeds, encoder.encode(["x"]).embeds, rtol=0, atol=1e-6)
    finally:
        with torch.no_grad():
            weight.view(-1)[-1] -= 1.0
    assert torch.equal(weight[0, :2], saved)


def test_prompt_cache_rejects_a_bare_string(encoder):
    from flux2_core.errors import Flux2Error

    with pytest.raises(Flux2Error, match="list of strings"):
        PromptCache().encode(encoder, "a cat")


def test_lru_bounds_by_items_and_bytes():
    cache = LRUCache(max_items=2, max_bytes=100, size=len)
    cache.put("a", b"x" * 40)
    cache.put("b", b"x" * 40)
    assert cache.get("a") is not None                     # "a" is now the most recent
    cache.put("c", b"x" * 10)                             # 3 entries > 2: "b", the least recent, goes
    assert "b" not in cache and "a" in cache and "c" in cache
    cache.put("d", b"x" * 60)                             # 40 + 10 + 60 > 100 bytes: "a", the oldest, goes
    assert list(cache.entries) == ["c", "d"] and cache.nbytes == 70
    cache.put("huge", b"x" * 101)                         # larger than the whole budget: not stored
    assert "huge" not in cache
    cache.clear()                                         # empty, and its byte count with it
    assert len(cache) == 0 and cache.nbytes == 0
    cache.put("e", b"x" * 100)                            # the whole budget is free again
    assert "e" in cache and cache.nbytes == 100


def tiny_model(seed: int) -> Flux2Transformer:
    model = Flux2Transformer(TINY_TRANSFORMER)
    model.load_state_dict(random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=seed))
    return to(model).eval()


def randn(*shape, generator=None):
    """Random inputs drawn on the CPU, in DTYPE on DEVICE."""
    return to(torch.randn(*shape, generator=generator))


def test_reference_kv_cache_skips_the_reference_pass():
    g = torch.Generator().manual_seed(0)
    model = tiny_model(0)
    calls = count_calls(model.double_blocks[0])
    ref, ref_ids = randn(1, 12, 128, generator=g), rope.reference_ids([(3, 4)], device=DEVICE)
    cache = ReferenceKVCache()

    kv = cache.get(model, ref, ref_ids)
    assert calls[0] == 1
    assert cache.get(model, ref.clone(), ref_ids.clone()) is kv        # same contents: no reference pass at all
    assert calls[0] == 1

    # Denoising with the cached K/V is exactly denoising with freshly computed K/V.
    other_ref = ref.clone()
    other_ref[0, 0, 0] = torch.nextafter(ref[0, 0, 0], ref.new_tensor(float("inf")))   # one ulp off: recomputed
    assert cache.get(model, other_ref, ref_ids) is not kv
    other_ids = rope.reference_ids([(4, 3)], device=DEVICE)                            # same latents, other grid: recomputed
    assert cache.get(model, ref, other_ids) is not kv
    assert calls[0] == 3

    # Denoising with the cached K/V is exactly denoising with freshly computed K/V.
    img, txt = randn(2, 16, 128, generator=g), randn(2, 5, TINY_TRANSFORMER.context_in_dim, generator=g)
    args = (img, rope.image_ids(2, 4, 4, device=DEVICE), to(torch.tensor([0.7, 0.7])), txt,
            rope.text_ids(2, 5, device=DEVICE))
    with torch.no_grad():
        assert torch.equal(model(*args, ref_kv=kv), model(*args, ref_kv=model.reference_kv(ref, ref_ids)))


def test_reference_kv_cache_keys_on_the_model():
    ref, ref_ids = randn(1, 12, 128), rope.reference_ids([(3, 4)], device=DEVICE)
    a, b = tiny_model(0), tiny_model(1)
    cache = ReferenceKVCache()
    kv_a = cache.get(a, ref, ref_ids)
    kv_b = cache.get(b, ref, ref_ids)
    assert kv_a is not kv_b and not torch.equal(kv_a.blocks[0][0], kv_b.blocks[0][0])
    assert cache.get(tiny_model(0), ref, ref_ids) is kv_a               # a reloaded copy of the same weights: a hit
    assert fingerprint(a) == fingerprint(tiny_model(0)) != fingerprint(b)


def test_reference_kv_cache_is_bounded_in_bytes():
    model = tiny_model(0)
    ref_ids = rope.reference_ids([(3, 4)], device=DEVICE)
    one = model.reference_kv(randn(1, 12, 128), ref_ids).nbytes
    cache = ReferenceKVCache(max_items=8, max_bytes=2 * one)
    for i in range(3):
        cache.get(model, torch.full((1, 12, 128), float(i), dtype=DTYPE, device=DEVICE), ref_ids)
    assert len(cache.cache) == 2 and cache.cache.nbytes == 2 * one


def test_reference_kv_cache_kept_another_way_frees_the_old_entry_before_making_the_new():
    """The ComfyUI node keeps its K/V wrapped (under ComfyUI's model management): ``make`` wraps them, ``holds`` says a
    hit beforehand (the memory estimate), and with one entry the old one is gone before the new one is made."""
    model = tiny_model(0)
    ref_ids = rope.reference_ids([(3, 4)], device=DEVICE)
    first, second = (torch.full((1, 12, 128), v, dtype=DTYPE, device=DEVICE) for v in (0.5, -0.5))
    alive_when_made = []
    cache = ReferenceKVCache(max_items=1, max_bytes=None, size=lambda held: held["kv"].nbytes)

    def make(ref):
        alive_when_made.append(len(cache.cache))
        return {"kv": model.reference_kv(ref, ref_ids)}

    assert not cache.holds("model", first, ref_ids)
    held = cache.get(model, first, ref_ids, model_key="model", make=lambda: make(first))
    assert cache.holds("model", first.clone(), ref_ids) and not cache.holds("other", first, ref_ids)
    assert cache.get(model, first, ref_ids, model_key="model", make=lambda: make(first)) is held
    cache.get(model, second, ref_ids, model_key="model", make=lambda: make(second))
    assert alive_when_made == [0, 0] and not cache.holds("model", first, ref_ids)
    assert torch.equal(held["kv"].blocks[0][0], model.reference_kv(first, ref_ids).blocks[0][0])


def test_tensor_digest_sees_dtype_shape_and_values():
    x = torch.arange(6.0)
    assert tensor_digest(x) == tensor_digest(x.clone())
    assert tensor_digest(x) != tensor_digest(x.double())
    assert tensor_digest(x) != tensor_digest(x.reshape(2, 3))
    y = x.clone()
    y[5] = 5.000001
    assert tensor_digest(x) != tensor_digest(y)


def flux2_encode(ae, images, dtype):
    from flux2_core.sampling.references import encode_references

    return encode_references(ae, images, dtype, ids=FLUX2.reference_ids, fit=FLUX2.references)


def test_reference_kv_cache_by_images_skips_the_autoencoder_too():
    from PIL import Image

    from flux2_core.models.autoencoder import AutoEncoder
    from flux2_core.sampling.references import encode_references
    from tests.tiny.autoencoder import TINY_AE_PARAMS

    g = torch.Generator().manual_seed(0)
    model, ae = tiny_model(0), AutoEncoder(TINY_AE_PARAMS).to(DEVICE).eval()     # the AE in float32, as loaded
    encodes, passes = count_calls(ae.encoder), count_calls(model.double_blocks[0])
    image = Image.fromarray((torch.rand(64, 80, 3, generator=g) * 255).byte().numpy())
    cache = ReferenceKVCache()
    with torch.no_grad():
        kv = cache.get_for_images(model, ae, [image], DTYPE, encode=flux2_encode)
        assert (encodes[0], passes[0]) == (1, 1)
        assert cache.get_for_images(model, ae, [image.copy()], DTYPE, encode=flux2_encode) is kv      # same pixels: nothing runs
        assert (encodes[0], passes[0]) == (1, 1)
        ref, ref_ids = encode_references(ae, [image], DTYPE, ids=FLUX2.reference_ids, fit=FLUX2.references)
        assert torch.equal(kv.blocks[-1][1], model.reference_kv(ref, ref_ids).blocks[-1][1])
        other = image.copy()
        other.putpixel((0, 0), (0, 0, 0) if image.getpixel((0, 0)) != (0, 0, 0) else (1, 1, 1))
        assert cache.get_for_images(model, ae, [other], DTYPE, encode=flux2_encode) is not kv        # one pixel changed: recomputed
