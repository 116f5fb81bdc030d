"""The storage protocol (flux2_core/storage/protocol.py): every weight storage class gives its weight as floats,
takes a merge and restores its stored tensors bit for bit, says its kind and what a call costs, so that patching,
the counters, the estimates and ComfyUI's model management ask it instead of testing its class."""

from types import SimpleNamespace

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as T

from flux2_core.families.flux2.transformer import Flux2Transformer
from flux2_core.models.layers import Layers
from flux2_core.storage.ggml_layers import GGMLEmbedding, GGMLLinear, gguf_types
from flux2_core.storage.int8 import Int8Linear
from flux2_core.storage.linear import Linear, VectorLinear
from flux2_core.storage.protocol import StoredLinear, call_bytes, census, stored_linears
from flux2_core.storage.quant import Fp8Linear, count_fp8
from flux2_core.storage.request import LayerRequest
from tests.tiny.transformer import TINY_TRANSFORMER

OUT, IN = 48, 64


def reference_weight() -> torch.Tensor:
    return torch.randn(OUT, IN, generator=torch.Generator().manual_seed(3))


def float_layer(weight):
    layer = Linear(IN, OUT)
    layer.weight.data.copy_(weight)
    return layer, weight.clone()


def fp8_layer(weight):
    layer = Fp8Linear.from_linear(float_layer(weight)[0])
    # what the layer stands for, by hand: the e4m3 values times each row's scale
    return layer, layer.weight.float() * layer.weight_scale[:, None]


def gguf_layer(weight):
    layer = GGMLLinear(IN, OUT, T.Q8_0)
    blocks = gguf.quants.quantize(weight.numpy(), T.Q8_0)
    layer.weight.copy_(torch.from_numpy(blocks))
    return layer, torch.from_numpy(gguf.quants.dequantize(blocks, T.Q8_0).copy())


def int8_layer(weight):
    layer = Int8Linear.from_linear(float_layer(weight)[0])
    return layer, layer.weight.float() * layer.weight_scale[:, None]


STORAGES = {"float": float_layer, "fp8": fp8_layer, "int8": int8_layer, "Q8_0": gguf_layer}


@pytest.mark.parametrize("kind", STORAGES)
def test_each_storage_gives_its_weight_and_takes_a_merge_undone_bit_for_bit(kind):
    layer, expected = STORAGES[kind](reference_weight())
    assert isinstance(layer, StoredLinear) and layer.kind == kind
    assert torch.equal(layer.float_weight(), expected)
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(layer(x), x @ expected.T, rtol=1e-5, atol=1e-5)
    stored = [t.clone() for t in layer.stored_tensors()]
    delta = torch.full((OUT, IN), 0.25)
    layer.merge_weight(lambda w: w.add_(delta))
    # what a merge leaves: float stores the sum, fp8 and int8 the sum quantized again (one e4m3 rounding: 2^-4 of
    # each row's largest value at most; one int8 rounding: half a step, 1/254 of it), GGUF patches the weight as it is
    # dequantized
    row_max = (expected + delta).abs().amax(dim=1, keepdim=True)
    tolerance = {"float": 0, "fp8": row_max / 16, "int8": row_max / 254 * 1.0001, "Q8_0": 0}[kind]
    assert ((layer.float_weight() - (expected + delta)).abs() <= tolerance).all()
    merged_out = layer(x)
    layer.merge_weight(lambda w: w.add_(delta))           # a second merge starts again from the stored weight
    torch.testing.assert_close(layer(x), merged_out)
    layer.unmerge_weight()
    assert all(torch.equal(a, b) for a, b in zip(layer.stored_tensors(), stored))
    assert torch.equal(layer.float_weight(), expected)


def test_census_counts_and_call_bytes_follow_the_storage_of_each_layer():
    fp8_names = {"single_blocks.0.linear1", "double_blocks.0.img_mlp.0"}
    file = SimpleNamespace(stored_format=lambda key: None, float_dtype=lambda key: None,
                           stores_fp8=lambda key: key.removesuffix(".weight") in fp8_names,
                           ggml_type=lambda key: T.Q8_0 if key == "final_layer.linear.weight" else None)
    with torch.device("meta"):
        model = Flux2Transformer(TINY_TRANSFORMER, Layers(LayerRequest(file, quantizable=lambda name: True)))
    layers = dict(stored_linears(model))
    kinds = {n: ("fp8" if isinstance(m, Fp8Linear) else "Q8_0" if isinstance(m, GGMLLinear) else "float")
             for n, m in model.named_modules() if isinstance(m, (Linear, Fp8Linear, GGMLLinear))}
    assert set(layers) == set(kinds)
    assert census(model) == {"float": len(kinds) - 3, "fp8": 2, "Q8_0": 1}
    assert count_fp8(model) == 2 and gguf_types(model) == {"Q8_0": 1}
    assert sum(isinstance(m, VectorLinear) for m in model.modules()) == sum(
        m.item_by_item for m in layers.values() if m.kind == "float")
    # the largest call: the GGUF layer dequantized (11 bytes per value beside the result) or an fp8 weight cast
    gguf_layer = model.final_layer.linear
    fp8_sizes = [layers[n].in_features * layers[n].out_features for n in fp8_names]
    expected = max(gguf_layer.in_features * gguf_layer.out_features * (11 + 2), max(fp8_sizes) * 2)
    assert call_bytes(model, torch.bfloat16) == expected
    with torch.device("meta"):
        assert call_bytes(Flux2Transformer(TINY_TRANSFORMER), torch.bfloat16) == 0


def test_gguf_storage_follows_its_input_and_the_table_is_counted():
    table = GGMLEmbedding(32, 64, T.Q8_0)
    assert table.follows_input and table.kind == "Q8_0" and GGMLLinear(IN, OUT, T.Q8_0).follows_input
    assert not any(layer.follows_input for layer in (Linear(IN, OUT), Fp8Linear(IN, OUT), Int8Linear(IN, OUT)))
    assert census(torch.nn.ModuleList([table, Linear(IN, OUT)])) == {"Q8_0": 1, "float": 1}


def test_a_merge_that_fails_half_way_is_undone():
    """A float32 weight is patched in place: when the patch raises after changing it, the weight is restored."""
    layer, expected = float_layer(reference_weight())

    def breaks(weight):
        weight.add_(1.0)
        raise RuntimeError("out of memory half-way")

    with pytest.raises(RuntimeError, match="half-way"):
        layer.merge_weight(breaks)
    assert torch.equal(layer.weight, expected)
    layer.merge_weight(lambda w: w.add_(2.0))                     # and the layer merges normally afterwards
    layer.unmerge_weight()
    assert torch.equal(layer.weight, expected)


def test_each_storage_reads_its_own_tensors_from_the_file():
    """read_from: a float layer casts the file's values to the compute dtype, a kept 16-bit one keeps them, int8
    quantizes them at load (equal to its own quantizer), and a format layer over a file that stores the layer as
    float is refused rather than read as garbage."""

    from flux2_core.errors import Flux2Error
    from flux2_core.storage.linear import CastLinear
    from flux2_core.storage.packed import NvFp4Linear

    values = torch.randn(8, 16, dtype=torch.bfloat16)
    file = SimpleNamespace(stored=False, dtype=torch.float32, values=lambda: values,
                           as_stored=lambda: pytest.fail("a float file's layer has nothing stored to read"))
    assert Linear(16, 8).read_from(file)["weight"].dtype == torch.float32
    kept = CastLinear(16, 8, torch.bfloat16).read_from(file)["weight"]
    assert kept.dtype == torch.bfloat16 and torch.equal(kept, values)
    int8 = Int8Linear(16, 8)
    weight, scale = int8.quantized(values)
    read = int8.read_from(file)
    assert torch.equal(read["weight"], weight) and torch.equal(read["weight_scale"], scale)
    with pytest.raises(Flux2Error, match="does not store this layer in one"):
        NvFp4Linear(16, 8, swizzled=True).read_from(file)
