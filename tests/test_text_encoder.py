"""PromptEncoder against diffusers 0.42.1 ``Flux2KleinPipeline._get_qwen3_prompt_embeds`` on a tiny random Qwen3.

Ours runs in the device mode's dtype and device (``tests/device.py``), diffusers' Qwen3 in float32 on the same device.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from flux2_core import families
from flux2_core.errors import Flux2Error
from flux2_core.families.flux2.variants import QWEN3_4B, QWEN3_8B
from flux2_core.models.qwen3 import Qwen3Params
from flux2_core.models.text_encoder import build_qwen3_encoder, build_qwen3_model, qwen3_state_dict
from flux2_core.models.tokenizer import build_qwen3_tokenizer, load_tokenizer
from tests.device import DEVICE, DTYPE, assert_close, relative_error, tolerance
from tests.tiny.text_encoder import (
    TINY_QWEN3_CONFIG,
    build_tiny_qwen3,
    comfyui_state_dict,
    save_comfyui_text_encoder,
    save_diffusers_text_encoder,
)

LONG = "a photo of a red fox standing in fresh snow at dawn, " * 50     # about 600 prompt tokens
PROMPTS = ["", "A cat holding a sign that says hello world", LONG, "Ein Café in Zürich, 東京の夜景 🌃, ночь, مرحبا"]
# The Klein template around a prompt, as ids (Qwen3 tokenizer_config): "<|im_start|>user\n" before it,
# "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n" after it.
TEMPLATE_HEAD = [151644, 872, 198]
TEMPLATE_TAIL = [151645, 198, 151644, 77091, 198, 151667, 271, 151668, 271]


@pytest.fixture(scope="module")
def qwen3():
    """The float32 oracle on DEVICE."""
    return build_tiny_qwen3().to(DEVICE)


def build(state_dict, **kwargs):
    """Our encoder in DTYPE on DEVICE."""
    return build_qwen3_encoder(state_dict, device=DEVICE, dtype=DTYPE, **{"spec": QWEN3_4B, **kwargs})


@pytest.fixture(scope="module")
def tokenizer():
    return build_qwen3_tokenizer()


@pytest.fixture(scope="module")
def encoder(qwen3, tokenizer):
    return build(qwen3.state_dict(), tokenizer=tokenizer)


@pytest.fixture(scope="module")
def reference(qwen3, tokenizer):
    """diffusers' embeddings of PROMPTS, and the ids and mask diffusers fed to Qwen3 (caught by a hook)."""
    from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline

    seen = {}
    hook = qwen3.register_forward_pre_hook(lambda module, args, kwargs: seen.update(kwargs), with_kwargs=True)
    try:
        embeds = Flux2KleinPipeline._get_qwen3_prompt_embeds(qwen3, tokenizer, PROMPTS, dtype=torch.float32,
                                                               device=DEVICE)
    finally:
        hook.remove()
    return embeds, seen["input_ids"].cpu(), seen["attention_mask"].cpu()


def test_embeddings_match_diffusers(encoder, reference):
    ref, _, _ = reference
    out = encoder.encode(PROMPTS)
    assert out.embeds.shape == ref.shape == (len(PROMPTS), 512, 3 * TINY_QWEN3_CONFIG["hidden_size"])
    assert out.embeds.dtype == DTYPE and out.embeds.device.type == DEVICE.type
    for i, prompt in enumerate(PROMPTS):
        err = relative_error(out.embeds[i], ref[i])
        print(f"prompt {i} ({len(prompt)} chars): max|ours - diffusers| / max|diffusers| = {err:.2e}")
        assert err <= tolerance("text_encoder"), prompt[:40]


def test_token_ids_match_diffusers(encoder, reference):
    _, ref_ids, ref_mask = reference
    ids, mask, _ = encoder.tokenize(PROMPTS)
    assert torch.equal(ids, ref_ids)
    assert torch.equal(mask, ref_mask)


def test_token_counts_and_dropped(encoder, tokenizer):
    out = encoder.encode(PROMPTS)
    counts = [len(TEMPLATE_HEAD) + len(tokenizer.encode(p)) + len(TEMPLATE_TAIL) for p in PROMPTS]
    assert counts[0] == 12 and counts[2] > 512
    assert out.token_counts == counts
    assert out.dropped == [0, 0, counts[2] - 512, 0]

    ids, mask, _ = encoder.tokenize(PROMPTS)
    short = ids[1, : counts[1]].tolist()
    assert short == TEMPLATE_HEAD + tokenizer.encode(PROMPTS[1]) + TEMPLATE_TAIL
    assert (ids[1, counts[1]:] == 151643).all() and mask[1].sum() == counts[1]
    assert ids[2].tolist() == (TEMPLATE_HEAD + tokenizer.encode(LONG))[:512]     # the tail is cut, template too
    assert mask[2].all()


def test_only_27_layers_are_built_and_run(qwen3, encoder):
    assert len(encoder.model.layers) == 27 and not hasattr(encoder.model, "norm")
    calls = []
    hooks = [layer.register_forward_hook(lambda *_, i=i: calls.append(i)) for i, layer in enumerate(encoder.model.layers)]
    try:
        encoder.encode(["a cat", "a dog"])
    finally:
        for h in hooks:
            h.remove()
    assert calls == list(range(27))     # one batched pass through layers 0..26

    # Layer 28 (index 27), the final norm and lm_head are never loaded: poisoning them changes nothing.
    poisoned = {k: v.clone() for k, v in qwen3.state_dict().items()}
    for k, v in poisoned.items():
        if k.startswith(("model.layers.27.", "model.norm.", "lm_head.")):
            v.fill_(float("nan"))
    other = build(poisoned, tokenizer=encoder.tokenizer)
    assert torch.equal(other.encode(["a cat"]).embeds, encoder.encode(["a cat"]).embeds)


def test_batched_equals_one_by_one(encoder):
    batch = encoder.encode(PROMPTS[:2]).embeds
    for i, prompt in enumerate(PROMPTS[:2]):
        assert_close(batch[i:i + 1], encoder.encode([prompt]).embeds, "text_encoder", rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("prefix", ["", "text_encoders.qwen3_4b.transformer."])
def test_comfyui_single_file(tmp_path, qwen3, encoder, prefix):
    path = save_comfyui_text_encoder(qwen3, tmp_path / "qwen_3_tiny.safetensors", prefix=prefix)
    sd = load_file(str(path))
    assert "lm_head.weight" not in sd and f"{prefix}model.layers.0.self_attn.q_norm.weight" in sd
    loaded = build(sd, tokenizer=encoder.tokenizer)
    assert torch.equal(loaded.encode(PROMPTS[1:2]).embeds, encoder.encode(PROMPTS[1:2]).embeds)


def test_bare_qwen3_model_keys(qwen3, encoder):
    loaded = build(qwen3.model.state_dict(), tokenizer=encoder.tokenizer)
    assert torch.equal(loaded.encode(PROMPTS[1:2]).embeds, encoder.encode(PROMPTS[1:2]).embeds)


def test_diffusers_folders_with_config_and_sibling_tokenizer(tmp_path, qwen3, encoder, tokenizer):
    folder = save_diffusers_text_encoder(qwen3, tmp_path, tokenizer)
    config = json.loads((folder / "config.json").read_text())
    sd = load_file(str(folder / "model.safetensors"))
    loaded = build(sd, config=config, tokenizer=load_tokenizer(folder))
    assert loaded.tokenizer is not tokenizer
    assert torch.equal(loaded.encode(PROMPTS[1:2]).embeds, encoder.encode(PROMPTS[1:2]).embeds)


def test_bfloat16_is_close_to_float32(qwen3, encoder):
    """Our bf16 encoder against our float32 one (both on DEVICE): within 5%, the bound this test always had."""
    half, full = (build_qwen3_encoder(qwen3.state_dict(), device=DEVICE, dtype=dtype, tokenizer=encoder.tokenizer,
                                      spec=QWEN3_4B)
                  for dtype in (torch.bfloat16, torch.float32))
    out = half.encode(PROMPTS[1:2]).embeds
    assert out.dtype == torch.bfloat16
    assert relative_error(out, full.encode(PROMPTS[1:2]).embeds) < 0.05         # bf16 through 27 layers: ~0.025


def qwen3_shapes(hidden, intermediate, heads, kv_heads, head_dim, layers, vocab=151936, tied=True) -> dict:
    """Meta tensors with the key names and shapes of a Hugging Face Qwen3ForCausalLM checkpoint."""
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden), p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden), p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,),
            p + "mlp.gate_proj.weight": (intermediate, hidden), p + "mlp.up_proj.weight": (intermediate, hidden),
            p + "mlp.down_proj.weight": (hidden, intermediate),
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
        })
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    return {k: torch.empty(shape, dtype=torch.bfloat16, device="meta") for k, shape in shapes.items()}


CONFIG_NAMES = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
                "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim", "rope_theta": "rope_theta",
                "rms_norm_eps": "rms_norm_eps"}


@pytest.mark.parametrize("source", ["shapes", "shapes without lm_head", "config.json", "transformers config"])
def test_params_agree_with_the_config(qwen3, source):
    """Every way to say what the Qwen3 is gives the values of the config the tiny model was made from."""
    params = {"shapes": lambda: Qwen3Params.from_state_dict(qwen3_state_dict(qwen3.state_dict())),
              "shapes without lm_head": lambda: Qwen3Params.from_state_dict(qwen3_state_dict(comfyui_state_dict(qwen3))),
              "config.json": lambda: Qwen3Params.from_config(json.loads(qwen3.config.to_json_string())),
              "transformers config": lambda: Qwen3Params.from_config(qwen3.config)}[source]()
    for ours, theirs in CONFIG_NAMES.items():
        assert getattr(params, ours) == TINY_QWEN3_CONFIG[theirs], ours


@pytest.mark.parametrize("change,message", [
    ({"hidden_size": 0}, "hidden_size"), ({"num_hidden_layers": 2.5}, "num_layers"), ({"rope_theta": [1e6]}, "rope_theta"),
    ({"rope_theta": 0}, "rope_theta"),
    ({"num_key_value_heads": 3}, "multiple"), ({"rms_norm_eps": "1e-6"}, "rms_norm_eps"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"), ({"hidden_act": "gelu"}, "silu"),
    ({"rope_parameters": [1]}, "object")])
def test_bad_config_values_are_refused(change, message):
    with pytest.raises(Flux2Error, match=message):
        Qwen3Params.from_config({**TINY_QWEN3_CONFIG, **change})


@pytest.mark.parametrize("size", ["4b", "8b"])
def test_real_sizes_on_meta(size, tokenizer):
    # Qwen3-4B: 2560 wide, 9728 MLP, 32 heads, 8 KV heads, tied; Qwen3-8B: 4096, 12288, 32, 8, untied.
    hidden, intermediate, tied, spec = {"4b": (2560, 9728, True, QWEN3_4B), "8b": (4096, 12288, False, QWEN3_8B)}[size]
    sd = qwen3_shapes(hidden, intermediate, heads=32, kv_heads=8, head_dim=128, layers=36, tied=tied)
    params = Qwen3Params.from_state_dict(qwen3_state_dict(sd))
    assert (params.hidden_size, params.intermediate_size, params.num_layers) == (hidden, intermediate, 36)
    assert (params.num_heads, params.num_kv_heads, params.head_dim, params.vocab_size) == (32, 8, 128, 151936)
    encoder = build_qwen3_encoder(sd, device="meta", dtype=torch.bfloat16, tokenizer=tokenizer,
                                  spec=families.encoder_for(None, hidden))       # the registry's pick by width
    assert encoder.spec == spec and len(encoder.model.layers) == 27
    per_layer = sum(v.numel() for k, v in sd.items() if k.startswith("model.layers.0."))
    expected = sd["model.embed_tokens.weight"].numel() + 27 * per_layer
    assert sum(p.numel() for p in encoder.model.parameters()) == expected


def test_bad_state_dicts_are_refused(qwen3):
    sd = qwen3.state_dict()
    with pytest.raises(Flux2Error, match="not a Qwen3"):
        build_qwen3_encoder({k: v for k, v in sd.items() if "embed_tokens" not in k}, spec=QWEN3_4B)
    with pytest.raises(Flux2Error, match="q_norm"):
        build_qwen3_encoder({k: v for k, v in sd.items() if "q_norm" not in k}, spec=QWEN3_4B)
    shallow = {k: v for k, v in sd.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < 20}
    with pytest.raises(Flux2Error, match="27"):
        build_qwen3_encoder(shallow, spec=QWEN3_4B)
    with pytest.raises(Flux2Error, match="quantized"):
        build_qwen3_encoder({**sd, "model.layers.0.mlp.up_proj.weight_scale": torch.ones(())}, spec=QWEN3_4B)
    params = Qwen3Params.from_state_dict(qwen3_state_dict(sd))
    with pytest.raises(Flux2Error, match="do not fit"):
        build_qwen3_model({k: v for k, v in sd.items() if "layers.3.mlp.up_proj" not in k}, params, 27, "cpu",
                          torch.float32)
    wider = {**TINY_QWEN3_CONFIG, "intermediate_size": 96}
    with pytest.raises(Flux2Error, match="do not fit"):
        build_qwen3_encoder(sd, config=wider, device="cpu", dtype=torch.float32, spec=QWEN3_4B)
    # a layer kept in a 16-bit dtype the compute dtype is not wider than would be made float and fed bf16 weights
    for kept, compute in ((torch.bfloat16, torch.float16), (torch.float32, torch.bfloat16)):
        with pytest.raises(Flux2Error, match="layers.0.mlp.up_proj in torch.(bfloat16|float32).*leave those"):
            build_qwen3_model(sd, params, 27, "cpu", compute, kept={"layers.0.mlp.up_proj": kept})
    model = build_qwen3_model(sd, params, 27, "cpu", torch.float32, kept={"layers.0.mlp.up_proj": torch.bfloat16})
    assert model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16 and model.layers[0].mlp.up_proj.kind == "bf16"


def test_bad_prompts_are_refused(encoder):
    with pytest.raises(Flux2Error, match="list of strings"):
        encoder.encode("a cat")
    with pytest.raises(Flux2Error, match="no prompt"):
        encoder.encode([])
