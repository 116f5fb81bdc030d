"""fp8 weight storage: quantization error within e4m3's rounding bound, Fp8Linear equal to a Linear over the
dequantized weight, a quantized transformer equal to the same transformer holding the dequantized weights, and fp8
files (BFL per-row, ComfyUI per-tensor) loading back to the same outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from flux2_core import rope
from flux2_core.errors import Flux2Error
from flux2_core.quant import FP8, Fp8Linear, dequantize_fp8, prepare_fp8, quantize_fp8, quantize_transformer
from flux2_core.transformer import Flux2Transformer
from tests.tiny.transformer import TINY_TRANSFORMER, random_bfl_transformer_state_dict

# e4m3: 3 mantissa bits, so rounding to nearest is off by at most 2^-4 of the value; below 2^-6 (the smallest normal)
# values are spaced 2^-9 apart, so the absolute error there is at most 2^-10. Both in units of the scale.
E4M3_REL, E4M3_ABS = 2.0 ** -4, 2.0 ** -10


def tiny_model() -> Flux2Transformer:
    model = Flux2Transformer(TINY_TRANSFORMER)
    model.load_state_dict(random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=0))
    return model.eval()


def tiny_inputs(batch: int = 2):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch, 16, 128, generator=g), rope.image_ids(batch, 4, 4), torch.tensor([0.7] * batch),
            torch.randn(batch, 6, TINY_TRANSFORMER.context_in_dim, generator=g), rope.text_ids(batch, 6))


@pytest.mark.parametrize("per_row", [True, False])
def test_quantization_error_is_within_e4m3_rounding(per_row):
    w = torch.randn(48, 80, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 48)[:, None]
    w8, scale = quantize_fp8(w, per_row)
    assert w8.dtype == FP8 and scale.shape == ((48,) if per_row else ())
    s = scale[:, None] if per_row else scale
    torch.testing.assert_close((w / s).abs().amax(dim=1 if per_row else None), torch.full_like(scale, 448.0))
    err = (dequantize_fp8(w8, scale) - w).abs()
    assert (err <= E4M3_REL * w.abs() + E4M3_ABS * s).all()
    assert err.max() > 0                                  # it is a real quantization, not a copy


@pytest.mark.parametrize("per_row", [True, False])
def test_fp8_linear_equals_linear_over_dequantized_weight(per_row):
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(64, 96, bias=False)
    torch.nn.init.normal_(linear.weight, generator=g)
    fp8 = Fp8Linear.from_linear(linear, per_row)
    x = torch.randn(3, 7, 64, generator=g)
    expected = F.linear(x, dequantize_fp8(fp8.weight, fp8.weight_scale))
    torch.testing.assert_close(fp8(x), expected, rtol=0, atol=1e-5 * expected.abs().max().item())
    assert fp8.weight.nbytes * 4 == linear.weight.nbytes


def test_quantized_transformer_equals_transformer_with_dequantized_weights():
    model = tiny_model()
    original = model(*tiny_inputs())
    names = quantize_transformer(model)
    assert names and all(n.startswith(("double_blocks", "single_blocks", "double_stream_mod", "single_stream_mod"))
                         for n in names)
    assert not any(n.startswith(("img_in", "txt_in", "time_in", "final_layer")) for n in names)

    # The same architecture holding float32 weights equal to what the fp8 storage stands for.
    reference = tiny_model()
    with torch.no_grad():
        for name in names:
            layer = model.get_submodule(name)
            reference.get_submodule(name).weight.copy_(dequantize_fp8(layer.weight, layer.weight_scale))
    with torch.no_grad():
        ours, expected = model(*tiny_inputs()), reference(*tiny_inputs())
    bound = 1e-4 * expected.abs().max().item()
    assert (ours - expected).abs().max().item() <= bound
    # And fp8 is close to, but not the same as, the original float32 model.
    rel = ((ours - original).abs().max() / original.abs().max()).item()
    assert 0 < rel < 0.1, rel


def test_block_weights_take_a_quarter_of_float32():
    model = tiny_model()
    before = sum(model.get_submodule(n).weight.nbytes for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and n.startswith(("double_blocks", "single_blocks")))
    quantize_transformer(model)
    after = sum(m.weight.nbytes for n, m in model.named_modules() if isinstance(m, Fp8Linear)
                and n.startswith(("double_blocks", "single_blocks")))
    assert after * 4 == before


@pytest.mark.parametrize("layout", ["bfl", "comfyui"])
def test_fp8_file_loads_back_to_the_same_outputs(tmp_path, layout):
    """BFL fp8 files: ``weight`` e4m3 + per-row ``weight_scale``; ComfyUI: per-tensor ``scale_weight`` (+ extra keys)."""
    model = tiny_model()
    quantize_transformer(model, per_row=layout == "bfl")
    sd = dict(model.state_dict())
    if layout == "comfyui":
        sd = {k.replace(".weight_scale", ".scale_weight"): v.reshape(1) if k.endswith("weight_scale") else v
              for k, v in sd.items()}
        sd["scaled_fp8"] = torch.zeros(2, dtype=FP8)
        sd["single_blocks.0.linear1.input_scale"] = torch.ones(())
    save_file(sd, str(tmp_path / "fp8.safetensors"))

    fresh = Flux2Transformer(TINY_TRANSFORMER).eval()
    fresh.load_state_dict(prepare_fp8(fresh, load_file(str(tmp_path / "fp8.safetensors"))))
    assert isinstance(fresh.single_blocks[0].linear1, Fp8Linear) and isinstance(fresh.img_in, torch.nn.Linear)
    with torch.no_grad():
        assert torch.equal(fresh(*tiny_inputs()), model(*tiny_inputs()))


def test_fp8_weight_for_a_missing_layer_is_an_error():
    model = tiny_model()
    with pytest.raises(Flux2Error, match="no matching layer"):
        prepare_fp8(model, {"double_blocks.9.img_attn.qkv.weight": torch.zeros(192, 64, dtype=FP8)})
    with pytest.raises(Flux2Error, match="does not fit"):
        prepare_fp8(model, {"double_blocks.0.img_attn.qkv.weight": torch.zeros(64, 64, dtype=FP8)})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp8 matmul (torch._scaled_mm) needs a CUDA GPU")
def test_fp8_matmul_on_cuda_is_close_to_dequantized_bf16():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 matmul needs compute capability 8.9 or newer")
    g = torch.Generator(device="cuda").manual_seed(0)
    linear = torch.nn.Linear(256, 512, bias=False, device="cuda")
    fp8 = Fp8Linear.from_linear(linear, fp8_matmul=True)
    x = torch.randn(64, 256, device="cuda", generator=g).bfloat16()
    expected = F.linear(x.float(), dequantize_fp8(fp8.weight, fp8.weight_scale))
    # Activations quantized to e4m3 per token add up to 2^-4 relative error per product; summed over 256 products
    # with random signs that is about 2^-4 / sqrt(3) / 16 * sqrt(256) ~ 4% of the typical output, far less at most.
    err = (fp8(x).float() - expected).abs().max() / expected.abs().max()
    assert err < 0.05, err.item()
