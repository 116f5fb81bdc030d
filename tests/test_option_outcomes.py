"""Options that change nothing and counts that surprise are said, before the models load where the files tell:
what --int8 / --int8 convrot / --fp8 yes do to a file's layers (quantized at load, or kept as the file stores them),
and FLUX 3 Image Klein's 10 references counted with the picture being inpainted, refused before any model loads."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGML
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from flux2_core import kitchen, pipeline, weights
from flux2_core.app import cli
from flux2_core.errors import Flux2Error
from flux2_core.families.flux2.files import quantizable
from tests.tiny.gguf import dit_types, save_gguf
from tests.tiny.layouts import comfy_fp8, save_prefixed
from tests.tiny.transformer import TINY_TRANSFORMER, random_bfl_transformer_state_dict

PREFIX = "model.diffusion_model."
LOADING = "the models were loaded"            # what the stand-in loader says, so a test sees it was reached


def stop_at_loading(*args, **kwargs):
    raise Flux2Error(LOADING)


@pytest.fixture(scope="module")
def float_sd():
    return random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=0)


@pytest.fixture(scope="module")
def block_layers(float_sd):
    """The layers --int8 / --fp8 store (the family's ``quantizable``), in the file's order."""
    return [k.removesuffix(".weight") for k, v in float_sd.items()
            if k.endswith(".weight") and v.ndim == 2 and quantizable(k.removesuffix(".weight"))]


def comfy_int8(weight: torch.Tensor, per_row: bool) -> dict[str, torch.Tensor]:
    """A ComfyUI int8_tensorwise layer by hand: int8 codes, a float32 scale per row (or one), its comfy_quant."""
    weight = weight.float()
    scale = weight.abs().amax(dim=1) / 127 if per_row else weight.abs().max() / 127
    codes = (weight / (scale[:, None] if per_row else scale)).round().clamp(-127, 127).to(torch.int8)
    spec = torch.tensor(list(json.dumps({"format": "int8_tensorwise"}).encode()), dtype=torch.uint8)
    return {"weight": codes, "weight_scale": scale, "comfy_quant": spec}


def write_file(float_sd, path, stored_int8: set[str], rest: str, per_row: bool) -> dict[str, torch.Tensor]:
    """The tiny transformer with ``stored_int8`` in ComfyUI's int8 and the other block layers in ``rest`` (float,
    ComfyUI's fp8 named by a comfy_quant tensor each, or the whole file a GGUF in Q8_0); returns what it wrote."""
    sd = dict(float_sd)
    if rest == "gguf":
        save_gguf(sd, path, dit_types(GGML.Q8_0))
        return sd
    others = [k.removesuffix(".weight") for k, v in sd.items() if k.endswith(".weight") and v.ndim == 2
              and quantizable(k.removesuffix(".weight")) and k.removesuffix(".weight") not in stored_int8]
    if rest == "fp8":
        sd = comfy_fp8(sd, others)[0]
        fp8_spec = torch.tensor(list(b'{"format": "float8_e4m3fn"}'), dtype=torch.uint8)
        sd |= {layer + ".comfy_quant": fp8_spec.clone() for layer in others}
    for layer in stored_int8:
        sd |= {f"{layer}.{name}": t for name, t in comfy_int8(sd.pop(layer + ".weight"), per_row).items()}
    save_prefixed(sd, path, PREFIX)
    return sd


@pytest.fixture(scope="module")
def other_files(tmp_path_factory):
    """A text encoder and an autoencoder for the command line (never loaded: the loader stops the run first)."""
    from tests.tiny.autoencoder import build_diffusers_autoencoder, save_bfl_autoencoder
    from tests.tiny.text_encoder import build_tiny_qwen3, save_comfyui_text_encoder

    folder = tmp_path_factory.mktemp("others")
    save_comfyui_text_encoder(build_tiny_qwen3(), folder / "qwen_3_4b.safetensors")
    save_bfl_autoencoder(build_diffusers_autoencoder(), folder / "flux2-vae.safetensors")
    return folder / "qwen_3_4b.safetensors", folder / "flux2-vae.safetensors"


OPTIONS = {"--int8": (["--int8"], "int8"), "--int8 convrot": (["--int8", "convrot"], "int8 ConvRot"),
           "--fp8 yes": (["--fp8", "yes"], "fp8")}


@settings(max_examples=12, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_the_loading_line_says_what_a_storage_option_does_to_the_layers(float_sd, block_layers, other_files,
                                                                       tmp_path, monkeypatch, capsys, data):
    """Draws a file (some block layers, none or all of them too, stored in ComfyUI's int8; the others in float or
    fp8; or a GGUF in Q8_0) and an option (--int8, --int8 convrot, --fp8 yes). The line printed before the models
    load says how many layers the option quantizes at load and how many stay as the file stores them, in which
    format, and says plainly when the option changes nothing; loading the file then does what the line said."""
    rest = data.draw(st.sampled_from(["float", "fp8", "gguf"]), label="the other layers")
    stored = set() if rest == "gguf" else data.draw(st.sets(st.sampled_from(block_layers)), label="int8 layers")
    if rest != "gguf" and data.draw(st.booleans(), label="all int8"):
        stored = set(block_layers)
    per_row = data.draw(st.booleans(), label="per-row scales")
    option = data.draw(st.sampled_from(sorted(OPTIONS)), label="option")
    flags, name = OPTIONS[option]
    path = tmp_path / f"klein-{len(stored)}-{rest}.{'gguf' if rest == 'gguf' else 'safetensors'}"
    written = write_file(float_sd, path, stored, rest, per_row)

    # the independent expectation: --int8 quantizes every block layer but the file's int8 ones (fp8 ones too, from
    # their values); --fp8 yes only the float ones, an fp8 file's stay fp8
    kept = {"int8_tensorwise": len(stored)}
    if option == "--fp8 yes" and rest in ("fp8", "gguf"):
        kept["fp8" if rest == "fp8" else "GGUF Q8_0"] = len(block_layers) - len(stored)
    kept = {fmt: n for fmt, n in kept.items() if n}
    quantized = len(block_layers) - sum(kept.values())

    monkeypatch.setattr(pipeline, "load_models", stop_at_loading)
    text_encoder, ae = other_files
    code = cli.main(["--transformer", str(path), "--text-encoder", str(text_encoder), "--ae", str(ae), "--prompt",
                     "a fox", "--device", "cpu", "--out", str(tmp_path / "out"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and LOADING in err, err
    line = next((line for line in err.splitlines() if line.startswith(f"loading {path.name}")), None)
    assert line is not None, err
    if quantized:
        assert f"{name}: {quantized} block layers quantized at load" in line, line
        assert "changes nothing" not in line, line
    else:
        assert f"{name} changes nothing here: the file already stores all {len(block_layers)} block layers" in line
        # already what was asked (int8 over per-row / per-tensor int8, fp8 over fp8): no advice to load another file
        already = ((option == "--int8" and len(stored) == len(block_layers))
                   or (option == "--fp8 yes" and rest == "fp8" and not stored))
        assert line.endswith(f"already in {name}") == already, line
        assert ("load the file's bf16 release" in line) != already, line
    for fmt, n in kept.items():
        assert f"{fmt}: {n}" in line, line
    if kept and quantized:
        assert f"{sum(kept.values())} kept as the file stores them" in line, line
    if not kept:
        assert "kept as the file stores them" not in line, line

    # and the load does what the line said: the file's int8 layers as written, the rest in the option's storage
    int8 = {"--int8": True, "--int8 convrot": "convrot"}.get(option, False)
    model, _ = weights.load_transformer(path, "cpu", torch.float32, fp8=True if option == "--fp8 yes" else None,
                                        int8=int8)
    for layer in stored:
        assert torch.equal(model.get_submodule(layer).weight, written[layer + ".weight"]), layer
    wanted = "int8" if int8 else "Q8_0" if rest == "gguf" else "fp8"
    assert [model.get_submodule(layer).kind for layer in block_layers if layer not in stored] == \
        [wanted] * (len(block_layers) - len(stored))


# --- FLUX 3 Image Klein's references -------------------------------------------------------------------------------

def write_picture(path, size=(32, 32), seed=0):
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return str(path)


# how the picture being edited reaches the model: as the start alone (image-to-image), or also as reference 1
EDITS = {"none": [], "image": ["--image", "{photo}"], "mask": ["--image", "{photo}", "--mask", "{mask}"],
         "expand": ["--image", "{photo}", "--expand", "0,0,16,0"]}


@settings(max_examples=25, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pictures=st.integers(0, 12), edit=st.sampled_from(sorted(EDITS)),
       variant=st.sampled_from(["flux3-klein", "flux3-klein-base", "klein-4b"]))
def test_references_over_the_limit_are_refused_before_any_model_loads(tmp_path, monkeypatch, capsys, pictures, edit,
                                                                       variant):
    """Draws the --ref pictures (around FLUX 3's 10), an edit (none, image-to-image, inpainting with --mask or
    --expand) and the variant. Inpainting gives the model the picture as one more reference: over FLUX 3's 10 the run
    is refused before any model loads, naming the pictures, the edited one and their sum; FLUX.2 has no limit, and a
    count within it reaches the loader."""
    monkeypatch.setattr(pipeline, "load_models", stop_at_loading)
    refs = [write_picture(tmp_path / f"ref{i}.png", (64, 64), seed=i) for i in range(pictures)]   # FLUX.2's least
    photo, mask = write_picture(tmp_path / "photo.png", (48, 32)), tmp_path / "mask.png"
    Image.new("L", (48, 32), 255).save(mask)
    edit_args = [a.format(photo=photo, mask=mask) for a in EDITS[edit]]
    code = cli.main(["--variant", variant, "--transformer", "t.safetensors", "--text-encoder", "te.safetensors",
                     "--ae", "ae.safetensors", "--prompt", "a fox", "--device", "cpu", "--out", str(tmp_path / "out"),
                     *[a for ref in refs for a in ("--ref", ref)], *edit_args])
    err = capsys.readouterr().err
    inpainted = edit in ("mask", "expand")
    total = pictures + inpainted
    assert code == 2, err
    if variant.startswith("flux3") and total > 10:
        assert LOADING not in err, err
        assert "FLUX 3 Image Klein takes at most 10 reference images" in err, err
        assert ("the picture being inpainted counts as one" in err) == inpainted, err
        parts = (f"{pictures} reference pictures plus the picture being inpainted ({total})" if inpainted
                 else f"{pictures} reference pictures")
        assert f"got {parts}" in err, err
    else:
        assert LOADING in err, err


class Unreachable:
    """A model that must not be used: any use is the test's failure."""

    def __getattr__(self, name):
        raise AssertionError(f"a model was used ({name}) before the reference count was checked")


@settings(max_examples=20, deadline=None, database=None)
@given(pictures=st.integers(1, 12), inpainted=st.booleans())
def test_generate_refuses_too_many_references_before_any_model_runs(pictures, inpainted):
    """``generate`` with FLUX 3 Image Klein: draws the references and whether it inpaints. Over 10 in all it is refused
    before the prompt encoder or the autoencoder is touched, the message naming what counts; within, the count passes
    (the run then reaches a model)."""
    from flux2_core.families.flux3 import FLUX3
    from flux2_core.families.flux3.transformer import Flux3Transformer
    from tests.tiny.flux3 import TINY_FLUX3

    with torch.device("meta"):
        transformer = Flux3Transformer(TINY_FLUX3)
    models = pipeline.Models(transformer, FLUX3.variant_for(TINY_FLUX3, ""), Unreachable(), Unreachable(),
                             prompt_cache=None, reference_cache=None)
    refs = [Image.new("RGB", (32, 32), (i * 20, 0, 0)) for i in range(pictures)]
    edit = {"image": Image.new("RGB", (48, 32)), "mask": Image.new("L", (48, 32), 255)} if inpainted else {}
    total = pictures + inpainted
    if total <= 10:
        with pytest.raises(AssertionError, match="a model was used"):
            pipeline.generate(models, "a fox", references=refs, **edit)
        return
    with pytest.raises(Flux2Error) as refused:
        pipeline.generate(models, "a fox", references=refs, **edit)
    message = str(refused.value)
    assert message.startswith("FLUX 3 Image Klein takes at most 10 reference images"), message
    parts = (f"{pictures} reference pictures plus the picture being inpainted ({total})" if inpainted
             else f"{pictures} reference pictures")
    assert f"got {parts}" in message and re.search(r"leave out \d+ reference picture", message), message


@pytest.mark.skipif(kitchen.ck is None, reason="comfy-kitchen writes the ConvRot file")
@pytest.mark.parametrize("option,already", [("convrot", True), (True, False)])
def test_int8_convrot_over_a_convrot_file_says_it_is_already_what_was_asked(float_sd, block_layers, tmp_path,
                                                                            option, already):
    """Every block layer in ComfyUI's int8 ConvRot (written by comfy-kitchen): --int8 convrot changes nothing and the
    layers are already ConvRot; plain --int8 changes nothing either, but they are not per-row int8."""
    from tests.tiny.layouts import comfy_quant

    path = save_prefixed(comfy_quant(float_sd, block_layers, "int8_convrot", 64), tmp_path / "c.safetensors", PREFIX)
    line = weights.storage_outcome(path, int8=option).line()
    name = "int8 ConvRot" if option == "convrot" else "int8"
    assert line.startswith(f"{name} changes nothing here: the file already stores all {len(block_layers)}"), line
    assert line.endswith(f"already in {name}") == already, line
