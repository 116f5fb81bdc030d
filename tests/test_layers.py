"""The seam where the transformer's linear layers are made (flux2_core/models/layers.py): every layer is asked for by the
name it ends up with, storage is chosen per name at construction, per-item layers stay per item."""

from types import SimpleNamespace

import torch

from flux2_core.families.flux2.transformer import Flux2Transformer
from flux2_core.models.layers import Layers
from flux2_core.storage.linear import Linear, VectorLinear
from flux2_core.storage.quant import Fp8Linear
from flux2_core.storage.request import LayerRequest
from tests.tiny.transformer import TINY_TRANSFORMER, bfl_transformer_shapes


def test_layers_are_made_under_their_own_names_in_the_storage_asked_for():
    asked = []

    def fp8(name: str) -> bool:
        asked.append(name)
        return name.startswith("single_blocks.1.") or name.endswith(".lin")

    file = SimpleNamespace(stored_format=lambda key: None, ggml_type=lambda key: None, float_dtype=lambda key: None,
                           stores_fp8=lambda key: fp8(key.removesuffix(".weight")))
    with torch.device("meta"):
        model = Flux2Transformer(TINY_TRANSFORMER, Layers(LayerRequest(file)))
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
