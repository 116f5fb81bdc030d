"""Adapter files -> patches (flux2_core/adapters/lora.py) on tiny random weights, float32.

Expectations come from outside the module: diffusers 0.42.1 loading and fusing the same file (its own converters),
ΔW written out here in plain torch from the documented math, and the same adapter written in every format.
"""

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flux2_core.adapters.formats import linear_shapes
from flux2_core.adapters.lora import read_adapter
from flux2_core.errors import Flux2Error
from flux2_core.families.flux2.variants import KLEIN_4B, KLEIN_9B
from tests.tiny.adapters import (
    LORA_FORMATS,
    adapter_state_dict,
    diffusers_fused_weights,
    lora_state_dict,
    module_shapes,
    near_square,
    random_lokr,
    random_lora,
    save_adapter,
)
from tests.tiny.layouts import write_pickle_checkpoint
from tests.tiny.transformer import TINY_TRANSFORMER as P
from tests.tiny.transformer import random_bfl_transformer_state_dict, save_bfl_transformer

H, M = P.hidden_size, P.mlp_hidden
EPS = torch.finfo(torch.float32).eps
MODULES = list(module_shapes(P))
BLOCK_MODULES = [m for m in MODULES if "blocks." in m]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def kron(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Kronecker product by its definition: out[i1·b1 + i2, j1·b2 + j2] = a[i1, j1] · b[i2, j2]."""
    return (a[:, None, :, None] * b[None, :, None, :]).reshape(a.shape[0] * b.shape[0], a.shape[1] * b.shape[1])


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    weights = {k.removesuffix(".weight"): v for k, v in random_bfl_transformer_state_dict(P, seed=0).items()}
    path = save_bfl_transformer({k + ".weight" if k in MODULES else k: v for k, v in weights.items()},
                                folder / "flux-2-klein-tiny.safetensors")
    return weights, path


def merge(adapter, weights, strength=1.0):
    """Every patch merged, in order, into a copy of our weights (what the layer seam will do)."""
    out = {m: weights[m].clone() for m in MODULES}
    for p in adapter.patches:
        rows = slice(*p.rows) if p.rows else slice(None)
        out[p.target][rows] = p.merged(out[p.target][rows], strength)
    return out


def test_linear_shapes_are_the_transformers():
    from flux2_core.families.flux2.transformer import Flux2Transformer

    for params in (P, KLEIN_4B, KLEIN_9B):
        with torch.device("meta"):
            model = Flux2Transformer(params)
        want = {k.removesuffix(".weight"): tuple(v.shape) for k, v in model.state_dict().items() if v.dim() == 2}
        assert linear_shapes(params) == want
    # hand-computed for Klein 4B (hidden 3072, MLP 9216, 5 double and 20 single blocks, 7680-wide text)
    shapes = linear_shapes(KLEIN_4B)
    assert len(shapes) == 4 + 3 + 5 * 2 * 4 + 20 * 2 + 2
    assert (shapes["txt_in"], shapes["single_blocks.19.linear1"], shapes["single_blocks.19.linear2"]) == (
        (3072, 7680), (3 * 3072 + 2 * 9216, 3072), (3072, 3072 + 9216))
    assert (shapes["double_blocks.4.txt_mlp.0"], shapes["double_stream_modulation_img.lin"]) == (
        (2 * 9216, 3072), (6 * 3072, 3072))


# ---------------------------------------------------------------------------------------------------------------
# (1) diffusers 0.42.1 as the oracle, for the formats it reads
# ---------------------------------------------------------------------------------------------------------------
# kohya's diffusers converter knows the blocks and these extras only (it warns about and drops the rest); diffusers'
# ai-toolkit converter maps final_layer.adaLN_modulation.1 to norm_out.linear without swapping the halves of lora_B
# (its base weight is swapped, so that LoRA lands on the wrong rows there): left out of that case.
KOHYA_EXTRAS = ["img_in", "txt_in", "time_in.in_layer", "time_in.out_layer", "final_layer.linear"]
LOKR_MODULES = ["double_blocks.0.img_attn.qkv", "double_blocks.1.txt_attn.qkv", "double_blocks.0.img_mlp.0",
                "double_blocks.1.txt_mlp.2", "single_blocks.0.linear1", "single_blocks.1.linear2"]


def lokr_file(decompose, alpha):
    shapes = module_shapes(P)
    modules = {m: random_lokr(shapes[m], decompose, rank=2, seed=i) for i, m in enumerate(LOKR_MODULES)}
    for m in modules.values():
        m["alpha"] = torch.tensor(alpha)
    return adapter_state_dict(modules, "diffusion_model."), {}


def lycoris_lokr_file():
    """D′: LyCORIS on the diffusers model (SimpleTuner), q/k/v separate, "." -> "_" behind lycoris_."""
    modules = {"transformer_blocks.0.attn.to_q": random_lokr((H, H), (), seed=1),
               "transformer_blocks.1.attn.add_v_proj": random_lokr((H, H), (), seed=2),
               "transformer_blocks.0.ff.linear_in": random_lokr((2 * M, H), (), seed=3),
               "transformer_blocks.1.ff_context.linear_out": random_lokr((H, M), (), seed=4),
               "single_transformer_blocks.0.attn.to_qkv_mlp_proj": random_lokr((3 * H + 2 * M, H), (), seed=5),
               "single_transformer_blocks.1.attn.to_out": random_lokr((H, H + M), (), seed=6)}
    return adapter_state_dict(modules, "lycoris_", underscore=True), {}


DIFFUSERS_CASES = {
    "ai-toolkit, no alpha": lambda: lora_state_dict(
        random_lora(P, [m for m in MODULES if m != "final_layer.adaLN_modulation.1"], 4, seed=1), "ai-toolkit"),
    "kohya, alpha 2 (s = 0.5)": lambda: lora_state_dict(
        random_lora(P, BLOCK_MODULES + KOHYA_EXTRAS, 4, seed=2), "kohya", alpha=2.0),
    "diffusers PEFT, metadata alpha 8 (s = 2)": lambda: lora_state_dict(
        random_lora(P, MODULES, 4, seed=3), "diffusers", alpha=8.0),
    "LoKr full factors (alpha unused)": lambda: lokr_file((), 7.0),
    "LoKr decomposed w2 (s = alpha/rank)": lambda: lokr_file(("w2",), 3.0),
    "LyCORIS LoKr on diffusers names": lycoris_lokr_file,
}


@pytest.mark.parametrize("case", list(DIFFUSERS_CASES))
def test_fused_weights_match_diffusers(case, base, tmp_path):
    pytest.importorskip("peft")
    weights, bfl_file = base
    sd, meta = DIFFUSERS_CASES[case]()
    path = save_adapter(sd, tmp_path / "adapter.safetensors", meta)
    theirs = diffusers_fused_weights(bfl_file, path, P, tmp_path / "config")
    ours = merge(read_adapter(path, P), weights)
    changed = [m for m in MODULES if not torch.equal(theirs[m], weights[m])]
    assert len(changed) >= 6                                      # the adapter did something there
    for m in MODULES:
        assert rel_err(ours[m], theirs[m]) <= 1e-5, m


# ---------------------------------------------------------------------------------------------------------------
# (2) hand-computed ΔW
# ---------------------------------------------------------------------------------------------------------------
def only_patch(sd, meta=None, **kw):
    adapter = read_adapter(sd, P, metadata=meta, **kw)
    assert len(adapter.patches) == 1
    return adapter.patches[0]


@pytest.mark.parametrize(("alpha", "scale"), [(None, 1.0), (2.0, 0.5), (12.0, 3.0)])
def test_lora_alpha_rule(alpha, scale):
    down, up = torch.randn(4, H), torch.randn(H, 4)
    sd = {"lora_unet_double_blocks_0_img_attn_proj.lora_down.weight": down,
          "lora_unet_double_blocks_0_img_attn_proj.lora_up.weight": up}
    if alpha is not None:
        sd["lora_unet_double_blocks_0_img_attn_proj.alpha"] = torch.tensor(alpha)
    p = only_patch(sd)
    assert p.scale == scale
    assert torch.allclose(p.delta(), scale * (up @ down), rtol=1e-6, atol=1e-6)


def test_peft_metadata_alpha_pattern_and_rslora():
    down, up = torch.randn(4, H), torch.randn(H, 4)
    sd = {"transformer.transformer_blocks.0.attn.to_out.0.lora_A.weight": down,
          "transformer.transformer_blocks.0.attn.to_out.0.lora_B.weight": up,
          "transformer.single_transformer_blocks.1.attn.to_out.lora_A.weight": torch.randn(4, H + M),
          "transformer.single_transformer_blocks.1.attn.to_out.lora_B.weight": up}
    config = {"transformer.r": 4, "transformer.lora_alpha": 8,
              "transformer.alpha_pattern": {"^single_transformer_blocks.1.attn.to_out": 2}}
    adapter = read_adapter(sd, P, metadata={"lora_adapter_metadata": json.dumps(config)})
    scales = {p.target: p.scale for p in adapter.patches}
    assert scales == {"double_blocks.0.img_attn.proj": 2.0, "single_blocks.1.linear2": 0.5}
    rs = read_adapter(sd, P, metadata={"lora_adapter_metadata": json.dumps({"lora_alpha": 8, "use_rslora": True})})
    assert {p.scale for p in rs.patches} == {4.0}                  # 8 / sqrt(4)


@pytest.mark.parametrize(("decompose", "ranks", "scale"), [((), (2, 2), 1.0), (("w1",), (3, 2), 6.0 / 3),
                                                           (("w2",), (2, 3), 6.0 / 3), (("w1", "w2"), (2, 3), 6.0 / 3)])
def test_lokr_delta_and_scale_rule(decompose, ranks, scale):
    """alpha counts only when a factor is decomposed; rank = w2_b's rows, else w1_b's (LyCORIS/ComfyUI/diffusers)."""
    g = torch.Generator().manual_seed(5)
    out, inp = 3 * H, H                                            # img_attn.qkv [192, 64] = kron([12, 8], [16, 8])
    t = {}
    w = {}
    for name, (r, c), rank in (("w1", (12, 8), ranks[0]), ("w2", (16, 8), ranks[1])):
        if name in decompose:
            a, b = torch.randn(r, rank, generator=g), torch.randn(rank, c, generator=g)
            t[f"lokr_{name}_a"], t[f"lokr_{name}_b"], w[name] = a, b, a @ b
        else:
            t[f"lokr_{name}"] = w[name] = torch.randn(r, c, generator=g)
    t["alpha"] = torch.tensor(6.0)
    p = only_patch(adapter_state_dict({"double_blocks.0.img_attn.qkv": t}))
    want = scale * kron(w["w1"], w["w2"])
    assert want.shape == (out, inp) and p.kind == "lokr" and p.scale == scale
    assert torch.allclose(p.delta(), want, rtol=1e-5, atol=1e-6)


def test_loha_delta():
    g = torch.Generator().manual_seed(6)
    t = {"hada_w1_a": torch.randn(H, 4, generator=g), "hada_w1_b": torch.randn(4, M, generator=g),
         "hada_w2_a": torch.randn(H, 4, generator=g), "hada_w2_b": torch.randn(4, M, generator=g),
         "alpha": torch.tensor(2.0)}
    p = only_patch(adapter_state_dict({"double_blocks.1.img_mlp.2": t}))
    want = 0.5 * (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"])
    assert p.target == "double_blocks.1.img_mlp.2" and torch.allclose(p.delta(), want, rtol=1e-5, atol=1e-6)


def test_diff_delta(base):
    weights, _ = base
    diff = torch.randn(H, H + M)
    adapter = read_adapter(adapter_state_dict({"single_blocks.0.linear2": {"diff": diff}}), P)
    assert torch.allclose(merge(adapter, weights)["single_blocks.0.linear2"], weights["single_blocks.0.linear2"] + diff)


@pytest.mark.parametrize("axis", ["out", "in"])
@pytest.mark.parametrize("strength", [1.0, 0.5])
def test_dora(base, axis, strength):
    """W' = m · (W + sΔW) / ‖W + sΔW‖ (norm of the merged weight, per output row or input column, LyCORIS), and
    W + strength·(W' − W); ComfyUI's quirk divides by the original W's row norms for the output axis."""
    weights, _ = base
    W = weights["double_blocks.0.img_attn.proj"]
    down, up = torch.randn(4, H), 0.1 * torch.randn(H, 4)
    m = 0.5 + torch.rand(H, 1) if axis == "out" else 0.5 + torch.rand(1, H)
    sd = adapter_state_dict({"double_blocks.0.img_attn.proj": {"lora_A.weight": down, "lora_B.weight": up,
                                                               "alpha": torch.tensor(2.0), "dora_scale": m}})
    p = only_patch(sd)
    Wc = W + 0.5 * up @ down
    dim = 1 if axis == "out" else 0
    norm = Wc.pow(2).sum(dim=dim, keepdim=True).sqrt()
    want = W + strength * (m * Wc / (norm + EPS) - W)
    assert torch.allclose(p.merged(W, strength), want, rtol=1e-5, atol=1e-6)
    quirk_norm = W.pow(2).sum(dim=1, keepdim=True).sqrt() if axis == "out" else norm
    assert torch.allclose(p.dora_factor(W, comfyui_quirk=True), m / (quirk_norm + EPS), rtol=1e-5)
    # at run time, without merging: the factor scales outputs (out axis) or inputs (in axis)
    x = torch.randn(3, H)
    y = (x @ Wc.T) * p.dora_factor(W).T if axis == "out" else (x * p.dora_factor(W)) @ Wc.T
    assert torch.allclose(y, x @ p.merged(W).T, rtol=1e-4, atol=1e-5)


def test_split_qkv_rows_and_swapped_halves(base):
    weights, _ = base
    down, up = torch.randn(4, H), torch.randn(H, 4)
    mod_down, mod_up = torch.randn(4, H), torch.randn(2 * H, 4)
    sd = {"transformer.transformer_blocks.1.attn.add_k_proj.lora_A.weight": down,
          "transformer.transformer_blocks.1.attn.add_k_proj.lora_B.weight": up,
          "transformer.norm_out.linear.lora_A.weight": mod_down, "transformer.norm_out.linear.lora_B.weight": mod_up}
    adapter = read_adapter(sd, P)
    merged = merge(adapter, weights)
    qkv = weights["double_blocks.1.txt_attn.qkv"].clone()
    qkv[H:2 * H] += up @ down                                      # k rows only
    assert torch.allclose(merged["double_blocks.1.txt_attn.qkv"], qkv, atol=1e-5)
    delta = mod_up @ mod_down                                      # diffusers rows (scale, shift) -> ours (shift, scale)
    want = weights["final_layer.adaLN_modulation.1"] + torch.cat([delta[H:], delta[:H]])
    assert torch.allclose(merged["final_layer.adaLN_modulation.1"], want, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# (3) one adapter, every format: the same fused weights
# ---------------------------------------------------------------------------------------------------------------
def test_every_lora_format_gives_the_same_weights(base):
    weights, _ = base
    lora = random_lora(P, MODULES, rank=4, seed=9)
    want = {m: weights[m] + 0.5 * lora[m][1] @ lora[m][0] for m in MODULES}      # alpha 2, rank 4
    for fmt in LORA_FORMATS:
        sd, meta = lora_state_dict(lora, fmt, alpha=2.0)
        got = merge(read_adapter(sd, P, metadata=meta), weights)
        for m in MODULES:
            assert rel_err(got[m], want[m]) <= 1e-6, (fmt, m)


def test_lycoris_diffusers_named_lokr_equals_bfl_lokr_on_the_rows(base):
    """D′ (lycoris_, separate q/k/v) lands on rows of the fused weight; D (BFL names) on the whole of it."""
    weights, _ = base
    q = random_lokr((H, H), ("w2",), seed=1) | {"alpha": torch.tensor(4.0)}
    mlp = random_lokr((2 * M, H), (), seed=2)
    sd = adapter_state_dict({"transformer_blocks.0.attn.to_q": q, "transformer_blocks.0.ff.linear_in": mlp},
                            "lycoris_", underscore=True)
    merged = merge(read_adapter(sd, P), weights)
    w1, w2 = q["lokr_w1"], q["lokr_w2_a"] @ q["lokr_w2_b"]
    qkv = weights["double_blocks.0.img_attn.qkv"].clone()
    qkv[:H] += 2.0 * kron(w1, w2)                                  # alpha 4 / rank 2
    assert torch.allclose(merged["double_blocks.0.img_attn.qkv"], qkv, atol=1e-5)
    assert torch.allclose(merged["double_blocks.0.img_mlp.0"],
                          weights["double_blocks.0.img_mlp.0"] + kron(mlp["lokr_w1"], mlp["lokr_w2"]), atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# branch(x) == x @ ΔWᵀ for every kind
# ---------------------------------------------------------------------------------------------------------------
def test_branch_equals_delta():
    g = torch.Generator().manual_seed(3)
    loha = {"hada_w1_a": torch.randn(H, 2, generator=g), "hada_w1_b": torch.randn(2, H, generator=g),
            "hada_w2_a": torch.randn(H, 2, generator=g), "hada_w2_b": torch.randn(2, H, generator=g)}
    sd = adapter_state_dict({
        "double_blocks.0.img_attn.qkv": random_lokr((3 * H, H), (), seed=1),
        "single_blocks.0.linear1": random_lokr((3 * H + 2 * M, H), ("w1", "w2"), seed=2) | {"alpha": torch.tensor(3.)},
        "double_blocks.0.txt_attn.proj": loha,
        "single_blocks.1.linear2": {"diff": torch.randn(H, H + M, generator=g)},
        "double_blocks.1.img_mlp.0": {"lora_down.weight": torch.randn(3, H, generator=g),
                                      "lora_up.weight": torch.randn(2 * M, 3, generator=g), "alpha": torch.tensor(1.)},
    }) | adapter_state_dict({"norm_out.linear": random_lokr((2 * H, H), (), seed=4),
                             "transformer_blocks.1.attn.to_v": {"lora_A.weight": torch.randn(2, H, generator=g),
                                                                "lora_B.weight": torch.randn(H, 2, generator=g)}},
                            "transformer.")
    adapter = read_adapter(sd, P)
    assert sorted(p.kind for p in adapter.patches) == ["diff", "loha", "lokr", "lokr", "lokr", "lora", "lora"]
    for p in adapter.patches:
        x = torch.randn(2, 3, p.shape[1], generator=g)
        assert torch.allclose(p.branch(x), x @ p.delta().T, rtol=1e-4, atol=1e-4), (p.source, p.kind)


# ---------------------------------------------------------------------------------------------------------------
# (4) the match report
# ---------------------------------------------------------------------------------------------------------------
def test_match_report_counts_and_unmatched_keys():
    lora = random_lora(P, ["double_blocks.0.img_attn.qkv", "double_blocks.1.img_mlp.2", "single_blocks.0.linear1",
                           "txt_in", "final_layer.linear"], rank=2)
    sd, _ = lora_state_dict(lora, "kohya", alpha=1.0)                # 3 tensors a module
    te = {"lora_te_model_layers_0_self_attn_q_proj.lora_down.weight": torch.randn(2, 32),
          "lora_te_model_layers_0_self_attn_q_proj.lora_up.weight": torch.randn(32, 2),
          "text_encoders.qwen3_4b.transformer.model.layers.3.mlp.down_proj.lora_A.weight": torch.randn(2, 64),
          "text_encoders.qwen3_4b.transformer.model.layers.3.mlp.down_proj.lora_B.weight": torch.randn(32, 2)}
    junk = {"lora_unet_double_blocks_0_img_attn_norm_query_norm.lora_down.weight": torch.randn(2, 16),
            "some_training_step": torch.tensor(100), "lora_unet_txt_in.alpha_extra": torch.tensor(1.0),
            "lora_unet_img_in.alpha": torch.tensor(1.0)}
    adapter = read_adapter(sd | te | junk, P, name="mixed.safetensors")
    report = adapter.report
    assert report.tensors == {"double blocks": 6, "single blocks": 3, "other": 6, "text encoder": 4}
    assert report.modules == {"double blocks": 2, "single blocks": 1, "other": 2, "text encoder": 2}
    assert set(report.unmatched) == set(junk)
    assert report.unmatched["lora_unet_img_in.alpha"] == "an alpha or dora_scale without adapter weights"
    assert {p.target for p in adapter.text_encoder_patches} == {"layers.0.self_attn.q_proj", "layers.3.mlp.down_proj"}
    assert len(adapter.patches) == 5
    line = report.summary()
    assert line.startswith("mixed.safetensors: lora (kohya/musubi (lora_unet_); text encoder")
    assert "19 tensors in 7 modules: double blocks 6, single blocks 3, other 6, text encoder 4" in line
    assert "4 keys matched nothing: " in line and "some_training_step" in line
    assert "and 1 more" in read_adapter(sd | junk, P).report.summary(limit=3)


def test_text_encoder_keys_checked_against_the_encoder():
    te = {"text_encoder.model.layers.1.self_attn.k_proj.lora_A.weight": torch.randn(2, 32),
          "text_encoder.model.layers.1.self_attn.k_proj.lora_B.weight": torch.randn(16, 2),
          "text_encoder.model.layers.30.self_attn.k_proj.lora_A.weight": torch.randn(2, 32),
          "text_encoder.model.layers.30.self_attn.k_proj.lora_B.weight": torch.randn(16, 2)}
    keys = {"layers.1.self_attn.k_proj.weight": (16, 32), "layers.1.self_attn.q_proj.weight": (32, 32)}
    adapter = read_adapter(te, P, text_encoder_keys=keys)
    assert [p.target for p in adapter.text_encoder_patches] == ["layers.1.self_attn.k_proj"]
    assert set(adapter.report.unmatched.values()) == {"a text-encoder layer this encoder does not have"}
    with pytest.raises(Flux2Error, match=r"\[16, 32\] but layers.1.self_attn.k_proj is \[8, 32\]"):
        read_adapter(te, P, text_encoder_keys={"layers.1.self_attn.k_proj.weight": torch.zeros(8, 32)})


# ---------------------------------------------------------------------------------------------------------------
# (5) bad input
# ---------------------------------------------------------------------------------------------------------------
def lora_keys(*paths, down=(2, H), up=(H, 2)):
    return {k: v for p in paths for k, v in ((f"{p}.lora_down.weight", torch.randn(*down)),
                                             (f"{p}.lora_up.weight", torch.randn(*up)))}


@pytest.mark.parametrize(("keys", "family"), [
    (lora_keys("lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_double_blocks_0_img_mod_lin"), "FLUX.1"),
    (lora_keys("diffusion_model.single_blocks.0.modulation.lin"), "FLUX.1"),
    (lora_keys("transformer.single_transformer_blocks.0.proj_mlp"), "FLUX.1"),
    (lora_keys("lora_unet_down_blocks_0_attentions_0_proj_in"), "Stable Diffusion"),
    (lora_keys("lora_te1_text_model_encoder_layers_0_mlp_fc1"), "Stable Diffusion"),
    (lora_keys("diffusion_model.blocks.0.self_attn.q", "diffusion_model.blocks.0.cross_attn.k"), "Wan"),
    (lora_keys("transformer.transformer_blocks.0.attn.to_q", "transformer.transformer_blocks.0.img_mod.1"),
     "Qwen-Image"),
])
def test_other_model_families_are_named(keys, family):
    with pytest.raises(Flux2Error, match=f"is an adapter for {family}"):
        read_adapter(keys, P)


def test_9b_lora_on_4b_names_both():
    sd = lora_keys("diffusion_model.double_blocks.0.img_attn.qkv", down=(1, 4096), up=(3 * 4096, 1))
    with pytest.raises(Flux2Error, match=r"made for Klein 9B \(hidden 4096\); the model is Klein 4B \(3072\)") as e:
        read_adapter(sd, KLEIN_4B)
    assert "[12288, 4096]" in str(e.value) and "[9216, 3072]" in str(e.value)


def test_flux1_mlp_width_is_named():
    sd = lora_keys("diffusion_model.single_blocks.0.linear1", up=(7 * H, 2))
    with pytest.raises(Flux2Error, match="FLUX.1's"):
        read_adapter(sd, P)


def test_blocks_the_model_lacks():
    sd = lora_keys("lora_unet_double_blocks_1_img_attn_proj", "lora_unet_double_blocks_7_img_attn_proj",
                   "lora_unet_single_blocks_23_linear2")
    with pytest.raises(Flux2Error, match="targets block 7 of the double_blocks.*probably made for Klein 9B"):
        read_adapter(sd, P)


def test_blocks_only_flux1_has_are_named():
    """An attention-only FLUX.1 LoRA (no modulation keys to tell it by): its block indices go past every FLUX.2
    model's (19 double, 38 single blocks in FLUX.1)."""
    sd = lora_keys("lora_unet_double_blocks_18_img_attn_proj", "lora_unet_single_blocks_37_linear2")
    with pytest.raises(Flux2Error, match="targets block 18 of the double_blocks.*probably made for FLUX.1"):
        read_adapter(sd, P)


@pytest.mark.parametrize(("sd", "message"), [
    (lora_keys("diffusion_model.img_in", down=(3, 128), up=(H, 2)), "ranks 2 and 3 differ"),
    ({"diffusion_model.img_in.lora_A.weight": torch.randn(2, 128)}, "no up tensor"),
    (adapter_state_dict({"img_in": {"lokr_w1": torch.randn(8, 8), "lokr_w2_a": torch.randn(8, 2)}}), "no w2_b"),
    (adapter_state_dict({"img_in": random_lokr((H, 128)) | {"lokr_t2": torch.randn(2, 2, 3, 3)}}), "convolutions"),
    (adapter_state_dict({"img_in": {"diff": torch.randn(H, 128), "diff_b": torch.randn(H)}}), "no bias"),
    (adapter_state_dict({"img_in": {"lora_A.weight": torch.randn(2, 128), "lora_B.weight": torch.randn(H, 2),
                                    "dora_scale": torch.randn(H, 2)}}), "dora_scale has shape"),
    (adapter_state_dict({"img_in": {"lora_A.weight": torch.randn(2, 128), "lora_B.weight": torch.randn(H, 2),
                                    "lokr_w1": torch.randn(2, 2)}}), "mixes lora and lokr"),
    ({"foo.weight": torch.randn(2, 2), "bar.lora_A.weight": torch.randn(2, 2)}, "none of its 2 keys"),
])
def test_bad_adapters(sd, message):
    with pytest.raises(Flux2Error, match=message):
        read_adapter(sd, P)


def test_bad_files(tmp_path):
    marker = tmp_path / "pickle-ran"
    with pytest.raises(Flux2Error, match="pickle"):
        read_adapter(write_pickle_checkpoint(tmp_path / "lora.pt", marker), P)
    assert not marker.exists()
    garbage = tmp_path / "lora.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(Flux2Error, match="not a valid .safetensors"):
        read_adapter(garbage, P)
    good = save_adapter(lora_keys("diffusion_model.img_in", down=(2, 128)), tmp_path / "good.safetensors")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(Flux2Error, match="truncated"):
        read_adapter(cut, P)
    with pytest.raises(Flux2Error, match="does not exist"):
        read_adapter(tmp_path / "missing.safetensors", P)
    assert read_adapter(good, P).report.name == "good.safetensors"


ADAPTER_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int32, torch.bool]


@st.composite
def one_module_adapter(draw):
    """A LoRA (or LoKr) for one linear layer of the tiny model, each of its tensors drawn with any shape, dtype and
    values: the right ones, off by one, another rank, a 3-D factor, NaN / inf, integers, an alpha that is not a
    scalar."""
    module = draw(st.sampled_from(MODULES))
    out, inp = module_shapes(P)[module]
    rank = draw(st.integers(1, 4))

    def tensor(shape):
        shape = draw(st.sampled_from([shape, (shape[0] + 1, *shape[1:]), (*shape[:-1], shape[-1] + 1),
                                      (*shape, 2), (0, *shape[1:])]))
        dtype = draw(st.sampled_from(ADAPTER_DTYPES))
        values = torch.randn(shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
        spoil = draw(st.sampled_from([None, None, None, float("nan"), float("inf")]))
        if spoil is not None and values.numel():
            values.view(-1)[draw(st.integers(0, values.numel() - 1))] = spoil
        return values.to(dtype) if dtype.is_floating_point else (values * 10).to(dtype)

    if draw(st.booleans()):
        tensors = {"lora_A.weight": tensor((rank, inp)), "lora_B.weight": tensor((out, rank))}
    else:
        tensors = {"lokr_w1": tensor(near_square(out)[:1] + near_square(inp)[:1]),
                   "lokr_w2": tensor((out // near_square(out)[0], inp // near_square(inp)[0]))}
    if draw(st.booleans()):
        tensors["alpha"] = tensor(draw(st.sampled_from([(1,), (2,), (rank, rank)]))).reshape(-1)
    if draw(st.booleans()):
        tensors["dora_scale"] = tensor((out, 1))
    return module, out, inp, adapter_state_dict({module: tensors})


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(one_module_adapter())
def test_any_adapter_tensor_reads_as_a_fitting_finite_patch_or_a_message(case):
    """Whatever an adapter file holds for a layer, reading it gives a patch of exactly that layer's shape whose ΔW
    is finite, or a Flux2Error that names the file and says what is wrong: never another exception."""
    _, out, inp, sd = case
    try:
        adapter = read_adapter(sd, P, name="fuzzed.safetensors")
    except Flux2Error as error:
        assert str(error).startswith("fuzzed.safetensors") or "fuzzed.safetensors" in str(error)
        return
    (patch,) = adapter.patches
    rows = patch.rows[1] - patch.rows[0] if patch.rows else out
    assert patch.shape == (rows, inp)
    assert bool(torch.isfinite(patch.merged(torch.zeros(patch.shape), 1.0)).all())


@pytest.mark.parametrize("stream,fused", [("img_attn", "to_qkv"), ("txt_attn", "to_added_qkv")])
def test_diffusers_fused_qkv_names_cover_the_whole_fused_weight(base, stream, fused):
    """diffusers' fused names (transformer.transformer_blocks.N.attn.to_qkv / to_added_qkv, which diffusers itself
    writes back for an adapter loaded on fused projections) patch all of our fused qkv weight: the same weights as
    the split to_q / to_k / to_v LoRA with the up matrix cut in three, which the other formats' tests prove equal to
    diffusers' own fusing."""
    weights, _ = base
    module = f"double_blocks.1.{stream}.qkv"
    (down, up), = random_lora(P, [module], rank=4, seed=11).values()
    split_names = ("to_q", "to_k", "to_v") if stream == "img_attn" else ("add_q_proj", "add_k_proj", "add_v_proj")
    fused_sd = {f"transformer.transformer_blocks.1.attn.{fused}.lora_A.weight": down,
                f"transformer.transformer_blocks.1.attn.{fused}.lora_B.weight": up}
    split_sd = {}
    for name, rows in zip(split_names, up.chunk(3)):
        split_sd |= {f"transformer.transformer_blocks.1.attn.{name}.lora_A.weight": down,
                     f"transformer.transformer_blocks.1.attn.{name}.lora_B.weight": rows}
    fused_adapter = read_adapter(fused_sd, P)
    assert [p.target for p in fused_adapter.patches] == [module] and fused_adapter.patches[0].rows is None
    assert "diffusers names" in fused_adapter.report.summary() and not fused_adapter.report.unmatched
    got, want = merge(fused_adapter, weights), merge(read_adapter(split_sd, P), weights)
    assert rel_err(got[module], want[module]) <= 1e-6
    assert rel_err(got[module], weights[module] + up @ down) <= 1e-6          # no alpha: scale 1


def test_peft_metadata_gives_each_model_its_own_alpha_as_peft_does():
    """diffusers' lora_adapter_metadata with a config per model (transformer., text_encoder.): each patch takes its
    own model's lora_alpha and alpha_pattern; the scales are what peft itself sets on layers of those names."""
    from peft import LoraConfig, inject_adapter_in_model

    configs = {"transformer": {"r": 4, "lora_alpha": 8, "target_modules": ["to_out"]},
               "text_encoder": {"r": 4, "lora_alpha": 16, "alpha_pattern": {"k_proj": 2},
                                "target_modules": ["q_proj", "k_proj"]}}
    te = "text_encoder.model.layers.0.self_attn"
    sd = {"transformer.transformer_blocks.0.attn.to_out.0.lora_A.weight": torch.randn(4, H),
          "transformer.transformer_blocks.0.attn.to_out.0.lora_B.weight": torch.randn(H, 4),
          f"{te}.q_proj.lora_A.weight": torch.randn(4, 8), f"{te}.q_proj.lora_B.weight": torch.randn(8, 4),
          f"{te}.k_proj.lora_A.weight": torch.randn(4, 8), f"{te}.k_proj.lora_B.weight": torch.randn(8, 4)}
    meta = {"lora_adapter_metadata": json.dumps({f"{m}.{k}": v for m, c in configs.items() for k, v in c.items()})}
    adapter = read_adapter(sd, P, metadata=meta)
    ours = {p.target: p.scale for p in adapter.patches + adapter.text_encoder_patches}

    def peft_scaling(config: dict, names: list[str]) -> dict[str, float]:
        """peft's own scaling of layers with these names under this config."""
        model = torch.nn.ModuleDict({name: torch.nn.Linear(8, 8) for name in names})
        model = inject_adapter_in_model(LoraConfig(**config), model)
        return {name: model[name].scaling["default"] for name in names}

    theirs = peft_scaling(configs["text_encoder"], ["q_proj", "k_proj"])
    assert ours == {"double_blocks.0.img_attn.proj": peft_scaling(configs["transformer"], ["to_out"])["to_out"],
                    "layers.0.self_attn.q_proj": theirs["q_proj"], "layers.0.self_attn.k_proj": theirs["k_proj"]}
    assert ours["layers.0.self_attn.q_proj"] == 4.0 and ours["layers.0.self_attn.k_proj"] == 0.5
