"""The main job: `python -m flux2_core --demo` in a subprocess (PNGs with metadata), weights found in a ComfyUI models
folder (tiny real files), the list of missing files, early errors, and the `queue` route."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flux2_core.app import cli
from flux2_core.errors import Flux2Error
from flux2_core.runtime import memory

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "flux2_core", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300, check=False)


def png_parameters(path):
    with Image.open(path) as im:
        return im.size, json.loads(im.text["parameters"])


@pytest.mark.slow
def test_demo_writes_pngs_with_metadata(tmp_path, monkeypatch):
    ref = tmp_path / "ref.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (70, 100, 3), dtype=np.uint8)).save(ref)
    proc = run_cli("--demo", "--prompt", "a red fox", "--seed", "5", "--batch", "2", "--ref", str(ref),
                   "--steps", "2", "--out", "pics", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "RANDOM weights" in proc.stdout.splitlines()[0]
    paths = [Path(line) for line in proc.stdout.splitlines()[1:]]
    assert [p.name for p in paths] == ["flux2_5.png", "flux2_6.png"]
    for path, seed in zip(paths, [5, 6]):
        size, params = png_parameters(tmp_path / path)
        assert size == (96, 64)                           # the reference's size, cropped to multiples of 16
        assert params["prompt"] == "a red fox" and params["seed"] == seed and params["steps"] == 2
        assert (params["width"], params["height"], params["references"]) == (96, 64, 1)
        assert params["weights"] == "demo (random)"
    assert "step 2/2" in proc.stderr or "2/2" in proc.stderr   # progress on stderr (plain or tqdm)
    # the same run again, in-process: a new file name, the same pixels (deterministic weights and seeds), to one
    # uint8 level: the two processes' CPU kernels may split a float reduction differently (seen here: 6 of 18432
    # values one level apart in about one run of three, on a 2-core Xeon); another seed differs everywhere
    monkeypatch.chdir(tmp_path)
    assert cli.main(["generate", "--demo", "--prompt", "a red fox", "--seed", "6", "--ref", str(ref),
                     "--steps", "2", "--out", "pics"]) == 0
    a, b = (np.asarray(Image.open(tmp_path / "pics" / n)).astype(int) for n in ("flux2_6.png", "flux2_6-1.png"))
    assert np.abs(a - b).max() <= 1 and (a != b).mean() < 0.01
    other = np.asarray(Image.open(tmp_path / "pics" / "flux2_5.png")).astype(int)
    assert (other != b).mean() > 0.5


@pytest.mark.parametrize("args,message", [
    (["--width", "100", "--height", "64"], "multiple of 16"),
    (["--width", "0"], "width"),
    (["--steps", "0"], "steps"),
    (["--batch", "0"], "batch"),
    (["--strength", "1.5"], "strength"),
    (["--strength", "0.5"], "--strength: denoise strength 0.5 < 1 is image-to-image, but there is no image"),
    (["--steps", "100000"], "--steps: steps must be a whole number from 1 to 10000"),
    (["--mask", "m.png"], "--mask: a mask needs the image it masks"),
    (["--width", "16384", "--height", "16384"], "at most about 4688x4688 px (86166 tokens) with 4 steps"),
    (["--width", "4096", "--height", "4096", "--steps", "200"], "at most about 3952x3952 px"),
])
def test_bad_settings_fail_before_loading(args, message, capsys):
    assert cli.main(["--prompt", "x", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err


@pytest.mark.parametrize("args,message", [
    (["--cfg", "nan"], "argument --cfg: --cfg must be a number written with digits 0-9"),
    (["--cfg=-inf"], "argument --cfg: --cfg must be a number written with digits 0-9"),
    (["--width", "１０２４"], "argument --width: --width must be a whole number written with digits 0-9"),
    (["--cfg", "1e999"], "argument --cfg: --cfg must be a finite number, got inf"),
    (["--seed", "9" * 41], "argument --seed: --seed must be a whole number of at most 40 characters"),
])
def test_numbers_not_written_in_digits_are_refused_by_the_usage_line(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--prompt", "x", *args])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("size,message", [((40, 200), "at least 64"), ((64, 700), "aspect ratio")])
def test_bad_references(tmp_path, capsys, size, message):
    """Refused before any weights are looked for, by the rules of the model's family (FLUX.2 here; FLUX 3 takes
    these pictures, and at most 10)."""
    Image.new("RGB", size).save(tmp_path / "bad.png")
    assert cli.main(["--prompt", "x", "--variant", "klein-4b", "--ref", str(tmp_path / "bad.png")]) == 2
    assert message in capsys.readouterr().err
    assert cli.main(["--prompt", "x", "--variant", "flux3-klein", "--ref", str(tmp_path / "bad.png")]) == 2
    err = capsys.readouterr().err
    assert message not in err and "no weights found" in err
    assert cli.main(["--prompt", "x", "--variant", "flux3-klein", *["--ref", str(tmp_path / "bad.png")] * 11]) == 2
    assert "--ref: FLUX 3 Image Klein takes at most 10 reference images" in capsys.readouterr().err
    assert cli.main(["--prompt", "x", "--ref", str(tmp_path / "missing.png")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_missing_weights_lists_the_files(tmp_path, capsys):
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "flux2-vae.safetensors").write_bytes(b"")
    assert cli.main(["--models", str(tmp_path), "--prompt", "x", "--variant", "klein-9b"]) == 2
    err = capsys.readouterr().err
    assert "--transformer, --text-encoder" in err and "--ae" not in err.split(".")[0]
    assert "diffusion_models/flux-2-klein-9b.safetensors or flux-2-klein-9b-fp8.safetensors" in err
    assert "text_encoders/qwen_3_8b.safetensors or qwen_3_8b_fp8mixed.safetensors" in err
    assert "--demo" in err
    assert cli.main(["--prompt", "x"]) == 2                 # nothing given at all
    err = capsys.readouterr().err
    assert "text_encoders/qwen_3_4b.safetensors" in err and "vae/flux2-vae.safetensors or ae.safetensors" in err


def test_find_weights_in_a_comfyui_folder(tmp_path):
    for rel in ["unet/flux-2-klein-base-9b-fp8.safetensors", "clip/qwen_3_8b_fp8mixed.safetensors",
                "vae/ae.safetensors", "diffusion_models/flux-2-klein-base-4b.safetensors"]:
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    t, te, ae = cli.find_weights(str(tmp_path), "klein-base-9b")
    assert (t.name, te.name, ae.name) == ("flux-2-klein-base-9b-fp8.safetensors", "qwen_3_8b_fp8mixed.safetensors",
                                         "ae.safetensors")
    with pytest.raises(Flux2Error, match="qwen_3_4b"):      # auto: base 4B is found first, its encoder is missing
        cli.find_weights(str(tmp_path), None)
    t, te, _ = cli.find_weights(str(tmp_path), None, text_encoder="/elsewhere/qwen.safetensors")
    assert t.name == "flux-2-klein-base-4b.safetensors" and str(te) == "/elsewhere/qwen.safetensors"
    with pytest.raises(Flux2Error, match="no such folder"):
        cli.find_weights(str(tmp_path / "nope"), None)


def test_find_gguf_weights_by_their_quant_suffix(tmp_path):
    """GGUF files are found by the names unsloth and stable-diffusion.cpp give them (<stem>-<quant>.gguf); a 9B-KV
    GGUF is not taken for a 9B one; safetensors files of the usual names come first."""
    for rel in ["unet/flux-2-klein-9b-kv-Q4_K_M.gguf", "diffusion_models/flux-2-klein-9b-Q8_0.gguf",
                "clip/Qwen3-8B-Q6_K.gguf", "text_encoders/Qwen3-4B-Q4_K_M.gguf", "vae/flux2-vae.safetensors"]:
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    t, te, _ = cli.find_weights(str(tmp_path), "klein-9b")
    assert (t.name, te.name) == ("flux-2-klein-9b-Q8_0.gguf", "Qwen3-8B-Q6_K.gguf")
    assert cli.find_weights(str(tmp_path), "klein-9b-kv")[0].name == "flux-2-klein-9b-kv-Q4_K_M.gguf"
    with pytest.raises(Flux2Error, match=r"flux-2-klein-4b-<quant>\.gguf"):
        cli.find_weights(str(tmp_path), "klein-4b")
    (tmp_path / "text_encoders/qwen_3_8b.safetensors").write_bytes(b"")
    assert cli.find_weights(str(tmp_path), "klein-9b")[1].name == "qwen_3_8b.safetensors"


def write_models_folder(folder, fp8_file: bool = False):
    """Tiny real weight files under ComfyUI's names (the transformer as a BFL fp8 file: per-row scales, if asked)."""
    from flux2_core.families.flux2.files import quantizable
    from flux2_core.families.flux2.transformer import Flux2Transformer
    from flux2_core.storage.quant import quantize_transformer
    from tests.tiny.autoencoder import build_diffusers_autoencoder, save_bfl_autoencoder
    from tests.tiny.text_encoder import build_tiny_qwen3, save_comfyui_text_encoder
    from tests.tiny.transformer import TINY_TRANSFORMER, random_bfl_transformer_state_dict, save_comfyui_transformer

    for sub in ("diffusion_models", "text_encoders", "vae"):
        (folder / sub).mkdir()
    sd = random_bfl_transformer_state_dict(TINY_TRANSFORMER)
    if fp8_file:
        model = Flux2Transformer(TINY_TRANSFORMER)
        model.load_state_dict(sd)
        quantize_transformer(model, quantizable)
        sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_comfyui_transformer(sd, folder / "diffusion_models" / "flux-2-klein-4b.safetensors")
    save_comfyui_text_encoder(build_tiny_qwen3(), folder / "text_encoders" / "qwen_3_4b.safetensors")
    save_bfl_autoencoder(build_diffusers_autoencoder(), folder / "vae" / "flux2-vae.safetensors")


def test_generate_from_a_models_folder(tmp_path, capsys):
    """Tiny real weight files under ComfyUI's names: found, loaded by flux2_core.weights, and run."""
    import torch

    write_models_folder(tmp_path)
    out = tmp_path / "out"
    code = cli.main(["--models", str(tmp_path), "--prompt", "a fox", "--width", "48", "--height", "32",
                     "--seed", "9", "--device", "cpu", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    size, params = png_parameters(out / "flux2_9.png")
    assert size == (48, 32)
    assert params["transformer"] == "flux-2-klein-4b.safetensors" and params["steps"] == 4
    assert params["ae"] == "flux2-vae.safetensors" and params["text_encoder"] == "qwen_3_4b.safetensors"
    assert "transformer_weights" not in params
    assert torch.get_default_dtype() == torch.float32


def test_inpaint_from_a_models_folder_equals_the_engine(tmp_path, capsys):
    """--image with --mask: the PNG is pipeline.generate's inpainting (itself proven against diffusers), pixel for
    pixel; an empty mask says that nothing is repainted; a mask of another shape is refused."""
    import torch

    from flux2_core import pipeline

    write_models_folder(tmp_path)
    rng = np.random.default_rng(1)
    Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(tmp_path / "photo.png")
    mask = Image.new("L", (64, 48), 0)
    mask.paste(255, (8, 8, 40, 40))
    mask.save(tmp_path / "mask.png")
    Image.new("L", (64, 48), 0).save(tmp_path / "empty.png")
    Image.new("L", (48, 64), 255).save(tmp_path / "tall.png")
    common = ["--models", str(tmp_path), "--prompt", "a fox", "--image", str(tmp_path / "photo.png"),
              "--strength", "0.75", "--seed", "9", "--device", "cpu", "--dtype", "float32", "--out",
              str(tmp_path / "out")]
    code = cli.main([*common, "--mask", str(tmp_path / "mask.png")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    size, params = png_parameters(tmp_path / "out" / "flux2_9.png")
    assert size == (64, 48) and params["mask"] is True and params["strength"] == 0.75 and params["steps"] == 3
    models = pipeline.load_models(tmp_path / "diffusion_models" / "flux-2-klein-4b.safetensors",
                                  tmp_path / "text_encoders" / "qwen_3_4b.safetensors",
                                  tmp_path / "vae" / "flux2-vae.safetensors", device="cpu", dtype=torch.float32)
    expected = pipeline.generate(models, "a fox", image=Image.open(tmp_path / "photo.png"), mask=mask,
                                 strength=0.75, seed=9)
    assert np.array_equal(np.asarray(Image.open(tmp_path / "out" / "flux2_9.png")), expected.images[0].numpy())

    assert cli.main([*common, "--mask", str(tmp_path / "empty.png")]) == 0
    assert "note: the mask is empty (all black): nothing is repainted" in capsys.readouterr().err
    assert cli.main([*common, "--mask", str(tmp_path / "tall.png")]) == 2
    assert "the mask is 48x64 (WxH) but the image is 64x48, another shape" in capsys.readouterr().err


@pytest.mark.parametrize("fp8_file,flag,stored", [(False, [], None), (False, ["--fp8"], "fp8"),
                                                   (True, [], "fp8"), (True, ["--fp8", "no"], None)])
def test_fp8_flag_and_fp8_files(tmp_path, capsys, fp8_file, flag, stored):
    """--fp8 stores a full-precision file's blocks in fp8; an fp8 file stays fp8 unless --fp8 no; the PNG says so."""
    write_models_folder(tmp_path, fp8_file)
    argv = ["--models", str(tmp_path), "--prompt", "a fox", "--width", "32", "--height", "32", "--steps", "1",
            "--seed", "2", "--device", "cpu", "--out", str(tmp_path / "out"), *flag]
    assert cli.main(argv) == 0, capsys.readouterr().err
    params = png_parameters(tmp_path / "out" / "flux2_2.png")[1]
    assert params.get("transformer_weights") == stored
    # fp8 weights on the CPU: fp8 matmul stays off, and the PNG says so
    assert params.get("fp8_matmul") == ("off" if stored else None)
    if stored:
        assert cli.main([*argv, "--fp8-matmul", "yes"]) == 2
        assert "cannot use fp8 matmul: fp8 matmul needs an NVIDIA GPU" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_from_gguf_files_equals_their_dequantized_values(tmp_path, capsys):
    """A models folder holding a GGUF transformer and a GGUF Qwen3 (found by their names) makes the image the same
    command makes from safetensors files of the values the GGUFs hold; the PNG names the quant types."""
    from gguf import GGMLQuantizationType as T
    from safetensors.torch import save_file

    from tests.tiny.gguf import dit_types, encoder_types, hf_names, llama_cpp_names, qwen3_tokens, save_gguf
    from tests.tiny.text_encoder import build_tiny_qwen3, comfyui_state_dict
    from tests.tiny.transformer import TINY_TRANSFORMER, random_bfl_transformer_state_dict, save_bfl_transformer

    write_models_folder(tmp_path)
    tokens = qwen3_tokens(151936)
    hf = comfyui_state_dict(build_tiny_qwen3(seed=3))
    _, te_values = save_gguf(llama_cpp_names(hf), tmp_path / "text_encoders" / "Qwen3-4B-Q8_0.gguf",
                             encoder_types(T.Q8_0), arch="qwen3", tokens=tokens)
    _, dit_values = save_gguf(random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=4),
                              tmp_path / "diffusion_models" / "flux-2-klein-4b-Q4_1.gguf", dit_types(T.Q4_1))
    (tmp_path / "diffusion_models" / "flux-2-klein-4b.safetensors").unlink()
    (tmp_path / "text_encoders" / "qwen_3_4b.safetensors").unlink()
    argv = ["--prompt", "a fox", "--width", "32", "--height", "32", "--steps", "2", "--seed", "5", "--device", "cpu"]
    assert cli.main([*argv, "--models", str(tmp_path), "--out", str(tmp_path / "gguf")]) == 0, capsys.readouterr().err
    save_file(hf_names(te_values, hf), str(tmp_path / "te.safetensors"))
    floats = ["--transformer", str(save_bfl_transformer(dit_values, tmp_path / "dit.safetensors")),
              "--text-encoder", str(tmp_path / "te.safetensors"), "--ae", str(tmp_path / "vae" / "flux2-vae.safetensors")]
    assert cli.main([*argv, *floats, "--out", str(tmp_path / "float")]) == 0, capsys.readouterr().err
    gguf_png, float_png = Image.open(tmp_path / "gguf" / "flux2_5.png"), Image.open(tmp_path / "float" / "flux2_5.png")
    assert np.array_equal(np.asarray(gguf_png), np.asarray(float_png))
    params = png_parameters(tmp_path / "gguf" / "flux2_5.png")[1]
    assert params["transformer"] == "flux-2-klein-4b-Q4_1.gguf" and params["text_encoder"] == "Qwen3-4B-Q8_0.gguf"
    assert params["transformer_weights"] == "Q4_1"


@pytest.mark.slow
def test_a_decoder_alone_decodes_instead_of_the_autoencoders_own(tmp_path, capsys):
    """--decoder small_decoder.safetensors: the run uses it (the PNG names it; the picture is another decoder's), the
    latents stay the transformer's; with --demo it is refused."""
    from safetensors.torch import save_file

    from tests.tiny.autoencoder import TINY_AE_DIFFUSERS_CONFIG, bfl_state_dict, build_diffusers_autoencoder

    write_models_folder(tmp_path)
    small = build_diffusers_autoencoder(seed=9, config={**TINY_AE_DIFFUSERS_CONFIG,
                                                        "decoder_block_out_channels": (32, 32, 32, 32)})
    decoder = tmp_path / "small_decoder.safetensors"
    save_file({k.removeprefix("decoder."): v for k, v in bfl_state_dict(small).items() if k.startswith("decoder.")},
              str(decoder))
    argv = ["--prompt", "a fox", "--width", "32", "--height", "32", "--steps", "2", "--seed", "5", "--device", "cpu",
            "--models", str(tmp_path)]
    assert cli.main([*argv, "--decoder", str(decoder), "--out", str(tmp_path / "small")]) == 0, capsys.readouterr().err
    assert cli.main([*argv, "--out", str(tmp_path / "full")]) == 0, capsys.readouterr().err
    params = png_parameters(tmp_path / "small" / "flux2_5.png")[1]
    assert params["decoder"] == "small_decoder.safetensors" and "decoder" not in png_parameters(
        tmp_path / "full" / "flux2_5.png")[1]
    pictures = [np.asarray(Image.open(tmp_path / d / "flux2_5.png")) for d in ("small", "full")]
    assert not np.array_equal(*pictures)
    assert cli.main(["--demo", "--decoder", str(decoder), "--prompt", "x", "--out", str(tmp_path / "d")]) == 2
    assert "--demo has none" in capsys.readouterr().err


def test_queue_is_routed(monkeypatch, capsys):
    from flux2_core.app import queue_command
    seen = []
    monkeypatch.setattr(queue_command, "main", lambda argv, prog: seen.append((argv, prog)) or 0)
    assert cli.main(["queue", "wf.json", "--seed", "3"]) == 0
    assert seen == [(["wf.json", "--seed", "3"], "flux2-klein queue")]
    assert cli.main(["paint", "--prompt", "x"]) == 2
    assert "unknown command 'paint'; use generate (the default) or queue (see --help)" in capsys.readouterr().err


def test_help_shows_the_queue_command_and_its_own_help():
    """`python -m flux2_core --help` names both commands and how to see queue's options; `queue --help` lists them."""
    main = run_cli("--help", cwd=ROOT)
    assert main.returncode == 0, main.stderr
    assert main.stdout.startswith("usage: python -m flux2_core [generate] --prompt TEXT [options]\n"
                                  "       python -m flux2_core queue WORKFLOW.json [--server HOST:PORT] [options]\n")
    assert "--prompt" in main.stdout and "python -m flux2_core queue --help" in main.stdout
    queue = run_cli("queue", "--help", cwd=ROOT)
    assert queue.returncode == 0, queue.stderr
    assert queue.stdout.startswith("usage: python -m flux2_core queue [-h] [--server HOST:PORT]")
    for option in ("--server", "--set NODE.INPUT=VALUE", "--prompt", "--seed", "--out", "--timeout"):
        assert option in queue.stdout


@pytest.mark.parametrize("make_out, says", [
    (lambda tmp: (tmp / "file").write_text("x") and tmp / "file", "is a file, not a folder"),
    (lambda tmp: (tmp / "file").write_text("x") and tmp / "file" / "pics", "file is a file"),
    (lambda tmp: tmp / "locked" / "pics", "cannot create it in"),
])
def test_out_is_checked_before_any_model_loads(tmp_path, monkeypatch, capsys, make_out, says):
    from flux2_core.app import demo

    (tmp_path / "locked").mkdir(mode=0o500)
    if "locked" in str(make_out(tmp_path)) and os.access(tmp_path / "locked", os.W_OK):
        pytest.skip("running as root: permission bits do not stop writes")
    monkeypatch.setattr(demo, "demo_models", lambda *a: pytest.fail("models were loaded despite a bad --out"))
    out = make_out(tmp_path)
    assert cli.main(["--demo", "--prompt", "x", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {out}") and says in err, err
    assert not (tmp_path / "locked" / "pics").exists()


def test_pngs_never_replace_a_file(tmp_path, monkeypatch, capsys):
    """An older flux2_5.png (and a folder squatting on flux2_5-1.png) stay as they are; the new image takes the
    first free name."""
    out = tmp_path / "pics"
    out.mkdir()
    (out / "flux2_5.png").write_bytes(b"an older picture")
    (out / "flux2_5-1.png").mkdir()
    assert cli.main(["--demo", "--prompt", "x", "--seed", "5", "--steps", "1", "--width", "64", "--height", "64",
                     "--out", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(out / "flux2_5-2.png")
    assert (out / "flux2_5.png").read_bytes() == b"an older picture" and (out / "flux2_5-1.png").is_dir()
    with Image.open(out / "flux2_5-2.png") as im:
        assert im.size == (64, 64) and json.loads(im.text["parameters"])["seed"] == 5


def test_plain_progress_without_tqdm(monkeypatch, capsys):
    from flux2_core.sampling.euler import Step
    monkeypatch.setitem(sys.modules, "tqdm", None)
    progress = cli.Progress()
    for i in range(2):
        progress(Step(i, 2, 1.0 - i / 2, 0.5 - i / 2, None, None))
    err = capsys.readouterr().err
    assert "step 1/2" in err and err.endswith("step 2/2 (sigma 0.000)\n")


def test_demo_with_fp8_weights(tmp_path, monkeypatch, capsys):
    from flux2_core.storage import quant

    quantized = []
    original = quant.quantize_transformer
    monkeypatch.setattr(quant, "quantize_transformer", lambda model, *args, **kwargs: quantized.append(model) or original(model, *args, **kwargs))
    monkeypatch.chdir(tmp_path)
    argv = ["--demo", "--prompt", "a red fox", "--seed", "3", "--width", "64", "--height", "64", "--steps", "2"]
    assert cli.main([*argv, "--fp8", "--out", "fp8"]) == 0, capsys.readouterr().err
    assert cli.main([*argv, "--out", "full"]) == 0
    (model,) = quantized
    fp8 = [m for m in model.modules() if isinstance(m, quant.Fp8Linear)]
    assert fp8 and all(m.weight.dtype == quant.FP8 for m in fp8)       # the blocks really ran with fp8 weights
    _, params = png_parameters(tmp_path / "fp8" / "flux2_3.png")
    assert params["transformer_weights"] == "fp8"
    a, b = (np.asarray(Image.open(tmp_path / d / "flux2_3.png"), dtype=np.int16) for d in ("fp8", "full"))
    assert 0 < np.abs(a - b).mean() < 2                                # close to the full-precision picture (0.7)


def test_demo_with_int8_weights(tmp_path, monkeypatch, capsys, machine):
    """--int8 stores the blocks in int8; on a CPU with VNNI in float32 they multiply in int8 where comfy-kitchen is
    there (the PNG says which), and the picture stays close to the full-precision one."""
    from flux2_core import kitchen
    from tests import machine as machines

    monkeypatch.chdir(tmp_path)
    machine.set(machines.ICE_LAKE)                                      # AVX-512 VNNI, no bf16: float32 and int8
    argv = ["--demo", "--prompt", "a red fox", "--seed", "3", "--width", "64", "--height", "64", "--steps", "2"]
    assert cli.main([*argv, "--int8", "--out", "int8"]) == 0, capsys.readouterr().err
    assert cli.main([*argv, "--out", "full"]) == 0
    _, params = png_parameters(tmp_path / "int8" / "flux2_3.png")
    assert params["transformer_weights"] == "int8"
    assert params["int8_matmul"] == ("off" if kitchen.ck is None else "on")
    a, b = (np.asarray(Image.open(tmp_path / d / "flux2_3.png"), dtype=np.int16) for d in ("int8", "full"))
    assert 0 < np.abs(a - b).mean() < 2


@pytest.mark.parametrize("flag,offload", [([], "auto"), (["--offload-encoder", "yes"], True),
                                          (["--offload-encoder", "no"], False)])
def test_compile_and_offload_flags_reach_the_engine(tmp_path, monkeypatch, flag, offload):
    """--compile calls compile.compile_blocks on the transformer (stubbed here: compiling takes minutes on a CPU);
    --offload-encoder reaches generate."""
    from flux2_core import pipeline
    from flux2_core.runtime import compile as compiling

    compiled, seen = [], []
    monkeypatch.setattr(compiling, "compile_blocks", lambda model: compiled.append(model) or model)
    original = pipeline.generate
    monkeypatch.setattr(pipeline, "generate", lambda *a, **kw: seen.append(kw["offload_encoder"]) or original(*a, **kw))
    monkeypatch.chdir(tmp_path)
    argv = ["--demo", "--prompt", "x", "--width", "32", "--height", "32", "--steps", "1", *flag]
    assert cli.main(argv) == 0
    assert compiled == [] and seen == [offload]
    assert cli.main([*argv, "--compile"]) == 0
    assert len(compiled) == 1 and type(compiled[0]).__name__ == "Flux2Transformer" and seen == [offload] * 2


@pytest.mark.parametrize("flag,encoder,blocks", [
    ([], "auto", "auto"),
    (["--offload", "none"], False, False),
    (["--offload", "encoder"], True, False),
    (["--offload", "blocks"], True, True),
    (["--offload", "blocks", "--offload-encoder", "no"], False, True),     # the encoder's own flag wins for it
    (["--offload-encoder", "yes"], True, "auto"),
])
def test_offload_flag_reaches_load_models_and_generate(tmp_path, monkeypatch, capsys, flag, encoder, blocks):
    from flux2_core import pipeline

    write_models_folder(tmp_path)
    loaded, generated = [], []
    real_load, real_generate = pipeline.load_models, pipeline.generate
    monkeypatch.setattr(pipeline, "load_models", lambda *a, **kw: loaded.append(kw) or real_load(*a, **kw))
    monkeypatch.setattr(pipeline, "generate", lambda *a, **kw: generated.append(kw) or real_generate(*a, **kw))
    argv = ["--models", str(tmp_path), "--prompt", "a fox", "--width", "48", "--height", "32", "--steps", "1",
            "--device", "cpu", "--out", str(tmp_path / "out"), *flag]
    assert cli.main(argv) == 0, capsys.readouterr().err
    ((kw,),) = [loaded]
    assert (kw["offload_encoder"], kw["offload_blocks"], kw["size"]) == (encoder, blocks, (48, 32))
    assert [g["offload_encoder"] for g in generated] == [encoder]
    assert "do not fit the GPU" not in capsys.readouterr().err           # on the CPU nothing streams


def test_streamed_blocks_are_reported_and_compile_says_it_skips_them(tmp_path, monkeypatch, capsys):
    """A load that streams (forced here: on the CPU nothing streams) is reported; --compile says it compiles only
    the resident blocks (compile_blocks is stubbed: inductor takes minutes on a CPU)."""
    from flux2_core import pipeline
    from flux2_core.runtime import compile as compiling
    from flux2_core.runtime import offload

    write_models_folder(tmp_path)
    real_load = pipeline.load_models

    def streamed_load(*a, **kw):
        models = real_load(*a, **kw)
        blocks = [*models.transformer.double_blocks, *models.transformer.single_blocks]
        fixed = memory.module_bytes(models.transformer) - sum(memory.module_bytes(b) for b in blocks)
        offload.stream_blocks(models.transformer, "cpu", fixed + 2 * max(memory.module_bytes(b) for b in blocks))
        return models

    monkeypatch.setattr(pipeline, "load_models", streamed_load)
    monkeypatch.setattr(compiling, "compile_blocks", lambda model: model)
    argv = ["--models", str(tmp_path), "--prompt", "a fox", "--width", "32", "--height", "32", "--steps", "1",
            "--device", "cpu", "--out", str(tmp_path / "out"), "--offload", "blocks"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "4 of 4 transformer blocks" in err and "--compile" not in err
    assert cli.main([*argv, "--compile"]) == 0
    assert "compiles only the blocks that stay on the GPU" in capsys.readouterr().err


def test_an_out_folder_that_refuses_files_is_refused(tmp_path, monkeypatch, capsys):
    """What a read-only mount or missing permission does (as root neither can be made here): the probe file fails."""
    from flux2_core.app import outputs

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(outputs.tempfile, "TemporaryFile", refuse)
    assert cli.main(["--demo", "--prompt", "x", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"error: --out {tmp_path}: cannot write there (Permission denied); choose a "
                                       "folder you can write to\n")
    assert cli.main(["--demo", "--prompt", "x", "--out", str(tmp_path / "new")]) == 2
    assert f"cannot create it in {tmp_path} (Permission denied)" in capsys.readouterr().err


def test_the_cli_flushes_denormals_only_while_it_runs(tmp_path):
    """Denormals are flushed for the command (they slow CPU matmuls) and the caller's setting comes back after."""
    seen = []
    subnormal = torch.tensor([1e-39])
    original = cli.generate_command
    try:
        cli.generate_command = lambda argv: seen.append(subnormal.mul(1.0).item()) or 0
        assert cli.main(["--prompt", "x"]) == 0
    finally:
        cli.generate_command = original
    assert seen == [0.0]                                   # flushed inside
    assert subnormal.mul(1.0).item() != 0.0                # as before, after
