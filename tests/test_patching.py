"""Adapters applied to models (flux2_core/adapters/patching.py, pipeline.apply_adapters, the CLI's --lora): merged float
weights equal W + strength·s·B·A computed here, fp8 layers run a branch equal to the merged float computation,
strength 0 and removal give the original model bit for bit after any number of changes, and a whole generation
with a LoRA equals one on the weights diffusers 0.42.1 fuses the same LoRA into."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from flux2_core import pipeline
from flux2_core.adapters.lora import read_adapter
from flux2_core.adapters.patching import set_adapters
from flux2_core.app import cli
from flux2_core.app.demo import DEMO_TRANSFORMER
from flux2_core.errors import Flux2Error
from flux2_core.families.flux2.files import quantizable
from flux2_core.families.flux2.transformer import Flux2Transformer
from flux2_core.models import rope
from flux2_core.models.run_state import run_state
from flux2_core.runtime import memory
from flux2_core.runtime.cache import fingerprint
from flux2_core.storage import quant
from tests.tiny.adapters import diffusers_fused_weights, lora_state_dict, random_lora, save_adapter
from tests.tiny.autoencoder import build_diffusers_autoencoder, save_bfl_autoencoder
from tests.tiny.text_encoder import build_tiny_qwen3, save_comfyui_text_encoder
from tests.tiny.transformer import TINY_TRANSFORMER, random_bfl_transformer_state_dict, save_bfl_transformer

P = TINY_TRANSFORMER
MODULES = ["double_blocks.0.img_attn.qkv", "double_blocks.0.txt_mlp.2", "single_blocks.0.linear1",
           "single_blocks.1.linear2", "final_layer.linear"]


def tiny_model(seed: int = 0) -> Flux2Transformer:
    model = Flux2Transformer(P)
    model.load_state_dict(random_bfl_transformer_state_dict(P, seed=seed))
    return model.eval()


def lora(seed: int, modules=MODULES, alpha: float | None = 8.0, rank: int = 4):
    """(adapter read by flux2_core, the raw {module: (down, up)}, its scale alpha/rank)."""
    raw = random_lora(P, modules, rank=rank, seed=seed)
    sd, _ = lora_state_dict(raw, "kohya", alpha=alpha)
    return read_adapter(sd, P, name=f"lora{seed}"), raw, (alpha / rank if alpha else 1.0)


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def forward(model, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    img, txt = torch.randn(2, 16, P.in_channels, generator=g), torch.randn(2, 8, P.context_in_dim, generator=g)
    with torch.no_grad():
        return model(img, rope.image_ids(2, 4, 4), torch.tensor([0.7, 0.3]), txt, rope.text_ids(2, 8))


def test_merged_weights_are_w_plus_strength_times_scaled_up_down():
    model = tiny_model()
    before = snapshot(model)
    (a, raw_a, s_a), (b, raw_b, s_b) = lora(1), lora(2, MODULES[:2], alpha=None)
    set_adapters(model, [(p, 0.7) for p in a.patches] + [(p, -1.5) for p in b.patches], key="ab")
    after = model.state_dict()
    for m in MODULES:
        want = before[m + ".weight"].clone()
        down, up = raw_a[m]
        want += 0.7 * s_a * (up @ down)
        if m in raw_b:
            down, up = raw_b[m]
            want += -1.5 * s_b * (up @ down)
        torch.testing.assert_close(after[m + ".weight"], want, rtol=1e-6, atol=1e-6)
    untouched = [k for k in before if not any(k.startswith(m + ".") for m in MODULES)]
    assert untouched and all(torch.equal(after[k], before[k]) for k in untouched)


def test_strength_zero_and_removal_give_the_original_bit_for_bit_after_many_changes():
    model = tiny_model()
    original, out = snapshot(model), forward(model)
    (a, _, _), (b, _, _) = lora(1), lora(2)
    set_adapters(model, [(p, 0.0) for p in a.patches], key="zero")
    assert all(torch.equal(v, original[k]) for k, v in model.state_dict().items())
    assert torch.equal(forward(model), out)
    g = torch.Generator().manual_seed(3)
    for i in range(12):                          # stacks, strengths and modes in a random order
        strengths = (torch.rand(2, generator=g) * 4 - 2).tolist()
        set_adapters(model, [(p, strengths[0]) for p in a.patches] + [(p, strengths[1]) for p in b.patches],
                     key=i, merge=[None, False][i % 2])
        assert not torch.equal(forward(model), out)
    set_adapters(model, [])
    assert all(torch.equal(v, original[k]) for k, v in model.state_dict().items())
    assert torch.equal(forward(model), out) and run_state(model).adapter_key == ()


@pytest.mark.parametrize("strength", [float("nan"), float("inf")])
def test_a_non_finite_strength_is_refused_and_changes_nothing(strength):
    model = tiny_model()
    (a, _, _) = lora(1)
    set_adapters(model, [(p, 0.5) for p in a.patches], key="half")
    applied = snapshot(model)
    with pytest.raises(Flux2Error, match="an adapter's strength must be a finite number"):
        set_adapters(model, [(p, strength) for p in a.patches], key="bad")
    assert all(torch.equal(v, applied[k]) for k, v in model.state_dict().items()) and run_state(model).adapter_key == "half"


def test_run_time_branches_equal_merged_weights():
    (a, _, _), (b, _, _) = lora(1), lora(2)
    patches = [(p, 0.8) for p in a.patches] + [(p, 0.5) for p in b.patches]
    merged, branched = tiny_model(), tiny_model()
    set_adapters(merged, patches)
    set_adapters(branched, patches, merge=False)
    assert all(torch.equal(v, tiny_model().state_dict()[k]) for k, v in branched.state_dict().items())
    want = forward(merged)
    assert (forward(branched) - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("axis", ["out", "in"])
def test_dora_as_a_branch_equals_its_merge_and_changes_no_stored_weight(axis):
    """merge=False (a host that streams the weights as stored, ComfyUI's dynamic VRAM): DoRA runs as a branch that
    gives what its merge gives, after another LoRA on the same layers and at a strength other than 1, per output row
    and per input column, and every stored tensor stays bit for bit."""
    (a, _, _), (b, _, _) = lora(1), lora(2)
    g = torch.Generator().manual_seed(3)

    def dora(patch):
        shape = (patch.shape[0], 1) if axis == "out" else (1, patch.shape[1])
        return replace(patch, dora_scale=0.5 + torch.rand(shape, generator=g))

    patches = [(p, 0.8) for p in a.patches] + [(dora(p), 0.6) for p in b.patches]
    merged, branched = tiny_model(), tiny_model()
    set_adapters(merged, patches)
    set_adapters(branched, patches, merge=False)
    assert not run_state(branched).adapters.merged and len(run_state(branched).adapters.hooks) == len(MODULES)
    assert all(torch.equal(v, tiny_model().state_dict()[k]) for k, v in branched.state_dict().items())
    want, plain = forward(merged), forward(tiny_model())
    assert (forward(branched) - want).abs().max() <= 1e-5 * want.abs().max()
    assert (plain - want).abs().max() > 1e-2 * want.abs().max()          # the patches change the result
    set_adapters(branched, [])
    assert torch.equal(forward(branched), plain)


def test_fp8_layers_take_a_branch_unless_asked_to_merge():
    """The fp8 weights stay as they are; the result equals merging the LoRA into the dequantized float weights."""
    a, _, _ = lora(1)
    fp8 = tiny_model()
    quant.quantize_transformer(fp8, quantizable)
    reference = tiny_model()                              # the float model the fp8 one stands for, LoRA merged
    with torch.no_grad():
        for name, layer in fp8.named_modules():
            if isinstance(layer, quant.Fp8Linear):
                reference.get_submodule(name).weight.copy_(quant.dequantize_fp8(layer.weight, layer.weight_scale))
    stored = snapshot(fp8)
    set_adapters(fp8, [(p, 0.9) for p in a.patches])
    set_adapters(reference, [(p, 0.9) for p in a.patches])
    in_fp8 = [n + s for n, m in fp8.named_modules() if isinstance(m, quant.Fp8Linear) for s in (".weight", ".weight_scale")]
    assert "single_blocks.0.linear1.weight" in in_fp8
    assert all(torch.equal(fp8.state_dict()[k], stored[k]) for k in in_fp8)        # nothing re-rounded
    want = forward(reference)
    assert (forward(fp8) - want).abs().max() <= 1e-5 * want.abs().max()
    set_adapters(fp8, [(p, 0.9) for p in a.patches], merge=True)                   # asked: re-quantized
    assert not torch.equal(fp8.state_dict()["single_blocks.0.linear1.weight"].float(),
                           stored["single_blocks.0.linear1.weight"].float())
    assert (forward(fp8) - want).abs().max() <= 0.05 * want.abs().max()            # fp8 rounding of W'
    set_adapters(fp8, [])
    assert all(torch.equal(v, stored[k]) for k, v in fp8.state_dict().items())


def test_caches_tell_adapter_sets_apart_even_when_weights_do_not_change():
    a, _, _ = lora(1)
    model = tiny_model()
    plain = fingerprint(model)
    set_adapters(model, [(p, 1.0) for p in a.patches], key=("a", 1.0), merge=False)    # weights untouched
    assert fingerprint(model) != plain
    set_adapters(model, [])
    assert fingerprint(model) == plain


def test_patches_for_another_model_are_refused():
    wider = replace(P, hidden_size=128, axes_dim=(16, 16, 16, 16), depth_single_blocks=4)   # another model size
    sd, _ = lora_state_dict(random_lora(wider, ["double_blocks.0.img_attn.qkv", "single_blocks.3.linear1"]), "kohya")
    patches = {p.target: p for p in read_adapter(sd, wider).patches}
    with pytest.raises(Flux2Error, match=r"\[384, 128\]\) does not fit double_blocks.0.img_attn.qkv of this model"):
        set_adapters(tiny_model(), [(patches["double_blocks.0.img_attn.qkv"], 1.0)])
    with pytest.raises(Flux2Error, match="patches single_blocks.3.linear1, which this model does not have"):
        set_adapters(tiny_model(), [(patches["single_blocks.3.linear1"], 1.0)])
    with pytest.raises(Flux2Error, match="merge must be"):
        set_adapters(tiny_model(), [], merge="yes")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-models")
    return tmp, [save_bfl_transformer(random_bfl_transformer_state_dict(P, seed=3), tmp / "flux-2-klein-tiny.safetensors"),
                 save_comfyui_text_encoder(build_tiny_qwen3(seed=5), tmp / "qwen_3_tiny.safetensors"),
                 save_bfl_autoencoder(build_diffusers_autoencoder(seed=4), tmp / "ae.safetensors")]


@pytest.mark.slow
def test_generation_with_a_lora_equals_diffusers_fusing_it(files):
    """Our pipeline with an ai-toolkit LoRA applied vs our pipeline on the weights diffusers 0.42.1 computes by
    loading and fusing the same file: the LoRA changes the picture, and both agree."""
    pytest.importorskip("peft")
    tmp, paths = files
    raw = random_lora(P, MODULES[:-1], rank=4, seed=7)
    sd, meta = lora_state_dict(raw, "ai-toolkit")
    lora_file = save_adapter(sd, tmp / "ai_toolkit_lora.safetensors", meta)
    fused = diffusers_fused_weights(paths[0], lora_file, P, tmp / "config")
    state = load_file(str(paths[0]))
    state.update({m + ".weight": w for m, w in fused.items()})
    (tmp / "fused").mkdir()
    fused_file = save_bfl_transformer(state, tmp / "fused" / "flux-2-klein-tiny.safetensors")
    args = {"width": 32, "height": 32, "steps": 2, "seed": 3}

    models = pipeline.load_models(*paths, device="cpu", dtype=torch.float32)
    plain = pipeline.generate(models, "a fox", **args).latents
    (line,) = pipeline.apply_adapters(models, [(lora_file, 1.0)])
    assert "ai_toolkit_lora.safetensors: lora" in line and "double blocks" in line and "(strength 1)" in line
    ours = pipeline.generate(models, "a fox", **args).latents
    theirs = pipeline.generate(pipeline.load_models(fused_file, *paths[1:], device="cpu", dtype=torch.float32),
                               "a fox", **args).latents
    assert (ours - plain).abs().max() > 1e-3 * plain.abs().max()
    assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()
    pipeline.apply_adapters(models, [])
    assert torch.equal(pipeline.generate(models, "a fox", **args).latents, plain)


@pytest.mark.slow
def test_cli_lora_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    raw = random_lora(DEMO_TRANSFORMER, ["double_blocks.0.img_attn.qkv", "single_blocks.1.linear1"], rank=2, seed=1)
    path = save_adapter(lora_state_dict(raw, "kohya", alpha=1.0)[0], tmp_path / "style.safetensors")
    argv = ["--demo", "--prompt", "a red fox", "--seed", "3", "--width", "64", "--height", "64", "--steps", "1"]
    assert cli.main([*argv, "--out", "plain"]) == 0
    assert cli.main([*argv, "--out", "lora", "--lora", f"{path}:3"]) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "LoRA style.safetensors: lora" in err and "(strength 3)" in err
    with Image.open(tmp_path / "lora" / "flux2_3.png") as image:
        assert json.loads(image.text["parameters"])["loras"] == [{"file": "style.safetensors", "strength": 3.0}]
    a, b = (np.asarray(Image.open(tmp_path / d / "flux2_3.png"), dtype=np.int16) for d in ("plain", "lora"))
    assert np.abs(a - b).mean() > 0                                          # it changed the picture
    assert cli.main([*argv, "--lora", str(tmp_path / "missing.safetensors")]) == 2
    assert "missing.safetensors: no such file" in capsys.readouterr().err
    assert cli.main([*argv, "--lora", f"{path}:nan"]) == 2
    assert "the strength must be a finite number" in capsys.readouterr().err
    seen = []
    original = pipeline.apply_adapters
    monkeypatch.setattr(pipeline, "apply_adapters", lambda *a, **kw: seen.append(kw.get("merge")) or original(*a, **kw))
    for flags in ([], ["--lora-merge"]):
        assert cli.main([*argv, "--fp8", "--lora", str(path), *flags, "--out", "fp8"]) == 0
    assert seen == [None, True]                       # fp8 layers: a branch, unless asked to merge
    assert cli.lora_argument("C:\\loras\\x.safetensors") == ("C:\\loras\\x.safetensors", 1.0)
    assert cli.lora_argument("x.safetensors:0.5") == ("x.safetensors", 0.5)


def test_adapters_on_a_streamed_model_equal_the_resident_one():
    """Block streaming swaps a streamed block's weights for device copies while it runs and back after; merged
    patches live in the stored weights, branches run where the layer computes. (CPU 'device': the placement logic.)"""
    from flux2_core.runtime import offload

    a, _, _ = lora(1)
    patches = [(p, 0.6) for p in a.patches]
    for merge in (None, False):
        resident, streamed = tiny_model(), tiny_model()
        sizes = [memory.module_bytes(b) for b in [*streamed.double_blocks, *streamed.single_blocks]]
        offload.stream_blocks(streamed, "cpu", memory.module_bytes(streamed) - sum(sizes) + 2 * max(sizes))
        assert offload.streamed_blocks(streamed)
        set_adapters(resident, patches, merge=merge)
        set_adapters(streamed, patches, merge=merge)
        want = forward(resident)
        assert torch.equal(forward(streamed), want) and torch.equal(forward(streamed), want)   # and still after a run
        set_adapters(streamed, [])
        assert torch.equal(forward(streamed), forward(tiny_model()))


@pytest.mark.slow
@pytest.mark.usefixtures("plain_ops")
def test_compiled_fp8_model_follows_adapter_changes():
    """fp8 layers take LoRAs as forward hooks; blocks compiled before or after a change must run the current ones
    (dynamo would otherwise keep the hooks it first saw: a silently stale LoRA)."""
    from torch._dynamo.testing import CompileCounter

    from flux2_core.runtime.compile import compile_blocks

    a, _, _ = lora(1)

    def fp8_model():
        model = tiny_model()
        quant.quantize_transformer(model, quantizable)
        return model

    torch._dynamo.reset()
    eager, compiled = fp8_model(), fp8_model()
    compile_blocks(compiled, backend=CompileCounter())
    try:
        for strengths in ([], [0.9], [2.0], [0.9, -0.4], []):           # add, change, stack, remove
            patches = [(p, s) for s in strengths for p in a.patches]
            set_adapters(eager, patches, key=tuple(strengths))
            set_adapters(compiled, patches, key=tuple(strengths))
            assert torch.equal(forward(compiled), forward(eager)), strengths
    finally:
        torch._dynamo.reset()
