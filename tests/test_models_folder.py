"""A ComfyUI models folder holding several families, laid out as ComfyUI's own templates leave it: the model a run
takes, what it says of the others, and what its refusals name."""

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from flux2_core.app import cli
from flux2_core.errors import Flux2Error

# ComfyUI's template file names (comfyui-workflow-templates), each with the variant it is or the part it plays
TRANSFORMERS = {
    "flux-2-klein-4b-fp8.safetensors": "klein-4b", "flux-2-klein-base-4b-fp8.safetensors": "klein-base-4b",
    "flux-2-klein-9b-fp8.safetensors": "klein-9b", "flux-2-klein-base-9b-fp8.safetensors": "klein-base-9b",
    "flux-2-klein-9b-kv-fp8.safetensors": "klein-9b-kv",
    "flux3-image-klein-int8-convrot.safetensors": "flux3-klein", "flux3-image-klein-bf16.safetensors": "flux3-klein",
    "flux3-image-klein-base-int8-convrot.safetensors": "flux3-klein-base",
    "flux3-image-klein-base-bf16.safetensors": "flux3-klein-base",
}
ENCODERS = {"qwen_3_4b.safetensors": ("klein-4b", "klein-base-4b"),
            "qwen_3_8b_fp8mixed.safetensors": ("klein-9b", "klein-base-9b", "klein-9b-kv"),
            "qwen3vl_4b_int8_convrot.safetensors": ("flux3-klein", "flux3-klein-base")}
VAE = "flux2-vae.safetensors"
UPSAMPLER = "qwen3.5_9b_flux3_prompt_upsampler_w4a8.safetensors"
BROKEN = "half-downloaded.safetensors"
# the order the registry lists the variants in: without --variant the first one present is taken
ORDER = ("klein-4b", "klein-9b", "klein-9b-kv", "klein-base-4b", "klein-base-9b", "flux3-klein", "flux3-klein-base")


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, Path]:
    """One tiny file of each kind, written once and linked under every name a drawn folder gives it."""
    import torch

    from tests.tiny.flux3 import TINY_QWEN3_VL_TEXT
    from tests.tiny.text_encoder import build_tiny_qwen3, save_comfyui_text_encoder
    from tests.tiny.transformer import random_bfl_transformer_state_dict, save_comfyui_transformer

    root = tmp_path_factory.mktemp("tiny")
    files = {"flux2": save_comfyui_transformer(random_bfl_transformer_state_dict(), root / "flux2.safetensors"),
             "qwen3": save_comfyui_text_encoder(build_tiny_qwen3(), root / "qwen3.safetensors"),
             "qwen3vl": save_comfyui_text_encoder(build_tiny_qwen3(1, TINY_QWEN3_VL_TEXT), root / "qwen3vl.safetensors")}
    flux3 = {"model.diffusion_model.early_stream_modulations.txt.lin.weight": torch.zeros(6, 4),
             "model.diffusion_model.emb_in.image.weight": torch.zeros(4, 8)}
    save_file(flux3, str(root / "flux3.safetensors"))        # its headers are never needed: it has its usual name
    save_file({"model.language_model.layers.0.linear_attn.A_log": torch.zeros(4),
               "model.language_model.embed_tokens.weight": torch.zeros(16, 8)}, str(root / "upsampler.safetensors"))
    files |= {"flux3": root / "flux3.safetensors", "upsampler": root / "upsampler.safetensors"}
    (root / "broken.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": ")     # cut short
    files["broken"] = root / "broken.safetensors"
    return files


def lay_out(folder: Path, names: set[str], tiny: dict[str, Path]) -> None:
    for sub in ("diffusion_models", "text_encoders", "vae"):
        (folder / sub).mkdir(parents=True)
    for name in names:
        if name in TRANSFORMERS:
            source, sub = tiny["flux3" if name.startswith("flux3") else "flux2"], "diffusion_models"
        elif name in ENCODERS:
            source, sub = tiny["qwen3vl" if "vl" in name else "qwen3"], "text_encoders"
        else:
            source, sub = {VAE: (tiny["flux2"], "vae"), UPSAMPLER: (tiny["upsampler"], "text_encoders"),
                           BROKEN: (tiny["broken"], "diffusion_models")}[name]
        os.link(source, folder / sub / name)


def search(folder: Path, variant):
    """What the search takes and says: (paths or the refusal's text, its notes)."""
    try:
        found = cli.search_models(str(folder), variant) if hasattr(cli, "search_models") else None
        paths = found.paths if found else cli.find_weights(str(folder), variant)
        return paths, " ".join(getattr(found, "notes", ()))
    except Flux2Error as e:
        return None, str(e)


NAMES = sorted([*TRANSFORMERS, *ENCODERS, VAE, UPSAMPLER, BROKEN])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(present=st.sets(st.sampled_from(NAMES), min_size=1),
       variant=st.sampled_from([None, *ORDER, "dev", "klein-12b"]))
def test_a_folder_of_several_families_says_what_it_takes_and_how_to_pick(tiny_files, tmp_path_factory, present,
                                                                         variant):
    """Draws which of ComfyUI's template files a models folder holds (FLUX.2 Klein's and FLUX 3 Image Klein's
    transformers, their encoders, the autoencoder, the upsampler's single file, a file cut short) and the --variant
    asked (none, each one, dev, an unknown name). Expected: an unknown or unrunnable name is refused listing the
    variants run; else the choice is the asked one or the first present in the registry's order, and a run takes its
    own files; without --variant the other models present are named with --variant; a refusal names the choice, only
    what it lacks, and the others present; the file cut short is named; the upsampler's file, where looked at, is
    called what it is with the folder the upsampler needs."""
    folder = tmp_path_factory.mktemp("models")
    lay_out(folder, present, tiny_files)
    paths, said = search(folder, variant)
    if variant in ("dev", "klein-12b"):
        assert paths is None and all(name in said for name in ORDER), said
        assert "-<quant>.gguf" not in said and " or )" not in said, said
        return
    held = {TRANSFORMERS[n] for n in present if n in TRANSFORMERS}
    choice = variant or next((v for v in ORDER if v in held), None)
    if choice is None:                      # no model at all: the refusal says what to put there
        assert paths is None and "no weights found" in said
        return
    others = held - {choice}
    encoders = [n for n in present if n in ENCODERS and choice in ENCODERS[n]]
    complete = choice in held and encoders and VAE in present
    if not variant:
        assert all(v in said for v in others) and (not others or "--variant" in said), said
    assert (BROKEN in said) == (BROKEN in present), said
    if complete:
        transformer, encoder, ae = paths
        assert TRANSFORMERS[transformer.name] == choice and encoder.name in encoders and ae.name == VAE
        return
    assert paths is None and choice in said, said
    assert all(v in said for v in others) and (not others or "--variant" in said), said
    needs = [n for n in ENCODERS if choice in ENCODERS[n]]
    if not encoders:
        assert needs[0] in said, said
    foreign = [n for n in ENCODERS if choice not in ENCODERS[n]]
    assert not any(n in said for n in foreign), said          # not the needs of every variant
    if not encoders and UPSAMPLER in present:
        assert "prompt upsampler" in said and "prompt_upsamplers" in said, said


def test_a_run_names_the_other_models_and_refuses_an_unrunnable_variant(tmp_path, capsys):
    """The command line: a FLUX.2 Klein 4B folder with a FLUX 3 transformer beside it runs Klein 4B and says how to
    run the other; --variant dev and a name that is none are usage errors listing the variants run."""
    from tests.test_cli import png_parameters, write_models_folder

    write_models_folder(tmp_path)
    (tmp_path / "diffusion_models" / "flux3-image-klein-bf16.safetensors").write_bytes(b"")
    code = cli.main(["--models", str(tmp_path), "--prompt", "a fox", "--width", "32", "--height", "32", "--seed", "1",
                     "--steps", "1", "--device", "cpu", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 0, err
    assert png_parameters(tmp_path / "out" / "flux2_1.png")[1]["transformer"] == "flux-2-klein-4b.safetensors"
    assert "note: this run takes klein-4b" in err and "flux3-klein (flux3-image-klein-bf16.safetensors)" in err
    assert "--variant NAME" in err
    for name in ("dev", "klein-12b"):
        with pytest.raises(SystemExit):
            cli.main(["--models", str(tmp_path), "--prompt", "x", "--variant", name])
        err = capsys.readouterr().err
        assert "argument --variant" in err and all(v in err.split("variants run here:")[1] for v in ORDER), err


def test_an_explicit_transformer_is_not_told_to_use_variant(tiny_files, tmp_path, monkeypatch):
    """--transformer given beside a folder of several models: the folder gives the other files, and the run does not
    suggest --variant, which could not replace the file given. (The tiny file's headers read as no real variant, so
    they are read here as Klein 4B's, as a real file's would be.)"""
    from flux2_core import weights
    from flux2_core.families import VARIANTS

    monkeypatch.setattr(weights, "inspect_transformer", lambda path: (None, VARIANTS["klein-4b"]))
    lay_out(tmp_path, {"flux-2-klein-4b-fp8.safetensors", "flux3-image-klein-bf16.safetensors",
                       "qwen_3_4b.safetensors", VAE}, tiny_files)
    explicit = tmp_path / "diffusion_models" / "flux-2-klein-4b-fp8.safetensors"
    found = cli.search_models(str(tmp_path), None, str(explicit))
    assert found.transformer == explicit and "--variant" not in " ".join(found.notes), found.notes
    assert cli.search_models(str(tmp_path), None).notes[0].startswith("this run takes klein-4b")    # without it: said


NOT_FILES = ["loop", "dangling", "folder", "fifo"]


def make_not_a_file(path: Path, kind: str) -> str:
    """An entry named like a weights file that is none: what the survey must call it."""
    if kind == "loop":
        os.symlink(path.name, path)
        return "a symbolic link that loops back on itself"
    if kind == "dangling":
        os.symlink("gone.safetensors", path)
        return "a link to gone.safetensors, which does not exist"
    if kind == "folder":
        path.mkdir()
        return "a folder, not a weights file"
    os.mkfifo(path)
    return "not a regular file"


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kinds=st.lists(st.sampled_from(NOT_FILES), min_size=1, max_size=3),
       names=st.lists(st.sampled_from(sorted(n for n in TRANSFORMERS if not n.startswith("flux3"))), min_size=3,
                      max_size=3, unique=True))
def test_entries_that_are_not_files_are_named_and_the_survey_goes_on(tiny_files, tmp_path_factory, kinds, names):
    """A symlink loop, a dangling link, a folder or a FIFO under a FLUX.2 file's usual name beside a working FLUX 3:
    each is passed over, named as what it is, and FLUX 3 runs (before: the loop was picked, then "does not exist")."""
    folder = tmp_path_factory.mktemp("not-files")
    lay_out(folder, {"flux3-image-klein-bf16.safetensors", "qwen3vl_4b_int8_convrot.safetensors", VAE}, tiny_files)
    said = {name: make_not_a_file(folder / "diffusion_models" / name, kind) for kind, name in zip(kinds, names)}
    paths, notes = search(folder, None)
    assert paths is not None and paths[0].name == "flux3-image-klein-bf16.safetensors", notes
    for name, what in said.items():
        assert f"passed over diffusion_models/{name}: it is {what}" in notes, notes
