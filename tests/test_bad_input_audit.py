"""What the command line does with input that is wrong or unusual, found by trying it on tiny real files: each a
Flux2Error printed without a traceback (exit code 2) that says what was wrong and how to fix it, or a run that
records what it did. Also: the outpainting canvas bounded by the family that runs, and every quantized kind's
matmul recorded in the PNG."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from flux2_core.app import cli
from flux2_core.errors import Flux2Error
from tests.test_cli import png_parameters, write_models_folder
from tests.tiny.autoencoder import build_diffusers_autoencoder, save_bfl_autoencoder
from tests.tiny.text_encoder import build_tiny_qwen3, save_comfyui_text_encoder

PREFIX = "model.diffusion_model."


def error_of(argv, capsys) -> str:
    """The CLI run in-process; its error line (it must end with exit code 2 and no traceback)."""
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "error: " in err, err
    return err[err.index("error: "):]


# --- --expand: the canvas is bounded by the family of the model that runs --------------------------------------------

@pytest.fixture(scope="module")
def other_files(tmp_path_factory):
    """A text encoder and an autoencoder beside the transformers below (the run stops before they load)."""
    tmp = tmp_path_factory.mktemp("expand")
    te = save_comfyui_text_encoder(build_tiny_qwen3(), tmp / "qwen_3_4b.safetensors")
    ae = save_bfl_autoencoder(build_diffusers_autoencoder(), tmp / "flux2-vae.safetensors")
    picture = tmp / "picture.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(picture)
    return tmp, te, ae, picture


def transformer_file(family: str, folder):
    if family == "flux2":
        from tests.tiny.transformer import TINY_TRANSFORMER, random_bfl_transformer_state_dict

        state, name = random_bfl_transformer_state_dict(TINY_TRANSFORMER), "flux-2-klein-4b.safetensors"
    else:
        from tests.tiny.flux3 import random_flux3_state_dict, tiny_flux3

        state, name = random_flux3_state_dict(tiny_flux3()), "flux3-image-klein.safetensors"
    path = folder / name
    if not path.exists():
        save_file({PREFIX + k: v.contiguous() for k, v in state.items()}, str(path))
    return path


@pytest.mark.parametrize("family", ["flux2", "flux3"])
def test_the_expanded_canvas_is_bounded_by_the_schedule_of_the_family_in_the_file(other_files, family, capsys,
                                                                                     monkeypatch):
    """A 64x48 picture expanded to 5120x5120 (102400 tokens): past what FLUX.2's schedule serves at 4 steps (it says
    at most about 4688x4688), within what an input may be (8192^2). FLUX.2's file is refused before it loads, naming
    --expand and the canvas; FLUX 3's schedule serves it, but its sides are past the 4096 FLUX 3 makes: refused too."""
    from flux2_core.families import FAMILIES

    tmp, te, ae, picture = other_files
    transformer = transformer_file(family, tmp)
    tokens = 320 * 320
    with pytest.raises(Flux2Error):                   # the premise: FLUX.2's schedule refuses this canvas
        FAMILIES["flux2"].schedule(4, tokens)
    FAMILIES["flux3"].schedule(4, tokens)             # and FLUX 3's serves it

    def loading(*args, **kwargs):
        raise Flux2Error("the run reached the loading of the models")

    from PIL import Image

    made, new = [], Image.new

    def spy(mode, size, *args, **kwargs):                 # every picture made: the canvas is one
        made.append(tuple(size))
        return new(mode, size, *args, **kwargs)

    monkeypatch.setattr(cli, "load_for_command", loading)
    monkeypatch.setattr(Image, "new", spy)
    err = error_of(["--transformer", str(transformer), "--text-encoder", str(te), "--ae", str(ae), "--prompt", "x",
                    "--image", str(picture), "--expand", "0,0,5056,5072", "--out", str(tmp / "out")], capsys)
    if family == "flux2":
        assert "--expand" in err and "5120x5120" in err and "FLUX.2 schedule" in err and "expand less" in err, err
    else:                                                 # its schedule serves it, its sides are past its 4096
        assert "--expand" in err and "FLUX 3 Image Klein makes pictures up to 4096 px a side" in err, err
    assert (5120, 5120) not in made and "reached the loading" not in err      # refused before the canvas was made


def test_the_expanded_canvas_is_still_at_most_an_inputs_size(other_files, capsys, monkeypatch):
    """A canvas past what an input may be (8192^2 px) is refused before it is made, whatever the family makes."""
    tmp, te, ae, picture = other_files
    transformer = transformer_file("flux3", tmp)
    monkeypatch.setattr(cli, "load_for_command", lambda *a, **k: pytest.fail("loaded"))
    err = error_of(["--transformer", str(transformer), "--text-encoder", str(te), "--ae", str(ae), "--prompt", "x",
                    "--image", str(picture), "--expand", "0,0,8192,8192", "--out", str(tmp / "out")], capsys)
    assert "canvas" in err and "expand less" in err, err


# --- every quantized kind's matmul: said, and recorded in the PNG ------------------------------------------------------

def test_the_png_records_the_matmul_of_every_4_bit_kind(tmp_path, capsys):
    """A mixed ComfyUI file: a W4A4 layer, an AWQ one and an SVDQuant one. On the CPU none has a kernel of its own
    (comfy-kitchen's are GPU kernels), so the run says each is off, and the PNG records the three."""
    pytest.importorskip("comfy_kitchen")
    from tests.tiny.layouts import comfy_quant, save_prefixed, w4_quant
    from tests.tiny.transformer import TINY_TRANSFORMER, random_bfl_transformer_state_dict

    write_models_folder(tmp_path)
    sd = random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=0)
    sd = comfy_quant(sd, ["double_blocks.0.img_attn.qkv"], "convrot_w4a4", 64)
    sd = w4_quant(sd, ["double_blocks.1.txt_mlp.0"], "awq_w4a16")
    sd = w4_quant(sd, ["single_blocks.0.linear1"], "svdquant_w4a4")
    save_prefixed(sd, tmp_path / "diffusion_models" / "flux-2-klein-4b.safetensors", PREFIX)
    code = cli.main(["--models", str(tmp_path), "--prompt", "a fox", "--width", "32", "--height", "32", "--steps", "1",
                     "--seed", "3", "--device", "cpu", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 0, err
    params = png_parameters(tmp_path / "out" / "flux2_3.png")[1]
    assert {k: v for k, v in params.items() if k.endswith("_matmul")} == {
        "w4a4_matmul": "off", "awq_matmul": "off", "svdquant_matmul": "off"}, params
    assert "W4A4 int4 matmul: off" in err and "awq matmul in its own format: off" in err
    assert "svdquant matmul in its own format: off" in err


# --- weight files that are not what their names say ------------------------------------------------------------------

@pytest.mark.parametrize("name,content,says", [
    ("flux-2-klein-4b.safetensors", b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64 +
     b"\nsize 7751087592\n", ["Git LFS pointer", "git lfs pull"]),
    ("flux-2-klein-4b-Q4_K_M.gguf", b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64 +
     b"\nsize 2751087592\n", ["Git LFS pointer", "git lfs pull"]),
    ("flux-2-klein-4b.safetensors", b"<!DOCTYPE html>\n<html><head><title>Sign in</title></head></html>",
     ["web page", "<!DOCTYPE html>", "licence"]),
    ("flux-2-klein-4b.safetensors", b'{"error":"Access to model is restricted. You must be authenticated."}',
     ["but text", "Access to model is restricted", "download it again"]),
    # a page with a byte-order mark, and one whose first line is not English
    ("flux-2-klein-4b.safetensors", b"\xef\xbb\xbf<!DOCTYPE html><html><title>Sign in</title></html>",
     ["web page", "<!DOCTYPE html>"]),
    ("flux-2-klein-4b.safetensors", "<title>Zugriff verweigert – Anmeldung</title>".encode(),
     ["web page", "Zugriff verweigert – Anmeldung"]),
    # a download manager's file, made at full size before its bytes arrive
    ("flux-2-klein-4b-Q4_K_M.gguf", bytes(4096), ["not a valid GGUF file", "download it again"]),
])
def test_a_weight_file_that_is_text_or_empty_says_what_it_is(other_files, tmp_path, capsys, name, content, says):
    _, te, ae, _ = other_files
    path = tmp_path / name
    path.write_bytes(content)
    err = error_of(["--transformer", str(path), "--text-encoder", str(te), "--ae", str(ae), "--prompt", "x",
                    "--out", str(tmp_path / "out")], capsys)
    assert str(path) in err and all(text in err for text in says), err
    assert name.endswith(".safetensors") or ".safetensors" not in err, err      # a GGUF is not called safetensors


def test_a_text_encoder_tensor_of_another_shape_is_named(other_files, tmp_path, capsys):
    """One linear of the encoder one row too wide: the message names the tensor, its shape and the one the file's other
    tensors imply (not torch's size-mismatch dump), and says to download the file again."""
    from safetensors.torch import load_file

    tmp, te, ae, _ = other_files
    state = load_file(str(te))
    key = "model.layers.0.mlp.up_proj.weight"
    rows, columns = state[key].shape
    state[key] = torch.zeros(rows + 1, columns)
    broken = tmp_path / "qwen_3_4b.safetensors"
    save_file(state, str(broken))
    err = error_of(["--transformer", str(transformer_file("flux2", tmp)), "--text-encoder", str(broken), "--ae",
                    str(ae), "--prompt", "x", "--width", "32", "--height", "32", "--device", "cpu",
                    "--out", str(tmp_path / "out")], capsys)
    assert f"layers.0.mlp.up_proj.weight is [{rows + 1}, {columns}], not [{rows}, {columns}]" in err, err
    assert "download it again" in err and "size mismatch" not in err, err


def test_an_animated_picture_gives_its_first_frame_and_says_so(tmp_path, capsys):
    """An animated GIF as --ref / --image / --mask: its first frame, as Pillow decodes it, and a note with the frame
    count; a still picture gets no note."""
    import numpy as np
    from PIL import Image

    from flux2_core.app import cli

    frames = [Image.new("RGB", (32, 32), colour) for colour in ((200, 10, 10), (10, 200, 10), (10, 10, 200))]
    frames[0].save(tmp_path / "moving.gif", save_all=True, append_images=frames[1:], duration=100)
    frames[0].save(tmp_path / "still.png")
    image = cli.open_image(str(tmp_path / "moving.gif"))
    with Image.open(tmp_path / "moving.gif") as first:
        assert np.array_equal(np.asarray(image), np.asarray(first.convert("RGB")))
    assert "moving.gif holds 3 frames" in capsys.readouterr().err
    cli.open_mask(str(tmp_path / "moving.gif"))
    assert "holds 3 frames" in capsys.readouterr().err
    cli.open_image(str(tmp_path / "still.png"))
    assert "frames" not in capsys.readouterr().err
    # a phone's JPEG with a second picture in a multi-picture block (a preview, a gain map) is one photo
    frames[0].save(tmp_path / "phone.jpg", "MPO", save_all=True, append_images=frames[1:2])
    with Image.open(tmp_path / "phone.jpg") as phone:
        assert phone.format == "MPO" and phone.n_frames == 2
    cli.open_image(str(tmp_path / "phone.jpg"))
    assert "frames" not in capsys.readouterr().err
