"""flux2_core.weights: every layout loads the same tiny weights to the same model, which matches diffusers' own model.

Layouts: BFL single file, ComfyUI file (with and without its prefix), diffusers folder / pipeline root / shards,
Hugging Face text-encoder folder; fp8 files; and every bad input as a Flux2Error. Parity bound against diffusers:
max|ours - diffusers| <= 1e-4 * max|diffusers| (float32, CPU).
"""

import dataclasses
import json
import pickle
import shutil
import struct
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from flux2_core import weights
from flux2_core.errors import Flux2Error
from flux2_core.families import get_variant
from flux2_core.families.flux2.variants import KLEIN_4B, KLEIN_9B
from flux2_core.models import rope
from flux2_core.weights import dequantize, loading
from tests.tiny.autoencoder import (
    build_diffusers_autoencoder,
    save_bfl_autoencoder,
    save_diffusers_autoencoder,
)
from tests.tiny.layouts import comfy_fp8, save_prefixed, write_pickle_checkpoint, write_sparse_safetensors
from tests.tiny.text_encoder import build_tiny_qwen3, comfyui_state_dict, save_diffusers_text_encoder
from tests.tiny.transformer import (
    TINY_TRANSFORMER,
    bfl_transformer_shapes,
    diffusers_transformer_from_bfl_file,
    random_bfl_transformer_state_dict,
    save_bfl_transformer,
    save_diffusers_transformer,
)

pytest.importorskip("diffusers")

BOUND = 1e-4
CPU = torch.device("cpu")


def rel_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max()).item()


def assert_same_state(model, state: dict[str, torch.Tensor]):
    got = model.state_dict()
    assert set(got) == set(state)
    for key, tensor in state.items():
        if got[key].dtype.itemsize == 1 and got[key].is_floating_point():       # float8: compared as its bytes
            assert torch.equal(got[key].view(torch.uint8), tensor.to(got[key].dtype).view(torch.uint8)), key
        else:
            assert torch.equal(got[key], tensor.to(got[key].dtype)), key


# ---------------------------------------------------------------------------------------------------------------
# transformer
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dit(tmp_path_factory):
    """Tiny BFL weights written in every transformer layout, plus diffusers' model loaded by its own converter."""
    tmp = tmp_path_factory.mktemp("dit")
    sd = random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=0)
    bfl = save_bfl_transformer(sd, tmp / "flux-2-klein-tiny.safetensors")
    theirs = diffusers_transformer_from_bfl_file(bfl, TINY_TRANSFORMER, tmp / "config")
    root = tmp / "FLUX.2-klein-tiny"
    save_diffusers_transformer(theirs, root / "transformer")
    (root / "model_index.json").write_text(json.dumps({"_class_name": "Flux2KleinPipeline", "is_distilled": True}))
    sharded = tmp / "sharded"
    theirs.save_pretrained(str(sharded), safe_serialization=True, max_shard_size="200KB")
    files = {
        "bfl": bfl,
        "comfyui": save_prefixed(sd, tmp / "comfy.safetensors", "model.diffusion_model."),
        "comfyui-no-prefix": save_prefixed(sd, tmp / "comfy-plain.safetensors"),
        "diffusers-folder": root / "transformer",
        "diffusers-root": root,
        "diffusers-sharded": sharded,
    }
    return SimpleNamespace(sd=sd, files=files, theirs=theirs, tmp=tmp)


@pytest.fixture(scope="module")
def dit_inputs():
    g = torch.Generator().manual_seed(1)
    h, w, n_txt = 3, 4, 8
    return {"img": torch.randn(1, h * w, 128, generator=g), "img_ids": rope.image_ids(1, h, w),
                "txt": torch.randn(1, n_txt, 96, generator=g), "txt_ids": rope.text_ids(1, n_txt),
                "timesteps": torch.tensor([0.7])}


def run_ours(model, x):
    with torch.no_grad():
        return model(x["img"], x["img_ids"], x["timesteps"], x["txt"], x["txt_ids"])


@pytest.mark.parametrize("layout", ["bfl", "comfyui", "comfyui-no-prefix", "diffusers-folder", "diffusers-root",
                                    "diffusers-sharded"])
def test_transformer_layouts_load_the_same_weights(dit, dit_inputs, layout):
    model, variant = weights.load_transformer(dit.files[layout], device="cpu", dtype=torch.float32)
    assert model.params == TINY_TRANSFORMER
    assert_same_state(model, dit.sd)
    assert variant.params == TINY_TRANSFORMER and variant.guidance_distilled and not variant.use_kv_cache
    if layout == "diffusers-sharded":
        assert len(list(dit.files[layout].glob("*.safetensors"))) > 1
    with torch.no_grad():
        want = dit.theirs(hidden_states=dit_inputs["img"], img_ids=dit_inputs["img_ids"],
                          encoder_hidden_states=dit_inputs["txt"], txt_ids=dit_inputs["txt_ids"],
                          timestep=dit_inputs["timesteps"], guidance=None, return_dict=False)[0]
    got = run_ours(model, dit_inputs)
    bfl_model, _ = weights.load_transformer(dit.files["bfl"], device="cpu", dtype=torch.float32)
    same = rel_diff(got, run_ours(bfl_model, dit_inputs))
    diff = rel_diff(got, want)
    print(f"transformer {layout}: max rel diff vs diffusers {diff:.2e}, vs the BFL file {same:.1e}")
    assert diff <= BOUND and same <= 1e-6


def test_transformer_dtype_and_meta_assignment(dit):
    """Built on meta, then assigned: the parameters are the very tensors read, and nothing is left on meta."""
    source = loading._transformer_source(dit.files["comfyui"])
    model = loading.build_on_meta(lambda: loading.Flux2Transformer(TINY_TRANSFORMER))
    assert all(p.is_meta for p in model.parameters())
    state = loading.read_state_dict(source, model, CPU, torch.bfloat16)
    model = loading.assign(model, state)
    for name, tensor in model.state_dict().items():
        assert tensor.data_ptr() == state[name].data_ptr(), name
        assert tensor.dtype == torch.bfloat16 and tensor.device == CPU
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert not any(p.requires_grad for p in model.parameters()) and not model.training
    loaded, _ = weights.load_transformer(dit.files["bfl"], device="cpu", dtype=torch.bfloat16)
    assert_same_state(loaded, {k: v.to(torch.bfloat16) for k, v in dit.sd.items()})


def test_transformer_params_override_and_config(dit):
    """Without config.json the RoPE axes default to head_dim/4 each; params= overrides, a diffusers config is read."""
    other = dataclasses.replace(TINY_TRANSFORMER, axes_dim=(4, 12, 8, 8), theta=1000)
    model, _ = weights.load_transformer(dit.files["bfl"], device="cpu", params=other, dtype=torch.float32)
    assert model.params == other
    folder = dit.tmp / "axes"
    shutil.copytree(dit.files["diffusers-folder"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "axes_dims_rope": [4, 12, 8, 8], "rope_theta": 1000}))
    assert weights.inspect_transformer(folder)[0] == other


@pytest.mark.parametrize("name, index, family", [
    ("flux-2-klein-tiny.safetensors", None, "distilled"),
    ("flux-2-klein-base-tiny.safetensors", None, "base"),
    ("flux-2-klein-9b-kv-tiny.safetensors", None, "kv"),
    ("tiny.safetensors", {"_class_name": "Flux2KleinPipeline", "is_distilled": False}, "base"),
    ("flux-2-klein-base-tiny.safetensors", {"_class_name": "Flux2KleinPipeline", "is_distilled": True}, "distilled"),
    ("tiny.safetensors", {"_class_name": "Flux2KleinKVPipeline"}, "kv"),
])
def test_variant_from_name_and_model_index(dit, tmp_path, name, index, family):
    shutil.copy(dit.files["bfl"], tmp_path / name)
    if index:
        (tmp_path / "model_index.json").write_text(json.dumps(index))
    _, variant = weights.inspect_transformer(tmp_path / name)
    assert (variant.default_steps, variant.guidance_distilled, variant.use_kv_cache) == {
        "distilled": (4, True, False), "base": (50, False, False), "kv": (4, True, True)}[family]


@pytest.mark.parametrize("params, name, expected", [
    (KLEIN_4B, "flux-2-klein-4b.safetensors", "klein-4b"),
    (KLEIN_4B, "flux-2-klein-base-4b.safetensors", "klein-base-4b"),
    (KLEIN_9B, "flux-2-klein-9b.safetensors", "klein-9b"),
    (KLEIN_9B, "flux-2-klein-9b-kv.safetensors", "klein-9b-kv"),
])
def test_real_architectures_from_headers(tmp_path, params, name, expected):
    """Real-size checkpoints (sparse, all-zero files) are recognised from their headers alone, with and without
    ComfyUI's prefix."""
    shapes = bfl_transformer_shapes(params)
    path = write_sparse_safetensors(tmp_path / name, {"model.diffusion_model." + k: s for k, s in shapes.items()})
    found, variant = weights.inspect_transformer(path)
    assert found == params and variant.name == expected


# ---------------------------------------------------------------------------------------------------------------
# autoencoder
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ae(tmp_path_factory):
    """Tiny AE weights in every layout, and what diffusers' AutoencoderKLFlux2 makes of a test image with them:
    the pipeline's encode (posterior mode, 2x2 patchify, BatchNorm) and decode of the unnormalised latent."""
    tmp = tmp_path_factory.mktemp("ae")
    vae = build_diffusers_autoencoder(seed=0)
    bfl = save_bfl_autoencoder(vae, tmp / "ae.safetensors")
    sd = load_file(str(bfl))
    root = tmp / "pipe"
    save_diffusers_autoencoder(vae, root / "vae")
    no_counter = {k: v for k, v in sd.items() if k != "bn.num_batches_tracked"}
    top_level = {k.replace("encoder.quant_conv.", "quant_conv.").replace("decoder.post_quant_conv.", "post_quant_conv."): v
                 for k, v in sd.items()}
    files = {
        "bfl": bfl,
        "comfyui-vae-prefix": save_prefixed(sd, tmp / "flux2-vae-prefixed.safetensors", "vae."),
        "comfyui-no-counter": save_prefixed(no_counter, tmp / "flux2-vae.safetensors"),
        "comfyui-top-level-quant-convs": save_prefixed(top_level, tmp / "comfy-saved-vae.safetensors"),
        "diffusers-folder": root / "vae",
        "diffusers-root": root,
    }
    image = torch.rand(1, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        mean = vae.encode(image).latent_dist.mode()                                          # [1,32,4,6]
        patched = mean.reshape(1, 32, 2, 2, 3, 2).permute(0, 1, 3, 5, 2, 4).reshape(1, 128, 2, 3)
        std = torch.sqrt(vae.bn.running_var + vae.config.batch_norm_eps).view(1, -1, 1, 1)
        latent = (patched - vae.bn.running_mean.view(1, -1, 1, 1)) / std
        decoded = vae.decode(mean).sample
    return SimpleNamespace(sd=sd, files=files, tmp=tmp, image=image, latent=latent, decoded=decoded)


@pytest.mark.parametrize("layout", ["bfl", "comfyui-vae-prefix", "comfyui-no-counter",
                                    "comfyui-top-level-quant-convs", "diffusers-folder", "diffusers-root"])
def test_autoencoder_layouts_load_the_same_weights(ae, layout):
    model = weights.load_autoencoder(ae.files[layout], device="cpu", dtype=torch.float32)
    assert model.params.ch == 32 and model.params.ch_mult == (1, 1, 2, 2)
    expected = dict(ae.sd)
    if layout == "comfyui-no-counter":
        expected["bn.num_batches_tracked"] = torch.tensor(0)
    assert_same_state(model, expected)
    assert model.bn.num_batches_tracked.dtype == torch.int64
    with torch.no_grad():
        latent = model.encode(ae.image)
        decoded = model.decode(latent)
    d_enc, d_dec = rel_diff(latent, ae.latent), rel_diff(decoded, ae.decoded)
    bfl_model = weights.load_autoencoder(ae.files["bfl"], device="cpu", dtype=torch.float32)
    with torch.no_grad():
        same = max(rel_diff(latent, bfl_model.encode(ae.image)), rel_diff(decoded, bfl_model.decode(latent)))
    print(f"autoencoder {layout}: encode {d_enc:.2e}, decode {d_dec:.2e} vs diffusers; {same:.1e} vs the BFL file")
    assert d_enc <= BOUND and d_dec <= BOUND and same <= 1e-6


# ---------------------------------------------------------------------------------------------------------------
# text encoder
# ---------------------------------------------------------------------------------------------------------------

PROMPTS = ["a red fox in the snow", ""]


@pytest.fixture(scope="module")
def te(tmp_path_factory):
    from diffusers import Flux2KleinPipeline

    from flux2_core.models.tokenizer import build_qwen3_tokenizer

    tmp = tmp_path_factory.mktemp("te")
    model = build_tiny_qwen3(seed=0)
    tokenizer = build_qwen3_tokenizer()
    root = tmp / "FLUX.2-klein-tiny"
    save_diffusers_text_encoder(model, root, tokenizer)
    sharded = tmp / "sharded" / "text_encoder"
    model.save_pretrained(str(sharded), max_shard_size="8MB")
    sd = comfyui_state_dict(model)
    files = {
        "diffusers-root": root,
        "diffusers-folder": root / "text_encoder",
        "hf-sharded": sharded,
        "comfyui": save_prefixed(sd, tmp / "qwen_3_tiny.safetensors"),
        "comfyui-checkpoint": save_prefixed(sd, tmp / "all-in-one.safetensors", "text_encoders.qwen3_4b.transformer."),
    }
    with torch.no_grad():
        want = Flux2KleinPipeline._get_qwen3_prompt_embeds(model, tokenizer, PROMPTS, device=CPU)
    return SimpleNamespace(model=model, tokenizer=tokenizer, files=files, want=want, tmp=tmp)


@pytest.mark.parametrize("layout", ["diffusers-root", "diffusers-folder", "hf-sharded", "comfyui",
                                    "comfyui-checkpoint"])
def test_text_encoder_layouts_load_the_same_weights(te, layout):
    """Every layout gives the first 27 layers of the same Qwen3, exactly, with nothing left on meta."""
    encoder = weights.load_text_encoder(te.files[layout], device="cpu", tokenizer=te.tokenizer, dtype=torch.float32)
    assert len(encoder.model.layers) == 27 and not hasattr(encoder.model, "norm")
    assert not any(t.is_meta for t in [*encoder.model.parameters(), *encoder.model.buffers()])
    if layout == "hf-sharded":
        assert len(list(te.files[layout].glob("*.safetensors"))) > 1
    full = te.model.model.state_dict()
    got = encoder.model.state_dict()
    assert len(got) == 1 + 27 * 11
    for key, tensor in got.items():
        assert torch.equal(tensor, full[key]), key


def test_text_encoder_matches_diffusers(te):
    """Embeddings equal diffusers' Flux2KleinPipeline on the same weights and tokenizer."""
    encoder = weights.load_text_encoder(te.files["comfyui"], device="cpu", tokenizer=te.tokenizer, dtype=torch.float32)
    got = encoder.encode(PROMPTS).embeds
    diff = rel_diff(got, te.want)
    print(f"text encoder: max rel diff vs diffusers {diff:.2e}")
    assert got.shape == te.want.shape == (2, 512, 96) and diff <= BOUND


def test_text_encoder_tokenizer_comes_from_the_folder(te, monkeypatch):
    """A folder's tokenizer is looked up beside its weights (tokenizer.py finds text_encoder/../tokenizer/);
    a single file gets the built-in tokenizer."""
    from flux2_core.models.tokenizer import Qwen3Tokenizer, cached_backend_tokenizer

    asked, folders, builtin = [], Qwen3Tokenizer(cached_backend_tokenizer()), Qwen3Tokenizer(cached_backend_tokenizer())
    monkeypatch.setattr(loading, "load_tokenizer", lambda folder: asked.append(folder) or folders)
    assert weights.load_text_encoder(te.files["diffusers-root"], device="cpu", dtype=torch.float32).tokenizer is folders
    assert asked == [te.files["diffusers-folder"]]
    monkeypatch.setattr("flux2_core.models.text_encoder.load_tokenizer", lambda: builtin)
    assert weights.load_text_encoder(te.files["comfyui"], device="cpu", dtype=torch.float32).tokenizer is builtin
    assert len(asked) == 1


def test_text_encoder_fits(dit, te):
    encoder = weights.load_text_encoder(te.files["comfyui"], device="cpu", tokenizer=te.tokenizer, dtype=torch.float32)
    _, tiny_variant = weights.inspect_transformer(dit.files["bfl"])
    weights.check_text_encoder_fits(tiny_variant, encoder)              # 3 x 32 == 96: fine
    with pytest.raises(Flux2Error, match=r"FLUX.2 Klein 4B.*Qwen3-4B.*qwen_3_4b.safetensors.*hidden 32"):
        weights.check_text_encoder_fits(get_variant("klein-4b"), encoder)
    qwen3_8b = SimpleNamespace(model=SimpleNamespace(embed_tokens=torch.nn.Embedding(151936, 4096, device="meta")))
    with pytest.raises(Flux2Error, match=r"FLUX.2 Klein Base 4B.*you gave a Qwen3-8B encoder \(hidden 4096,"):
        weights.check_text_encoder_fits(get_variant("klein-base-4b"), qwen3_8b)
    weights.check_text_encoder_fits(get_variant("klein-9b-kv"), qwen3_8b)


def test_prompt_embeddings_made_elsewhere_fit_the_model():
    """A CONDITIONING's embeddings against the model's text width (3 layers x 2560 for Klein 4B, 3 x 4096 for 9B)."""
    weights.check_embeddings_fit(get_variant("klein-4b"), torch.zeros(1, 512, 3 * 2560))
    with pytest.raises(Flux2Error, match=r"12288 wide but this model \(klein-4b\) takes 7680: encode the prompt "
                                         r"with the Qwen3-4B text encoder \(qwen_3_4b.safetensors\)"):
        weights.check_embeddings_fit(get_variant("klein-4b"), torch.zeros(1, 512, 3 * 4096))
    with pytest.raises(Flux2Error, match=r"shape \[512, 12288\] but this model \(klein-9b\) takes \[batch, tokens, "
                                         r"12288\]"):
        weights.check_embeddings_fit(get_variant("klein-9b"), torch.zeros(512, 3 * 4096))      # no batch axis


# ---------------------------------------------------------------------------------------------------------------
# quantised files
# ---------------------------------------------------------------------------------------------------------------

FP8_LAYERS = ["double_blocks.0.img_attn.qkv", "single_blocks.1.linear1", "final_layer.adaLN_modulation.1"]


def test_comfyui_fp8mixed_is_dequantized(dit, tmp_path):
    """With fp8=False quantised layers load as float8 * per-tensor scale (ComfyUI's QUANTIZATION.md); the others
    unchanged. (Kept in fp8, the default, in test_quant.py.)"""
    sd, meta = comfy_fp8(dit.sd, FP8_LAYERS)
    path = save_prefixed(sd, tmp_path / "flux-2-klein-tiny-fp8mixed.safetensors", "model.diffusion_model.", meta)
    model, _ = weights.load_transformer(path, device="cpu", fp8=False, dtype=torch.float32)
    expected = dict(dit.sd)
    for layer in FP8_LAYERS:
        expected[layer + ".weight"] = sd[layer + ".weight"].float() * sd[layer + ".weight_scale"]
        assert rel_diff(expected[layer + ".weight"], dit.sd[layer + ".weight"]) < 0.07   # fp8 is close, not equal
    assert_same_state(model, expected)


def test_comfyui_per_layer_comfy_quant_and_old_scaled_fp8(dit, tmp_path):
    sd, _ = comfy_fp8(dit.sd, FP8_LAYERS[:1])
    layer = FP8_LAYERS[0]
    sd[layer + ".comfy_quant"] = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)
    model, _ = weights.load_transformer(save_prefixed(sd, tmp_path / "a.safetensors"), device="cpu", fp8=False,
                                        dtype=torch.float32)
    want = sd[layer + ".weight"].float() * sd[layer + ".weight_scale"]
    assert torch.equal(model.state_dict()[layer + ".weight"], want)

    old = {k: v for k, v in sd.items() if not k.endswith((".comfy_quant", ".input_scale"))}
    old[layer + ".scale_weight"] = old.pop(layer + ".weight_scale")
    old["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    model, _ = weights.load_transformer(save_prefixed(old, tmp_path / "b.safetensors"), device="cpu", fp8=False,
                                        dtype=torch.float32)
    assert torch.equal(model.state_dict()[layer + ".weight"], want)


def test_bfl_fp8_and_nvfp4_match_diffusers_dequantization(dit, tmp_path):
    """BFL's fp8 (per-row scales) and nvfp4 files, written and read back with diffusers' BFL quantizer code."""
    from diffusers.quantizers.bfl.utils import dequantize_fp8r, dequantize_nvfp4, quantize_fp8r, quantize_nvfp4

    sd = dict(dit.sd)
    expected = dict(dit.sd)
    fp8_layer, fp4_layer = "double_blocks.1.txt_mlp.0", "single_blocks.0.linear2"
    q, scale = quantize_fp8r(sd[fp8_layer + ".weight"])
    sd.update({fp8_layer + ".weight": q, fp8_layer + ".weight_scale": scale, fp8_layer + ".input_scale": torch.ones(())})
    expected[fp8_layer + ".weight"] = dequantize_fp8r(q, scale)
    q, block, global_scale = quantize_nvfp4(sd[fp4_layer + ".weight"])
    sd.update({fp4_layer + ".weight": q, fp4_layer + ".weight_scale": block,
               fp4_layer + ".weight_scale_2": global_scale, fp4_layer + ".input_scale": torch.ones(())})
    fp4_weight = dequantize_nvfp4(q, block, global_scale)
    del expected[fp4_layer + ".weight"]
    model, _ = weights.load_transformer(save_prefixed(sd, tmp_path / "flux-2-klein-tiny-fp8.safetensors"),
                                        device="cpu", fp8=False, dtype=torch.float32)
    kept = model.get_submodule(fp4_layer)                     # nvfp4 stays as stored, dequantized at each call
    assert kept.kind == "nvfp4" and torch.equal(kept.weight, q) and torch.equal(kept.float_weight(), fp4_weight)
    assert_same_state(model, {k: v for k, v in expected.items() if not k.startswith(fp4_layer + ".")}
                      | {f"{fp4_layer}.{n}": t for n, t in kept.state_dict().items()})


def test_a_quantized_layer_of_a_diffusers_folder_is_dequantized(dit, tmp_path):
    """diffusers' to_q / to_k / to_v become one qkv of ours: an nvfp4 to_q (BFL's layout) is dequantized as it is
    read, and equals diffusers' own dequantization."""
    from diffusers.quantizers.bfl.utils import dequantize_nvfp4, quantize_nvfp4

    folder = tmp_path / "transformer"
    shutil.copytree(dit.files["diffusers-folder"], folder)
    (file,) = folder.glob("*.safetensors")
    sd = load_file(str(file))
    key = "transformer_blocks.0.attn.to_q"
    q, block, global_scale = quantize_nvfp4(sd[key + ".weight"])
    sd.update({key + ".weight": q, key + ".weight_scale": block, key + ".weight_scale_2": global_scale})
    save_file(sd, str(file))
    model, _ = weights.load_transformer(folder, device="cpu", dtype=torch.float32)
    qkv = model.state_dict()["double_blocks.0.img_attn.qkv.weight"]
    rows = q.shape[0]
    assert torch.equal(qkv[:rows], dequantize_nvfp4(q, block, global_scale))
    assert torch.equal(qkv[rows:], torch.cat([sd["transformer_blocks.0.attn.to_k.weight"],
                                              sd["transformer_blocks.0.attn.to_v.weight"]]).float())


def test_text_encoder_fp8mixed_and_block_fp8(te, tmp_path):
    """ComfyUI's qwen_3_8b_fp8mixed layout (per-tensor scales, metadata naming full keys) and Hugging Face's
    fine-grained fp8 (Qwen3-*-FP8: ``weight_scale_inv`` per block, block size in config.json) both dequantize."""
    layers = ["model.layers.0.mlp.up_proj", "model.layers.26.self_attn.o_proj"]
    sd, meta = comfy_fp8(comfyui_state_dict(te.model), layers)
    encoder = weights.load_text_encoder(save_prefixed(sd, tmp_path / "qwen_3_tiny_fp8mixed.safetensors", "", meta),
                                        device="cpu", tokenizer=te.tokenizer, dtype=torch.float32)
    got = encoder.model.state_dict()
    for layer in layers:
        want = sd[layer + ".weight"].float() * sd[layer + ".weight_scale"]
        assert torch.equal(got[layer[len("model."):] + ".weight"], want)

    folder = tmp_path / "Qwen3-tiny-FP8"
    shutil.copytree(te.files["diffusers-folder"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 16]}
    (folder / "config.json").write_text(json.dumps(config))
    sd = load_file(str(folder / "model.safetensors"))
    layer = "model.layers.3.mlp.down_proj"                              # [32, 64]: 2 x 4 blocks of 16 x 16
    weight = sd[layer + ".weight"]
    scale = weight.abs().reshape(2, 16, 4, 16).amax(dim=(1, 3)) / 448          # one scale per block
    sd[layer + ".weight"] = (weight / scale.repeat_interleave(16, 0).repeat_interleave(16, 1)).to(torch.float8_e4m3fn)
    sd[layer + ".weight_scale_inv"] = scale
    save_file(sd, str(folder / "model.safetensors"))
    encoder = weights.load_text_encoder(folder, device="cpu", tokenizer=te.tokenizer, dtype=torch.float32)
    want = sd[layer + ".weight"].float() * scale.repeat_interleave(16, 0).repeat_interleave(16, 1)
    assert torch.equal(encoder.model.state_dict()["layers.3.mlp.down_proj.weight"], want)
    assert rel_diff(want, weight) < 0.07


def test_nvfp4_codes_by_hand():
    """E2M1 codes: 0x21 -> (0.5, 1.0) (low nibble first); 0xF8 -> (-0.0, -6.0); 16 values share one block scale."""
    packed = torch.tensor([[0x21, 0xF8] + [0x00] * 6], dtype=torch.uint8)          # [1, 8] -> 16 values
    block = torch.tensor([[2.0]]).to(torch.float8_e4m3fn)
    out = dequantize.dequantize_nvfp4(packed, block, torch.tensor(0.5))
    assert out.tolist() == [[0.5, 1.0, -0.0, -6.0] + [0.0] * 12]


def test_block_and_row_scales_by_hand():
    w = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]).to(torch.float8_e4m3fn)
    rows = dequantize.dequantize(w, torch.tensor([1.0, 10.0, 100.0]), (128, 128))
    assert rows.tolist() == [[1, 2, 3], [40, 50, 60], [700, 800, 900]]
    blocks = dequantize.dequantize(w, torch.tensor([[1.0, 2.0], [3.0, 4.0]]), (2, 2))    # 2x2 blocks, edges cut
    assert blocks.tolist() == [[1, 2, 6], [4, 5, 12], [21, 24, 36]]
    with pytest.raises(Flux2Error, match="not a known quantisation"):
        dequantize.dequantize(w, torch.ones(2), (128, 128))


@pytest.mark.parametrize("case, message", [
    ("comfy-gptq", "'gptq_w4a16'.*cannot be loaded"),        # layouts ComfyUI's files may name and we do not run
    ("comfy-unknown", "'marlin_w4a16'.*cannot be loaded"),
    ("int8-weight", "stored as torch.int8.*does not know"),
    ("gptq", "GPTQ"),
    ("bnb", "bitsandbytes"),
])
def test_unknown_quantisation_is_refused(dit, tmp_path, case, message):
    sd, meta = dict(dit.sd), None
    layer = "double_blocks.0.img_attn.proj"
    if case.startswith("comfy"):
        fmt = "gptq_w4a16" if case == "comfy-gptq" else "marlin_w4a16"
        meta = {"_quantization_metadata": json.dumps({"layers": {layer: fmt}})}
    elif case == "int8-weight":
        sd[layer + ".weight"] = torch.ones(64, 64, dtype=torch.int8)
    elif case == "gptq":
        sd[layer + ".qweight"] = torch.ones(8, 64, dtype=torch.int32)
    else:
        sd[layer + ".weight.absmax"] = torch.ones(8)
    with pytest.raises(Flux2Error, match=message):
        weights.load_transformer(save_prefixed(sd, tmp_path / "q.safetensors", metadata=meta), device="cpu",
                                 dtype=torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------------

LOADERS = {"transformer": weights.load_transformer, "autoencoder": weights.load_autoencoder,
           "text_encoder": weights.load_text_encoder}


@pytest.mark.parametrize("loader", LOADERS)
def test_missing_path(tmp_path, loader):
    with pytest.raises(Flux2Error, match="does not exist"):
        LOADERS[loader](tmp_path / "nope.safetensors", device="cpu")


@pytest.mark.parametrize("name", ["model.ckpt", "model.pt", "model.safetensors", "pytorch_model.bin"])
def test_pickle_files_are_refused_unopened(tmp_path, name):
    """torch.save zips and raw pickles, whatever their name, are refused; the payload never runs."""
    marker = tmp_path / "unpickled"
    path = write_pickle_checkpoint(tmp_path / name, marker)
    with pytest.raises(Flux2Error, match=r"pickle.*never loaded.*safetensors"):
        weights.load_transformer(path, device="cpu", dtype=torch.float32)
    path.write_bytes(pickle.dumps({"img_in.weight": [0.0]}))      # a raw pickle: starts with b"\x80"
    with pytest.raises(Flux2Error, match="pickle"):
        weights.load_autoencoder(path, device="cpu", dtype=torch.float32)
    assert not marker.exists()


def test_folder_with_only_pickles(tmp_path):
    marker = tmp_path / "unpickled"
    write_pickle_checkpoint(tmp_path / "pytorch_model.bin", marker)
    with pytest.raises(Flux2Error, match=r"only pickle-based weights.*safetensors"):
        weights.load_text_encoder(tmp_path, device="cpu", dtype=torch.float32)
    assert not marker.exists()


def test_corrupt_truncated_and_gguf_files(dit, tmp_path):
    data = dit.files["bfl"].read_bytes()
    (tmp_path / "half.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(Flux2Error, match=r"truncated.*download"):
        weights.load_transformer(tmp_path / "half.safetensors", device="cpu", dtype=torch.float32)
    (tmp_path / "header.safetensors").write_bytes(data[:40])                  # cut inside the header
    with pytest.raises(Flux2Error, match=r"not a valid \.safetensors file.*corrupt or only partly downloaded"):
        weights.load_transformer(tmp_path / "header.safetensors", device="cpu", dtype=torch.float32)
    (tmp_path / "json.safetensors").write_bytes(struct.pack("<Q", 12) + b'{"a": broken')
    with pytest.raises(Flux2Error, match="not a valid"):
        weights.load_transformer(tmp_path / "json.safetensors", device="cpu", dtype=torch.float32)
    (tmp_path / "text.safetensors").write_bytes(b"this is not a safetensors file at all\n" * 20)
    with pytest.raises(Flux2Error, match="not a valid"):
        weights.load_transformer(tmp_path / "text.safetensors", device="cpu", dtype=torch.float32)
    (tmp_path / "empty.safetensors").write_bytes(b"")
    with pytest.raises(Flux2Error, match="not a valid"):
        weights.load_transformer(tmp_path / "empty.safetensors", device="cpu", dtype=torch.float32)
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(Flux2Error, match="GGUF"):
        weights.load_transformer(tmp_path / "m.gguf", device="cpu", dtype=torch.float32)


def test_missing_and_unexpected_keys_are_named(dit, tmp_path):
    sd = {k: v for k, v in dit.sd.items() if not k.startswith("single_blocks.1.")}
    sd.update({f"extra.{i}.weight": torch.zeros(1) for i in range(7)})
    sd.pop("double_blocks.1.txt_attn.proj.weight")
    path = save_prefixed(sd, tmp_path / "broken.safetensors", "model.diffusion_model.")
    with pytest.raises(Flux2Error) as error:
        weights.load_transformer(path, device="cpu", dtype=torch.float32)
    text = str(error.value)
    print(text)
    assert "Missing from the file (1): double_blocks.1.txt_attn.proj.weight" in text
    assert "Not expected (7): extra.0.weight, extra.1.weight, extra.2.weight, extra.3.weight, extra.4.weight, ..." in text
    assert "BFL layout behind the prefix 'model.diffusion_model.'" in text and "FLUX.2 transformer" in text

    folder = tmp_path / "transformer"
    shutil.copytree(dit.files["diffusers-folder"], folder)
    sd = {k: v for k, v in load_file(str(folder / "diffusion_pytorch_model.safetensors")).items()
          if "add_k_proj" not in k}
    save_file(sd, str(folder / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(Flux2Error, match=r"(?s)diffusers layout.*Missing from the file \(2\): "
                                         r"transformer_blocks.0.attn.add_k_proj.weight"):
        weights.load_transformer(folder, device="cpu", dtype=torch.float32)


def test_wrong_kind_of_file(dit, ae, te):
    with pytest.raises(Flux2Error, match="is not a FLUX.2 or FLUX 3 Image Klein transformer: it looks like a FLUX.2 autoencoder"):
        weights.load_transformer(ae.files["bfl"], device="cpu", dtype=torch.float32)
    with pytest.raises(Flux2Error, match="is not a FLUX.2 or FLUX 3 Image Klein transformer: it looks like a Qwen3 text encoder"):
        weights.load_transformer(te.files["comfyui"], device="cpu", dtype=torch.float32)
    with pytest.raises(Flux2Error, match="is not a FLUX.2 autoencoder: it looks like a FLUX.2 transformer"):
        weights.load_autoencoder(dit.files["comfyui"], device="cpu", dtype=torch.float32)
    with pytest.raises(Flux2Error, match="is not a Qwen3 text encoder: it looks like a FLUX.2 transformer"):
        weights.load_text_encoder(dit.files["bfl"], device="cpu", dtype=torch.float32)
    flux1_vae = {k: v for k, v in ae.sd.items() if not k.startswith("bn.")}
    with pytest.raises(Flux2Error, match=r"without FLUX.2's latent BatchNorm.*ae.safetensors"):
        weights.load_autoencoder(save_prefixed(flux1_vae, ae.tmp / "flux1-ae.safetensors"), device="cpu",
                                 dtype=torch.float32)
    lora = {"diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight": torch.zeros(4, 64)}
    with pytest.raises(Flux2Error, match="looks like a LoRA"):
        weights.load_transformer(save_prefixed(lora, ae.tmp / "lora.safetensors"), device="cpu", dtype=torch.float32)


def test_folder_errors(dit, tmp_path):
    shutil.copy(dit.files["bfl"], tmp_path / "a.safetensors")
    shutil.copy(dit.files["bfl"], tmp_path / "b.safetensors")
    with pytest.raises(Flux2Error, match="several .safetensors files"):
        weights.load_transformer(tmp_path, device="cpu", dtype=torch.float32)
    sharded = tmp_path / "sharded"
    shutil.copytree(dit.files["diffusers-sharded"], sharded)
    lost = max(sharded.glob("*.safetensors"))
    lost.unlink()
    with pytest.raises(Flux2Error, match=f"names shards that are not in.*{lost.name}"):
        weights.load_transformer(sharded, device="cpu", dtype=torch.float32)
    (tmp_path / "empty").mkdir()
    with pytest.raises(Flux2Error, match="holds no .safetensors"):
        weights.load_autoencoder(tmp_path / "empty", device="cpu", dtype=torch.float32)


def test_explicit_variant(dit):
    with pytest.raises(Flux2Error, match="variant 'klein-4b' is 3072 wide"):
        weights.load_transformer(dit.files["bfl"], device="cpu", variant="klein-4b", dtype=torch.float32)
    with pytest.raises(Flux2Error, match="unknown variant"):
        weights.load_transformer(dit.files["bfl"], device="cpu", variant="klein-2b", dtype=torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_defaults_to_bf16_and_reads_straight_to_the_device(dit, dit_inputs):
    model, _ = weights.load_transformer(dit.files["comfyui"])
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    x = {k: v.cuda() for k, v in dit_inputs.items()}
    x["img"], x["txt"], x["timesteps"] = x["img"].bfloat16(), x["txt"].bfloat16(), x["timesteps"].bfloat16()
    reference, _ = weights.load_transformer(dit.files["bfl"], device="cpu", dtype=torch.bfloat16)
    cpu = run_ours(reference, {k: v.cpu() for k, v in x.items()})
    assert rel_diff(run_ours(model, x).cpu(), cpu) < 2e-2


def test_all_in_one_checkpoint(dit, ae, te, tmp_path):
    """A ComfyUI all-in-one checkpoint (model.diffusion_model. / vae. / text_encoders.qwen3_4b.transformer.):
    each loader takes its own part and ignores the others."""
    parts = {**{"model.diffusion_model." + k: v for k, v in dit.sd.items()},
             **{"vae." + k: v for k, v in ae.sd.items()},
             **comfyui_state_dict(te.model, "text_encoders.qwen3_4b.transformer.")}
    path = save_prefixed(parts, tmp_path / "flux2-klein-tiny-all-in-one.safetensors")
    model, _ = weights.load_transformer(path, device="cpu", dtype=torch.float32)
    assert_same_state(model, dit.sd)
    assert_same_state(weights.load_autoencoder(path, device="cpu", dtype=torch.float32), ae.sd)
    encoder = weights.load_text_encoder(path, device="cpu", tokenizer=te.tokenizer, dtype=torch.float32)
    assert torch.equal(encoder.model.embed_tokens.weight, te.model.model.embed_tokens.weight)


def test_loaded_weights_do_not_share_the_file(dit, tmp_path):
    """A loaded model keeps its own memory: overwriting the file in place (a re-download) leaves it unchanged."""
    path = shutil.copy(dit.files["comfyui"], tmp_path / "flux-2-klein-tiny.safetensors")
    model, _ = weights.load_transformer(path, device="cpu", dtype=torch.float32)
    header = 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]
    with open(path, "r+b") as f:
        f.seek(header)
        f.write(bytes(path.stat().st_size - header))
    assert_same_state(model, dit.sd)
    assert all(p.data_ptr() % 16 == 0 for p in model.parameters())


def test_cpu_reads_equal_safetensors_own_for_every_dtype(tmp_path):
    """checkpoint.read_tensor (plain reads at the header's offsets) against safetensors' load_file, dtype by dtype,
    with scalars and empty tensors; a file cut after its header was read is an error, not garbage."""
    from flux2_core.weights.checkpoint import TORCH_DTYPES, read_header, read_tensor

    g = torch.Generator().manual_seed(0)
    sd = {f"t_{code}": (torch.randn(5, 7, generator=g) * 50).to(dtype) for code, dtype in TORCH_DTYPES.items()}
    sd.update(scalar=torch.tensor(3.5, dtype=torch.bfloat16), empty=torch.zeros(0, 4), odd=torch.arange(3, dtype=torch.int8))
    path = tmp_path / "all.safetensors"
    save_file(sd, str(path))
    expected = load_file(str(path))
    infos, _ = read_header(path)
    with open(path, "rb", buffering=0) as f:
        for name, info in infos.items():
            got = read_tensor(info, f)
            assert got.dtype == expected[name].dtype and got.shape == expected[name].shape, name
            assert torch.equal(got.view(torch.uint8) if got.dtype.itemsize == 1 else got, expected[name].view(
                torch.uint8) if got.dtype.itemsize == 1 else expected[name]), name
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 10)
    last = max((i for i in infos.values() if i.name != "empty"), key=lambda i: i.offset)
    with open(path, "rb", buffering=0) as f, pytest.raises(Flux2Error, match="ended inside tensor"):
        read_tensor(last, f)


@pytest.mark.parametrize("key,value", [("rope_theta", "abc"), ("axes_dims_rope", [8, "8"]), ("rope_theta", -1),
                                       ("quantization_config", [1]), ("axes_dims_rope", 32)])
def test_config_values_of_the_wrong_kind_are_named(dit, tmp_path, key, value):
    """A diffusers config.json holding a value of the wrong kind is a Flux2Error naming the key, not a traceback."""
    import shutil

    folder = tmp_path / "transformer"
    shutil.copytree(dit.files["diffusers-folder"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(Flux2Error, match=rf"config.json of .* is damaged: {key} is"):
        weights.load_transformer(folder, device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("key,value", [("hidden_size", "wide"), ("num_attention_heads", 0), ("intermediate_size", -5)])
def test_a_text_encoder_config_that_does_not_fit_is_named(te, tmp_path, key, value):
    import shutil

    folder = tmp_path / "text_encoder"
    shutil.copytree(te.files["diffusers-folder"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(Flux2Error, match="config.json of .* does not describe a Qwen3"):
        weights.load_text_encoder(folder, device="cpu", tokenizer=te.tokenizer, dtype=torch.float32)
