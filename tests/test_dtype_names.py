"""The names users write for a compute dtype mean the torch dtype, wherever a dtype is taken (the engine's loaders,
load_models, the command line), or are refused with the names; expectations are the torch dtypes by hand."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flux2_core import devices, pipeline, weights
from flux2_core.app import cli
from flux2_core.errors import Flux2Error
from tests.tiny.transformer import TINY_TRANSFORMER, random_bfl_transformer_state_dict, save_bfl_transformer

NAMES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
         "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}


def spellings(name: str):
    return st.sampled_from([name, name.upper(), name.title(), f" {name} "])


@given(st.sampled_from(sorted(NAMES)).flatmap(lambda n: st.tuples(st.just(n), spellings(n))))
def test_every_name_means_its_torch_dtype_in_any_case(named):
    name, written = named
    assert devices.dtype_named(written) == NAMES[name]


@given(st.text(max_size=12).filter(lambda t: t.strip().lower() not in {*NAMES, "auto"}))
def test_anything_else_is_refused_with_the_names(text):
    with pytest.raises(Flux2Error, match=r"is not a compute dtype: use auto, bfloat16 \(bf16\), float16 \(fp16\) or "
                                         r"float32 \(fp32\)"):
        devices.dtype_named(text)


@pytest.mark.parametrize("value", [torch.int8, torch.float64, torch.float8_e4m3fn, 16, 3.5, b"fp16"])
def test_other_dtypes_and_kinds_are_refused(value):
    with pytest.raises(Flux2Error, match="is not a compute dtype"):
        devices.dtype_named(value)


def test_auto_and_none_leave_the_choice_to_the_device():
    assert devices.dtype_named(None) is None and devices.dtype_named("auto") is None and devices.dtype_named(" AUTO ") is None
    assert all(devices.dtype_named(d) is d for d in (torch.bfloat16, torch.float16, torch.float32))


@pytest.fixture(scope="module")
def flux2_file(tmp_path_factory):
    return save_bfl_transformer(random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=5),
                                tmp_path_factory.mktemp("names") / "flux-2-klein-tiny.safetensors")


@pytest.mark.parametrize("written", ["float16", "fp16", "FP16"])
def test_the_loaders_take_the_names(flux2_file, written):
    """Before: load_transformer(..., dtype="float16") said "FLUX.2 runs in bfloat16 or float16 or float32, not in
    float16"."""
    model, _ = weights.load_transformer(flux2_file, "cpu", written)
    assert model.dtype == torch.float16


def test_flux3_refuses_float16_by_any_name(tmp_path):
    from safetensors.torch import save_file

    from tests.tiny.flux3 import random_flux3_state_dict, tiny_flux3

    path = tmp_path / "flux3.safetensors"
    save_file(random_flux3_state_dict(tiny_flux3()), str(path))
    for written in ("float16", "fp16", "half", torch.float16):
        with pytest.raises(Flux2Error, match="runs in bfloat16 or float32, not in float16"):
            weights.load_transformer(path, "cpu", written)
    assert weights.load_transformer(path, "cpu", "bf16")[0].dtype == torch.bfloat16


def test_load_models_takes_the_names_and_refuses_others(flux2_file, tmp_path):
    with pytest.raises(Flux2Error, match="'int8' is not a compute dtype"):
        pipeline.load_models(flux2_file, tmp_path / "te", tmp_path / "ae.safetensors", device="cpu", dtype="int8")


def test_the_command_line_takes_the_names(tmp_path, capsys):
    from tests.test_cli import png_parameters, write_models_folder

    write_models_folder(tmp_path)
    args = ["--prompt", "x", "--models", str(tmp_path), "--width", "32", "--height", "32", "--steps", "1", "--seed",
            "1", "--device", "cpu"]
    assert cli.main([*args, "--dtype", "FP32", "--out", str(tmp_path / "o")]) == 0
    assert png_parameters(tmp_path / "o" / "flux2_1.png")[1]["dtype"] == "float32 (--dtype)"
    with pytest.raises(SystemExit) as stop:
        cli.main([*args, "--dtype", "double", "--out", str(tmp_path / "p")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "'double' is not a compute dtype" in err and "Traceback" not in err
