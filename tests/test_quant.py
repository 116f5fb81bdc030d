"""fp8 weight storage: quantization error within e4m3's rounding bound, Fp8Linear equal to a Linear over the
dequantized weight, a quantized transformer equal to the same transformer holding the dequantized weights, and fp8
files (BFL per-row, ComfyUI per-tensor, diffusers split q/k/v) loading as fp8 with the file's own values. The models
and layers run in the device mode's dtype and device (``tests/device.py``); the quantization arithmetic itself is
float32 in every mode."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from flux2_core.errors import Flux2Error
from flux2_core.families.flux2.files import quantizable
from flux2_core.families.flux2.transformer import Flux2Transformer
from flux2_core.models import rope
from flux2_core.storage import kernels, quant
from flux2_core.storage.quant import FP8, Fp8Linear, count_fp8, dequantize_fp8, quantize_fp8, quantize_transformer
from flux2_core.weights import load_transformer
from tests.device import DEVICE, DTYPE, assert_close, relative_error, to
from tests.fused import fused_on, graphs, ran_fused  # noqa: F401 (fixtures)
from tests.tiny.layouts import comfy_fp8, comfy_fp8_metadata, save_prefixed
from tests.tiny.transformer import TINY_TRANSFORMER, random_bfl_transformer_state_dict

# e4m3: 3 mantissa bits, so rounding to nearest is off by at most 2^-4 of the value; below 2^-6 (the smallest normal)
# values are spaced 2^-9 apart, so the absolute error there is at most 2^-10. Both in units of the scale.
E4M3_REL, E4M3_ABS = 2.0 ** -4, 2.0 ** -10


def tiny_model(dtype: torch.dtype = DTYPE) -> Flux2Transformer:
    model = Flux2Transformer(TINY_TRANSFORMER)
    model.load_state_dict(random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=0))
    return to(model, dtype).eval()


def tiny_inputs(batch: int = 2):
    """Inputs in DTYPE on DEVICE (drawn on the CPU: the same numbers in every mode)."""
    g = torch.Generator().manual_seed(1)
    return tuple(to(x) for x in (
        torch.randn(batch, 16, 128, generator=g), rope.image_ids(batch, 4, 4), torch.tensor([0.7] * batch),
        torch.randn(batch, 6, TINY_TRANSFORMER.context_in_dim, generator=g), rope.text_ids(batch, 6)))


@pytest.mark.parametrize("per_row", [True, False])
def test_quantization_error_is_within_e4m3_rounding(per_row):
    w = torch.randn(48, 80, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 48)[:, None]
    w = w.to(DEVICE)
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
    fp8 = Fp8Linear.from_linear(to(linear), per_row)
    x = to(torch.randn(3, 7, 64, generator=g))
    expected = F.linear(x, dequantize_fp8(fp8.weight, fp8.weight_scale, DTYPE))
    assert fp8(x).dtype == DTYPE
    # one layer: in low precision the dequantized weight rounded to DTYPE against fp8 * scale in one kernel
    assert_close(fp8(x), expected, "transformer", rtol=0, atol=1e-5 * expected.abs().max().item())
    assert fp8.weight.nbytes * DTYPE.itemsize == linear.weight.nbytes


def test_quantized_transformer_equals_transformer_with_dequantized_weights():
    model = tiny_model()
    original = model(*tiny_inputs())
    names = quantize_transformer(model, quantizable)
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
    assert_close(ours, expected, "transformer", rtol=0, atol=1e-4 * expected.abs().max().item())
    # And fp8 is close to, but not the same as, the original model.
    rel = relative_error(ours, original)
    assert 0 < rel < 0.1, rel


def test_block_weights_take_one_byte_per_weight():
    model = tiny_model()
    before = sum(model.get_submodule(n).weight.nbytes for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and n.startswith(("double_blocks", "single_blocks")))
    quantize_transformer(model, quantizable)
    after = sum(m.weight.nbytes for n, m in model.named_modules() if isinstance(m, Fp8Linear)
                and n.startswith(("double_blocks", "single_blocks")))
    assert after * DTYPE.itemsize == before           # a quarter of float32, half of bf16


def fp8_file(tmp_path, layout: str) -> tuple[torch.nn.Module, str]:
    """A tiny transformer quantized as each fp8 layout stores it, written to a file; returns (the model, path).

    bfl: ``weight`` e4m3 + per-row ``weight_scale`` [N] (+ ``input_scale``); comfyui: ComfyUI's fp8mixed, per-tensor
    ``weight_scale`` [] named in the ``_quantization_metadata``, behind ``model.diffusion_model.``; comfyui-old: the
    older ``scaled_fp8`` files with ``scale_weight`` [1]."""
    model = tiny_model()
    quantize_transformer(model, quantizable, per_row=layout == "bfl")
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    names = [n for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    meta, prefix = None, ""
    if layout == "bfl":
        sd.update({n + ".input_scale": torch.ones(()) for n in names})
    elif layout == "comfyui":
        sd.update({n + ".input_scale": torch.ones(()) for n in names})
        meta = comfy_fp8_metadata(names)
        prefix = "model.diffusion_model."
    else:
        sd = {k.replace(".weight_scale", ".scale_weight"): v.reshape(1) if k.endswith(".weight_scale") else v
              for k, v in sd.items()}
        sd["scaled_fp8"] = torch.zeros(2, dtype=FP8)
    return model, save_prefixed(sd, tmp_path / f"flux-2-klein-tiny-{layout}-fp8.safetensors", prefix, meta)


@pytest.mark.parametrize("layout", ["bfl", "comfyui", "comfyui-old"])
def test_fp8_file_stays_fp8_with_its_own_values_and_scales(tmp_path, layout):
    model, path = fp8_file(tmp_path, layout)
    loaded, _ = load_transformer(path, DEVICE, DTYPE)
    names = [n for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    assert [n for n, m in loaded.named_modules() if isinstance(m, Fp8Linear)] == names
    for name in names:                                   # the file's bytes, and its scale on every row
        ours, theirs = loaded.get_submodule(name), model.get_submodule(name)
        assert ours.weight.dtype == FP8 and torch.equal(ours.weight.view(torch.uint8), theirs.weight.view(torch.uint8))
        assert torch.equal(ours.weight_scale, theirs.weight_scale.expand(ours.out_features))
    assert type(loaded.img_in) is type(model.img_in) and loaded.img_in.weight.dtype == DTYPE
    with torch.no_grad():
        out = loaded(*tiny_inputs())
        assert torch.equal(out, model(*tiny_inputs()))
        # batch invariant, as in float (in low precision, other kernels for another batch may round otherwise)
        assert_close(out[1:], loaded(*[t[1:] for t in tiny_inputs()]), "transformer", rtol=0, atol=0)

    dequantized, _ = load_transformer(path, DEVICE, DTYPE, fp8=False)            # fp8=False: plain float layers
    assert count_fp8(dequantized) == 0
    with torch.no_grad():
        expected = dequantized(*tiny_inputs())
        assert_close(loaded(*tiny_inputs()), expected, "transformer", rtol=0, atol=1e-5 * expected.abs().max().item())


def test_fp8_true_quantizes_what_the_file_stores_in_full_precision(tmp_path):
    """A float32 file with fp8=True: the block layers quantized per row while reading, exactly as quantize_transformer
    does after a full load; an fp8mixed file: its fp8 layers kept as they are, its other block layers quantized."""
    sd = random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=0)
    path = save_prefixed(sd, tmp_path / "flux-2-klein-tiny.safetensors")
    loaded, _ = load_transformer(path, DEVICE, DTYPE, fp8=True)
    expected = tiny_model(torch.float32)     # quantized from the file's float32 values, not from their DTYPE rounding
    names = quantize_transformer(expected, quantizable)
    assert [n for n, m in loaded.named_modules() if isinstance(m, Fp8Linear)] == names
    got, want = loaded.state_dict(), expected.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8))
                                         if want[k].dtype == FP8 else torch.equal(got[k], want[k].to(got[k].dtype))
                                         for k in want)
    assert count_fp8(load_transformer(path, DEVICE, DTYPE)[0]) == 0     # None: a float file stays float

    kept = "single_blocks.1.linear1"
    mixed, meta = comfy_fp8(sd, [kept])
    path = save_prefixed(mixed, tmp_path / "flux-2-klein-tiny-fp8mixed.safetensors", "", meta)
    loaded, _ = load_transformer(path, DEVICE, DTYPE, fp8=True)
    assert count_fp8(loaded) == len(names)
    layer = loaded.get_submodule(kept)
    assert torch.equal(layer.weight.view(torch.uint8).cpu(), mixed[kept + ".weight"].view(torch.uint8))
    assert torch.equal(layer.weight_scale.cpu(), mixed[kept + ".weight_scale"].expand(layer.out_features))
    assert count_fp8(load_transformer(path, DEVICE, DTYPE)[0]) == 1         # None: only the file's fp8 layer


def test_fp8_layers_split_over_several_file_tensors_are_quantized_per_row(tmp_path):
    """diffusers names layers otherwise and keeps q, k and v apart: a renamed fp8 layer (here plain float8, no scale)
    keeps its values; fp8 parts are joined in float32 and quantized again per row, within e4m3's rounding."""
    from tests.tiny.transformer import diffusers_transformer_from_bfl_file, save_diffusers_transformer

    sd = random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=0)
    bfl = save_prefixed(sd, tmp_path / "flux-2-klein-tiny.safetensors")
    save_diffusers_transformer(diffusers_transformer_from_bfl_file(bfl, TINY_TRANSFORMER, tmp_path / "config"),
                               tmp_path / "transformer")
    file = tmp_path / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(file))
    parts = [f"transformer_blocks.0.attn.to_{x}.weight" for x in "qkv"]
    renamed = "transformer_blocks.0.attn.to_out.0.weight"               # one file tensor: kept as it is
    state.update({k: (state[k] * 8).to(FP8) for k in [*parts, renamed]})
    save_file(state, str(file))
    loaded, _ = load_transformer(tmp_path / "transformer", DEVICE, DTYPE)
    proj = loaded.get_submodule("double_blocks.0.img_attn.proj")
    assert isinstance(proj, Fp8Linear)
    assert torch.equal(proj.weight.view(torch.uint8).cpu(), state[renamed].view(torch.uint8))
    assert torch.equal(proj.weight_scale.cpu(), torch.ones(proj.out_features))
    layer = loaded.get_submodule("double_blocks.0.img_attn.qkv")
    assert isinstance(layer, Fp8Linear) and count_fp8(loaded) == 2
    joined = torch.cat([state[k].float() for k in parts])
    scale = layer.weight_scale.cpu()
    err = (dequantize_fp8(layer.weight.cpu(), scale) - joined).abs()
    assert (err <= E4M3_REL * joined.abs() + E4M3_ABS * scale[:, None]).all()


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


def test_fp8_matmul_gate_takes_bf16_activations_only(monkeypatch):
    """On CUDA (faked: the gate's device check says yes) only bf16 activations with 16-aligned sizes go to
    torch._scaled_mm; fp16 (whose output some cuBLAS versions cannot write) and fp32 do not."""
    from flux2_core.storage import quant

    monkeypatch.setattr(quant, "FP8_MATMUL_DEVICES", {"meta"})
    w8 = torch.zeros(32, 64, dtype=FP8, device="meta")
    assert quant._scaled_mm_ok(torch.empty(4, 64, dtype=torch.bfloat16, device="meta"), w8)
    for dtype in (torch.float16, torch.float32):
        assert not quant._scaled_mm_ok(torch.empty(4, 64, dtype=dtype, device="meta"), w8)
    assert not quant._scaled_mm_ok(torch.empty(4, 56, dtype=torch.bfloat16, device="meta"), w8[:, :56])  # K % 16
    assert not quant._scaled_mm_ok(torch.empty(4, 64, dtype=torch.bfloat16, device="meta"), w8.to(torch.float8_e5m2))
    monkeypatch.setattr(quant, "FP8_MATMUL_DEVICES", {"cuda"})
    assert not quant._scaled_mm_ok(torch.empty(4, 64, dtype=torch.bfloat16, device="meta"), w8)


def test_fp16_activations_use_the_dequantizing_path(monkeypatch):
    """fp8_matmul=True with fp16 activations on 'CUDA' (faked): the layer never calls the fp8 matmul and gives the
    matmul over the dequantized weight, in fp16."""
    from flux2_core.storage import quant

    def no_fp8(*args):
        raise AssertionError("fp16 activations must not reach torch._scaled_mm")

    monkeypatch.setattr(quant, "FP8_MATMUL_DEVICES", {"cuda", "cpu"})
    monkeypatch.setattr(quant, "_fp8_matmul", no_fp8)
    g = torch.Generator().manual_seed(0)
    layer = Fp8Linear.from_linear(torch.nn.Linear(64, 32, bias=False), fp8_matmul=True)
    x = torch.randn(4, 64, generator=g)
    got = layer(x.half())
    want = x @ dequantize_fp8(layer.weight, layer.weight_scale).t()
    assert got.dtype == torch.float16
    assert (got.float() - want).abs().max() <= 2e-3 * want.abs().max()          # fp16 rounding of x and of y


def fake_gpu(monkeypatch, capability: tuple[int, int], name: str = "NVIDIA H100", failure: str | None = None) -> None:
    from flux2_core.storage import quant

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(quant, "scaled_mm_failure", lambda device: failure)     # the probe matmul, faked too


@pytest.mark.parametrize("device,capability,dtype,choice,note", [
    ("cuda", (9, 0), torch.bfloat16, "auto", "fp8 matmul: on"),                               # Hopper
    ("cuda", (8, 9), torch.bfloat16, "auto", "fp8 matmul: on"),                               # Ada
    ("cuda", (8, 6), torch.bfloat16, "auto", ("fp8 matmul: off (fp8 matmul needs compute capability 8.9 or newer "
                                             "(Ada, Hopper, Blackwell); NVIDIA RTX 3090 is 8.6); the fp8 weights "
                                             "compute in bfloat16")),
    ("cuda", (9, 0), torch.float16, "auto", ("fp8 matmul: off (fp8 matmul writes bfloat16; this model computes in "
                                            "float16); the fp8 weights compute in float16")),
    ("cpu", None, torch.float32, "auto", ("fp8 matmul: off (fp8 matmul needs an NVIDIA GPU; this model runs on cpu); "
                                         "the fp8 weights compute in float32")),
    ("cuda", (9, 0), torch.bfloat16, False, "fp8 matmul: off (turned off); the fp8 weights compute in bfloat16"),
    ("cuda", (9, 0), torch.bfloat16, True, "fp8 matmul: on"),
])
def test_fp8_matmul_is_used_where_the_gpu_supports_it(monkeypatch, device, capability, dtype, choice, note):
    """The GPU is faked (capability and name); nothing runs. auto turns fp8 matmul on for the fp8 layers exactly on
    GPUs with fp8 tensor cores and bf16 compute, and the note says why not elsewhere; plain layers are left alone."""
    from flux2_core.storage import quant

    if capability:
        fake_gpu(monkeypatch, capability, "NVIDIA RTX 3090" if capability < (8, 9) else "NVIDIA H100")
    model = torch.nn.Sequential(Fp8Linear.from_linear(torch.nn.Linear(32, 32, bias=False)),
                                torch.nn.Linear(32, 16, bias=False))
    on = note == "fp8 matmul: on"
    assert quant.use_fp8_matmul(model, choice, torch.device(device), dtype) == (on, note)
    assert model[0].fp8_matmul is on and not hasattr(model[1], "fp8_matmul")


def test_fp8_matmul_refusals_say_why(monkeypatch):
    from flux2_core.storage import quant

    fake_gpu(monkeypatch, (8, 6), "NVIDIA RTX 3090")
    fp8_model = torch.nn.Sequential(Fp8Linear.from_linear(torch.nn.Linear(32, 32, bias=False)))
    with pytest.raises(Flux2Error, match="cannot use fp8 matmul: fp8 matmul needs compute capability 8.9"):
        quant.use_fp8_matmul(fp8_model, True, torch.device("cuda"), torch.bfloat16)
    plain = torch.nn.Sequential(torch.nn.Linear(32, 32, bias=False))
    assert quant.use_fp8_matmul(plain, "auto", torch.device("cuda"), torch.bfloat16) == (False, "")
    with pytest.raises(Flux2Error, match="needs fp8 weights"):
        quant.use_fp8_matmul(plain, True, torch.device("cuda"), torch.bfloat16)
    with pytest.raises(Flux2Error, match="'auto', True or False"):
        quant.use_fp8_matmul(fp8_model, "yes", torch.device("cuda"), torch.bfloat16)


def test_fp8_matmul_stays_off_where_this_torch_cannot_run_it(monkeypatch):
    """A GPU with fp8 tensor cores but a torch whose _scaled_mm lacks per-row scales there: the probe's error is
    the reason, instead of a RuntimeError in the middle of a generation."""
    from flux2_core.storage import quant

    fake_gpu(monkeypatch, (12, 0), "NVIDIA RTX 5090", failure="CUDA error: operation not supported")
    model = torch.nn.Sequential(Fp8Linear.from_linear(torch.nn.Linear(32, 32, bias=False)))
    on, note = quant.use_fp8_matmul(model, "auto", torch.device("cuda"), torch.bfloat16)
    assert not on and not model[0].fp8_matmul
    assert ("torch._scaled_mm with per-row scales fails on NVIDIA RTX 5090 with this torch "
            f"({torch.__version__}): CUDA error: operation not supported") in note



# ---------------------------------------------------------------------------------------------------------------
# fp8 matmul's activation quantization as one fused kernel (flux2_core/storage/kernels.py): the plain ops' values to the bit.
# torch._scaled_mm runs on the CPU too (this torch), so the whole fp8 matmul path is checked here, the GPU's
# gate (`FP8_MATMUL_DEVICES`) opened to the CPU; on a GPU the device mode runs the same tests there.
# ---------------------------------------------------------------------------------------------------------------

def fp8_matmul_runs_here() -> str | None:
    """Why torch._scaled_mm with per-row scales cannot run on the device mode's device (None when it can)."""
    if DEVICE.type == "cuda" and torch.cuda.get_device_capability(DEVICE) < (8, 9):
        return "fp8 matmul needs compute capability 8.9 or newer"
    try:
        torch._scaled_mm(torch.ones(16, 16, device=DEVICE).to(FP8), torch.ones(16, 16, device=DEVICE).to(FP8).t(),
                         scale_a=torch.ones(16, 1, device=DEVICE), scale_b=torch.ones(1, 16, device=DEVICE),
                         out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as error:
        return f"torch._scaled_mm does not run on {DEVICE.type} here: {str(error).splitlines()[0]}"
    return None


needs_scaled_mm = pytest.mark.skipif(fp8_matmul_runs_here() is not None, reason=str(fp8_matmul_runs_here()))


def activations(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """bf16 [rows, cols] on DEVICE whose rows span 1e-4 to 1e4 in size; a zero row and a row of one spike."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-4, 4, rows)[:, None]
    if rows > 2:
        x[1] = 0
        x[2] = 0
        x[2, cols // 2] = -3e4
    return x.bfloat16().to(DEVICE)


def plain_then_fused(monkeypatch, compute):
    """compute() with the fused kernels off (FLUX2_NO_FUSED), then on: (plain, fused)."""
    monkeypatch.setenv(kernels.OFF_VARIABLE, "1")
    kernels.forget()
    plain = compute()
    monkeypatch.delenv(kernels.OFF_VARIABLE)
    kernels.forget()
    return plain, compute()


@pytest.mark.usefixtures("fused_on")
def test_fused_activation_quantization_equals_the_plain_ops():
    """Per token: the scale is the row's max |x| times 1/448 and every value within e4m3's rounding of x / scale,
    the same bits as the plain ops, at every size from one graph (and one more for a single token)."""
    before = graphs()
    for rows, cols in [(64, 256), (7, 3072), (300, 96), (1, 512), (1, 64), (33, 1024)]:
        x = activations(rows, cols, seed=rows)
        x8, scale = kernels.call(quant.quantize_rows, x, dynamic=(0, 1))
        plain8, plain_scale = quant.quantize_rows(x)
        assert x8.dtype == FP8 and x8.shape == (rows, cols) and scale.shape == (rows, 1)
        assert torch.equal(x8.view(torch.uint8), plain8.view(torch.uint8)) and torch.equal(scale, plain_scale)
        expected_scale = (x.float().abs().amax(dim=1, keepdim=True) * (1 / 448)).clamp(min=1e-12)
        assert torch.equal(scale, expected_scale)
        assert (x8.float().abs().amax(dim=1) <= 448).all()
        exact = x.float() / scale
        assert ((x8.float() - exact).abs() <= E4M3_REL * exact.abs() + E4M3_ABS).all()
    assert ran_fused(quant.quantize_rows, DEVICE)
    assert graphs() - before == 2


@needs_scaled_mm
@pytest.mark.usefixtures("fused_on")
def test_fp8_matmul_with_the_fused_quantizer_is_the_plain_one_within_the_activation_rounding(monkeypatch):
    """One fp8 layer (fp8 matmul on, bf16 activations): the fused quantizer's output equals the plain ops' to the bit,
    and both are within the rounding of the activations to e4m3 of the exact product with the fp8 weight."""
    monkeypatch.setattr(quant, "FP8_MATMUL_DEVICES", {"cuda", "cpu"})
    torch.manual_seed(0)
    layer = Fp8Linear.from_linear(torch.nn.Linear(512, 256, bias=False), fp8_matmul=True).to(DEVICE)
    x = activations(3 * 40, 512).reshape(3, 40, 512)
    plain, fused = plain_then_fused(monkeypatch, lambda: layer(x))
    assert ran_fused(quant.quantize_rows, DEVICE)
    assert fused.dtype == torch.bfloat16 and fused.shape == (3, 40, 256) and torch.equal(fused, plain)
    # |y - x w| <= sum_k |x̂_k - x_k| |w_k| + bf16's rounding of y, with |x̂ - x| <= 2^-4 |x| + 2^-10 scale (e4m3);
    # float32 accumulation adds far less than the 0.1% margin
    w = dequantize_fp8(layer.weight, layer.weight_scale).to(DEVICE)
    xf = x.float().reshape(-1, 512)
    scale = xf.abs().amax(dim=1, keepdim=True) / 448
    exact = xf @ w.t()
    bound = E4M3_REL * (xf.abs() @ w.abs().t()) + E4M3_ABS * scale * w.abs().sum(dim=1) + 2.0 ** -8 * exact.abs()
    error = (fused.float().reshape(-1, 256) - exact).abs()
    assert (error <= bound * 1.001).all()
    assert error.max() > 0                                    # the activations really were rounded


@needs_scaled_mm
@pytest.mark.usefixtures("fused_on")
def test_a_transformer_with_fp8_matmul_computes_the_same_with_the_fused_quantizer(monkeypatch):
    """A whole forward, fp8 matmul in every block layer, one batch item (the modulations' single token: the
    size-1 graph): equal to the bit to the plain quantizer's forward; two graphs for every layer."""
    monkeypatch.setattr(quant, "FP8_MATMUL_DEVICES", {"cuda", "cpu"})
    model = tiny_model(torch.bfloat16)
    assert quantize_transformer(model, quantizable, fp8_matmul=True)
    inputs = [x.bfloat16() if x.is_floating_point() and x.ndim == 3 else x for x in tiny_inputs(batch=1)]
    before = graphs()
    with torch.no_grad():
        plain, fused = plain_then_fused(monkeypatch, lambda: model(*inputs))
    assert ran_fused(quant.quantize_rows, DEVICE)
    assert torch.equal(fused, plain)
    assert graphs() - before == 2


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=st.sampled_from(["bfl", "comfyui-old"]), bad=st.sampled_from([-1.0, math.nan, math.inf]),
       where=st.integers(0, 10_000))
def test_a_damaged_scale_of_an_fp8_file_without_a_format_object_is_refused(tmp_path_factory, layout, bad, where):
    """BFL's fp8 (a scale per row) and the older scaled_fp8 files (one .scale_weight) name no format, so the formats'
    table does not cover them: a scale no quantizer writes (negative, NaN, infinite, drawn at any position) is
    refused all the same, naming the layer and its scale (it loaded silently before). A zero one is an all-zero row:
    test_a_zero_scale_is_an_all_zero_row."""
    tmp = tmp_path_factory.mktemp("fp8")
    _, path = fp8_file(tmp, layout)
    sd = load_file(str(path))
    key = sorted(k for k in sd if k.endswith((".weight_scale", ".scale_weight")))[where % 4]
    scale = sd[key].clone()
    scale.view(-1)[where % scale.numel()] = bad
    sd[key] = scale
    save_file(sd, str(path))
    layer = key.rsplit(".", 1)[0]
    with pytest.raises(Flux2Error, match=rf"layer {re.escape(layer)} is fp8, and 1 of the {scale.numel()} values of "
                                         rf"its {key.rsplit('.', 1)[1]} are"):
        load_transformer(path, "cpu", torch.float32)
