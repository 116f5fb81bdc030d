"""The registry of model families (flux2_core/families/): what each family record answers, checked against the
FLUX.2 model it describes and against values worked out by hand."""

from dataclasses import dataclass

import pytest
import torch

from flux2_core import families, weights
from flux2_core.errors import Flux2Error
from flux2_core.families.flux2 import FLUX2
from flux2_core.runtime import memory
from flux2_core.variants import KLEIN_4B, KLEIN_9B, VARIANTS
from tests.tiny.transformer import TINY_TRANSFORMER, random_bfl_transformer_state_dict, save_comfyui_transformer


def test_every_variant_belongs_to_a_registered_family_of_its_parameters():
    for variant in VARIANTS.values():
        assert families.family_of(variant) is families.family_of_params(variant.params) is FLUX2


def test_parameters_of_no_family_are_refused_with_the_known_ones():
    @dataclass(frozen=True)
    class OtherParams:
        hidden_size: int = 8

    with pytest.raises(Flux2Error, match="OtherParams is no model family's parameters; known: TransformerParams"):
        families.family_of_params(OtherParams())
    with pytest.raises(Flux2Error, match="unknown model family 'flux9'; known: flux2"):
        families.get_family("flux9")


def test_a_file_is_read_by_its_family(tmp_path):
    """Detection from the keys, parameters from the shapes, the model built by the family: what the loader does."""
    path = save_comfyui_transformer(random_bfl_transformer_state_dict(TINY_TRANSFORMER), tmp_path / "klein.safetensors")
    model, variant = weights.load_transformer(path, "cpu", torch.float32)
    assert variant.family == "flux2" and model.params == TINY_TRANSFORMER
    keys = set(model.state_dict())
    assert families.detect(lambda key: key in keys) is FLUX2
    assert families.detect(lambda key: key in {"model.layers.0.mlp.up_proj.weight"}) is None


def test_a_file_without_its_familys_marker_is_refused_with_what_to_pass(tmp_path):
    state = random_bfl_transformer_state_dict(TINY_TRANSFORMER)
    del state[FLUX2.marker]
    path = save_comfyui_transformer(state, tmp_path / "cut.safetensors")
    with pytest.raises(Flux2Error, match=r"cut.safetensors is not a FLUX.2 transformer: .* Pass a FLUX.2 diffusion "
                                         r"model"):
        weights.load_transformer(path, "cpu", torch.float32)


def test_only_the_blocks_and_shared_modulations_quantize():
    chosen = {name for name in families.linear_shapes(KLEIN_4B) if FLUX2.quantizable(name)}
    # 5 double blocks x 2 streams x (qkv, proj, mlp in, mlp out), 20 single blocks x 2, three shared modulations
    assert len(chosen) == 5 * 2 * 4 + 20 * 2 + 3
    assert not chosen & {"img_in", "txt_in", "time_in.in_layer", "time_in.out_layer", "final_layer.linear",
                         "final_layer.adaLN_modulation.1"}


def test_memory_inputs_by_hand():
    """Klein 4B: hidden 3072, MLP 3x: a single block's peak holds (3H + 2M) + (H + M) + M + 8H = 24H values per token;
    Klein 9B keeps the K and V of 8 + 24 blocks: 2 GiB for one 1024^2 reference (4096 tokens) in bf16."""
    arch = FLUX2.memory(KLEIN_4B)
    assert (arch.peak_values, arch.table_bytes, arch.hidden, arch.kv_layers) == (24 * 3072, 128 * 4, 3072, 25)
    assert memory.reference_kv_bytes(KLEIN_9B, 4096, torch.bfloat16) == 2 * 2**30
    assert memory.denoise_memory(KLEIN_4B, 1000, 2, torch.bfloat16) == 2 * 1000 * (24 * 3072 * 2 + 512)
