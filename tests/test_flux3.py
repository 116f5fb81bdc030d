"""FLUX 3 Image Klein against flux3-mlx (a port validated against BFL's reference code) run on mlx-cpu, on the same
tiny random weights in float32: the schedule, the ids, the transformer (both variants; no, one and several
references; samples whose prompts differ in length)."""

import json

import numpy as np
import pytest
import torch

from flux2_core.families.flux3 import transformer as flux3
from flux2_core.families.flux3.schedule import flux3_schedule
from flux2_core.prompt_padding import ToMultiple
from tests.tiny.flux3 import (
    flux3_mlx_at,
    mlx_dit,
    mlx_pipeline,
    our_models,
    random_flux3_state_dict,
    save_tiny_qwen3_vl,
    tiny_flux3,
    to_mlx,
    to_torch,
)

pytest.importorskip("mlx.core", reason="flux3-mlx's oracle needs mlx (mlx-cpu on Linux): pip install -e .[test]")

RTOL = ATOL = 1e-5
SCALED = 1e-5


def assert_close_to_scale(got: torch.Tensor, expected: torch.Tensor, tolerance: float = SCALED) -> None:
    """Every difference within ``tolerance`` of the largest expected value. Elementwise 1e-5 is beyond float32 here:
    torch's and mlx's float32 exp differ in the last bit for 90 of the time embedding's 128 frequencies, which at
    1000·t = 699 moves an angle by 4e-5 (seen as ~2e-5 on outputs of ~3.5, the same against our float64 run)."""
    assert got.shape == expected.shape
    worst = (got.double() - expected.double()).abs().max().item()
    scale = expected.abs().max().item()
    assert worst <= tolerance * scale, f"largest difference {worst:.3g} exceeds {tolerance:g} x {scale:.3g}"


def test_schedule_equals_the_reference():
    from flux3_mlx.pipeline import schedule

    for steps in (1, 4, 16, 50, 137):
        assert flux3_schedule(steps) == schedule(steps).tolist()


def test_ids_equal_the_reference():
    """Image (0, row/2, col/2, 0); reference i at l = -(1 + i) (as flux3-mlx's encode_references writes them); text
    (0, 0, 0, position)."""
    from flux3_mlx.autoencoder import latent_ids
    from flux3_mlx.pipeline import scaled_ids

    assert np.array_equal(flux3.image_ids(1, 3, 5)[0].numpy(), scaled_ids(latent_ids(3, 5)))
    expected = []
    for i, (h, w) in enumerate([(2, 3), (4, 1)]):
        ids = scaled_ids(latent_ids(h, w))
        ids[:, 3] = -(1 + i)
        expected.append(ids)
    assert np.array_equal(flux3.reference_ids([(2, 3), (4, 1)])[0].numpy(), np.concatenate(expected))
    assert flux3.text_ids(1, 4)[0].tolist() == [[0, 0, 0, p] for p in range(4)]


def oracle_velocity(params, state, samples, t, t_next):
    """samples: [(txt [L, C], ref [Lref, 128] or None, ref_ids, img [Limg, 128], img_ids)] -> [sum Limg, 128]."""
    with flux3_mlx_at(params) as dit:
        model = mlx_dit(dit, params, state)
        packed = dit.pack([[(to_mlx(txt), flux3.text_ids(1, txt.shape[0])[0].numpy()),
                            None if ref is None else (to_mlx(ref), ref_ids.numpy()),
                            (to_mlx(img), img_ids.numpy())] for txt, ref, ref_ids, img, img_ids in samples])
        return to_torch(model(packed, t, t_ref=t_next if params.flow_map else None))


@pytest.mark.parametrize("flow_map", [True, False])
@pytest.mark.parametrize("grids", [[], [(2, 3)], [(2, 2), (3, 1), (1, 4)]])
def test_transformer_equals_the_reference(flow_map, grids):
    """Two samples with texts of 5 and 3 tokens (the shorter one's rows past 3 masked out), the same references;
    velocity within 1e-5 (of its scale) of flux3-mlx's."""
    params = tiny_flux3(flow_map)
    state = random_flux3_state_dict(params, seed=3)
    model = flux3.Flux3Transformer(params).eval()
    model.load_state_dict(state)
    g = torch.Generator().manual_seed(1)
    h, w = 3, 4
    img = torch.randn(2, h * w, 128, generator=g)
    texts = [torch.randn(5, params.context_in_dim, generator=g), torch.randn(3, params.context_in_dim, generator=g)]
    ref = torch.cat([torch.randn(a * b, 128, generator=g) for a, b in grids]) if grids else None
    ref_ids = flux3.reference_ids(grids)[0] if grids else None
    img_ids = flux3.image_ids(1, h, w)[0]
    t, t_next = 0.7, 0.55

    expected = oracle_velocity(params, state, [(txt, ref, ref_ids, img[i], img_ids) for i, txt in enumerate(texts)],
                               t, t_next)
    txt = torch.zeros(2, 5, params.context_in_dim)
    txt[0], txt[1, :3] = texts[0], texts[1]
    txt[1, 3:] = 1e3                                   # padding rows: must not be seen
    with torch.no_grad():
        got = model(img, flux3.image_ids(1, h, w), torch.full((2,), t), txt, flux3.text_ids(1, 5),
                    t_next=torch.full((2,), t_next) if flow_map else None,
                    ref=None if ref is None else ref[None], ref_ids=None if ref is None else ref_ids[None],
                    txt_lengths=[5, 3])
    assert_close_to_scale(got.reshape(-1, 128), expected)


def test_one_sample_alone_equals_its_row_in_a_batch():
    """The mask is what makes a padded sample equal to itself alone (the shape of a CFG pair with prompts of two
    lengths)."""
    params = tiny_flux3(False)
    model = flux3.Flux3Transformer(params).eval()
    model.load_state_dict(random_flux3_state_dict(params, seed=4))
    g = torch.Generator().manual_seed(2)
    img, txt = torch.randn(2, 6, 128, generator=g), torch.randn(2, 7, params.context_in_dim, generator=g)
    ids, t = flux3.image_ids(1, 2, 3), torch.tensor([0.5, 0.5])
    with torch.no_grad():
        both = model(img, ids, t, txt, flux3.text_ids(1, 7), txt_lengths=[7, 4])
        alone = model(img[1:], ids, t[1:], txt[1:, :4], flux3.text_ids(1, 4))
    torch.testing.assert_close(both[1:], alone, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
@pytest.mark.parametrize("flow_map", [True, False])
def test_a_flux3_file_is_read_by_its_family(tmp_path, prefix, flow_map):
    """BFL's names, bare or behind ComfyUI's prefix: the family from the keys, the architecture from the shapes (the
    flow map from its ref_time_in), the weights as stored; int8 only where the family lets a storage quantize."""
    from safetensors.torch import save_file

    from flux2_core import weights
    from flux2_core.storage.protocol import census

    params = tiny_flux3(flow_map)
    state = random_flux3_state_dict(params, seed=5)
    path = tmp_path / "flux3-image-klein-tiny.safetensors"
    save_file({prefix + k: v for k, v in state.items()}, str(path))
    model, variant = weights.load_transformer(path, "cpu", torch.float32)
    assert isinstance(model, flux3.Flux3Transformer) and model.params == params
    assert (variant.family, variant.guidance_distilled, variant.default_steps) == (
        "flux3", flow_map, 16 if flow_map else 50)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    quantized, _ = weights.load_transformer(path, "cpu", torch.float32, int8=True)
    # per block 6 linears x (2 early modes + text + single) x 2, and 6 modulations
    assert census(quantized)["int8"] == 6 * 4 * 2 + 6


# --- the text encoder -----------------------------------------------------------------------------------------------

LONG_PROMPT = ("a ceramicist's studio at golden hour, shelves of glazed bowls in celadon and tenmoku, a wheel "
               "still wet with slip, dust in the slanting light, a cat asleep on a stack of newspapers, ") * 2


def tiny_vl_spec():
    from dataclasses import replace

    from flux2_core.families.flux3.variants import QWEN3_VL_4B

    return replace(QWEN3_VL_4B, name="custom", hidden_size=32)


def test_text_encoder_equals_the_reference(tmp_path):
    """Qwen3-VL's chat template, each prompt alone padded to a multiple of 80 tokens (pads at position 1, masked as
    keys), the hidden states of layers 4, 8, ..., 32 stacked per token: equal to flux3-mlx's encoder (which gives
    bf16, so the comparison is at bf16's precision) for a short and a long prompt encoded in one batch."""
    from flux3_mlx.text_encoder import TextEncoder

    from flux2_core import weights

    folder = save_tiny_qwen3_vl(tmp_path / "text_encoder")
    ours = weights.load_text_encoder(folder, "cpu", torch.float32, spec=tiny_vl_spec())
    assert ours.model.params.rope_theta == 5_000_000.0 and len(ours.model.layers) == 32
    oracle = TextEncoder(str(folder), dtype=__import__("mlx.core").core.float32)
    prompts = ["a red fox", LONG_PROMPT]
    got = ours.encode(prompts)
    assert got.token_counts[1] > 80 and got.lengths == [80, 160]
    for i, prompt in enumerate(prompts):
        tokens, ids = oracle.encode(prompt)
        expected = to_torch(tokens.astype(__import__("mlx.core").core.float32))
        assert got.row(i).shape == (1, *expected.shape)
        # bf16 keeps 8 bits: half a unit of its last place relative, plus float32 noise near zero
        torch.testing.assert_close(got.row(i)[0], expected, rtol=2 ** -8, atol=1e-5 * expected.abs().max().item())
        assert np.array_equal(flux3.text_ids(1, expected.shape[0])[0].numpy(), ids)
    assert torch.all(got.embeds[0, 80:] == 0)                   # the short prompt's rows past its own 80


def test_text_encoder_equals_transformers_qwen3_vl(tmp_path):
    """The same tower in transformers' own Qwen3-VL text model (its interleaved MRoPE, all three position sections at
    the text positions), given our tokens, mask and positions (pads at 1): its hidden states 4, 8, ..., 32 equal ours
    in float32, every row, pads included. Its model has the real tower's 36 layers (the last four never read), so
    that state 32 is a layer's output and not the final norm's, which transformers puts on the last state."""
    from safetensors.torch import load_file
    from transformers import Qwen3VLTextConfig, Qwen3VLTextModel

    from flux2_core import weights

    folder = save_tiny_qwen3_vl(tmp_path / "text_encoder")
    config = json.loads((folder / "config.json").read_text())["text_config"]
    hf = Qwen3VLTextModel(Qwen3VLTextConfig(**config | {"num_hidden_layers": 36})).eval()
    state = {k.removeprefix("model.language_model."): v for k, v in load_file(folder / "model.safetensors").items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and {k.split(".")[1] for k in missing} == {"32", "33", "34", "35"}
    ours = weights.load_text_encoder(folder, "cpu", torch.float32, spec=tiny_vl_spec())
    prompts = ["a red fox", LONG_PROMPT]
    got = ours.encode(prompts)
    for i, prompt in enumerate(prompts):
        ids, mask = (t[:, :got.lengths[i]] for t in ours.tokenize([prompt])[:2])
        positions = torch.where(mask.bool(), torch.arange(mask.shape[1]), 1)      # pads at position 1
        with torch.no_grad():
            out = hf(input_ids=ids, attention_mask=mask, position_ids=positions[None].expand(3, -1, -1),
                     output_hidden_states=True)
        expected = torch.cat([out.hidden_states[layer] for layer in ours.spec.output_layers], dim=-1)
        assert_close_to_scale(got.row(i), expected, 1e-5)


# --- the whole pipeline -----------------------------------------------------------------------------------------------

def flux3_files(tmp_path, flow_map: bool):
    """A tiny FLUX 3 transformer state, a tiny Qwen3-VL folder and a tiny FLUX.2 autoencoder file (BFL's layout)."""
    from dataclasses import replace

    from tests.tiny.autoencoder import build_diffusers_autoencoder, save_bfl_autoencoder

    params = replace(tiny_flux3(flow_map), context_in_dim=8 * 32)        # 8 layers of the tiny 32-wide tower
    state = random_flux3_state_dict(params, seed=6)
    te = save_tiny_qwen3_vl(tmp_path / "text_encoder", seed=1)
    ae = save_bfl_autoencoder(build_diffusers_autoencoder(2), tmp_path / "ae.safetensors")
    return params, state, te, ae


def oracle_generate(params, state, te, ae, prompt, references, width, height, steps, noise):
    """The final latent tokens [h*w, 128] and the picture of flux3-mlx's Pipeline.generate."""
    with mlx_pipeline(params, state, te, ae) as pipe:
        picture = pipe.generate(prompt, references, width, height, steps, None, 0, noise=noise.numpy())
        return pipe.latents[0], torch.from_numpy(np.array(picture))


@pytest.mark.slow
@pytest.mark.parametrize("flow_map,references", [(True, 0), (True, 1), (False, 2)])
def test_generate_equals_the_reference(tmp_path, flow_map, references):
    """Prompt to picture: distilled (one pass per step, t_next) and base (CFG 3.5 with the empty negative, whose
    prompt is shorter than the positive's), with 0, 1 or 2 references; the final latents within 1e-5 (of scale) of
    flux3-mlx's and the uint8 pictures within one level."""
    from PIL import Image

    from flux2_core import pipeline

    params, state, te, ae = flux3_files(tmp_path, flow_map)
    width, height, steps = 64, 48, 3
    g = torch.Generator().manual_seed(9)
    refs = [Image.fromarray(torch.randint(0, 256, (64, 80, 3), generator=g, dtype=torch.uint8).numpy())
            for _ in range(references)]
    noise = torch.randn(12, 128, generator=g).to(torch.bfloat16).float()      # tokens, as the reference draws them
    prompt = LONG_PROMPT if not flow_map else "a red fox in the snow"
    expected_latents, expected_picture = oracle_generate(params, state, te, ae, prompt, refs, width, height, steps,
                                                         noise)
    result = pipeline.generate(our_models(params, state, te, ae), prompt, references=refs, width=width,
                               height=height, steps=steps, noise=flux3_noise_grid(noise, 3, 4))
    assert result.settings["cfg"] == (1.0 if flow_map else 3.5)
    assert_close_to_scale(result.latents[0].permute(1, 2, 0).reshape(-1, 128), expected_latents)
    assert (result.images[0].int() - expected_picture.int()).abs().max() <= 1


def flux3_noise_grid(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[h*w, 128] tokens (row-major) -> [1, 128, h, w]."""
    return tokens.T.reshape(1, 128, h, w)


def test_a_seed_draws_the_references_noise():
    """Token-major [h*w, 128] from torch's CPU generator, rounded through bf16: flux3-mlx reproduces the same draw in
    numpy (to ~2e-6, so equal after the rounding but for values at a rounding edge)."""
    from flux3_mlx.torch_randn import randn

    from flux2_core.families.flux3 import FLUX3
    from flux2_core.sampling.euler import make_noise

    noise = make_noise(2, 48, 64, 11, reading=FLUX3.noise)
    for i in range(2):
        tokens = torch.randn(12, 128, generator=torch.Generator().manual_seed(11 + i))
        assert torch.equal(noise[i:i + 1], flux3_noise_grid(tokens.to(torch.bfloat16).float(), 3, 4))
        theirs = torch.from_numpy(randn((12, 128), 11 + i)).to(torch.bfloat16).float()
        assert (flux3_noise_grid(theirs, 3, 4) != noise[i:i + 1]).float().mean() < 0.01


@pytest.mark.slow
def test_flux3_runs_from_the_command_line(tmp_path, capsys):
    """The main job on FLUX 3 files (its transformer behind ComfyUI's prefix, a Qwen3-VL folder, the FLUX.2
    autoencoder): the family and variant read from the file, its 16 steps by default, a reference sized by FLUX 3's
    rules, and the PNG equal to pipeline.generate on the same files (itself proven against flux3-mlx above)."""
    from PIL import Image
    from safetensors.torch import save_file

    from flux2_core import pipeline
    from flux2_core.app import cli
    from tests.test_cli import png_parameters

    _, state, te, ae = flux3_files(tmp_path, flow_map=True)
    transformer = tmp_path / "flux3-image-klein.safetensors"
    save_file({"model.diffusion_model." + k: v for k, v in state.items()}, str(transformer))
    small = random_picture(40, 30, 2)           # FLUX.2 refuses a side under 64 px; FLUX 3, known from the file, takes it
    small.save(tmp_path / "small.png")
    code = cli.main(["--transformer", str(transformer), "--text-encoder", str(te), "--ae", str(ae),
                     "--prompt", "a fox", "--width", "64", "--height", "48", "--seed", "4", "--device", "cpu",
                     "--dtype", "float32", "--out", str(tmp_path / "out"), "--ref", str(tmp_path / "small.png")])
    assert code == 0, capsys.readouterr().err
    written = next((tmp_path / "out").glob("*.png"))
    size, settings = png_parameters(written)
    assert size == (64, 48) and settings["steps"] == 16 and settings["variant"] == "custom"
    models = pipeline.load_models(transformer, te, ae, device="cpu", dtype=torch.float32)
    expected = pipeline.generate(models, "a fox", width=64, height=48, seed=4, references=[small])
    assert np.array_equal(np.asarray(Image.open(written)), expected.images[0].numpy())


# --- references -------------------------------------------------------------------------------------------------------

def random_picture(width: int, height: int, seed: int = 0):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy())


@pytest.mark.parametrize("size", [(64, 48), (20, 20), (12, 40), (100, 37), (3000, 2000), (5000, 900), (4096, 4096),
                                  (2048, 2049), (16, 16)])
def test_one_reference_is_fitted_and_padded_as_the_reference(size):
    """Alone, a reference is fitted to 4 MP and 4096 px a side and centred on its 16-px canvas (64 px at least) with
    its border reflected: the canvas and the picture's box on it equal flux3-mlx's."""
    from flux3_mlx.pipeline import prepare_reference

    from flux2_core.families.flux3 import FLUX3
    from flux2_core.sampling.references import padded_reference, prepare_references

    picture = random_picture(*size)
    expected, box = prepare_reference(picture)
    canvas, our_box = padded_reference(picture, FLUX3.references)
    assert our_box == box and canvas.size == expected.size
    assert np.array_equal(np.asarray(canvas), np.asarray(expected))
    assert np.array_equal(np.asarray(prepare_references([picture], None, FLUX3.references)[0]), np.asarray(expected))


def test_several_references_are_capped_and_cropped_as_the_reference():
    """Two or more: each at most 1 MP (sizes floored), centre-cropped to 16 px; more than 10 refused."""
    from flux3_mlx.pipeline import prepare_multi_reference

    from flux2_core.errors import Flux2Error
    from flux2_core.families.flux3 import FLUX3
    from flux2_core.sampling.references import prepare_references

    pictures = [random_picture(w, h, i) for i, (w, h) in enumerate([(1500, 1000), (70, 50), (17, 900)])]
    ours = prepare_references(pictures, None, FLUX3.references)
    for picture, prepared in zip(pictures, ours):
        assert np.array_equal(np.asarray(prepared), np.asarray(prepare_multi_reference(picture)))
    with pytest.raises(Flux2Error, match="takes at most 10 reference images.*got 11 reference pictures"):
        prepare_references([random_picture(32, 32)] * 11, None, FLUX3.references)


@pytest.mark.slow
def test_an_edit_of_one_reference_is_cropped_back_as_the_reference(tmp_path, monkeypatch):
    """flux3-mlx's whole call (its ``Flux3Klein``: the reference fitted and padded, the output size from it, the
    picture cropped back to the reference's box) against ``generate`` with no size given: the same picture, within
    one level. Its noise is torch's own draw (flux3-mlx reproduces torch's generator in numpy to ~2e-6)."""
    from flux3_mlx import api
    from flux3_mlx import pipeline as their_pipeline

    from flux2_core import pipeline

    monkeypatch.setattr(their_pipeline, "randn", lambda shape, seed: torch.randn(
        shape, generator=torch.Generator().manual_seed(seed)).numpy())
    params, state, te, ae = flux3_files(tmp_path, flow_map=True)
    reference = random_picture(70, 50, 3)                       # canvas 80x64, the picture at (5, 7)
    with mlx_pipeline(params, state, te, ae) as pipe:
        picture, record = api.Flux3Klein(pipe)("make it night", [reference], steps=3, seed=5)
    expected = torch.from_numpy(np.array(picture))
    result = pipeline.generate(our_models(params, state, te, ae), "make it night", references=[reference], steps=3,
                               seed=5)
    assert expected.shape == (50, 70, 3) and result.images.shape == (1, 50, 70, 3)
    assert (result.settings["width"], result.settings["height"]) == (record["width"], record["height"]) == (70, 50)
    assert (result.images[0].int() - expected.int()).abs().max() <= 1


@pytest.mark.slow
def test_a_layout_equals_the_reference(tmp_path, monkeypatch):
    """Boxes through flux3-mlx's whole call (the rows appended to the prompt as BFL's bbox.py writes them) against
    ``generate`` with the same boxes: the same picture within one level; without the boxes it differs (the rows
    reach the model)."""
    from flux3_mlx import api
    from flux3_mlx import pipeline as their_pipeline

    from flux2_core import pipeline

    monkeypatch.setattr(their_pipeline, "randn", lambda shape, seed: torch.randn(
        shape, generator=torch.Generator().manual_seed(seed)).numpy())
    params, state, te, ae = flux3_files(tmp_path, flow_map=True)
    boxes = [{"desc": "a red balloon", "bbox": [0.1, 0.05, 0.6, 0.4]},
             {"id": "lake", "desc": "a lake", "bbox": [0.7, 0.0, 1.0, 1.0]}]
    with mlx_pipeline(params, state, te, ae) as pipe:
        picture, record = api.Flux3Klein(pipe)("balloons over a valley", [], boxes, width=64, height=48, steps=3,
                                               seed=5)
    expected = torch.from_numpy(np.array(picture))
    models = our_models(params, state, te, ae)
    result = pipeline.generate(models, "balloons over a valley", boxes=boxes, width=64, height=48, steps=3, seed=5)
    assert (result.images[0].int() - expected.int()).abs().max() <= 1
    assert result.settings["boxes"][0] == {"id": "obj_1", "bbox": [100, 50, 600, 400], "desc": "a red balloon"}
    assert record["prompt"] == f"balloons over a valley {json.dumps(result.settings['boxes'])}"
    plain = pipeline.generate(models, "balloons over a valley", width=64, height=48, steps=3, seed=5)
    assert (plain.images[0].int() - expected.int()).abs().max() > 1


@pytest.mark.parametrize("qtype,arch", [("Q8_0", None), ("Q4_0", "flux3")], ids=["Q8_0-sdcpp", "Q4_0-flux3"])
def test_a_flux3_gguf_runs_as_its_stored_values(tmp_path, qtype, arch):
    """A FLUX 3 GGUF under BFL's names (as stable-diffusion.cpp writes them, with no architecture field, or declaring
    "flux3"): read as FLUX 3 from its tensors, its blocks kept quantized, and a run equal to the float model holding
    the values gguf.quants dequantizes from the file."""
    from gguf import GGMLQuantizationType
    from safetensors.torch import save_file

    from flux2_core import pipeline
    from flux2_core.storage.protocol import census
    from tests.tiny.gguf import dit_types, save_gguf

    _, state, te, ae = flux3_files(tmp_path, flow_map=True)
    path, stored = save_gguf(state, tmp_path / "flux3.gguf", dit_types(GGMLQuantizationType[qtype]), arch=arch)
    save_file({k: v.contiguous() for k, v in stored.items()}, str(tmp_path / "stored.safetensors"))
    quantized = pipeline.load_models(path, te, ae, device="cpu", dtype=torch.float32)
    assert type(quantized.transformer).__name__ == "Flux3Transformer" and census(quantized.transformer)[qtype] > 0
    floats = pipeline.load_models(tmp_path / "stored.safetensors", te, ae, device="cpu", dtype=torch.float32)
    runs = [pipeline.generate(m, "a fox", width=64, height=48, steps=2, seed=3) for m in (quantized, floats)]
    assert torch.allclose(runs[0].latents, runs[1].latents, rtol=0, atol=1e-5 * runs[1].latents.abs().max())


def test_a_flux3_fp8_file_runs_as_its_stored_values(tmp_path):
    """A FLUX 3 transformer in ComfyUI's fp8 layout (float8_e4m3fn blocks with per-tensor scales and the
    ``_quantization_metadata`` naming them, behind model.diffusion_model.): its fp8 layers kept as stored, and a run
    equal to the float model holding float8 x scale, the value ComfyUI's format defines."""
    from safetensors.torch import save_file

    from flux2_core import pipeline
    from flux2_core.families.flux3.files import quantizable
    from flux2_core.storage.protocol import census
    from tests.tiny.layouts import comfy_fp8, save_prefixed

    _, state, te, ae = flux3_files(tmp_path, flow_map=True)
    layers = sorted(k.removesuffix(".weight") for k in state if quantizable(k) and k.endswith(".weight")
                    and state[k].ndim == 2)
    stored, meta = comfy_fp8(state, layers)
    path = save_prefixed(stored, tmp_path / "flux3-image-klein-fp8.safetensors", "model.diffusion_model.", meta)
    values = dict(state) | {f"{layer}.weight": stored[f"{layer}.weight"].float() * stored[f"{layer}.weight_scale"]
                            for layer in layers}
    save_file({k: v.contiguous() for k, v in values.items()}, str(tmp_path / "values.safetensors"))
    fp8 = pipeline.load_models(path, te, ae, device="cpu", dtype=torch.float32)
    assert type(fp8.transformer).__name__ == "Flux3Transformer"
    assert census(fp8.transformer)["fp8"] == len(layers) > 30
    floats = pipeline.load_models(tmp_path / "values.safetensors", te, ae, device="cpu", dtype=torch.float32)
    runs = [pipeline.generate(m, "a fox", width=64, height=48, steps=2, seed=3) for m in (fp8, floats)]
    assert torch.allclose(runs[0].latents, runs[1].latents, rtol=0, atol=1e-5 * runs[1].latents.abs().max())


@pytest.mark.parametrize("kind", ["int8_convrot", "nvfp4"])
def test_a_flux3_file_in_comfyuis_quantized_formats_keeps_them(tmp_path, kind):
    """FLUX 3 in ComfyUI's int8 ConvRot and NVFP4 layouts (BFL's ComfyUI files; written by comfy-kitchen's own
    quantizers): the blocks kept as stored, and a run equal to the float model holding comfy-kitchen's dequantized
    weights."""
    from safetensors.torch import save_file

    from flux2_core import pipeline
    from flux2_core.families.flux3.files import quantizable
    from flux2_core.storage.protocol import census
    from tests.tiny.layouts import comfy_quant, kitchen_weight, save_prefixed

    _, state, te, ae = flux3_files(tmp_path, flow_map=True)
    layers = sorted(k.removesuffix(".weight") for k in state if quantizable(k) and k.endswith(".weight")
                    and state[k].ndim == 2)
    stored = comfy_quant(state, layers, kind, 256 if kind == "int8_convrot" else 0)
    path = save_prefixed(stored, tmp_path / f"flux3-image-klein-{kind}.safetensors", "model.diffusion_model.")
    quantized = pipeline.load_models(path, te, ae, device="cpu", dtype=torch.float32)
    assert census(quantized.transformer)[kind.split("_")[0]] == len(layers) > 30
    values = dict(state) | {f"{layer}.weight": kitchen_weight(stored, layer, kind).dequantize().float()[
        : state[f"{layer}.weight"].shape[0], : state[f"{layer}.weight"].shape[1]] for layer in layers}
    save_file({k: v.contiguous() for k, v in values.items()}, str(tmp_path / "values.safetensors"))
    floats = pipeline.load_models(tmp_path / "values.safetensors", te, ae, device="cpu", dtype=torch.float32)
    runs = [pipeline.generate(m, "a fox", width=64, height=48, steps=2, seed=3) for m in (quantized, floats)]
    assert torch.allclose(runs[0].latents, runs[1].latents, rtol=0, atol=1e-5 * runs[1].latents.abs().max())


def test_int8_and_a_lora_on_flux3(tmp_path):
    """--int8 holds exactly the blocks and modulations in int8 (the embedders, time embedders and final layer stay
    float) as the per-row rounding computed by hand, and generate equals the float model holding those weights; a LoRA in
    ai-toolkit's layout on BFL names (the diffusion_model. prefix), applied unmerged, equals its hand merge
    W + strength * B @ A loaded as plain weights."""
    from safetensors.torch import save_file

    from flux2_core import pipeline
    from flux2_core.families.flux3 import FLUX3
    from flux2_core.storage.int8 import quantize_blocks
    from flux2_core.storage.protocol import census

    params, state, te, ae = flux3_files(tmp_path, flow_map=True)
    run = {"prompt": "a fox", "width": 64, "height": 48, "steps": 2, "seed": 3}

    models = our_models(params, state, te, ae)
    names = quantize_blocks(models.transformer, FLUX3.quantizable)
    families = {n.split(".")[0] for n in names}
    assert families == {"content_mode_blocks", "txt_mode_blocks", "single_blocks", "early_stream_modulations",
                        "single_stream_modulations"} and census(models.transformer)["int8"] == len(names)
    rounded, layers, same, count = dict(state), dict(models.transformer.named_modules()), 0, 0
    for name in names:              # the stored weights are the per-row rounding (float32 vs float64 at the halves)
        w = state[name + ".weight"].double().numpy()
        scale = np.abs(w).max(axis=1, keepdims=True) / 127
        stored = layers[name].float_weight().double().numpy()
        steps = np.abs(stored - np.clip(np.round(w / scale), -127, 127) * scale) / scale
        assert steps.max() < 1 + 1e-4
        same, count = same + (steps < 1e-4).sum(), count + steps.size
        rounded[name + ".weight"] = torch.from_numpy(stored).float()
    assert same / count > 0.999
    got = pipeline.generate(models, **run)
    expected = pipeline.generate(our_models(params, rounded, te, ae), **run)
    assert_close_to_scale(got.latents, expected.latents)

    g = torch.Generator().manual_seed(4)
    lora, merged = {}, dict(state)
    for name in ("single_blocks.0.q_proj", "txt_mode_blocks.1.mlp_out", "early_stream_modulations.image.lin"):
        out_features, in_features = state[name + ".weight"].shape
        a, b = torch.randn(4, in_features, generator=g) * 0.3, torch.randn(out_features, 4, generator=g) * 0.3
        lora |= {f"diffusion_model.{name}.lora_A.weight": a, f"diffusion_model.{name}.lora_B.weight": b}
        merged[name + ".weight"] = state[name + ".weight"] + 0.7 * b @ a
    save_file(lora, str(tmp_path / "lora.safetensors"))
    models = our_models(params, state, te, ae)
    (line,) = pipeline.apply_adapters(models, [(tmp_path / "lora.safetensors", 0.7)], merge=False)
    assert "3 modules" in line
    got = pipeline.generate(models, **run)
    expected = pipeline.generate(our_models(params, merged, te, ae), **run)
    plain = pipeline.generate(our_models(params, state, te, ae), **run)
    assert_close_to_scale(got.latents, expected.latents)
    assert (plain.latents - expected.latents).abs().max() > 1e-2 * expected.latents.abs().max()


def test_a_models_folder_gives_flux3_files_under_any_name(tmp_path, monkeypatch):
    """--models finds FLUX 3 files by what their headers say where their names are not the usual ones: the
    transformer among FLUX.2 and other files, and its Qwen3-VL encoder (known by its text tower's names) past a
    plain Qwen3 file of the same width. The registry's FLUX 3 entries are given the tiny sizes, as a real file's
    sizes cannot be written here."""
    from dataclasses import replace

    from safetensors.torch import load_file, save_file

    from flux2_core.app import cli
    from flux2_core.errors import Flux2Error
    from flux2_core.families import VARIANTS
    from tests.tiny.text_encoder import build_tiny_qwen3, save_comfyui_text_encoder
    from tests.tiny.transformer import TINY_TRANSFORMER, random_bfl_transformer_state_dict, save_bfl_transformer

    params, state, te, _ = flux3_files(tmp_path, flow_map=False)
    for name in ("flux3-klein", "flux3-klein-base"):
        v = VARIANTS[name]
        monkeypatch.setitem(VARIANTS, name, replace(v, params=replace(params, flow_map=v.params.flow_map),
                                                    text_encoder=replace(v.text_encoder, hidden_size=32)))
    models = tmp_path / "models"
    for folder in ("diffusion_models", "text_encoders", "vae"):
        (models / folder).mkdir(parents=True)
    save_bfl_transformer(random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=1),
                         models / "diffusion_models" / "a-flux2-finetune.safetensors")
    (models / "diffusion_models" / "broken.safetensors").write_bytes(b"not a file")
    save_file({"model.diffusion_model." + k: v for k, v in state.items()},
              str(models / "diffusion_models" / "my-download.safetensors"))
    save_comfyui_text_encoder(build_tiny_qwen3(2), models / "text_encoders" / "a-qwen3.safetensors")
    save_file(load_file(te / "model.safetensors"), str(models / "text_encoders" / "encoder.safetensors"))
    (models / "vae" / "flux2-vae.safetensors").write_bytes(b"")
    transformer, encoder, _ = cli.find_weights(str(models), None)
    assert (transformer.name, encoder.name) == ("my-download.safetensors", "encoder.safetensors")
    assert cli.find_weights(str(models), "flux3-klein-base")[0].name == "my-download.safetensors"
    with pytest.raises(Flux2Error, match="for flux3-klein:"):      # the distilled model is not there
        cli.find_weights(str(models), "flux3-klein")


def test_a_text_encoder_file_says_which_model_it_is(tmp_path):
    """A Qwen3-VL folder loads as FLUX 3's encoder without being told (its config and text tower's names say it), as
    does a single file by its name, and the folder is refused for FLUX.2; a Qwen3 folder (its config says so) is refused for FLUX 3, naming the file to load."""
    from flux2_core import weights
    from flux2_core.errors import Flux2Error
    from flux2_core.families.flux2.variants import QWEN3_4B
    from flux2_core.families.flux3.variants import QWEN3_VL_4B
    from tests.tiny.flux3 import TINY_QWEN3_VL_TEXT
    from tests.tiny.text_encoder import build_tiny_qwen3, save_comfyui_text_encoder, save_diffusers_text_encoder

    folder = save_tiny_qwen3_vl(tmp_path / "vl")
    found = weights.load_text_encoder(folder, "cpu", torch.float32)
    assert found.spec.model == "qwen3-vl" and found.spec.padding == ToMultiple(80, pad_position=1) and len(found.model.layers) == 32
    with pytest.raises(Flux2Error, match=r"is a Qwen3-VL text encoder \(known by its config.json; FLUX 3 Image Klein "
                                         r"reads it\), but FLUX.2 Klein 4B reads Qwen3-4B: load the Qwen3-4B text "
                                         r"encoder"):
        weights.load_text_encoder(folder, "cpu", torch.float32, spec=QWEN3_4B)
    single = save_comfyui_text_encoder(build_tiny_qwen3(3, TINY_QWEN3_VL_TEXT), tmp_path / "qwen3vl_4b.safetensors")
    assert weights.load_text_encoder(single, "cpu", torch.float32).spec.model == "qwen3-vl"     # by its name
    plain = save_diffusers_text_encoder(build_tiny_qwen3(), tmp_path / "qwen3")
    with pytest.raises(Flux2Error, match=r"is a Qwen3 text encoder \(known by its config.json; FLUX.2 reads it\), but "
                                         r"FLUX 3 Image Klein reads Qwen3-VL-4B-Instruct: load the Qwen3-VL-4B-Instruct "
                                         r"text encoder \(qwen3vl_4b"):
        weights.load_text_encoder(plain, "cpu", torch.float32, spec=QWEN3_VL_4B)


@pytest.mark.slow
def test_a_qwen3_vl_gguf_is_flux3s_encoder(tmp_path):
    """A Qwen3-VL text tower as llama.cpp writes it (architecture "qwen3vl", Qwen3's tensor names, Qwen's vocabulary)
    loads as FLUX 3's encoder without being told (by its architecture; the name says nothing), keeps its blocks
    quantized, and encodes what the float tower holding ``gguf.quants``' dequantized values encodes; it is refused for
    FLUX.2, and a foreign vocabulary names FLUX 3's encoder."""
    from gguf import GGMLQuantizationType as T
    from safetensors.torch import save_file

    from flux2_core import weights
    from flux2_core.errors import Flux2Error
    from flux2_core.families.flux2.variants import QWEN3_4B
    from flux2_core.storage.ggml_layers import GGMLLinear
    from tests.tiny.flux3 import TINY_QWEN3_VL_TEXT
    from tests.tiny.gguf import encoder_types, hf_names, llama_cpp_names, qwen3_tokens, save_gguf
    from tests.tiny.text_encoder import build_tiny_qwen3, comfyui_state_dict

    hf = comfyui_state_dict(build_tiny_qwen3(4, TINY_QWEN3_VL_TEXT))
    tokens = qwen3_tokens(TINY_QWEN3_VL_TEXT["vocab_size"])
    path, values = save_gguf(llama_cpp_names(hf), tmp_path / "encoder-Q8_0.gguf", encoder_types(T.Q8_0, T.F16),
                             arch="qwen3vl", tokens=tokens)
    save_file(hf_names(values, hf), str(tmp_path / "qwen3vl_4b.safetensors"))
    encoder = weights.load_text_encoder(path, "cpu", torch.float32)
    reference = weights.load_text_encoder(tmp_path / "qwen3vl_4b.safetensors", "cpu", torch.float32)
    assert encoder.spec == reference.spec and encoder.spec.model == "qwen3-vl" and encoder.spec.padding == ToMultiple(80, pad_position=1)
    assert weights.text_encoder_spec(path).model == "qwen3-vl"
    # q, o and the MLP's three of each of the 32 layers (k and v hold 1024 values, which llama.cpp keeps in F32)
    assert len([m for m in encoder.model.modules() if isinstance(m, GGMLLinear)]) == 32 * 5
    prompts = ["a red fox", LONG_PROMPT]
    got, want = encoder.encode(prompts), reference.encode(prompts)
    assert got.lengths == want.lengths == [80, 160]
    torch.testing.assert_close(got.embeds, want.embeds, rtol=1e-5, atol=1e-5 * want.embeds.abs().max().item())
    with pytest.raises(Flux2Error, match=r"is a Qwen3-VL text encoder \(known by its GGUF architecture; FLUX 3 Image "
                                         r"Klein reads it\), but FLUX.2 Klein 4B reads Qwen3-4B"):
        weights.load_text_encoder(path, "cpu", torch.float32, spec=QWEN3_4B)
    tokens[500] = "not-qwen"
    other, _ = save_gguf(llama_cpp_names(hf), tmp_path / "other.gguf", encoder_types(T.Q8_0, T.F16), arch="qwen3vl",
                         tokens=tokens, values=False)
    with pytest.raises(Flux2Error, match="token 500 is 'not-qwen'.*FLUX 3 Image Klein needs the stock Qwen3-VL-4B"):
        weights.load_text_encoder(other, "cpu", torch.float32)


def test_the_memory_estimate_counts_the_prompts_own_rows(tmp_path, monkeypatch):
    """generate sizes the denoise for the text rows the model gets (each prompt padded to its multiple of 80, CFG's
    two prompts to the longer), not for the 4096 a FLUX 3 prompt may reach."""
    from flux2_core import pipeline
    from flux2_core.runtime import memory

    params, state, te, ae = flux3_files(tmp_path, flow_map=False)
    models = our_models(params, state, te, ae)
    asked, estimate = [], memory.denoiser_memory

    def spy(*args, **kwargs):
        asked.append(kwargs["text_tokens"])
        return estimate(*args, **kwargs)
    monkeypatch.setattr(memory, "denoiser_memory", spy)
    run = {"width": 32, "height": 32, "steps": 1, "seed": 1}
    pipeline.generate(models, "a fox", cfg=1.0, **run)
    pipeline.generate(models, "a fox", negative=LONG_PROMPT, cfg=3.5, **run)
    assert asked == [80, 160]
    encoded = models.prompt_encoder.encode(["a fox", LONG_PROMPT])
    assert encoded.embeds.shape[1] == models.prompt_encoder.text_tokens(["a fox", LONG_PROMPT]) == 160
