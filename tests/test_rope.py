"""Position ids, packing and RoPE against diffusers 0.42.1's Flux2 helpers and hand-written values."""

import warnings

import pytest
import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux2 import Flux2PosEmbed
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline as Klein

from flux2_core.errors import Flux2Error
from flux2_core.models import rope


def test_text_ids():
    ids = rope.text_ids(2, 5)
    assert ids.dtype == torch.int64 and ids.shape == (2, 5, 4)
    assert ids[1].tolist() == [[0, 0, 0, l] for l in range(5)]
    assert torch.equal(ids, Klein._prepare_text_ids(torch.zeros(2, 5, 3)))


def test_image_ids_row_major():
    ids = rope.image_ids(2, 3, 4)
    assert ids.dtype == torch.int64 and ids.shape == (2, 12, 4)
    assert ids[0, 5].tolist() == [0, 1, 1, 0] and ids[0, 11].tolist() == [0, 2, 3, 0]
    assert torch.equal(ids, Klein._prepare_latent_ids(torch.zeros(2, 8, 3, 4)))
    assert rope.image_ids(1, 2, 2, t=7)[0, :, 0].tolist() == [7] * 4


def test_reference_ids():
    grids = [(2, 3), (4, 1), (1, 2)]
    ids = rope.reference_ids(grids)
    assert ids.dtype == torch.int64 and ids.shape == (1, 6 + 4 + 2, 4)
    assert ids[0, :, 0].tolist() == [10] * 6 + [20] * 4 + [30] * 2
    assert torch.equal(ids, Klein._prepare_image_ids([torch.zeros(1, 8, h, w) for h, w in grids]))
    with pytest.raises(Flux2Error):
        rope.reference_ids([])


def test_pack_unpack():
    latent = torch.randn(2, 8, 3, 5)
    tokens = rope.pack(latent)
    assert torch.equal(tokens, Klein._pack_latents(latent))
    assert torch.equal(tokens[1, 5 + 2], latent[1, :, 1, 2])        # token k = (k // w, k % w)
    assert torch.equal(rope.unpack(tokens, 3, 5), latent)
    assert torch.equal(rope.unpack(tokens, 3, 5), Klein._unpack_latents_with_ids(tokens, rope.image_ids(2, 3, 5)))
    with pytest.raises(Flux2Error):
        rope.unpack(tokens, 4, 5)


def test_rope_table_and_rotation_match_diffusers():
    axes, theta = (8, 8, 8, 8), 2000
    ids = torch.cat([rope.text_ids(1, 6), rope.image_ids(1, 3, 4), rope.reference_ids([(2, 2), (1, 3)])], dim=1)
    table = rope.rope_table(ids, axes, theta)
    assert table.dtype == torch.float32 and table.shape == (1, ids.shape[1], 16, 2)
    # Hand value: pair 8 + 1 is the w axis' second frequency, 2000^(-2/8).
    assert table[0, 6 + 5, 9, 0].item() == pytest.approx(torch.cos(torch.tensor(1 * 2000 ** -0.25)).item())

    cos, sin = Flux2PosEmbed(theta, list(axes))(ids[0])          # [L, D], each pair's value repeated
    assert (table[0, :, :, 0] - cos[:, ::2]).abs().max() < 1e-5
    assert (table[0, :, :, 1] - sin[:, ::2]).abs().max() < 1e-5

    q, k = torch.randn(2, 1, 3, ids.shape[1], 32).unbind(0)        # [B, heads, L, D]
    q_rot, k_rot = rope.apply_rope(q, k, table)
    want = apply_rotary_emb(q, (cos, sin), sequence_dim=2)
    assert (q_rot - want).abs().max() < 1e-4 * want.abs().max()
    assert torch.allclose(k_rot.norm(dim=-1), k.norm(dim=-1), atol=1e-5)   # a rotation

    q16 = q.to(torch.bfloat16)
    assert rope.apply_rope(q16, q16, table)[0].dtype == torch.bfloat16


def rotation_matrices(table: torch.Tensor) -> torch.Tensor:
    """float64 2x2 rotation matrices [[cos, -sin], [sin, cos]] [B, L, D/2, 2, 2] from the table's (cos, sin)."""
    cos, sin = table.double().unbind(-1)
    return torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], -2)


@pytest.mark.parametrize("rotate", [rope.rotate, rope.rotate_real], ids=["eager", "compiled form"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_equals_a_float64_rotation_matrix_per_pair(dtype, rotate):
    """Each channel pair (2j, 2j+1) of every token is multiplied by its own rotation matrix; computed here in float64
    with einsum and compared with the float32 result rounded to the input's dtype."""
    ids = torch.cat([rope.text_ids(2, 3), rope.image_ids(2, 2, 3, t=10)], dim=1)            # [2, 9, 4]
    table = rope.rope_table(ids, (4, 4, 4, 4), 10_000)                                      # [2, 9, 8, 2]
    x = torch.randn(2, 3, 9, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    pairs = x.double().unflatten(-1, (8, 2))                                                # [B, H, L, D/2, 2]
    want = torch.einsum("blpij,bhlpj->bhlpi", rotation_matrices(table), pairs).flatten(-2)
    got = rotate(x, table)
    assert got.dtype == dtype and got.shape == x.shape
    # float32 arithmetic: a few ulps of |x|; bfloat16 output: the float64 result rounded, at most one bf16 ulp off.
    tol = 1e-6 if dtype == torch.float32 else 2 ** -8
    assert ((got.double() - want).abs() <= tol * want.abs().clamp(min=x.double().abs().max() / 8)).all()
    assert not torch.equal(got, x)                                                          # it did rotate


@pytest.mark.slow
def test_rope_compiles_to_inductor_code_without_complex_fallbacks():
    """fullgraph inductor compile of apply_rope: no graph break, no 'complex operators' fallback warning, same values."""
    torch._dynamo.reset()
    table = rope.rope_table(rope.image_ids(1, 4, 4), (8, 8, 8, 8), 2000)
    q, k = torch.randn(2, 1, 2, 16, 32, generator=torch.Generator().manual_seed(0)).unbind(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(rope.apply_rope, fullgraph=True)(q, k, table)
    assert not [w for w in caught if "complex" in str(w.message)]
    want = rope.apply_rope(q, k, table)
    assert all((a - b).abs().max() <= 1e-6 * b.abs().max() for a, b in zip(got, want))
    torch._dynamo.reset()
