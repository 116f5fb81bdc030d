"""ComfyUI's quantized files (int8 per tensor / per row / ConvRot, nvfp4, mxfp8, ConvRot W4A4, 2-D block int8 and
fp8), written by comfy-kitchen's own quantize functions (the converter's block formats by hand), loaded as stored.
The oracle is comfy-kitchen: its dequantize for the weights, its ops (eager backend) for a layer's output."""

from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flux2_core import weights
from flux2_core.adapters.lora import read_adapter
from flux2_core.adapters.patching import set_adapters
from flux2_core.errors import Flux2Error
from flux2_core.storage import rotation
from flux2_core.storage.linear import Linear
from flux2_core.storage.protocol import FLOAT_KINDS, census
from tests.tiny.adapters import lora_state_dict, random_lora
from tests.tiny.layouts import KITCHEN_LAYOUTS, comfy_fp8, comfy_quant, kitchen_weight, save_prefixed
from tests.tiny.transformer import TINY_TRANSFORMER as P
from tests.tiny.transformer import random_bfl_transformer_state_dict
from tests.tiny.transformer import tiny_forward as forward

ck = pytest.importorskip("comfy_kitchen")
from comfy_kitchen.tensor import get_layout_class

PREFIX = "model.diffusion_model."
# a mixed file, as users get them: attention, MLPs, the text input quantized; modulations, the image input and the
# final layer left in float
LAYERS = ["double_blocks.0.img_attn.qkv", "double_blocks.1.txt_mlp.0", "single_blocks.0.linear1",
          "single_blocks.1.linear2", "txt_in"]
W4A4_LAYERS = LAYERS[:4]                   # W4A4 needs inputs in multiples of 64 (txt_in has 96)
ROTATION = {"int8_convrot": 64, "convrot_w4a4": 64}
# max |model - float model| / max |float model| on the tiny model, about 3x what was measured
# (measured: int8 0.0014-0.0024, nvfp4 0.019, mxfp8 0.0051, W4A4 0.024)
MODEL_ERROR = {"int8_tensorwise": 0.01, "int8_rowwise": 0.01, "int8_convrot": 0.01, "nvfp4": 0.06, "mxfp8": 0.02,
               "convrot_w4a4": 0.08}


@pytest.fixture(scope="module")
def float_sd():
    return random_bfl_transformer_state_dict(P, seed=0)


@pytest.fixture(scope="module")
def files(float_sd, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("comfy_quant")
    out = {}
    for kind in KITCHEN_LAYOUTS:
        layers = W4A4_LAYERS if kind == "convrot_w4a4" else LAYERS
        sd = comfy_quant(float_sd, layers, kind, ROTATION.get(kind, 0))
        out[kind] = (save_prefixed(sd, tmp / f"klein-tiny-{kind}.safetensors", PREFIX), sd, layers)
    return out


@pytest.mark.parametrize("kind", list(KITCHEN_LAYOUTS))
def test_stored_weights_equal_comfy_kitchens_dequantize(files, kind):
    path, sd, layers = files[kind]
    model, _ = weights.load_transformer(path, device="cpu", dtype=torch.float32)
    expected_kind = {"int8_tensorwise": "int8", "int8_rowwise": "int8", "int8_convrot": "int8"}.get(kind, kind)
    assert census(model)[{"convrot_w4a4": "w4a4"}.get(expected_kind, expected_kind)] == len(layers)
    for layer in layers:
        ours = model.get_submodule(layer)
        assert torch.equal(ours.weight.view(torch.uint8), sd[layer + ".weight"].view(torch.uint8))   # as stored
        theirs = kitchen_weight(sd, layer, kind).dequantize().float()
        out, inputs = ours.out_features, ours.in_features
        assert torch.equal(ours.float_weight(), theirs[:out, :inputs]), layer


@pytest.mark.parametrize("kind", [k for k in KITCHEN_LAYOUTS if k != "mxfp8"])    # E8M0 exponents hold no zero
def test_a_zero_scale_loads_as_comfy_kitchen_dequantizes_it(float_sd, tmp_path, kind):
    """A layer whose every scale is 0 (an all-zero layer, as a quantizer writes it; ComfyUI loads it): ours holds what
    comfy-kitchen's dequantize makes of it, zeros, and computes zeros (before: refused as damaged)."""
    layer = (W4A4_LAYERS if kind == "convrot_w4a4" else LAYERS)[0]
    sd = comfy_quant(float_sd, [layer], kind, ROTATION.get(kind, 0))
    for name in [k for k in sd if k.startswith(layer + ".weight_scale")]:
        sd[name] = torch.zeros_like(sd[name])
    model, _ = weights.load_transformer(save_prefixed(sd, tmp_path / "zero.safetensors", PREFIX), "cpu", torch.float32)
    ours = model.get_submodule(layer)
    theirs = kitchen_weight(sd, layer, kind).dequantize().float()[: ours.out_features, : ours.in_features]
    assert torch.equal(ours.float_weight(), theirs) and not theirs.any()
    assert not ours(torch.randn(2, ours.in_features)).any()


@pytest.mark.parametrize("kind", list(KITCHEN_LAYOUTS))
def test_a_layer_computes_what_comfy_kitchen_computes(files, kind):
    """Float path: x @ the dequantized weight (comfy-kitchen's, falling back as ComfyUI does off Blackwell). Kernel
    paths (int8 matmul, W4A4's int4 matmul) on comfy-kitchen's eager backend: its own linear on the same tensors."""
    path, sd, layers = files[kind]
    model, _ = weights.load_transformer(path, device="cpu", dtype=torch.float32)
    layer = layers[0]
    ours = model.get_submodule(layer)
    x = torch.randn(2, 7, ours.in_features, generator=torch.Generator().manual_seed(3))
    theirs = kitchen_weight(sd, layer, kind)
    want = torch.nn.functional.linear(x, theirs.dequantize().float()[: ours.out_features, : ours.in_features])
    with torch.no_grad():
        got = ours(x)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    kernel = {"int8": "int8_matmul", "w4a4": "int4_matmul"}.get(ours.kind)
    if kernel:
        setattr(ours, kernel, True)
        with ck.use_backend("eager"), torch.no_grad():
            got = ours(x)
            want = torch.nn.functional.linear(x, theirs)          # comfy-kitchen's dispatch for its layout
        assert torch.equal(got, want)


def test_whole_models_error_against_float_per_format(files, float_sd, tmp_path):
    reference, _ = weights.load_transformer(save_prefixed(float_sd, tmp_path / "float.safetensors", PREFIX),
                                            device="cpu", dtype=torch.float32)
    want = forward(reference)
    errors = {}
    for kind, (path, _, _) in files.items():
        model, _ = weights.load_transformer(path, device="cpu", dtype=torch.float32)
        errors[kind] = ((forward(model) - want).abs().max() / want.abs().max()).item()
    print("model error against float:", {k: round(v, 4) for k, v in errors.items()})
    assert all(0 < errors[k] <= MODEL_ERROR[k] for k in errors), errors


@pytest.mark.parametrize("kind", ["nvfp4", "int8_convrot", "convrot_w4a4"])
def test_a_lora_on_a_stored_layer_equals_it_on_the_dequantized_weights(files, kind):
    path, _sd, layers = files[kind]
    raw = random_lora(P, layers[:2], rank=4, seed=5)
    adapter = read_adapter(lora_state_dict(raw, "kohya", alpha=4.0)[0], P, name="l")
    model, _ = weights.load_transformer(path, device="cpu", dtype=torch.float32)
    reference, _ = weights.load_transformer(path, device="cpu", dtype=torch.float32)
    for layer in layers[:2]:                                     # the float model the stored one stands for
        stored = reference.get_submodule(layer)
        plain = Linear(stored.in_features, stored.out_features)
        plain.weight.data = stored.float_weight()
        reference.set_submodule(layer, plain)
    stored_state = {k: v.clone() for k, v in model.state_dict().items()}
    for merge in (None, True):          # a branch; a merge (int8: quantized again; the others: patched as dequantized)
        set_adapters(model, [(p, 0.8) for p in adapter.patches], merge=merge)
        set_adapters(reference, [(p, 0.8) for p in adapter.patches])
        want = forward(reference)
        bound = 0.02 if merge and kind.startswith("int8") else 2e-5
        assert (forward(model) - want).abs().max() <= bound * want.abs().max(), merge
    set_adapters(model, [])
    assert all(torch.equal(v.view(torch.uint8) if v.dtype.itemsize == 1 else v,
                           stored_state[k].view(torch.uint8) if v.dtype.itemsize == 1 else stored_state[k])
               for k, v in model.state_dict().items())


@pytest.mark.parametrize("kind", list(KITCHEN_LAYOUTS))
def test_memory_held_is_the_files_bytes(files, kind):
    path, sd, _ = files[kind]
    model, _ = weights.load_transformer(path, device="cpu", dtype=torch.float32)
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    in_file = sum(t.numel() * t.element_size() for k, t in sd.items() if not k.endswith(".comfy_quant"))
    assert held == in_file
    assert weights.transformer_bytes(path, torch.float32) == held


def block_file(float_sd, fmt: str, block: int, layers: list[str]) -> tuple[dict, dict]:
    """The converter's 2-D block formats by hand: a scale per block x block of the weight, max |value| = 127 (int8)
    or 448 (fp8) in each block; returns the tensors and the dequantized weights."""
    sd, expected = dict(float_sd), {}
    for layer in layers:
        w = sd.pop(layer + ".weight").float()
        n, k = w.shape
        tiles = w.reshape(n // block, block, k // block, block)
        top = 127.0 if fmt == "int8_blockwise" else 448.0
        scale = tiles.abs().amax(dim=(1, 3)) / top                                  # [n/b, k/b]
        q = tiles / scale[:, None, :, None]
        q = q.round().to(torch.int8) if fmt == "int8_blockwise" else q.to(torch.float8_e4m3fn)
        sd[layer + ".weight"], sd[layer + ".weight_scale"] = q.reshape(n, k), scale
        sd[layer + ".comfy_quant"] = torch.tensor(list(json.dumps({"format": fmt, "group_size": block}).encode()),
                                                  dtype=torch.uint8)
        expected[layer] = (q.float() * scale[:, None, :, None]).reshape(n, k)
    return sd, expected


@pytest.mark.parametrize("fmt", ["int8_blockwise", "float8_e4m3fn_blockwise"])
def test_block_scaled_formats(float_sd, tmp_path, fmt):
    layers = LAYERS[:4]
    sd, expected = block_file(float_sd, fmt, 32, layers)
    model, _ = weights.load_transformer(save_prefixed(sd, tmp_path / "b.safetensors", PREFIX), device="cpu",
                                        dtype=torch.float32)
    for layer in layers:
        assert torch.equal(model.get_submodule(layer).float_weight(), expected[layer])


def test_int8_convrot_at_load_holds_outliers_better(float_sd, tmp_path):
    """``int8="convrot"``: the weights quantized in ConvRot's basis. On weights with outlier inputs (as real
    models have) its error is below per-row int8's; each layer equals comfy-kitchen's ConvRot quantization."""
    sd = dict(float_sd)
    g = torch.Generator().manual_seed(7)
    for layer in LAYERS:
        w = sd[layer + ".weight"].float()
        columns = torch.randperm(w.shape[1], generator=g)[:3]
        w[:, columns] *= 30                                                  # a few loud input channels
        sd[layer + ".weight"] = w
    path = save_prefixed(sd, tmp_path / "outliers.safetensors", PREFIX)
    errors = {}
    for int8 in (True, "convrot"):
        model, _ = weights.load_transformer(path, device="cpu", dtype=torch.float32, int8=int8)
        layer = model.get_submodule("double_blocks.0.img_attn.qkv")
        w = sd["double_blocks.0.img_attn.qkv.weight"]
        errors[int8] = ((layer.float_weight() - w).norm() / w.norm()).item()
        if int8 == "convrot":
            assert layer.rotation == rotation.group_for(layer.in_features) == 64
            q, params = get_layout_class("TensorWiseINT8Layout").quantize(w, per_channel=True, convrot=True,
                                                                           convrot_groupsize=64)
            assert (layer.weight.int() - q.int()).abs().max() <= 1            # our rounding: |w8| <= 127, ties
            assert torch.allclose(layer.weight_scale, params.scale.reshape(-1), rtol=1e-6)
    print("int8 weight error, per row vs ConvRot:", errors)
    assert errors["convrot"] < 0.5 * errors[True], errors


@pytest.mark.parametrize("spec, message", [
    ({"format": "gptq_w4a16"}, "'gptq_w4a16'.*cannot be loaded here"),
    ({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 48}, "not a power of 4"),
    ({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": "big"}, "not a positive whole number"),
    ({"format": "nvfp4", "convrot": True}, "runs for int8, W4A4 and W4A8 only"),
    ({"format": "float8_e4m3fn", "convrot": True}, "runs for int8, W4A4 and W4A8 only"),
])
def test_formats_that_cannot_run_are_refused_by_name_and_layer(files, tmp_path, spec, message):
    _, sd, layers = files["int8_rowwise"]
    sd = dict(sd)
    sd[layers[0] + ".comfy_quant"] = torch.tensor(list(json.dumps(spec).encode()), dtype=torch.uint8)
    path = save_prefixed(sd, tmp_path / "bad.safetensors", PREFIX)
    with pytest.raises(Flux2Error, match=f"layer {PREFIX}{layers[0]}.*{message}|{message}"):
        weights.load_transformer(path, device="cpu")


def test_a_scale_of_the_wrong_size_is_refused(files, tmp_path):
    _, sd, layers = files["nvfp4"]
    sd = dict(sd)
    sd[layers[0] + ".weight_scale"] = sd[layers[0] + ".weight_scale"][:64]
    with pytest.raises(Flux2Error, match="weight_scale.*needs.*corrupt"):
        weights.load_transformer(save_prefixed(sd, tmp_path / "cut.safetensors", PREFIX), device="cpu")


@pytest.mark.parametrize("kind", ["int8_convrot", "nvfp4", "mxfp8", "convrot_w4a4"])
def test_a_quantized_text_encoder_keeps_its_format(tmp_path, kind):
    """A ComfyUI Qwen3 file with quantized attention and MLP layers: kept as stored, weights equal comfy-kitchen's."""
    from flux2_core.models.tokenizer import build_qwen3_tokenizer
    from tests.tiny.text_encoder import build_tiny_qwen3, comfyui_state_dict

    model = build_tiny_qwen3(seed=0)
    layers = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    layers = layers[1:] if kind == "convrot_w4a4" else layers             # W4A4: 64 inputs or more
    sd = comfy_quant(comfyui_state_dict(model), layers, kind, ROTATION.get(kind, 0))
    encoder = weights.load_text_encoder(save_prefixed(sd, tmp_path / "qwen_3_tiny_q.safetensors"), device="cpu",
                                        dtype=torch.float32, tokenizer=build_qwen3_tokenizer())
    for layer in layers:
        ours = encoder.model.get_submodule(layer.removeprefix("model."))
        assert ours.kind == {"int8_convrot": "int8", "convrot_w4a4": "w4a4"}.get(kind, kind)
        theirs = kitchen_weight(sd, layer, kind).dequantize().float()
        assert torch.equal(ours.float_weight(), theirs[: ours.out_features, : ours.in_features])


def test_a_missing_scale_is_refused_and_a_16_bit_scale_is_widened(files, tmp_path):
    _, sd, layers = files["int8_rowwise"]
    cut = {k: v for k, v in sd.items() if k != layers[1] + ".weight_scale"}
    with pytest.raises(Flux2Error, match=f"layer {PREFIX}{layers[1]} is int8 but has no weight_scale"):
        weights.load_transformer(save_prefixed(cut, tmp_path / "cut.safetensors", PREFIX), device="cpu")
    _, fp4, fp4_layers = files["nvfp4"]
    cut = {k: v for k, v in fp4.items() if k != fp4_layers[1] + ".weight_scale_2"}
    with pytest.raises(Flux2Error, match=f"no {PREFIX}{fp4_layers[1]}.weight_scale_2, which its nvfp4 layer needs"):
        weights.load_transformer(save_prefixed(cut, tmp_path / "cut4.safetensors", PREFIX), device="cpu")
    half = dict(sd) | {layers[1] + ".weight_scale": sd[layers[1] + ".weight_scale"].to(torch.bfloat16)}
    model, _ = weights.load_transformer(save_prefixed(half, tmp_path / "half.safetensors", PREFIX), device="cpu")
    assert torch.equal(model.get_submodule(layers[1]).weight_scale, half[layers[1] + ".weight_scale"].float().flatten())


def test_row_scaled_fp8_with_an_input_scale_stays_fp8(float_sd, tmp_path):
    """The converter's float8_e4m3fn_rowwise (a scale per row, [N, 1]) beside an input_scale: kept as fp8 with the
    file's values (the input scale, a static activation scale, is not used: activations quantize per token)."""
    sd, layers = dict(float_sd), LAYERS[:2]
    for layer in layers:
        w = sd.pop(layer + ".weight").float()
        scale = w.abs().amax(dim=1, keepdim=True) / 448.0
        sd[layer + ".weight"], sd[layer + ".weight_scale"] = (w / scale).to(torch.float8_e4m3fn), scale
        sd[layer + ".input_scale"] = torch.tensor(0.5)
        sd[layer + ".comfy_quant"] = torch.tensor(list(b'{"format": "float8_e4m3fn_rowwise"}'), dtype=torch.uint8)
    model, _ = weights.load_transformer(save_prefixed(sd, tmp_path / "rows.safetensors", PREFIX), device="cpu",
                                        dtype=torch.float32)
    for layer in layers:
        ours = model.get_submodule(layer)
        assert ours.kind == "fp8"
        assert torch.equal(ours.float_weight(), sd[layer + ".weight"].float() * sd[layer + ".weight_scale"])


def test_a_scale_of_the_right_size_in_the_wrong_shape_is_refused(tmp_path, float_sd):
    sd, _ = block_file(float_sd, "int8_blockwise", 32, ["single_blocks.0.linear1"])
    sd["single_blocks.0.linear1.weight_scale"] = sd["single_blocks.0.linear1.weight_scale"].T.contiguous()
    with pytest.raises(Flux2Error, match="linear1.weight_scale is torch.float32 .*needs torch.float32"):
        weights.load_transformer(save_prefixed(sd, tmp_path / "t.safetensors", PREFIX), device="cpu")


# ---------------------------------------------------------------------------------------------------------------
# every tensor of a quantized layer in the dtype its format stores, every scale one a quantizer writes
# ---------------------------------------------------------------------------------------------------------------

# the test's own facts, from the writers above: the format name each file kind gives, its tensors' dtypes as written
FORMAT_NAME = {"int8_rowwise": "int8_tensorwise", "int8_convrot": "int8_tensorwise"}
QUANTIZED_KINDS = [*KITCHEN_LAYOUTS, "int8_blockwise", "float8_e4m3fn_blockwise", "float8_e4m3fn", "nvfp4_modelopt"]
# dtypes of one item size: a tensor written as one of them, saved as another, keeps its bytes and changes its meaning
SAME_SIZE = ([torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu],
             [torch.int32, torch.float32])
CODES = {torch.int8: "I8", torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
         torch.float8_e8m0fnu: "F8_E8M0", torch.int32: "I32", torch.float32: "F32"}
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu)


def quantized_file(float_sd, kind: str, layer: str) -> dict[str, torch.Tensor]:
    """The tiny transformer with ``layer`` quantized as ``kind`` by the writers above (comfy-kitchen's quantizers, the
    converter's block formats, ComfyUI's fp8, BFL's nvfp4 by diffusers' quantizer)."""
    if kind in KITCHEN_LAYOUTS:
        return comfy_quant(float_sd, [layer], kind, ROTATION.get(kind, 0))
    if kind.endswith("_blockwise"):
        return block_file(float_sd, kind, 32, [layer])[0]
    if kind == "float8_e4m3fn":
        sd = comfy_fp8(float_sd, [layer])[0]
        sd[layer + ".comfy_quant"] = torch.tensor(list(b'{"format": "float8_e4m3fn"}'), dtype=torch.uint8)
        return sd
    from diffusers.quantizers.bfl.utils import quantize_nvfp4

    sd = dict(float_sd)
    q, block, global_scale = quantize_nvfp4(sd.pop(layer + ".weight"))
    return sd | {layer + ".weight": q, layer + ".weight_scale": block, layer + ".weight_scale_2": global_scale}


def wrong_dtypes(written: torch.dtype) -> list[torch.dtype]:
    """Same item size, another meaning; uint8 holding float8 bytes is ComfyUI's container for them, not wrong."""
    group = next(g for g in SAME_SIZE if written in g)
    return [d for d in group if d != written and not (written in FLOAT8 and d == torch.uint8)]


def set_code(tensor: torch.Tensor, index: int, code: int) -> torch.Tensor:
    """``tensor`` (one byte a value) with the byte at flat ``index`` replaced by ``code``."""
    raw = tensor.contiguous().view(torch.uint8).clone()
    raw.view(-1)[index] = code
    return raw.view(tensor.dtype)


def set_value(tensor: torch.Tensor, index: int, value: float) -> torch.Tensor:
    return set_code(tensor, index, int(torch.tensor([value]).to(tensor.dtype).view(torch.uint8)[0]))


def scale_values(scale: torch.Tensor, index: int) -> dict[str, torch.Tensor]:
    """The scale with a value no per-tensor or per-row scale holds at ``index`` (quantizers clamp their amax above
    zero), as far as its dtype can hold it: negative, zero, NaN, inf in float32; negative, zero, NaN in nvfp4's fp8
    block scales (no inf in e4m3fn); NaN (code 255) in mxfp8's E8M0 exponents (no sign, no zero)."""
    if scale.dtype == torch.float32:
        out = {}
        for name, value in {"negative": -scale.view(-1)[index].abs().item() - 1.0, "zero": 0.0,
                            "NaN": float("nan"), "inf": float("inf")}.items():
            out[name] = scale.clone()
            out[name].view(-1)[index] = value
        return out
    if scale.dtype == torch.float8_e4m3fn:
        return {"negative": set_value(scale, index, -1.0), "zero": set_value(scale, index, 0.0),
                "NaN": set_code(scale, index, 0x7F)}
    return {"NaN": set_code(scale, index, 0xFF)}


def layer_tensors(sd: dict, layer: str) -> list[str]:
    """The names of the layer's quantized tensors (its weight and scales; input_scale and the format object aside)."""
    return sorted(k.removeprefix(layer + ".") for k in sd
                  if k.startswith(layer + ".") and not k.endswith((".comfy_quant", ".input_scale")))


@settings(max_examples=60, deadline=None, database=None)
@given(data=st.data())
def test_a_quantized_layers_tensors_of_a_wrong_dtype_or_damaged_scales_are_refused(float_sd, tmp_path_factory, data):
    """A drawn format and layer: a tensor saved as a wrong dtype of the same item size (its bytes unchanged), or a
    scale with a value no quantizer writes at a drawn position, is a Flux2Error naming the layer, the format and the
    tensor; the file as written, a float32 scale stored in bf16 (widened exactly) and a zero scale (what the
    quantizers write for an all-zero layer, row or block; every dequantize gives zeros there) load, finite."""
    kind, layer = data.draw(st.sampled_from(QUANTIZED_KINDS)), data.draw(st.sampled_from(W4A4_LAYERS))
    sd = quantized_file(float_sd, kind, layer)
    fmt = FORMAT_NAME.get(kind, kind)
    tensor = data.draw(st.sampled_from(layer_tensors(sd, layer)))
    key, written = f"{layer}.{tensor}", sd[f"{layer}.{tensor}"]
    is_scale = tensor != "weight"
    index = data.draw(st.integers(0, written.numel() - 1))
    refused = {f"wrong dtype {CODES[d]}": written.view(d) for d in wrong_dtypes(written.dtype)}
    kept = {"as written": written}
    if is_scale:
        refused |= scale_values(written, index)
        if "zero" in refused:           # what a quantizer writes for an all-zero layer, row or block: dequantized to 0
            kept["a zero scale"] = refused.pop("zero")
        if written.dtype == torch.float32:
            kept["in bf16"] = written.to(torch.bfloat16)
    case = data.draw(st.sampled_from(sorted(refused) + sorted(kept)))
    path = save_prefixed(sd | {key: (refused | kept)[case]}, tmp_path_factory.mktemp("damaged") / "q.safetensors",
                         PREFIX)
    if case in kept:
        model, _ = weights.load_transformer(path, device="cpu", dtype=torch.float32)
        assert model.get_submodule(layer).kind not in FLOAT_KINDS, case
        assert torch.isfinite(model.get_submodule(layer).float_weight()).all(), case
        return
    with pytest.raises(Flux2Error) as error:
        weights.load_transformer(path, device="cpu", dtype=torch.float32)
    message = str(error.value)
    named = [PREFIX + layer, fmt, tensor] + ([case.removeprefix("wrong dtype ")] if case.startswith("wrong") else [])
    assert all(re.search(rf"(?<!\w){re.escape(word)}\b", message) for word in named), (case, message)
