"""Compiled blocks: two graphs for the whole model, none more for later steps or new prompts, and the same outputs
as eager. The fast tests count graphs with dynamo's CompileCounter backend (it runs the captured graphs as they are);
the slow one compiles for real with inductor. The models run in the device mode's dtype and device
(``tests/device.py``)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from flux2_core.errors import Flux2Error
from flux2_core.families.flux2.transformer import Flux2Transformer
from flux2_core.models import rope
from flux2_core.runtime.compile import compile_blocks, is_compiled, uncompile_blocks
from tests.device import DEVICE, DTYPE, assert_close, to
from tests.tiny.transformer import TINY_TRANSFORMER, random_bfl_transformer_state_dict

CTX = TINY_TRANSFORMER.context_in_dim

# a compiled block runs the plain torch ops (comfy-kitchen's fused kernels are for eager runs): eager runs the same here
pytestmark = pytest.mark.usefixtures("plain_ops")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def tiny_model() -> Flux2Transformer:
    model = Flux2Transformer(TINY_TRANSFORMER)
    model.load_state_dict(random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=0))
    return to(model).eval()


def randn(*shape, generator):
    """Random inputs drawn on the CPU (the same numbers in every mode), in DTYPE on DEVICE."""
    return to(torch.randn(*shape, generator=generator))


def euler(model, x, txt, sigmas, **kw):
    """A plain Euler loop over packed tokens x [B, h*w, 128] of a 4x4 latent."""
    batch = x.shape[0]
    img_ids, txt_ids = rope.image_ids(batch, 4, 4, device=DEVICE), rope.text_ids(batch, txt.shape[1], device=DEVICE)
    for sigma, sigma_next in itertools.pairwise(sigmas):
        t = torch.full((batch,), sigma, dtype=DTYPE, device=DEVICE)
        x = x + (sigma_next - sigma) * model(x, img_ids, t, txt, txt_ids, **kw)
    return x


def test_steps_and_new_prompts_do_not_recompile():
    g = torch.Generator().manual_seed(0)
    eager, model = tiny_model(), tiny_model()
    counter = CompileCounter()
    compile_blocks(model, backend=counter)
    assert is_compiled(model)
    x, txt = randn(1, 16, 128, generator=g), randn(1, 8, CTX, generator=g)
    sigmas = [1.0, 0.75, 0.5, 0.0]
    with torch.no_grad():
        out = euler(model, x, txt, sigmas)
        assert counter.frame_count == 2                    # one graph per block kind, over 3 steps and 4 blocks
        other_prompt = randn(1, 8, CTX, generator=g)
        out2 = euler(model, randn(1, 16, 128, generator=g), other_prompt, [0.9, 0.1, 0.0])
        assert counter.frame_count == 2                    # new prompt, noise and sigmas: nothing new
        assert torch.equal(out, euler(eager, x, txt, sigmas))
        assert not torch.equal(out, out2)


@pytest.mark.slow
def test_new_shapes_compile_once_each_and_kv_path_works():
    g = torch.Generator().manual_seed(0)
    eager, model = tiny_model(), tiny_model()
    counter = CompileCounter()
    compile_blocks(model, backend=counter)
    txt = randn(2, 8, CTX, generator=g)
    with torch.no_grad():
        euler(model, randn(1, 16, 128, generator=g), txt[:1], [1.0, 0.0])
        euler(model, randn(2, 16, 128, generator=g), txt, [1.0, 0.0])          # batch 2: a new shape
        assert counter.frame_count == 4
        euler(model, randn(1, 16, 128, generator=g), txt[:1], [0.5, 0.0])      # back to batch 1: cached
        assert counter.frame_count == 4

        ref, ref_ids = randn(1, 6, 128, generator=g), rope.reference_ids([(2, 3)], device=DEVICE)
        kv, kv_eager = model.reference_kv(ref, ref_ids), eager.reference_kv(ref, ref_ids)
        x = randn(1, 16, 128, generator=g)
        assert torch.equal(euler(model, x, txt[:1], [1.0, 0.5, 0.0], ref_kv=kv),
                           euler(eager, x, txt[:1], [1.0, 0.5, 0.0], ref_kv=kv_eager))
    uncompile_blocks(model)
    assert not is_compiled(model)


def test_compile_blocks_needs_a_transformer():
    with pytest.raises(Flux2Error, match=r"needs a transformer \(a model with blocks\(\)\), got Linear"):
        compile_blocks(torch.nn.Linear(2, 2))


@pytest.mark.slow
def test_inductor_matches_eager_without_recompiling():
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(0)
    eager, model = tiny_model(), tiny_model()
    compile_blocks(model)
    x, txt = randn(1, 16, 128, generator=g), randn(1, 8, CTX, generator=g)
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        expected = euler(eager, x, txt, [1.0, 0.6, 0.0])
        got = euler(model, x, txt, [1.0, 0.6, 0.0])
        assert counters["stats"]["unique_graphs"] - before == 2
        euler(model, x, randn(1, 8, CTX, generator=g), [0.8, 0.4, 0.0])
        assert counters["stats"]["unique_graphs"] - before == 2
    # inductor fuses and reorders float32 ops, so bit-equality is not expected; 1e-5 is far below the 1e-4 parity bound.
    # In low precision it also keeps fused intermediates in float32 where eager rounds them: the two-ways bound.
    assert_close(got, expected, "transformer", rtol=0, atol=1e-5 * expected.abs().max().item())


@pytest.mark.slow
def test_blocks_that_stream_weights_compile_in_pieces():
    """ComfyUI's partial loading (and block streaming) move weights inside a layer's call, code that breaks the
    graph. Stand-in: each linear layer fetches its weight through a call dynamo cannot trace. fullgraph=True fails
    loudly; fullgraph=False (what the Denoise node uses for a partially loaded model) runs and equals eager."""
    from flux2_core.storage.linear import Linear

    class Streamed(Linear):
        def forward(self, x):
            torch._dynamo.graph_break()                     # where a weight would be copied in from the CPU
            return super().forward(x)

    def streaming_model():
        model = tiny_model()
        for layer in model.modules():
            if type(layer) is Linear:
                layer.__class__ = Streamed
        return model

    g = torch.Generator().manual_seed(1)
    x, txt = randn(1, 16, 128, generator=g), randn(1, 8, CTX, generator=g)
    with torch.no_grad():
        eager = euler(tiny_model(), x, txt, [1.0, 0.5, 0.0])
        strict = compile_blocks(streaming_model(), backend=CompileCounter())
        with pytest.raises(Exception, match="graph_break|Graph break"):
            euler(strict, x, txt, [1.0, 0.5, 0.0])
        torch._dynamo.reset()
        counter = CompileCounter()
        pieces = compile_blocks(streaming_model(), backend=counter, fullgraph=False)
        assert is_compiled(pieces, fullgraph=False) and not is_compiled(pieces, fullgraph=True)
        assert torch.equal(euler(pieces, x, txt, [1.0, 0.5, 0.0]), eager)
        assert counter.frame_count > 2                      # the blocks really ran compiled, in several pieces
    assert not is_compiled(uncompile_blocks(pieces))


def test_a_compiled_decoder_decodes_as_the_eager_one():
    """compile_decoder: the decoder's forward compiled (the 'eager' backend here: dynamo traces it in one graph); a
    decode equals the eager decode, and the next one of the same size reuses the graph."""
    from torch._dynamo.testing import CompileCounter

    from flux2_core.models.autoencoder import AutoEncoder
    from flux2_core.runtime.compile import compile_decoder
    from tests.tiny.autoencoder import TINY_AE_PARAMS, bfl_state_dict, build_diffusers_autoencoder

    ae = AutoEncoder(TINY_AE_PARAMS)
    ae.load_state_dict(bfl_state_dict(build_diffusers_autoencoder(seed=0)))
    ae.eval()
    z = torch.randn(1, 128, 4, 6, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager = ae.decode(z)
        torch._dynamo.reset()
        counter = CompileCounter()
        compile_decoder(ae, backend=counter)
        assert torch.equal(ae.decode(z), eager) and counter.frame_count == 1
        ae.decode(z * 2)
        assert counter.frame_count == 1
