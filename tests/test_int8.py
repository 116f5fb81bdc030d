"""int8 weight storage (W8A8, flux2_core/storage/int8.py): per-row quantization as computed by hand, the int8 matmul
(comfy-kitchen's int8_linear, its eager backend on the CPU) against a W8A8 written out in plain torch and within the
activation-rounding bound of the dequantizing path, whole models within a stated error of the float model, int8
loaded from bf16, fp8 and GGUF files, and the plain path (with the reason logged) where comfy-kitchen is missing."""

from __future__ import annotations

import contextlib
import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from flux2_core import kitchen, weights
from flux2_core.app import cli
from flux2_core.errors import Flux2Error
from flux2_core.families.flux2.files import quantizable
from flux2_core.families.flux2.transformer import Flux2Transformer
from flux2_core.models import rope
from flux2_core.storage.int8 import Int8Linear, quantize_blocks, quantize_int8, use_int8_matmul
from flux2_core.storage.linear import Linear
from flux2_core.storage.protocol import census
from tests import machine as machines
from tests.tiny.gguf import dit_types, save_gguf
from tests.tiny.layouts import comfy_fp8, save_prefixed
from tests.tiny.transformer import TINY_TRANSFORMER, random_bfl_transformer_state_dict, save_bfl_transformer

CPU = torch.device("cpu")
needs_kitchen = pytest.mark.skipif(kitchen.ck is None, reason=f"comfy-kitchen is not importable: {kitchen.MISSING}")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def random_layer(in_features=96, out_features=80, seed=0) -> tuple[Int8Linear, torch.Tensor]:
    """An Int8Linear and the float weight it was quantized from (rows of very different sizes)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g) * torch.logspace(-2, 1, out_features)[:, None]
    layer = Linear(in_features, out_features)
    layer.weight.data.copy_(weight)
    return Int8Linear.from_linear(layer), weight


def w8a8_by_hand(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Dynamic W8A8 written out: each token scaled by max|x|/127 (float32), divided in x's dtype, rounded half to
    even and clamped to int8, integer products summed exactly (float64 holds these sums exactly), then scaled."""
    rows = x.reshape(-1, x.shape[-1])
    x_scale = (rows.abs().amax(dim=1, keepdim=True).float() / 127).clamp(min=1e-30)
    x8 = torch.round(rows / x_scale.to(rows.dtype)).clamp(-128, 127)
    sums = x8.double() @ w8.double().T
    return (sums.float() * (x_scale * w_scale[None, :])).to(x.dtype).reshape(*x.shape[:-1], -1)


def test_quantize_int8_is_the_per_row_rounding_computed_by_hand():
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(2)) * torch.logspace(-3, 2, 40)[:, None]
    w8, scale = quantize_int8(w)
    array = w.numpy().astype(np.float64)
    expected_scale = np.abs(array).max(axis=1) / 127
    expected = np.clip(np.round(array / expected_scale[:, None]), -127, 127)     # numpy rounds half to even too
    np.testing.assert_allclose(scale.numpy(), expected_scale, rtol=1e-6)
    assert w8.dtype == torch.int8 and (w8.numpy() == expected).mean() > 0.999     # float32 vs float64 at the halves
    assert (w8.abs().amax(dim=1) == 127).all()
    error = (w8.float() * scale[:, None] - w).abs()
    assert (error <= scale[:, None] / 2 * (1 + 1e-5)).all() and error.max() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantizing_path_is_exact_in_the_stored_weights(dtype):
    layer, _ = random_layer()
    x = torch.randn(3, 7, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = x.float() @ layer.float_weight().T
    # float32 sums in another order (1e-5 of the sum of magnitudes); bf16 adds its own rounding of the output
    scale = x.float().abs() @ layer.float_weight().abs().T
    bound = 1e-5 * scale if dtype == torch.float32 else 2 ** -7 * (scale + expected.abs())
    assert ((layer(x).float() - expected).abs() <= bound).all()


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@needs_kitchen
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_matmul_is_w8a8_within_the_activation_rounding_of_the_exact_path(dtype, device):
    """On the CPU through comfy-kitchen's eager backend (its reference), on a GPU through whichever it picks."""
    layer, _ = random_layer()
    layer = layer.to(device)
    x = (torch.randn(2, 9, 96, generator=torch.Generator().manual_seed(3)) * 3).to(device, dtype)
    exact = layer(x).float()                                     # the dequantizing path
    on, note = use_int8_matmul(layer, True, torch.device(device), dtype)
    if not on:                         # oneDNN held below VNNI on this CPU: its int8 sums would be wrong, so refused
        assert "int8 sums overflow 16 bits" in note and torch.equal(layer(x).float(), exact)
        return
    with kitchen.ck.use_backend("eager") if device == "cpu" else contextlib.nullcontext():
        w8a8 = layer(x)
    assert w8a8.dtype == dtype and w8a8.shape == (2, 9, 80)
    torch.testing.assert_close(w8a8, w8a8_by_hand(x, layer.weight, layer.weight_scale), rtol=1e-5, atol=1e-6)
    # each token's values are off by at most half its scale, so output n is off by at most that times sum_k |w[n, k]|
    # (plus the output's own rounding in bf16)
    x_scale = x.float().abs().amax(dim=-1, keepdim=True) / 127
    bound = x_scale / 2 * layer.float_weight().abs().sum(dim=1) + (exact.abs() * 2 ** -7 if dtype == torch.bfloat16
                                                                    else 1e-5)
    assert ((w8a8.float() - exact).abs() <= bound).all()
    assert 1e-4 < rel(w8a8, exact) < 2e-2


def tiny_model() -> Flux2Transformer:
    model = Flux2Transformer(TINY_TRANSFORMER)
    model.load_state_dict(random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=0))
    return model.eval()


def tiny_inputs(batch: int = 2):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch, 16, 128, generator=g), rope.image_ids(batch, 4, 4), torch.tensor([0.7] * batch),
            torch.randn(batch, 6, TINY_TRANSFORMER.context_in_dim, generator=g), rope.text_ids(batch, 6))


@pytest.mark.parametrize("int8_matmul", [False, pytest.param(True, marks=needs_kitchen)])
def test_an_int8_transformer_stays_near_the_float_model(int8_matmul):
    """Per-row int8 weights alone: 0.36% relative error on this random tiny model's output (bound 1%); with the
    activations quantized too (W8A8): 0.61% (bound 3%). The float model's own rounding is far below (1e-4)."""
    model, args = tiny_model(), tiny_inputs()
    with torch.no_grad():
        want = model(*args)
        names = quantize_blocks(model, quantizable)
        assert census(model)["int8"] == len(names) and all(quantizable(n) for n in names)
        on, note = use_int8_matmul(model, int8_matmul, CPU, torch.float32)
        # asked for, it is refused only where oneDNN is held below this CPU's VNNI (its int8 sums would be wrong)
        assert on == (int8_matmul and "int8 sums overflow 16 bits" not in note)
        assert ("int8 matmul: on" in note) == on
        got = model(*args)
    assert 1e-4 < rel(got, want) < (0.03 if on else 0.01)


@needs_kitchen
def test_auto_turns_int8_matmul_on_where_it_is_faster(machine):
    machine.set(machines.AVX2)                                                  # a CPU without VNNI / AMX: never
    model = tiny_model()
    quantize_blocks(model, quantizable)
    on, note = use_int8_matmul(model, "auto", CPU, torch.float32)
    assert on is False and "no 8-bit dot-product instructions" in note
    assert use_int8_matmul(model, True, CPU, torch.float32)[0]                  # asked for: it runs all the same
    machine.set(machines.ICE_LAKE)                                              # AVX-512 VNNI
    model = tiny_model()
    quantize_blocks(model, quantizable)
    narrow = census(model)["int8"]                                               # all narrower than 1024
    on, note = use_int8_matmul(model, "auto", CPU, torch.float32)                # the CPU's integer kernel wins...
    assert on is True and f"{narrow} narrow layers compute in float32" in note   # ...from 1024 inputs on only
    wide = torch.nn.Sequential(Int8Linear(1024, 64), Int8Linear(512, 64))
    assert use_int8_matmul(wide, "auto", CPU, torch.float32)[0]
    assert [layer.int8_matmul for layer in wide] == [True, False]
    assert use_int8_matmul(wide, True, CPU, torch.float32)[0] and all(layer.int8_matmul for layer in wide)
    on, note = use_int8_matmul(model, "auto", CPU, torch.bfloat16)
    assert on is False and "float32 matmuls only" in note
    assert use_int8_matmul(tiny_model(), "auto", CPU, torch.float32) == (False, "")   # no int8 layers: nothing to say
    with pytest.raises(Flux2Error, match="needs int8 weights"):
        use_int8_matmul(tiny_model(), True, CPU, torch.float32)
    with pytest.raises(Flux2Error, match="'auto', True or False"):
        use_int8_matmul(model, "yes", CPU, torch.float32)


@needs_kitchen
@pytest.mark.parametrize("variable", ["ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"])
@pytest.mark.parametrize("isa,saturates", [("AVX2", True), ("avx512_core", True), ("AVX2_VNNI", True),
                                           ("AVX512_CORE_VNNI", False), ("AVX512_CORE_AMX", False)])
def test_int8_matmul_stays_off_where_onednn_would_sum_in_16_bits(machine, monkeypatch, variable, isa, saturates):
    """A CPU with VNNI gives torch's int8 matmul to oneDNN; held below VNNI oneDNN sums 8-bit pair products in 16
    bits (wrong sums), so int8 matmul stays off there, asked for or not, and says which variable to change. Without
    VNNI torch sums in its own exact loop: asked for, it runs."""
    machine.set(machines.ICE_LAKE)
    monkeypatch.setenv(variable, isa)
    model = tiny_model()
    quantize_blocks(model, quantizable)
    wide = torch.nn.Sequential(Int8Linear(1024, 64))
    for choice in ("auto", True):
        on, note = use_int8_matmul(wide, choice, CPU, torch.float32)
        assert on is not saturates and wide[0].int8_matmul is on
        if saturates:
            assert f"oneDNN is held to {isa.upper()} ({variable})" in note and f"unset {variable}" in note
            assert note.startswith("int8 matmul: off (" + ("asked for, but " if choice is True else ""))
    machine.set(machines.AVX2.held_to(isa))                  # no VNNI: torch's exact loop, whatever oneDNN may use
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    assert use_int8_matmul(wide, True, CPU, torch.float32)[0] and wide[0].int8_matmul


HELD_TO_AVX2 = """
import json, torch
from flux2_core import devices
from flux2_core.storage.int8 import Int8Linear, use_int8_matmul
g = torch.Generator().manual_seed(0)
layer = Int8Linear(512, 64)
layer.weight.copy_(torch.randint(-127, 128, (64, 512), generator=g, dtype=torch.int8))
layer.weight_scale.fill_(1.0)
x = torch.randn(64, 512, generator=g) * 3
exact = x @ layer.weight.float().T                             # the dequantizing path (scale 1: the weight itself)
x_scale = x.abs().amax(dim=1, keepdim=True) / 127              # dynamic W8A8 by hand, summed in float64
x8 = torch.round(x / x_scale).clamp(-128, 127)
w8a8 = (x8.double() @ layer.weight.double().T) * x_scale.double()
on, note = use_int8_matmul(torch.nn.Sequential(layer), True, torch.device("cpu"), torch.float32)
with torch.no_grad():
    y = layer(x).double()
print(json.dumps({"on": on, "note": note, "vnni": bool(torch.cpu._is_vnni_supported()),
                  "from_w8a8": ((y - w8a8).abs().max() / w8a8.abs().max()).item(),
                  "from_exact": ((y - exact.double()).abs().max() / exact.abs().max()).item()}))
"""


@needs_kitchen
@pytest.mark.real_machine
@pytest.mark.slow
def test_int8_sums_with_onednn_held_to_avx2_are_exact():
    """A fresh process with ONEDNN_MAX_CPU_ISA=AVX2 (oneDNN reads it at its first use), full-range int8 weights: a
    layer asked for int8 matmul computes the W8A8 sums exactly (no sum off by a saturated pair: 1e-6 of the largest
    output, where a 16-bit saturation is off by 20 %), or, on a CPU with VNNI, refuses it and computes the exact path."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    env.pop("DNNL_MAX_CPU_ISA", None)
    run = subprocess.run([sys.executable, "-c", HELD_TO_AVX2], env=env, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["on"] is not got["vnni"], got
    if got["on"]:
        assert got["from_w8a8"] < 1e-6 and got["from_exact"] > 1e-4, got       # W8A8: the activations rounded
    else:
        assert "oneDNN is held to AVX2 (ONEDNN_MAX_CPU_ISA)" in got["note"] and got["from_exact"] < 1e-6, got


def test_without_comfy_kitchen_the_plain_path_runs_and_the_log_says_why(no_kitchen, caplog, machine):
    machine.set(machines.ZEN4)              # a CPU whose int8 matmul would run: the missing kitchen is the reason
    model, args = tiny_model(), tiny_inputs()
    with torch.no_grad():
        want = model(*args)
        quantize_blocks(model, quantizable)
        with caplog.at_level(logging.INFO, logger="flux2_klein"):
            on, note = use_int8_matmul(model, "auto", CPU, torch.float32)
            use_int8_matmul(model, "auto", CPU, torch.float32)
        got = model(*args)
    assert on is False and "comfy-kitchen is not importable" in note
    assert [r.getMessage() for r in caplog.records].count(
        "FLUX.2 Klein: int8_linear runs in plain torch: comfy-kitchen is not importable (No module named "
        "'comfy_kitchen'); pip install comfy-kitchen packaging") == 1
    with pytest.raises(Flux2Error, match="cannot use int8 matmul: comfy-kitchen is not importable"):
        use_int8_matmul(model, True, CPU, torch.float32)
    assert rel(got, want) < 0.01


def file_layouts(tmp_path):
    """The tiny transformer as a bf16 BFL file, a ComfyUI fp8 file and a Q8_0 GGUF, each with the float32 values
    its block weights stand for."""
    state = random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=4)
    bf16 = {k: v.to(torch.bfloat16) for k, v in state.items()}
    fp8_layers = [k.removesuffix(".weight") for k, v in state.items() if v.ndim == 2 and quantizable(k)]
    fp8_state, metadata = comfy_fp8(state, fp8_layers)
    gguf_path, gguf_values = save_gguf(state, tmp_path / "flux-2-klein-tiny-Q8_0.gguf", dit_types(T.Q8_0))
    fp8_values = {f"{layer}.weight": fp8_state[f"{layer}.weight"].float() * fp8_state[f"{layer}.weight_scale"]
                  for layer in fp8_layers}
    return {
        "bf16": (save_bfl_transformer(bf16, tmp_path / "flux-2-klein-tiny.safetensors"),
                 {k: v.float() for k, v in bf16.items()}),
        "fp8": (save_prefixed(fp8_state, tmp_path / "flux-2-klein-tiny-fp8.safetensors", "model.diffusion_model.",
                              metadata), {**state, **fp8_values}),
        "gguf": (gguf_path, {k.removeprefix("model.diffusion_model."): v for k, v in gguf_values.items()}),
    }


@pytest.mark.parametrize("layout", ["bf16", "fp8", "gguf"])
def test_int8_loads_from_any_file_quantizing_the_values_it_holds(tmp_path, layout):
    path, values = file_layouts(tmp_path)[layout]
    model, _ = weights.load_transformer(path, CPU, torch.float32, int8=True)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Int8Linear)}
    assert set(layers) == {n for n, m in model.named_modules() if isinstance(m, torch.nn.Module) and quantizable(n)
                           and hasattr(m, "weight") and m.weight.ndim == 2}
    for name, layer in layers.items():
        w8, scale = quantize_int8(values[name + ".weight"])
        assert torch.equal(layer.weight, w8) and torch.equal(layer.weight_scale, scale), name
    assert weights.transformer_bytes(path, torch.float32, int8=True) == sum(
        t.nbytes for t in model.state_dict().values())


def test_cli_int8_and_fp8_together_are_refused(capsys):
    assert cli.main(["--demo", "--int8", "--fp8", "--prompt", "x", "--out", "unused"]) == 2
    assert "--int8 and --fp8 both choose" in capsys.readouterr().err


def test_quantizing_a_model_with_loras_applied_is_refused(tmp_path):
    """optimize_transformer(int8=/fp8=) after apply_adapters would build the layers from the merged weights, and the
    LoRAs could never be taken off: refused, with the order that works; after removing them it runs."""
    from flux2_core.app.demo import demo_models
    from flux2_core.errors import Flux2Error
    from flux2_core.pipeline import apply_adapters, optimize_transformer
    from tests.tiny.adapters import lora_state_dict, random_lora, save_adapter

    models = demo_models("klein-4b", "cpu")
    module = "double_blocks.0.img_attn.qkv"
    sd, meta = lora_state_dict(random_lora(models.variant.params, [module], seed=1), "ai-toolkit")
    apply_adapters(models, [(save_adapter(sd, tmp_path / "lora.safetensors", meta), 0.8)])
    for option in ({"int8": True}, {"fp8": True}):
        with pytest.raises(Flux2Error, match="LoRAs applied: quantize first"):
            optimize_transformer(models, **option)
    apply_adapters(models, [])
    optimize_transformer(models, int8=True)
    assert census(models.transformer)["int8"] > 0
