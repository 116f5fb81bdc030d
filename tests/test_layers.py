"""The seam where the transformer's linear layers are made (flux2_core/layers.py): every layer is asked for by the
name it ends up with, storage is chosen per name at construction, per-item layers stay per item."""

import torch

from flux2_core.layers import Layers
from flux2_core.linear import Linear, VectorLinear
from flux2_core.quant import Fp8Linear
from flux2_core.transformer import Flux2Transformer
from tests.tiny.transformer import TINY_TRANSFORMER, bfl_transformer_shapes


def test_layers_are_made_under_their_own_names_in_the_storage_asked_for():
    asked = []

    def fp8(name: str) -> bool:
        asked.append(name)
        return name.startswith("single_blocks.1.") or name.endswith(".lin")

    with torch.device("meta"):
        model = Flux2Transformer(TINY_TRANSFORMER, Layers(fp8=fp8))
    linears = {n: m for n, m in model.named_modules() if isinstance(m, (Linear, Fp8Linear))}
    # the names the maker saw are exactly the layers' module paths, and BFL's 2-D weight keys
    assert sorted(asked) == sorted(linears)
    assert {n + ".weight" for n in linears} == {k for k, s in bfl_transformer_shapes(TINY_TRANSFORMER).items()
                                                if len(s) == 2}
    stored_fp8 = {n for n, m in linears.items() if isinstance(m, Fp8Linear)}
    assert stored_fp8 == {n for n in linears if fp8(n)} and "single_blocks.1.linear1" in stored_fp8
    # per-item vector layers (modulations, embedders) keep their batch invariance in either storage
    assert linears["double_stream_modulation_img.lin"].item_by_item
    assert isinstance(linears["time_in.in_layer"], VectorLinear) and not linears["single_blocks.1.linear2"].item_by_item
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in linears.values() if isinstance(m, Fp8Linear))
    with torch.device("meta"):
        plain = Flux2Transformer(TINY_TRANSFORMER)
    assert not any(isinstance(m, Fp8Linear) for m in plain.modules())


def test_a_model_built_elsewhere_adopts_the_layers_the_maker_would_make():
    """transformers builds the Qwen3 encoder itself; Layers.adopt gives it our layers under the same per-name rule:
    float ones keep their Parameter (state dict unchanged), fp8 ones are quantized per row."""
    from flux2_core.quant import dequantize_fp8

    g = torch.Generator().manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.Linear(32, 8, bias=False),
                                 torch.nn.Linear(8, 4))
    weight0, weight1 = module[0].weight, module[1].weight.detach().clone()
    assert Layers(fp8=lambda name: name == "1").adopt(module) == 2            # the biased layer is left alone
    assert type(module[0]) is Linear and module[0].weight is weight0
    assert isinstance(module[1], Fp8Linear) and type(module[2]) is torch.nn.Linear
    restored = dequantize_fp8(module[1].weight, module[1].weight_scale)
    assert (restored - weight1).abs().max() <= 2 ** -4 * weight1.abs().max()   # e4m3: 3 mantissa bits
    x = torch.randn(5, 16, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(module[1](module[0](x)), module[0](x) @ restored.T, rtol=1e-5, atol=1e-6)
