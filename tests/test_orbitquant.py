"""OrbitQuant artifacts, kept packed as stored, against orbitquant itself: artifacts of tiny FLUX.2 (diffusers' names)
and FLUX 3 (BFL's) transformers written by its own quantizer at each width it writes (and once with its GPTQ
rounding); the oracle is its own layers (their dequantized weights, their calls) and its own rotation, and for whole
runs the float model holding those dequantized weights."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from flux2_core import weights
from flux2_core.adapters.lora import read_adapter
from flux2_core.adapters.patching import set_adapters
from flux2_core.errors import Flux2Error
from flux2_core.storage.orbitquant import Int4GroupLinear, OrbitLinear
from flux2_core.storage.protocol import census
from tests.tiny.adapters import lora_state_dict, random_lora
from tests.tiny.orbitquant import dequantized, oq, quantize, rewrite
from tests.tiny.transformer import TINY_TRANSFORMER as P
from tests.tiny.transformer import (
    diffusers_transformer_from_bfl_file,
    random_bfl_transformer_state_dict,
    save_bfl_transformer,
)
from tests.tiny.transformer import tiny_forward as forward

WIDTHS = (2, 3, 4, 6, 8)
# orbitquant's module (diffusers' FLUX.2 names) -> ours (BFL's) and the rows of ours it is
PAIRS = {"single_transformer_blocks.0.attn.to_out": ("single_blocks.0.linear2", None),
         "single_transformer_blocks.1.attn.to_qkv_mlp_proj": ("single_blocks.1.linear1", None),
         "transformer_blocks.0.ff.linear_out": ("double_blocks.0.img_mlp.2", None),
         "transformer_blocks.1.ff_context.linear_in": ("double_blocks.1.txt_mlp.0", None),
         "transformer_blocks.0.attn.to_q": ("double_blocks.0.img_attn.qkv", 0),
         "transformer_blocks.0.attn.to_k": ("double_blocks.0.img_attn.qkv", 1),
         "transformer_blocks.1.attn.add_v_proj": ("double_blocks.1.txt_attn.qkv", 2),
         "double_stream_modulation_img.linear": ("double_stream_modulation_img.lin", None)}


def load(path):
    return weights.load_transformer(path, device="cpu", dtype=torch.float32)[0]


def part(tensor: torch.Tensor, third) -> torch.Tensor:
    return tensor if third is None else tensor.chunk(3)[third]


@pytest.fixture(scope="module")
def flux2(tmp_path_factory):
    """(BFL float state, float diffusers model, {width: (artifact folder, orbitquant's quantized model)})."""
    tmp = tmp_path_factory.mktemp("oq")
    sd = random_bfl_transformer_state_dict(P, seed=0)
    save_bfl_transformer(sd, tmp / "bfl.safetensors")
    float_model = diffusers_transformer_from_bfl_file(tmp / "bfl.safetensors", P, tmp / "config")
    artifacts = {}
    for bits in WIDTHS:
        theirs = copy.deepcopy(float_model)
        # at 2 bits orbitquant keeps boundary blocks in 4 bits (all of a tiny model's): here none
        protect = {"lowbit_boundary_protection": 0} if bits == 2 else {}
        artifacts[bits] = (quantize(theirs, tmp / f"w{bits}", bits, "flux2", **protect), theirs)
    return sd, float_model, artifacts


@pytest.mark.parametrize("bits", WIDTHS)
def test_each_width_is_kept_packed_and_dequantizes_as_orbitquant(flux2, bits):
    """Every layer orbitquant quantized is held as its codes, its weight in the rotated basis equal bit for bit to orbitquant's
    dequantization, turned back equal to orbitquant's own inverse rotation of it; its int4 modulation layers too."""
    folder, theirs = flux2[2][bits]
    ours = load(folder)
    manifest = json.loads((folder / "orbitquant_manifest.json").read_text())
    counts = census(ours)
    assert counts["orbitquant"] == len(manifest["quantized_modules"]) - 2 * 2 * P.depth       # q, k, v joined
    assert counts["int4 RTN"] == len(manifest["adaln_modules"]) == 3
    widths = {m.bits for m in ours.modules() if isinstance(m, OrbitLinear)}
    assert widths == {bits}, widths
    for name, (layer, third) in PAIRS.items():
        rotated, weight = dequantized(theirs.get_submodule(name))
        mine = ours.get_submodule(layer)
        if isinstance(mine, OrbitLinear):
            assert torch.equal(part(mine.rotated("cpu"), third), rotated), name
        assert torch.equal(part(mine.float_weight(), third), weight), name
    held = sum(t.numel() * t.element_size() for t in ours.state_dict().values())
    assert weights.transformer_bytes(folder, torch.float32) == held
    packed = sum(t.numel() for n, t in theirs.state_dict().items() if n.endswith(("packed_weight_indices",
                                                                                  "packed_weight")))
    assert sum(m.weight.numel() for m in ours.modules() if isinstance(m, (OrbitLinear, Int4GroupLinear))) == packed


def test_a_layer_computes_orbitquants_call_but_its_activation_quantization(flux2):
    """Ours is orbitquant's layer without its activation quantization (its own debug mode, float32); with it,
    each output differs from ours by no more than Cauchy-Schwarz allows for the activations' quantization error
    in the rotated basis: |y - ŷ| <= ||x·R - x̂|| · ||row of W·R||."""
    folder, theirs = flux2[2][4]
    layer = theirs.get_submodule("single_transformer_blocks.0.attn.to_out")
    mine = load(folder).get_submodule("single_blocks.0.linear2")
    x = torch.randn(2, 9, mine.in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = mine(x)
        layer.runtime_mode = "debug_no_activation_quant"
        exact = layer(x)
        layer.runtime_mode = "dequant_bf16"
        quantized = layer(x)
    assert (got - exact).abs().max() <= 1e-5 * exact.abs().max()
    rotated = layer.rotation.apply_to_activations(x)
    x_hat = oq.functional.quantize_activations(x, rotation=layer.rotation, codebook=layer.activation_codebook,
                                               eps=layer.activation_eps)
    bound = (rotated - x_hat).norm(dim=-1, keepdim=True) * dequantized(layer)[0].norm(dim=-1)
    assert ((got - quantized).abs() <= bound * (1 + 1e-5) + 1e-6).all()
    assert (got - quantized).abs().max() > 0                    # the activation quantization is not ours


def test_orbitquants_own_layer_runs_the_call_where_its_kernels_do(flux2, monkeypatch):
    """Where orbitquant's kernels run (a GPU with orbitquant installed; forced here on the CPU, its reference mode),
    each call is orbitquant's own layer over our very codes and norms: bit for bit its artifact's layer. That layer is
    no part of the model's state (nothing more saved or moved) and is made again after a move."""
    from flux2_core.storage import orbitquant
    from flux2_core.storage.matmul import choose_matmuls

    folder, theirs = flux2[2][4]
    model = load(folder)
    keys = set(model.state_dict())
    for layer in model.modules():
        if isinstance(layer, OrbitLinear):
            layer.settings["runtime_mode"] = "dequant_bf16"
    monkeypatch.setattr(orbitquant, "kernels_run", lambda device: True)
    choice = choose_matmuls(model, "cpu", torch.float32)
    assert choice.used["orbitquant"] and "orbitquant's own kernels" in choice.note_for("orbitquant")
    mine = model.get_submodule("double_blocks.0.img_mlp.2")
    x = torch.randn(3, mine.in_features, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(mine(x), theirs.get_submodule("transformer_blocks.0.ff.linear_out")(x))
        assert mine.kernel().packed_weight_indices.data_ptr() == mine.weight.data_ptr()       # the same codes
        assert set(model.state_dict()) == keys
        model.to("cpu")
        assert mine._kernel == (None, None)


def test_orbitquants_layer_is_not_used_where_its_settings_make_other_levels(flux2, tmp_path, monkeypatch):
    """Settings that would make another codebook than the artifact's (a version-1 codebook named over version-2
    levels): the calls stay dequantized, and the note says why."""
    import shutil

    from flux2_core.storage import orbitquant
    from flux2_core.storage.matmul import choose_matmuls

    folder = rewrite(shutil.copytree(flux2[2][4][0], tmp_path / "a"), config_changes={"codebook_version": 1})
    model = load(folder)
    monkeypatch.setattr(orbitquant, "kernels_run", lambda device: True)
    choice = choose_matmuls(model, "cpu", torch.float32)
    assert not choice.used["orbitquant"] and "not the one its codes were made in" in choice.note_for("orbitquant")
    assert not any(m.kernel_on for m in model.modules() if isinstance(m, OrbitLinear))


def float_twin(theirs) -> torch.nn.Module:
    """orbitquant's quantized diffusers model with each of its layers a float Linear of its dequantized weight."""
    twin = copy.deepcopy(theirs)
    for name, layer in list(twin.named_modules()):
        if isinstance(layer, (oq.OrbitQuantLinear, oq.adaln.RTNInt4Linear)):
            plain = torch.nn.Linear(layer.in_features, layer.out_features, bias=False)
            plain.weight.data = dequantized(layer)[1]
            twin.set_submodule(name, plain)
    return twin.float()


@pytest.mark.parametrize("bits", (3, 4))
def test_a_whole_flux2_model_equals_the_float_model_of_orbitquants_weights(flux2, tmp_path, bits):
    folder, theirs = flux2[2][bits]
    float_twin(theirs).save_pretrained(tmp_path / "twin")
    want, got = forward(load(tmp_path / "twin")), forward(load(folder))
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_a_lora_runs_as_a_branch_and_equals_it_merged_into_the_float_model(flux2, tmp_path):
    folder, theirs = flux2[2][4]
    float_twin(theirs).save_pretrained(tmp_path / "twin")
    layers = ["double_blocks.0.img_attn.qkv", "single_blocks.1.linear2"]
    adapter = read_adapter(lora_state_dict(random_lora(P, layers, rank=4, seed=5), "kohya", alpha=4.0)[0], P,
                           name="l")
    reference = load(tmp_path / "twin")
    set_adapters(reference, [(p, 0.8) for p in adapter.patches], merge=True)
    want = forward(reference)
    model = load(folder)
    stored = {k: v.clone() for k, v in model.state_dict().items()}
    for merge in (None, True):
        set_adapters(model, [(p, 0.8) for p in adapter.patches], merge=merge)
        assert (forward(model) - want).abs().max() <= 2e-5 * want.abs().max(), merge
    set_adapters(model, [])
    assert all(torch.equal(v, stored[k]) for k, v in model.state_dict().items())


def test_gptq_rounding_is_read_as_the_same_format(flux2, tmp_path):
    """orbitquant's GPTQ rounding (calibrated on a few random inputs) changes only the codes: read as any artifact,
    dequantized as orbitquant dequantizes them, and not the calibration-free codes."""
    from orbitquant.gptq import HessianCollector, load_rounded_codes, round_groups

    from tests.tiny.orbitquant import config

    _, float_model, artifacts = flux2
    model = copy.deepcopy(float_model)
    settings = config(4, "flux2")
    groups = [["single_transformer_blocks.0.attn.to_out"], ["transformer_blocks.0.ff.linear_out"]]
    with HessianCollector(model, groups, settings) as hessians:
        for seed in range(2):
            generator = torch.Generator().manual_seed(seed)
            model(hidden_states=torch.randn(1, 16, P.in_channels, generator=generator),
                  encoder_hidden_states=torch.randn(1, 8, P.context_in_dim, generator=generator),
                  timestep=torch.tensor([0.5]), img_ids=torch.zeros(1, 16, 4), txt_ids=torch.zeros(1, 8, 4),
                  guidance=None)
    codes = round_groups(model, groups, hessians, settings)
    summary = oq.quantize_model(model, settings, quantization_device="cpu")
    load_rounded_codes(model, codes)
    oq.artifacts.save_orbitquant_artifact(model, tmp_path / "gptq", config=settings, source_model_id="t/t",
                                          source_revision="0" * 40, source_license="apache-2.0", summary=summary)
    ours = load(tmp_path / "gptq")
    for name in groups[0] + groups[1]:
        layer, _ = PAIRS[name]
        assert torch.equal(ours.get_submodule(layer).rotated("cpu"), dequantized(model.get_submodule(name))[0])
    plain = artifacts[4][1].get_submodule(groups[0][0])
    assert not torch.equal(plain.packed_weight_indices, model.get_submodule(groups[0][0]).packed_weight_indices)


def test_a_flux3_generate_equals_the_float_model_of_orbitquants_weights(tmp_path):
    """FLUX 3 in BFL's names, quantized by orbitquant over our own float model (its universal policy: every block
    layer and the modulations): a whole run equal to the float model holding orbitquant's dequantized weights."""
    from flux2_core import pipeline
    from tests.tiny.autoencoder import build_diffusers_autoencoder, save_bfl_autoencoder
    from tests.tiny.flux3 import random_flux3_state_dict, save_tiny_qwen3_vl, tiny_flux3

    params = replace(tiny_flux3(True), context_in_dim=8 * 32)
    state = random_flux3_state_dict(params, seed=6)
    save_file(state, tmp_path / "flux3.safetensors")
    te = save_tiny_qwen3_vl(tmp_path / "text_encoder", seed=1)
    ae = save_bfl_autoencoder(build_diffusers_autoencoder(2), tmp_path / "ae.safetensors")
    theirs = load(tmp_path / "flux3.safetensors")
    folder = quantize(theirs, tmp_path / "flux3-oq", 4, "universal")
    values = dict(state) | {f"{name}.weight": dequantized(layer)[1] for name, layer in theirs.named_modules()
                            if isinstance(layer, oq.OrbitQuantLinear)}
    save_file({k: v.contiguous() for k, v in values.items()}, tmp_path / "values.safetensors")
    quantized = pipeline.load_models(folder, te, ae, device="cpu", dtype=torch.float32)
    assert census(quantized.transformer)["orbitquant"] > 40
    floats = pipeline.load_models(tmp_path / "values.safetensors", te, ae, device="cpu", dtype=torch.float32)
    runs = [pipeline.generate(m, "a fox", width=64, height=48, steps=2, seed=3) for m in (quantized, floats)]
    assert torch.allclose(runs[0].latents, runs[1].latents, rtol=0, atol=1e-5 * runs[1].latents.abs().max())


# ---------------------------------------------------------------------------------------------------------------
# damaged artifacts
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture
def artifact(flux2, tmp_path):
    import shutil

    return shutil.copytree(flux2[2][4][0], tmp_path / "artifact")


def refused(path, *words) -> str:
    with pytest.raises(Flux2Error) as e:
        load(path)
    assert all(w in str(e.value) for w in words), str(e.value)
    return str(e.value)


def test_a_file_whose_checksum_is_off_is_refused(artifact):
    data = bytearray((artifact / "model.safetensors").read_bytes())
    data[-1] ^= 0x10                                      # one code of the last tensor
    (artifact / "model.safetensors").write_bytes(bytes(data))
    refused(artifact, "model.safetensors", "SHA-256")


def test_checksums_left_out_are_refused(artifact):
    names = json.loads((artifact / "orbitquant_manifest.json").read_text())["checksums"]
    rewrite(artifact, manifest=lambda m: m | {"checksums": {}})
    refused(artifact, "no checksum of model.safetensors")
    rewrite(artifact, manifest=lambda m: m | {"checksums": names})          # true again
    load(artifact)
    sums = (artifact / "SHA256SUMS").read_text().splitlines()
    (artifact / "SHA256SUMS").write_text("".join(f"{line}\n" for line in sums if "manifest" not in line))
    refused(artifact, "SHA256SUMS", "orbitquant_manifest.json")


def test_a_second_rotation_and_a_float_weight_beside_codes_are_refused(artifact):
    from safetensors.torch import load_file

    rotations = load_file(artifact / "orbitquant_rotations.safetensors")
    head = next(k for k in rotations if k.endswith(".signs")).removesuffix(".signs")
    rotations |= {k.replace("_seed0_", "_seed7_"): v.clone() for k, v in rotations.items() if k.startswith(head + ".")}
    save_file(rotations, artifact / "orbitquant_rotations.safetensors")
    rewrite(artifact)
    refused(artifact, "seed 7")
    rotations = {k: v for k, v in rotations.items() if "_seed7_" not in k}
    save_file(rotations, artifact / "orbitquant_rotations.safetensors")
    name = "single_transformer_blocks.0.attn.to_out"
    rewrite(artifact, tensors=lambda sd: sd | {f"{name}.weight": torch.zeros(64, 256, dtype=torch.bfloat16)})
    refused(artifact, name, "float weight")


def test_a_single_file_naming_the_format_has_its_values_checked(artifact, tmp_path):
    """A file in ComfyUI's convention naming the format of its own: a rotation that is no permutation is refused by
    the value rules as its tensors are read, not run."""
    from flux2_core.weights.checkpoint import open_checkpoint, read_tensor
    from flux2_core.weights.orbitquant_files import as_stored

    ckpt = as_stored(open_checkpoint(artifact, "transformer"))
    state = {}
    for key, info in ckpt.tensors.items():
        with open(info.file, "rb") as f:
            state[key] = read_tensor(info, f)
    name = "single_transformer_blocks.0.attn.to_out"
    state[f"{name}.weight_order"] = torch.zeros_like(state[f"{name}.weight_order"])
    save_file(state, tmp_path / "one.safetensors", metadata={"_quantization_metadata": ckpt.metadata[
        "_quantization_metadata"]})
    refused(tmp_path / "one.safetensors", "weight_order", "not a permutation")


def test_a_manifest_listing_a_layer_the_file_lacks_is_refused(artifact):
    name = "transformer_blocks.1.attn.to_out.0"
    rewrite(artifact, tensors=lambda sd: {k: v for k, v in sd.items() if not k.startswith(name + ".")})
    refused(artifact, name, "packed_weight_indices")


def test_a_manifest_giving_a_layer_the_wrong_width_is_refused(artifact):
    name = "single_transformer_blocks.0.attn.to_out"
    rewrite(artifact, manifest=lambda m: m | {"module_bits": {name: 8}})
    refused(artifact, name, "8-bit")


def test_codes_of_a_layer_the_manifest_does_not_list_are_refused(artifact):
    name = "single_transformer_blocks.1.attn.to_out"
    rewrite(artifact, manifest=lambda m: m | {"quantized_modules": [n for n in m["quantized_modules"] if n != name]})
    refused(artifact, name, "does not list")


def test_a_damaged_rotation_is_refused(artifact):
    from safetensors.torch import load_file

    rotations = load_file(artifact / "orbitquant_rotations.safetensors")
    key = next(k for k in rotations if k.endswith(".signs"))
    rotations[key][0] = 3
    save_file(rotations, artifact / "orbitquant_rotations.safetensors")
    rewrite(artifact)
    refused(artifact, "orbitquant_rotations.safetensors", key.removesuffix(".signs"))


def test_a_fused_checkpoint_is_refused_naming_what_to_download(artifact):
    rewrite(artifact, config_changes={"fused_layout": {"family": "flux2", "version": 1, "dense": "int8"}})
    refused(artifact, "fused", "unfused artifact")


def test_its_model_file_alone_is_refused_naming_the_folder(artifact, tmp_path):
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "flux-2-klein-oq.safetensors").write_bytes((artifact / "model.safetensors").read_bytes())
    refused(alone / "flux-2-klein-oq.safetensors", "orbitquant_manifest.json", "whole artifact folder")
    refused(artifact / "orbitquant_codebooks.safetensors", "model.safetensors")


# ---------------------------------------------------------------------------------------------------------------
# where users give it
# ---------------------------------------------------------------------------------------------------------------

def test_the_command_line_runs_an_artifact_folder(flux2, tmp_path, capsys, monkeypatch):
    """--transformer takes the folder (or its model.safetensors); --models finds a folder in diffusion_models by
    its headers (the tiny model's read here as Klein 4B's, as a real artifact's would be)."""
    import shutil

    from flux2_core import weights as weights_api
    from flux2_core.app import cli
    from flux2_core.families import VARIANTS
    from tests.test_cli import png_parameters, write_models_folder

    write_models_folder(tmp_path)
    folder = shutil.copytree(flux2[2][4][0], tmp_path / "diffusion_models" / "flux-2-klein-4b-orbitquant-w4a4")
    for given in (folder, folder / "model.safetensors"):
        code = cli.main(["--transformer", str(given), "--text-encoder", str(tmp_path / "text_encoders" / "qwen_3_4b.safetensors"),
                         "--ae", str(tmp_path / "vae" / "flux2-vae.safetensors"), "--prompt", "a fox", "--width", "32",
                         "--height", "32", "--seed", "1", "--steps", "1", "--device", "cpu", "--out",
                         str(tmp_path / "out")])
        assert code == 0, capsys.readouterr().err
        assert "orbitquant" in png_parameters(tmp_path / "out" / "flux2_1.png")[1]["transformer_weights"]
        (tmp_path / "out" / "flux2_1.png").unlink()
    (tmp_path / "diffusion_models" / "flux-2-klein-4b.safetensors").unlink()
    real = weights_api.inspect_transformer
    monkeypatch.setattr(weights_api, "inspect_transformer",
                        lambda path: (real(path)[0], VARIANTS["klein-4b"]) if path == folder else real(path))
    from flux2_core.app.models_folder import search_models

    found = search_models(str(tmp_path), None)
    assert found.transformer == folder, found


def test_other_orbitquant_layouts_are_refused_naming_what_they_are(artifact, tmp_path):
    """The same codes in orbitquant's Hugging Face form (settings in config.json, no manifest) and in a release bundle
    for orbitquant's own runner (a manifest.json of its format above the model folder)."""
    codes = (artifact / "model.safetensors").read_bytes()
    hub = tmp_path / "hub" / "transformer"
    hub.mkdir(parents=True)
    (hub / "diffusion_pytorch_model.safetensors").write_bytes(codes)
    (hub / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "orbitquant"}}))
    refused(hub, "Hugging Face integration", "orbitquant_manifest.json")
    bundle = tmp_path / "bundle"
    (bundle / "dit").mkdir(parents=True)
    (bundle / "manifest.json").write_text(json.dumps({"format": "flux3-orbitquant"}))
    (bundle / "dit" / "model.safetensors").write_bytes(codes)
    refused(bundle / "dit", "flux3-orbitquant release bundle", "orbitquant_manifest.json")
