"""Flux2Transformer against diffusers 0.42.1 on the same tiny random BFL weights.

Ours runs in the device mode's dtype and device (``tests/device.py``; default float32 on the CPU), diffusers in float32
on the same device. Parity bound everywhere: max|ours - diffusers| <= tolerance("transformer") * max|diffusers|
(1e-4 in float32).
"""

import math

import pytest
import torch

from flux2_core.errors import Flux2Error
from flux2_core.families.flux2.transformer import Flux2Transformer
from flux2_core.families.flux2.variants import KLEIN_4B, KLEIN_9B
from flux2_core.models import rope
from flux2_core.models.blocks import timestep_embedding
from flux2_core.models.reference_kv import ReferenceKV
from tests.device import DEVICE, DTYPE, to, tolerance
from tests.tiny.transformer import (
    TINY_TRANSFORMER,
    bfl_transformer_shapes,
    diffusers_transformer_from_bfl_file,
    random_bfl_transformer_state_dict,
    save_bfl_transformer,
)

BOUND = tolerance("transformer")
# A real change of the prediction, one the parity check would catch: 100x the bound in float32; in low precision
# the bound itself (the KV and joint schemes differ by about 3e-2 on these inputs, bf16 noise is about 7e-3).
CHANGES = max(1e-2, BOUND)
BATCH, H, W, TXT_LEN = 2, 3, 4, 8
REF_GRIDS = [(2, 3), (3, 2)]


def rel_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    ours, theirs = ours.float(), theirs.float()
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory):
    sd = random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=0)
    return sd, save_bfl_transformer(sd, tmp_path_factory.mktemp("dit") / "flux-2-klein-tiny.safetensors")


@pytest.fixture(scope="module")
def ours(weights_file):
    model = Flux2Transformer(TINY_TRANSFORMER)
    model.load_state_dict(weights_file[0], strict=True)
    return to(model).eval()


@pytest.fixture(scope="module")
def theirs(weights_file):
    return diffusers_transformer_from_bfl_file(weights_file[1], TINY_TRANSFORMER).to(DEVICE)


@pytest.fixture(scope="module")
def theirs_kv(weights_file):
    """diffusers' model with the KV attention processors, as Flux2KleinKVPipeline sets them."""
    from diffusers.models.transformers.transformer_flux2 import (
        Flux2KVAttnProcessor,
        Flux2KVParallelSelfAttnProcessor,
    )

    model = diffusers_transformer_from_bfl_file(weights_file[1], TINY_TRANSFORMER).to(DEVICE)
    for block in model.transformer_blocks:
        block.attn.set_processor(Flux2KVAttnProcessor())
    for block in model.single_transformer_blocks:
        block.attn.set_processor(Flux2KVParallelSelfAttnProcessor())
    return model


@pytest.fixture(scope="module")
def inputs():
    """The shared inputs in float32 on DEVICE (diffusers' dtype); ours gets them in DTYPE through ``mine``."""
    g = torch.Generator().manual_seed(1)
    img = torch.randn(BATCH, H * W, TINY_TRANSFORMER.in_channels, generator=g)
    txt = torch.randn(BATCH, TXT_LEN, TINY_TRANSFORMER.context_in_dim, generator=g)
    ref = torch.randn(1, sum(h * w for h, w in REF_GRIDS), TINY_TRANSFORMER.in_channels, generator=g)
    x = {"img": img, "img_ids": rope.image_ids(BATCH, H, W), "txt": txt, "txt_ids": rope.text_ids(BATCH, TXT_LEN),
         "ref": ref, "ref_ids": rope.reference_ids(REF_GRIDS)}
    return {k: v.to(DEVICE) for k, v in x.items()}


def mine(x: torch.Tensor) -> torch.Tensor:
    """An input as our model takes it: on DEVICE, floating point in DTYPE (the sampler passes sigmas in it too)."""
    return to(x)


def run_ours(model, x, t, **kwargs):
    """Our forward on the shared inputs in DTYPE; the output must come back in DTYPE."""
    kwargs = {k: mine(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with torch.no_grad():
        out = model(mine(x["img"]), x["img_ids"], mine(t), mine(x["txt"]), x["txt_ids"], **kwargs)
    assert out.dtype == DTYPE and out.device.type == DEVICE.type
    return out


def run_diffusers(model, x, timesteps, hidden_states=None, img_ids=None, **kv_args):
    """diffusers' forward on the shared inputs (image tokens and ids replaceable); returns its output tuple."""
    with torch.no_grad():
        return model(hidden_states=x["img"] if hidden_states is None else hidden_states,
                     img_ids=x["img_ids"] if img_ids is None else img_ids, encoder_hidden_states=x["txt"],
                     txt_ids=x["txt_ids"], timestep=timesteps.to(DEVICE), guidance=None, return_dict=False, **kv_args)


@pytest.mark.parametrize("sigmas", [(1.0, 0.5), (0.9, 0.05), (0.25, 0.0)])
def test_forward_matches_diffusers(ours, theirs, inputs, sigmas):
    t = torch.tensor(sigmas)
    got = run_ours(ours, inputs, t)
    want = run_diffusers(theirs, inputs, t)[0]
    assert got.shape == (BATCH, H * W, TINY_TRANSFORMER.in_channels)
    diff = rel_diff(got, want)
    print(f"plain forward t={sigmas}: max rel diff {diff:.2e}")
    assert diff <= BOUND


def test_joint_references_match_diffusers(ours, theirs, inputs):
    t = torch.tensor([0.8, 0.4])
    # ours broadcasts the batch-1 references; diffusers gets them repeated per item
    got = run_ours(ours, inputs, t, ref=inputs["ref"], ref_ids=inputs["ref_ids"])
    plain = run_ours(ours, inputs, t)
    x = torch.cat([inputs["img"], inputs["ref"].repeat(BATCH, 1, 1)], dim=1)
    ids = torch.cat([inputs["img_ids"], inputs["ref_ids"].repeat(BATCH, 1, 1)], dim=1)
    want = run_diffusers(theirs, inputs, t, hidden_states=x, img_ids=ids)[0][:, : H * W]
    diff = rel_diff(got, want)
    print(f"joint references {REF_GRIDS}: max rel diff {diff:.2e}")
    assert diff <= BOUND
    assert rel_diff(plain, want) > CHANGES   # the references do change the prediction


def test_reference_kv_matches_diffusers_kv_modes(ours, theirs_kv, inputs):
    n_ref = inputs["ref"].shape[1]
    cache = ours.reference_kv(mine(inputs["ref"]), inputs["ref_ids"])
    assert cache.num_tokens == n_ref and cache.batch == 1 and cache.dtype == DTYPE
    assert len(cache.blocks) == TINY_TRANSFORMER.depth + TINY_TRANSFORMER.depth_single_blocks

    # Step 0: diffusers' "extract" runs [ref, img] with reference rows at t = 0 attending only to themselves.
    t0 = torch.tensor([1.0, 1.0])
    x = torch.cat([inputs["ref"].repeat(BATCH, 1, 1), inputs["img"]], dim=1)
    ids = torch.cat([inputs["ref_ids"].repeat(BATCH, 1, 1), inputs["img_ids"]], dim=1)
    want0, their_cache = run_diffusers(theirs_kv, inputs, t0, hidden_states=x, img_ids=ids,
                                       kv_cache_mode="extract", num_ref_tokens=n_ref)
    got0 = run_ours(ours, inputs, t0, ref_kv=cache)
    diff0 = rel_diff(got0, want0)

    # The cached K/V themselves: diffusers stores [B, L, heads, D], ours [1, heads, L, D].
    their_layers = their_cache.double_block_caches + their_cache.single_block_caches
    kv_diff = max(rel_diff(mine.expand(BATCH, -1, -1, -1), theirs_t.transpose(1, 2))
                  for (k, v), layer in zip(cache.blocks, their_layers)
                  for mine, theirs_t in [(k, layer.k_ref), (v, layer.v_ref)])

    # A later step: diffusers' "cached" mode with its extracted cache, ours with the same ReferenceKV.
    t2 = torch.tensor([0.6, 0.6])
    want2 = run_diffusers(theirs_kv, inputs, t2, kv_cache=their_cache, kv_cache_mode="cached")[0]
    got2 = run_ours(ours, inputs, t2, ref_kv=cache)
    joint2 = run_ours(ours, inputs, t2, ref=inputs["ref"], ref_ids=inputs["ref_ids"])
    diff2 = rel_diff(got2, want2)
    print(f"KV: step 0 {diff0:.2e}, cached K/V {kv_diff:.2e}, later step {diff2:.2e}")
    assert diff0 <= BOUND and kv_diff <= BOUND and diff2 <= BOUND
    assert rel_diff(joint2, want2) > CHANGES   # the KV scheme is not the joint scheme


def test_reference_kv_helpers(ours, inputs):
    cache = ours.reference_kv(mine(inputs["ref"]), inputs["ref_ids"])
    heads, head_dim = TINY_TRANSFORMER.num_heads, TINY_TRANSFORMER.head_dim
    assert all(k.shape == v.shape == (1, heads, cache.num_tokens, head_dim) for k, v in cache.blocks)
    # each K and V holds only its own memory, not the larger block output it was sliced from
    assert all(t.untyped_storage().nbytes() == t.nbytes for kv in cache.blocks for t in kv)
    size = 2 * len(cache.blocks) * heads * cache.num_tokens * head_dim
    assert cache.nbytes == size * DTYPE.itemsize
    wide = cache.to(dtype=torch.float64)
    assert isinstance(wide, ReferenceKV) and wide.dtype == torch.float64 and wide.device == cache.device
    assert wide.nbytes == size * 8
    with pytest.raises(Flux2Error):
        run_ours(ours, inputs, torch.ones(BATCH), ref=inputs["ref"], ref_ids=inputs["ref_ids"], ref_kv=cache)


def test_bad_inputs_raise_flux2_error(ours, inputs):
    t = mine(torch.ones(BATCH))
    img, txt = mine(inputs["img"]), mine(inputs["txt"])
    with pytest.raises(Flux2Error, match="text embeddings"):
        ours(img, inputs["img_ids"], t, txt[..., :10], inputs["txt_ids"])
    with pytest.raises(Flux2Error, match="image tokens"):
        ours(img[..., :64], inputs["img_ids"], t, txt, inputs["txt_ids"])
    with pytest.raises(Flux2Error, match="batch"):
        ours(img, inputs["img_ids"], t, txt, inputs["txt_ids"], ref=mine(inputs["ref"]).repeat(3, 1, 1),
             ref_ids=inputs["ref_ids"])


def test_tiny_state_dict_keys_are_bfl_keys():
    model = Flux2Transformer(TINY_TRANSFORMER)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == bfl_transformer_shapes(TINY_TRANSFORMER)


@pytest.mark.parametrize("params, tensors, billions", [(KLEIN_4B, 149, 3.876), (KLEIN_9B, 201, 9.079)])
def test_real_sizes_on_meta(params, tensors, billions):
    with torch.device("meta"):
        model = Flux2Transformer(params)
    sd = model.state_dict()
    assert len(sd) == tensors
    assert round(sum(v.numel() for v in sd.values()) / 1e9, 3) == billions
    assert {k: tuple(v.shape) for k, v in sd.items()} == bfl_transformer_shapes(params)
    assert sd["double_blocks.0.img_attn.qkv.weight"].shape == (3 * params.hidden_size, params.hidden_size)
    assert not any(k.endswith(".bias") for k in sd) and not any(k.startswith("guidance_in") for k in sd)


def test_bf16_timestep_embedding_uses_documented_arguments():
    """1024^2, 4 steps: bf16 sigmas, then 1000·t in bf16, give arguments 1000, 968, 908, 764 (BFL fact 7)."""
    sigmas = torch.tensor([1.0, 0.967384, 0.908144, 0.767200]).to(torch.bfloat16)
    emb = timestep_embedding(sigmas).float()
    assert emb.shape == (4, 256)

    def expected(args):
        freqs = [math.exp(-math.log(10000) * i / 128) for i in range(128)]
        return torch.tensor([[math.cos(a * f) for f in freqs] + [math.sin(a * f) for f in freqs] for a in args])

    assert (emb - expected([1000, 968, 908, 764])).abs().max() < 8e-3          # bf16 output resolution
    assert (emb - expected([1000, 967.384, 908.144, 767.2])).abs().max() > 0.5  # not the unrounded sigmas


def test_tiny_file_helpers(weights_file, theirs, inputs, tmp_path):
    """The ComfyUI file and the diffusers folder that other tests load hold these same weights."""
    from diffusers import Flux2Transformer2DModel
    from safetensors.torch import load_file

    from tests.tiny.transformer import COMFYUI_PREFIX, save_comfyui_transformer, save_diffusers_transformer

    sd = weights_file[0]
    comfy = load_file(str(save_comfyui_transformer(sd, tmp_path / "comfy.safetensors")))
    assert comfy.keys() == {COMFYUI_PREFIX + k for k in sd} and all(torch.equal(comfy[COMFYUI_PREFIX + k], v)
                                                                   for k, v in sd.items())
    folder = save_diffusers_transformer(theirs, tmp_path / "transformer")
    reloaded = Flux2Transformer2DModel.from_pretrained(str(folder), local_files_only=True).to(DEVICE).eval()
    t = torch.tensor([0.7, 0.2])
    assert torch.equal(run_diffusers(reloaded, inputs, t)[0], run_diffusers(theirs, inputs, t)[0])
