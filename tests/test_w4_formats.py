"""comfy-kitchen's grouped 4-bit formats in ComfyUI's files, kept as stored: W4A8 (``asym_w4a8_int8``, written by
comfy-kitchen's own quantizer), SVDQuant W4A4 (``svdquant_w4a4``) and AWQ W4A16 (``awq_w4a16``), the last two written
by their layouts' rules (comfy-kitchen has no quantizer for them: they are calibrated offline). The oracle is
comfy-kitchen: its dequantize for the weights, its dispatch (``F.linear`` on its QuantizedTensor, eager backend) for a
layer's own-format matmul."""

from __future__ import annotations

import json
import re

import pytest
import torch

from flux2_core import weights
from flux2_core.adapters.lora import read_adapter
from flux2_core.adapters.patching import set_adapters
from flux2_core.errors import Flux2Error
from flux2_core.storage.linear import Linear
from flux2_core.storage.protocol import census
from tests.tiny.adapters import lora_state_dict, random_lora
from tests.tiny.layouts import W4_LAYOUTS, save_prefixed, w4_quant, w4_weight
from tests.tiny.transformer import TINY_TRANSFORMER as P
from tests.tiny.transformer import random_bfl_transformer_state_dict
from tests.tiny.transformer import tiny_forward as forward

ck = pytest.importorskip("comfy_kitchen")

PREFIX = "model.diffusion_model."
LAYERS = ["double_blocks.0.img_attn.qkv", "double_blocks.1.txt_mlp.0", "single_blocks.0.linear1",
          "single_blocks.1.linear2"]                    # inputs in multiples of 64 (SVDQuant's group)
KINDS = list(W4_LAYOUTS)
KIND = {"asym_w4a8_int8": "w4a8", "svdquant_w4a4": "svdquant", "awq_w4a16": "awq"}     # the census's names
# W4A8's quantizer options: its default (a codebook, fp8 group scales), uniform codes, asymmetric (a correction),
# float32 group scales
W4A8_OPTIONS = {"codebook": {}, "uniform": {"codebook": False}, "asymmetric": {"symmetric": False},
                "float32 scales": {"scale_dtype": torch.float32}}


@pytest.fixture(scope="module")
def float_sd():
    return random_bfl_transformer_state_dict(P, seed=0)


@pytest.fixture(scope="module")
def files(float_sd, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("w4")
    out = {}
    for kind in KINDS:
        sd = w4_quant(float_sd, LAYERS, kind)
        out[kind] = (save_prefixed(sd, tmp / f"klein-tiny-{kind}.safetensors", PREFIX), sd)
    return out


def load(path):
    return weights.load_transformer(path, device="cpu", dtype=torch.float32)[0]


@pytest.mark.parametrize("kind", KINDS)
def test_kept_as_stored_with_the_files_bytes_and_comfy_kitchens_weights(files, kind):
    path, sd = files[kind]
    model = load(path)
    assert census(model)[KIND[kind]] == len(LAYERS)
    for layer in LAYERS:
        ours = model.get_submodule(layer)
        for name, tensor in ours.state_dict().items():                          # every tensor as stored
            assert torch.equal(tensor.view(torch.uint8), sd[f"{layer}.{name}"].view(torch.uint8)), name
        assert torch.equal(ours.float_weight(), w4_weight(sd, layer, kind).dequantize().float()), layer
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert held == sum(t.numel() * t.element_size() for k, t in sd.items() if not k.endswith(".comfy_quant"))
    assert weights.transformer_bytes(path, torch.float32) == held


@pytest.mark.parametrize("option", list(W4A8_OPTIONS))
def test_each_of_w4a8s_quantizer_options_dequantizes_as_comfy_kitchen(float_sd, tmp_path, option):
    sd = w4_quant(float_sd, LAYERS[:2], "asym_w4a8_int8", **W4A8_OPTIONS[option])
    model = load(save_prefixed(sd, tmp_path / "w4a8.safetensors", PREFIX))
    for layer in LAYERS[:2]:
        ours = model.get_submodule(layer)
        assert set(ours.state_dict()) == {k.removeprefix(layer + ".") for k in sd if k.startswith(layer + ".weight")}
        assert torch.equal(ours.float_weight(), w4_weight(sd, layer, "asym_w4a8_int8").dequantize().float())


def test_bf16_tensors_are_kept_in_bf16(float_sd, tmp_path):
    """SVDQuant's and AWQ's small tensors as files have them (bf16): held in bf16, the weight computed in float32
    from their exact values, equal to comfy-kitchen's dequantize in float32 of the same values widened."""
    for kind in ("svdquant_w4a4", "awq_w4a16"):
        sd = w4_quant(float_sd, LAYERS[:1], kind, dtype=torch.bfloat16)
        ours = load(save_prefixed(sd, tmp_path / f"{kind}.safetensors", PREFIX)).get_submodule(LAYERS[0])
        assert all(t.dtype == torch.bfloat16 for n, t in ours.state_dict().items() if n != "weight")
        widened = {k: v.float() if v.dtype == torch.bfloat16 else v for k, v in sd.items()}
        assert torch.equal(ours.float_weight(), w4_weight(widened, LAYERS[0], kind).dequantize())


@pytest.mark.parametrize("kind", KINDS)
def test_a_layer_computes_what_comfy_kitchen_computes(files, kind):
    """Dequantized (the CPU's path): x @ comfy-kitchen's dequantized weight. In its own format (``kitchen_matmul``,
    on where comfy-kitchen has a GPU kernel), run here on its eager backend: its dispatch on the same tensors, bit for
    bit (W4A8: int8 activations; SVDQuant: int4 activations and the low-rank branch; AWQ: 16-bit activations)."""
    path, sd = files[kind]
    ours = load(path).get_submodule(LAYERS[1])
    x = torch.randn(2, 7, ours.in_features, generator=torch.Generator().manual_seed(3))
    theirs = w4_weight(sd, LAYERS[1], kind)
    want = torch.nn.functional.linear(x, theirs.dequantize().float())
    with torch.no_grad():
        got = ours(x)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    ours.kitchen_matmul = True
    with ck.use_backend("eager"), torch.no_grad():
        got, want = ours(x), torch.nn.functional.linear(x, theirs)
    assert torch.equal(got, want)


def test_kitchen_matmul_is_off_on_the_cpu(files):
    from flux2_core.storage.matmul import choose_matmuls

    model = load(files["asym_w4a8_int8"][0])
    choice = choose_matmuls(model, "cpu", torch.float32)
    assert any("w4a8 matmul in its own format: off" in n for n in choice.notes), choice.notes
    assert set(choice.used) == {"w4a8"} and choice.note_for("w4a8") in choice.notes      # the kind the model holds
    assert not any(getattr(m, "kitchen_matmul", False) for m in model.modules())


@pytest.mark.parametrize("kind", KINDS)
def test_a_whole_flux2_model_equals_the_float_model_of_its_dequantized_weights(files, float_sd, tmp_path, kind):
    path, sd = files[kind]
    values = dict(float_sd) | {f"{layer}.weight": w4_weight(sd, layer, kind).dequantize().float() for layer in LAYERS}
    reference = load(save_prefixed(values, tmp_path / "values.safetensors", PREFIX))
    want, got = forward(reference), forward(load(path))
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert (want - forward(load(save_prefixed(float_sd, tmp_path / "f.safetensors", PREFIX)))).abs().max() > 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_flux3_file_keeps_them(tmp_path, kind):
    """FLUX 3's blocks (inputs in multiples of 64) in each format: kept as stored, and a run equal to the float
    model holding comfy-kitchen's dequantized weights."""
    from dataclasses import replace

    from safetensors.torch import save_file

    from flux2_core import pipeline
    from flux2_core.families.flux3.files import quantizable
    from tests.tiny.autoencoder import build_diffusers_autoencoder, save_bfl_autoencoder
    from tests.tiny.flux3 import random_flux3_state_dict, save_tiny_qwen3_vl, tiny_flux3

    params = replace(tiny_flux3(True), context_in_dim=8 * 32)
    state = random_flux3_state_dict(params, seed=6)
    te = save_tiny_qwen3_vl(tmp_path / "text_encoder", seed=1)
    ae = save_bfl_autoencoder(build_diffusers_autoencoder(2), tmp_path / "ae.safetensors")
    layers = sorted(k.removesuffix(".weight") for k in state if quantizable(k) and k.endswith(".weight")
                    and state[k].ndim == 2 and state[k].shape[1] % 64 == 0)
    stored = w4_quant(state, layers, kind)
    path = save_prefixed(stored, tmp_path / f"flux3-image-klein-{kind}.safetensors", PREFIX)
    quantized = pipeline.load_models(path, te, ae, device="cpu", dtype=torch.float32)
    assert census(quantized.transformer)[KIND[kind]] == len(layers) > 30
    values = dict(state) | {f"{layer}.weight": w4_weight(stored, layer, kind).dequantize().float() for layer in layers}
    save_file({k: v.contiguous() for k, v in values.items()}, str(tmp_path / "values.safetensors"))
    floats = pipeline.load_models(tmp_path / "values.safetensors", te, ae, device="cpu", dtype=torch.float32)
    runs = [pipeline.generate(m, "a fox", width=64, height=48, steps=2, seed=3) for m in (quantized, floats)]
    assert torch.allclose(runs[0].latents, runs[1].latents, rtol=0, atol=1e-5 * runs[1].latents.abs().max())


@pytest.mark.parametrize("kind", KINDS)
def test_a_lora_on_a_stored_layer_equals_it_merged_into_the_float_model(files, kind):
    """A LoRA as a branch beside the stored layer, and merged (patching the weight as it is dequantized), equals the
    float model holding the dequantized weights with the LoRA merged into them; removed, the stored tensors are
    untouched."""
    path, _sd = files[kind]
    raw = random_lora(P, LAYERS[:2], rank=4, seed=5)
    adapter = read_adapter(lora_state_dict(raw, "kohya", alpha=4.0)[0], P, name="l")
    model, reference = load(path), load(path)
    for layer in LAYERS:                                          # the float model the stored one stands for
        stored = reference.get_submodule(layer)
        plain = Linear(stored.in_features, stored.out_features)
        plain.weight.data = stored.float_weight()
        reference.set_submodule(layer, plain)
    set_adapters(reference, [(p, 0.8) for p in adapter.patches], merge=True)
    want = forward(reference)
    stored_state = {k: v.clone() for k, v in model.state_dict().items()}
    for merge in (None, True):
        set_adapters(model, [(p, 0.8) for p in adapter.patches], merge=merge)
        assert (forward(model) - want).abs().max() <= 2e-5 * want.abs().max(), merge
    set_adapters(model, [])
    assert all(torch.equal(v.view(torch.uint8), stored_state[k].view(torch.uint8))
               for k, v in model.state_dict().items())


@pytest.mark.parametrize("kind", KINDS)
def test_a_quantized_text_encoder_keeps_its_format(tmp_path, kind):
    from flux2_core.models.tokenizer import build_qwen3_tokenizer
    from tests.tiny.text_encoder import build_tiny_qwen3, comfyui_state_dict

    model = build_tiny_qwen3(seed=0)
    sd = comfyui_state_dict(model)
    layers = [k.removesuffix(".weight") for k in ("model.layers.0.self_attn.q_proj.weight",
                                                  "model.layers.1.mlp.down_proj.weight") if sd[k].shape[1] % 64 == 0]
    assert layers
    sd = w4_quant(sd, layers, kind)
    encoder = weights.load_text_encoder(save_prefixed(sd, tmp_path / "qwen_3_tiny_q.safetensors"), device="cpu",
                                        dtype=torch.float32, tokenizer=build_qwen3_tokenizer())
    for layer in layers:
        ours = encoder.model.get_submodule(layer.removeprefix("model."))
        assert ours.kind == KIND[kind]
        assert torch.equal(ours.float_weight(), w4_weight(sd, layer, kind).dequantize().float())


# ---------------------------------------------------------------------------------------------------------------
# refusals: each names the layer, the format and the tensor or setting
# ---------------------------------------------------------------------------------------------------------------

def spec_of(sd: dict, layer: str) -> dict:
    return json.loads(bytes(sd[layer + ".comfy_quant"].tolist()))


def with_spec(sd: dict, layer: str, **changes) -> dict:
    spec = spec_of(sd, layer) | changes
    return sd | {layer + ".comfy_quant": torch.tensor(list(json.dumps(spec).encode()), dtype=torch.uint8)}


def refused(sd: dict, tmp_path, *words: str) -> str:
    with pytest.raises(Flux2Error) as error:
        load(save_prefixed(sd, tmp_path / "bad.safetensors", PREFIX))
    message = str(error.value)
    assert all(re.search(rf"(?<!\w){re.escape(w)}(?!\w)", message) for w in words), message
    return message


BAD_GROUPS = {"asym_w4a8_int8": 12, "svdquant_w4a4": 32, "awq_w4a16": 48}


@pytest.mark.parametrize("kind", KINDS)
def test_a_wrong_group_size_is_refused(files, tmp_path, kind):
    _, sd = files[kind]
    refused(with_spec(sd, LAYERS[0], group_size=BAD_GROUPS[kind]), tmp_path, PREFIX + LAYERS[0], kind,
            "group_size", str(BAD_GROUPS[kind]))


@pytest.mark.parametrize("kind", KINDS)
def test_a_missing_tensor_is_refused(files, tmp_path, kind):
    _, sd = files[kind]
    for name in sorted(k.removeprefix(LAYERS[1] + ".") for k in sd if k.startswith(LAYERS[1] + ".weight_")):
        if name in ("weight_codebook", "weight_correction"):
            continue                                              # optional: the codes are then uniform / symmetric
        cut = {k: v for k, v in sd.items() if k != f"{LAYERS[1]}.{name}"}
        refused(cut, tmp_path, PREFIX + LAYERS[1], kind, name)


WRONG = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8,
         torch.int8: torch.uint8}


@pytest.mark.parametrize("kind", KINDS)
def test_a_tensor_of_a_wrong_dtype_is_refused(files, tmp_path, kind):
    """Each tensor saved as another dtype of its item size (its bytes unchanged): refused from the header."""
    _, sd = files[kind]
    for key in sorted(k for k in sd if k.startswith(LAYERS[2] + ".weight")):
        bad = sd[key].view(WRONG[sd[key].dtype])
        refused(sd | {key: bad}, tmp_path, PREFIX + LAYERS[2], kind, key.removeprefix(LAYERS[2] + "."))


def test_damaged_scales_and_other_layouts_are_refused(files, tmp_path):
    _, w4a8 = files["asym_w4a8_int8"]
    key = LAYERS[0] + ".weight_s_channel"
    refused(w4a8 | {key: -w4a8[key]}, tmp_path, PREFIX + LAYERS[0], "asym_w4a8_int8", "weight_s_channel")
    _, svd = files["svdquant_w4a4"]
    key = LAYERS[0] + ".weight_smooth_factor"
    refused(svd | {key: torch.zeros_like(svd[key])}, tmp_path, PREFIX + LAYERS[0], "weight_smooth_factor")
    refused(with_spec(svd, LAYERS[0], act_unsigned=True), tmp_path, PREFIX + LAYERS[0], "svdquant_w4a4",
            "act_unsigned")
    key = LAYERS[0] + ".weight_proj_up"
    refused(svd | {key: svd[key][:, :2].contiguous()}, tmp_path, PREFIX + LAYERS[0], "weight_proj_up")
    six_bit = w4_quant(random_bfl_transformer_state_dict(P, seed=0), LAYERS[:1], "asym_w4a8_int8", bits=6)
    codes, groups = six_bit[LAYERS[0] + ".weight"], six_bit[LAYERS[0] + ".weight_s_rel"]
    if codes.shape[1] * 8 == groups.shape[1] * 16 * 6:       # comfy-kitchen before 0.2.40 writes 4-bit codes for it
        refused(six_bit, tmp_path, PREFIX + LAYERS[0], "asym_w4a8_int8", "6-bit")
