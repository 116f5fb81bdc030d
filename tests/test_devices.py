"""The dtype each device computes in (``devices.compute_dtype``), 16-bit weights kept as the file stores them and cast
per layer (``storage.linear.CastLinear``), and fp16 made safe as ComfyUI makes it (the transformer's clamps).

Expectations are written by hand from the devices' instruction sets; the kept model is checked against the same file
loaded wholly in float32 (bf16 widens to float32 exactly, so the two compute the same numbers).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flux2_core import devices, weights
from flux2_core.app import cli
from flux2_core.app.demo import demo_models
from flux2_core.families.flux2 import transformer as transformer_module
from flux2_core.storage.linear import CastLinear, Linear
from flux2_core.storage.protocol import call_bytes, census
from tests import machine as machines
from tests.tiny.text_encoder import build_tiny_qwen3, save_comfyui_text_encoder
from tests.tiny.transformer import TINY_TRANSFORMER, random_bfl_transformer_state_dict, save_bfl_transformer


def gpu(monkeypatch, name: str, major: int, minor: int):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(name=name, major=major, minor=minor))


@pytest.mark.parametrize("name,capability,fp16,expected", [
    ("NVIDIA H100 80GB HBM3", (9, 0), True, torch.bfloat16),
    ("NVIDIA GeForce RTX 3060", (8, 6), True, torch.bfloat16),
    ("Tesla T4", (7, 5), True, torch.float16),                   # Turing: fp16 tensor cores, no bf16 ones
    ("NVIDIA GeForce RTX 2080 Ti", (7, 5), True, torch.float16),
    ("Tesla V100-SXM2-16GB", (7, 0), True, torch.float16),
    ("Tesla T4", (7, 5), False, torch.float32),                  # a model unsafe in fp16 (the text encoder)
    ("NVIDIA GeForce GTX 1660 SUPER", (7, 5), True, torch.float32),   # Turing without fp16 tensor cores
    ("NVIDIA GeForce GTX 1080", (6, 1), True, torch.float32),
])
def test_gpus_compute_in_what_they_run_fast(monkeypatch, name, capability, fp16, expected):
    gpu(monkeypatch, name, *capability)
    chosen = devices.compute_dtype(torch.device("cuda", 0), fp16=fp16)
    assert chosen.dtype == expected and name in chosen.why


@pytest.mark.parametrize("cpu,variables,expected", [
    (machines.SAPPHIRE_RAPIDS, {}, torch.bfloat16),
    (machines.ZEN4, {}, torch.bfloat16),                                     # Zen 4 / 5, Cooper Lake
    (machines.ZEN4, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, torch.bfloat16),   # a cap above its instructions
    (machines.ZEN4, {"ONEDNN_MAX_CPU_ISA": "avx512_core_bf16"}, torch.bfloat16),  # oneDNN reads it in any case
    (machines.ICE_LAKE, {}, torch.float32),                                   # AVX-512 without BF16
    (machines.AVX2, {}, torch.float32),                                      # Zen 2 / 3, most laptops
    (machines.SAPPHIRE_RAPIDS, {"ONEDNN_MAX_CPU_ISA": "AVX2"}, torch.float32),    # oneDNN held below its bf16
    (machines.ZEN4, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}, torch.float32),
    (machines.ZEN4, {"DNNL_MAX_CPU_ISA": "AVX2"}, torch.float32),            # the older name, still read by oneDNN
    (machines.ZEN4, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "DNNL_MAX_CPU_ISA": "AVX2"}, torch.bfloat16),  # new first
    (machines.ZEN4, {"ONEDNN_MAX_CPU_ISA": "", "DNNL_MAX_CPU_ISA": "AVX2"}, torch.float32),   # empty: not set
    (machines.SAPPHIRE_RAPIDS.kernels("AVX2"), {}, torch.float32),    # ATEN_CPU_CAPABILITY=avx2: no bf16 attention
    (machines.SAPPHIRE_RAPIDS.kernels("DEFAULT"), {}, torch.float32),
    (machines.ZEN4.kernels("AVX2"), {}, torch.bfloat16),              # its bf16 attention runs on AVX2 kernels
    (machines.ZEN4.kernels("DEFAULT"), {}, torch.bfloat16),
], ids=lambda v: v.name if isinstance(v, machines.Machine) else ",".join(f"{k}={x}" for k, x in v.items()) or "-"
    if isinstance(v, dict) else str(v).removeprefix("torch."))
def test_cpus_are_told_apart_by_the_bf16_instructions_onednn_may_use(machine, monkeypatch, cpu, variables, expected):
    machine.set(cpu)
    for variable, value in variables.items():
        monkeypatch.setenv(variable, value)
    chosen = devices.compute_dtype("cpu")
    assert chosen.dtype == expected
    held = next((v for v in variables.values() if v), "")
    if expected == torch.float32 and held:
        assert f"oneDNN is held to {held.upper()}" in chosen.why


ONEDNN_ISAS = ["SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
               "AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10_1_512_AMX_FP16"]
BELOW_BF16 = ONEDNN_ISAS[:ONEDNN_ISAS.index("AVX512_CORE_BF16")]
BELOW_AVX512_VNNI = ONEDNN_ISAS[:ONEDNN_ISAS.index("AVX512_CORE_VNNI")]
ISA_VALUE = st.one_of(st.none(), st.just(""), st.sampled_from(ONEDNN_ISAS).flatmap(
    lambda isa: st.sampled_from([isa, isa.lower(), isa.title(), f" {isa} "])))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cpu=st.sampled_from(list(machines.KINDS.values())), onednn=ISA_VALUE, dnnl=ISA_VALUE)
def test_the_cpu_rule_reads_what_onednn_reads(machine, monkeypatch, cpu, onednn, dnnl):
    """Any CPU, either variable unset, empty or naming any of oneDNN's ISAs in any case: the cap is the first set of
    ONEDNN_MAX_CPU_ISA and DNNL_MAX_CPU_ISA (as oneDNN reads them), bf16 only with bf16 instructions oneDNN may use,
    int8 matmul exact unless a CPU with VNNI has oneDNN held below it. (DNNL_MAX_CPU_ISA alone was not read before.)"""
    machine.set(cpu)
    for variable, value in (("ONEDNN_MAX_CPU_ISA", onednn), ("DNNL_MAX_CPU_ISA", dnnl)):
        if value is None:
            monkeypatch.delenv(variable, raising=False)
        else:
            monkeypatch.setenv(variable, value)
    cap = next((v.strip().upper() for v in (onednn, dnnl) if v), "")
    expect_bf16 = (cpu.amx or cpu.avx512_bf16) and cap not in BELOW_BF16 and not (cpu.amx and cpu.aten != "AVX512")
    assert devices.compute_dtype("cpu").dtype == (torch.bfloat16 if expect_bf16 else torch.float32)
    saturates = bool(devices.cpu_int8_saturates())
    assert saturates == (cpu.vnni and cap in BELOW_AVX512_VNNI)
    assert bool(devices.cpu_int8()) == (cpu.vnni and not saturates)


def test_torchs_kernel_build_decides_only_where_bf16_attention_needs_it(machine):
    """ATEN_CPU_CAPABILITY=avx2 picks torch's own AVX2 kernels. The matmuls stay oneDNN's, bf16 ones about 2x faster
    than float32 there (measured on an AVX-512 BF16 EPYC), and bf16 attention runs on those kernels there: bf16 stays.
    On an AMX CPU torch's bf16 attention needs its AVX-512 kernels (torch 2.13 raises "pack_vnni2 is only supported
    when avx512 is supported"): float32, said why; bf16 asked for by name is refused with the fix."""
    from flux2_core.errors import Flux2Error

    machine.set(machines.ZEN4.kernels("AVX2"))
    assert devices.compute_dtype("cpu").dtype == torch.bfloat16 and devices.check_cpu_dtype(torch.bfloat16)
    machine.set(machines.SAPPHIRE_RAPIDS.kernels("AVX2"))
    chosen = devices.compute_dtype("cpu")
    assert chosen.dtype == torch.float32 and not devices.cpu_bf16()
    assert "torch's bf16 attention on an AMX CPU needs its AVX-512 kernels, and it runs its AVX2 ones" in chosen.why
    assert devices.cpu_int8()                                     # its int8 matmuls are oneDNN's: unchanged
    assert devices.check_cpu_dtype(torch.float32) == torch.float32
    with pytest.raises(Flux2Error, match=r"bfloat16 cannot run on this CPU: .*Unset ATEN_CPU_CAPABILITY"):
        devices.check_cpu_dtype(torch.bfloat16)


def test_loading_onto_the_cpu_in_bf16_stays_allowed_where_the_cpu_does_not_compute(machine):
    """The check is where the CPU computes, not where weights wait: a GPU run loads its text encoder (and streamed
    blocks, and ComfyUI's offloaded models) onto the CPU in the GPU's bf16. ComfyUI's own bf16 choice for a CPU run
    (--bf16-unet) is not taken there: float32, said why."""
    from flux2_core.families import FAMILIES

    machine.set(machines.SAPPHIRE_RAPIDS.kernels("AVX2"))
    assert weights.default_device_dtype("cpu", torch.bfloat16) == (torch.device("cpu"), torch.bfloat16)
    chosen = devices.model_dtype("cpu", FAMILIES["flux2"].dtypes, host=torch.bfloat16)
    assert chosen.dtype == torch.float32 and "AVX-512 kernels" in chosen.why
    machine.set(machines.ZEN4)
    assert devices.model_dtype("cpu", FAMILIES["flux2"].dtypes, host=torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.real_machine
def test_the_probe_reads_torchs_kernel_build():
    assert devices.cpu_flags().aten == torch.backends.cpu.get_cpu_capability()


@pytest.mark.parametrize("stored,compute,kept", [
    (torch.bfloat16, torch.float32, torch.bfloat16), (torch.float16, torch.float32, torch.float16),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float16, torch.float16),
    (torch.float32, torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32, torch.float32),
    (None, torch.float32, torch.float32),
])
def test_sixteen_bit_weights_stay_sixteen_bit_only_under_a_wider_compute_dtype(stored, compute, kept):
    assert devices.kept_dtype(stored, compute) == kept


@pytest.fixture(scope="module")
def bf16_file(tmp_path_factory):
    sd = {k: v.to(torch.bfloat16) for k, v in random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=3).items()}
    return save_bfl_transformer(sd, tmp_path_factory.mktemp("bf16") / "flux-2-klein-tiny.safetensors")


def inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = TINY_TRANSFORMER
    img = torch.randn(1, 12, p.in_channels, generator=g)
    txt = torch.randn(1, 5, p.context_in_dim, generator=g)
    ids = torch.zeros(1, 12, 4)
    ids[0, :, 1], ids[0, :, 2] = torch.arange(12) // 4, torch.arange(12) % 4
    txt_ids = torch.zeros(1, 5, 4)
    txt_ids[0, :, 3] = torch.arange(5)
    return {"img": img.to(dtype), "img_ids": ids, "timesteps": torch.tensor([0.7]).to(dtype), "txt": txt.to(dtype),
                "txt_ids": txt_ids}


def test_a_bf16_file_computed_in_float32_keeps_its_blocks_in_bf16_with_the_same_result(bf16_file):
    kept, _ = weights.load_transformer(bf16_file, "cpu", torch.float32)
    kinds = census(kept)
    assert set(kinds) == {"float", "bf16"} and kinds["bf16"] > kinds["float"], kinds
    assert kept.dtype == torch.float32 and kept.device == torch.device("cpu")   # the compute dtype, as asked
    assert len(kept.blocks()) == TINY_TRANSFORMER.depth + TINY_TRANSFORMER.depth_single_blocks
    with torch.no_grad():
        assert torch.equal(kept(**inputs()), reference_velocity(bf16_file))
    held = sum(t.nbytes for t in [*kept.parameters(), *kept.buffers()])
    assert held == weights.transformer_bytes(bf16_file, torch.float32)
    full = sum(t.numel() * 4 for t in kept.state_dict().values())
    assert held < 0.6 * full                                   # the blocks at 2 bytes a weight, not 4
    assert call_bytes(kept, torch.float32) == max(m.in_features * m.out_features * 4 for m in kept.modules()
                                                  if isinstance(m, CastLinear))


def reference_velocity(path) -> torch.Tensor:
    """The file's weights widened to float32 by safetensors' own reader, into a model built in float32."""
    from safetensors.torch import load_file

    from flux2_core.families.flux2.transformer import Flux2Transformer

    model = Flux2Transformer(TINY_TRANSFORMER)
    model.load_state_dict({k: v.float() for k, v in load_file(str(path)).items()})
    with torch.no_grad():
        return model(**inputs())


def test_a_bf16_file_computed_in_bf16_is_plain_bf16(bf16_file):
    model, _ = weights.load_transformer(bf16_file, "cpu", torch.bfloat16)
    assert set(census(model)) == {"float"} and {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_a_kept_text_encoder_equals_the_widened_one(tmp_path):
    qwen = build_tiny_qwen3(seed=1)
    path = save_comfyui_text_encoder(qwen, tmp_path / "qwen.safetensors", dtype=torch.bfloat16)
    kept = weights.load_text_encoder(path, "cpu", torch.float32)
    kinds = census(kept.model)
    assert kinds.get("bf16", 0) == 7 * len(kept.model.layers), kinds     # q, k, v, o, gate, up, down in each layer
    widened = weights.load_text_encoder(path, "cpu", torch.float32)
    for name, layer in list(widened.model.named_modules()):     # each kept layer made a float32 one by hand
        if isinstance(layer, CastLinear):
            plain = Linear(layer.in_features, layer.out_features)
            plain.weight = torch.nn.Parameter(layer.weight.detach().float())
            widened.model.set_submodule(name, plain)
    assert set(census(widened.model)) == {"float"}
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ours, theirs = kept.model(ids, mask, (1, 2)), widened.model(ids, mask, (1, 2))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


# --- fp16 --------------------------------------------------------------------------------------------------------

def test_fp16_streams_are_clamped_where_comfyui_clamps_them_and_nan_still_stops(monkeypatch):
    """A residual stream pushed past 65504 comes back as 65504 (ComfyUI's nan_to_num bounds, the same values); a NaN
    from broken weights still reaches the NaN guard instead of becoming zeros."""
    x = torch.tensor([1.0, 7e4, -7e4, float("inf"), float("-inf")], dtype=torch.float16)
    assert torch.equal(transformer_module.fp16_bounded(x), torch.nan_to_num(x, nan=0.0, posinf=65504, neginf=-65504))
    assert torch.isnan(transformer_module.fp16_bounded(torch.tensor([float("nan")], dtype=torch.float16))).all()
    wide = torch.tensor([7e4], dtype=torch.float32)
    assert transformer_module.fp16_bounded(wide) is wide

    models = demo_models("klein-4b", "cpu")
    half = {k: v.to(torch.float16) if v.is_floating_point() else v for k, v in demo_inputs(models).items()}
    model = copy.deepcopy(models.transformer).to(torch.float16)
    with torch.no_grad():                   # text and single streams pushed past 65504 in every block
        for block in model.double_blocks:
            block.txt_mlp[2].weight.mul_(1e5)
        for block in model.single_blocks:
            block.linear2.weight.mul_(1e5)
    bounded = transformer_module.fp16_bounded
    seen = []

    def recorded(x, bound=True):
        seen.append(not bool(torch.isfinite(x).all()))
        return bounded(x) if bound else x

    monkeypatch.setattr(transformer_module, "fp16_bounded", recorded)
    with torch.no_grad():
        assert torch.isfinite(model(**half)).all()
    # ComfyUI's three places: each double block's text stream, the image stream once, each single block's stream
    assert len(seen) == len(model.double_blocks) + 1 + len(model.single_blocks) and any(seen)
    monkeypatch.setattr(transformer_module, "fp16_bounded", lambda x: recorded(x, bound=False))
    with torch.no_grad():
        assert not torch.isfinite(model(**half)).all()          # the same run unbounded: inf, then NaN
    monkeypatch.setattr(transformer_module, "fp16_bounded", bounded)
    with torch.no_grad():
        dict(model.named_parameters())["img_in.weight"].view(-1)[0] = float("nan")
        assert torch.isnan(model(**half)).any()                 # broken weights still reach the NaN guard


def demo_inputs(models):
    p = models.transformer.params
    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(1, 16, 4)
    ids[0, :, 1], ids[0, :, 2] = torch.arange(16) // 4, torch.arange(16) % 4
    txt_ids = torch.zeros(1, 6, 4)
    txt_ids[0, :, 3] = torch.arange(6)
    return {"img": torch.randn(1, 16, p.in_channels, generator=g), "img_ids": ids, "timesteps": torch.tensor([0.5]),
                "txt": torch.randn(1, 6, p.context_in_dim, generator=g), "txt_ids": txt_ids}


# --- what the user sees ------------------------------------------------------------------------------------------

def test_the_cli_names_the_devices_choice_in_the_log_and_the_png(tmp_path, capsys):
    """The chosen dtype and why, in the log and in the PNG's parameters (real files, so the automatic choice runs)."""
    from tests.test_cli import png_parameters, write_models_folder

    write_models_folder(tmp_path)
    code = cli.main(["--prompt", "x", "--models", str(tmp_path), "--width", "32", "--height", "32", "--steps", "1",
                     "--seed", "1", "--out", str(tmp_path / "o"), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 0, err
    chosen = devices.compute_dtype("cpu")
    assert f"computing in {chosen.name}: {chosen.why}" in err
    assert png_parameters(tmp_path / "o" / "flux2_1.png")[1]["dtype"] == f"{chosen.name} ({chosen.why})"
    code = cli.main(["--prompt", "x", "--models", str(tmp_path), "--width", "32", "--height", "32", "--steps", "1",
                     "--seed", "1", "--out", str(tmp_path / "p"), "--device", "cpu", "--dtype", "float32"])
    assert code == 0 and png_parameters(tmp_path / "p" / "flux2_1.png")[1]["dtype"] == "float32 (--dtype)"


def test_an_amx_cpu_on_avx2_kernels_makes_its_picture_in_float32(machine, tmp_path, capsys):
    """ATEN_CPU_CAPABILITY=avx2 on an AMX CPU: the command line computes in float32 and says why in the log and the
    PNG; --dtype bfloat16 is refused before any model loads (an error line with the fix, no traceback, no picture)."""
    from tests.test_cli import png_parameters, write_models_folder

    machine.set(machines.SAPPHIRE_RAPIDS.kernels("AVX2"))
    write_models_folder(tmp_path)
    args = ["--prompt", "x", "--models", str(tmp_path), "--width", "32", "--height", "32", "--steps", "1", "--seed",
            "1", "--device", "cpu"]
    code = cli.main([*args, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 0, err
    dtype = png_parameters(tmp_path / "o" / "flux2_1.png")[1]["dtype"]
    assert dtype.startswith("float32 (") and "needs its AVX-512 kernels" in dtype and "computing in float32" in err
    code = cli.main([*args, "--dtype", "bfloat16", "--out", str(tmp_path / "p")])
    err = capsys.readouterr().err
    assert code == 2 and "bfloat16 cannot run on this CPU" in err and "Traceback" not in err, err
    assert not (tmp_path / "p").exists() or not list((tmp_path / "p").glob("*.png"))


def test_the_files_own_dtype_is_read_from_its_header(bf16_file, tmp_path):
    """What ComfyUI's loader weighs to choose its dtype (nodes pass it on): the dtype of most values, and their count."""
    dtype, values = weights.stored_dtype(bf16_file)
    expected = sum(t.numel() for t in random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=3).values())
    assert dtype == torch.bfloat16 and values == expected
    mixed = {k: v if "single_blocks" in k else v.half()
             for k, v in random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=3).items()}
    path = save_bfl_transformer(mixed, tmp_path / "flux-2-klein-mixed.safetensors")
    by_dtype = {}
    for v in mixed.values():
        by_dtype[v.dtype] = by_dtype.get(v.dtype, 0) + v.numel()
    assert weights.stored_dtype(path)[0] == max(by_dtype, key=by_dtype.get)


# --- one dtype rule for a transformer, per family: the command line's and the nodes' -------------------------------

@pytest.mark.parametrize("name,capability,family,host,expected", [
    ("Tesla T4", (7, 5), "flux2", None, torch.float16),          # fp16 fast, and FLUX.2 runs in it (its clamps)
    ("Tesla T4", (7, 5), "flux3", None, torch.float32),          # FLUX 3 does not: the next the device runs well
    ("NVIDIA H100 80GB HBM3", (9, 0), "flux3", None, torch.bfloat16),
    ("Tesla T4", (7, 5), "flux3", torch.float16, torch.float32),   # a host's choice outside the family's is not taken
    ("NVIDIA H100 80GB HBM3", (9, 0), "flux2", torch.float16, torch.float16),   # ComfyUI's --fp16-unet is
])
def test_a_transformers_dtype_is_the_devices_among_its_familys(monkeypatch, name, capability, family, host, expected):
    from flux2_core.families import FAMILIES

    gpu(monkeypatch, name, *capability)
    chosen = devices.model_dtype(torch.device("cuda", 0), FAMILIES[family].dtypes, host)
    assert chosen.dtype == expected
    if family == "flux3" and host is None and expected == torch.float32:
        assert "does not run in float16" in chosen.why


def test_a_flux3_file_is_loaded_in_its_familys_dtype_where_the_device_would_pick_fp16(monkeypatch, tmp_path):
    """The engine's loader and the command line take the dtype from the file's family: where the device's own pick is
    float16 (a T4), a FLUX.2 file computes in float16 and a FLUX 3 file in float32 (FLUX 3 does not run in float16)."""
    from safetensors.torch import save_file

    from tests.tiny.flux3 import random_flux3_state_dict, tiny_flux3

    pick = devices.ComputeDtype(torch.float16, "a T4 (simulated)")
    monkeypatch.setattr(devices, "compute_dtype", lambda device, fp16=True: pick if fp16 else
                        devices.ComputeDtype(torch.float32, "no fp16"))
    flux2_file = tmp_path / "flux2.safetensors"
    save_bfl_transformer(random_bfl_transformer_state_dict(TINY_TRANSFORMER), flux2_file)
    flux3_file = tmp_path / "flux3.safetensors"
    save_file(random_flux3_state_dict(tiny_flux3()), str(flux3_file))
    assert weights.transformer_dtype(flux2_file, "cpu").dtype == torch.float16
    assert weights.transformer_dtype(flux3_file, "cpu").dtype == torch.float32
    model, _ = weights.load_transformer(flux3_file, "cpu")
    assert model.dtype == torch.float32


def test_a_dtype_asked_for_that_the_family_does_not_run_in_is_refused_before_loading(tmp_path, capsys):
    """float16 asked for by name: a FLUX.2 file computes in it (its clamps), a FLUX 3 file is refused with the dtypes
    it runs in, from the engine's loader and from the command line (an error line, no traceback, no picture)."""
    from safetensors.torch import save_file

    from flux2_core.errors import Flux2Error
    from tests.tiny.flux3 import random_flux3_state_dict, tiny_flux3

    flux2_file = tmp_path / "flux2.safetensors"
    save_bfl_transformer(random_bfl_transformer_state_dict(TINY_TRANSFORMER), flux2_file)
    flux3_file = tmp_path / "flux3.safetensors"
    save_file(random_flux3_state_dict(tiny_flux3()), str(flux3_file))
    model, _ = weights.load_transformer(flux2_file, "cpu", torch.float16)
    assert model.dtype == torch.float16
    with pytest.raises(Flux2Error, match=r"FLUX 3 Image Klein runs in bfloat16 or float32, not in float16"):
        weights.load_transformer(flux3_file, "cpu", torch.float16)
    for dtype in (torch.bfloat16, torch.float32):
        assert weights.load_transformer(flux3_file, "cpu", dtype)[0].dtype == dtype
    code = cli.main(["--transformer", str(flux3_file), "--text-encoder", str(tmp_path / "te"), "--ae",
                     str(tmp_path / "ae.safetensors"), "--prompt", "a fox", "--width", "64", "--height", "64",
                     "--device", "cpu", "--dtype", "float16", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code != 0 and "not in float16" in err and "Traceback" not in err, err
    assert not list(tmp_path.glob("out/*.png"))
