"""A stored format is one object (``storage.stored_format.StoredFormat``) in one registry (``storage.formats``): the
toy format of ``tests/toy_format.py``, registered and nothing else, loads through ``weights.load_transformer``, runs
as the float model holding its dequantized weights, streams, and takes a LoRA."""

from __future__ import annotations

import pytest
import torch

from flux2_core import weights
from flux2_core.adapters.lora import read_adapter
from flux2_core.adapters.patching import set_adapters
from flux2_core.errors import Flux2Error
from flux2_core.models import rope
from flux2_core.runtime import offload
from flux2_core.storage import formats
from flux2_core.storage.protocol import census
from tests.test_offload import FakeDevice, sizes
from tests.tiny.adapters import lora_state_dict, random_lora
from tests.tiny.layouts import save_prefixed
from tests.tiny.transformer import TINY_TRANSFORMER as P
from tests.tiny.transformer import random_bfl_transformer_state_dict
from tests.toy_format import NAME, TOY_FORMAT, Int16Linear, dequantized, toy_file

PREFIX = "model.diffusion_model."
LAYERS = ["double_blocks.0.img_attn.qkv", "double_blocks.1.txt_mlp.0", "single_blocks.0.linear1",
          "single_blocks.1.linear2", "txt_in"]
CPU = torch.device("cpu")


@pytest.fixture
def toy():
    formats.register(TOY_FORMAT)
    yield TOY_FORMAT
    formats.unregister(TOY_FORMAT)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(the toy file, its tensors, the float file holding the weights it stands for)."""
    tmp = tmp_path_factory.mktemp("toy_format")
    sd = toy_file(random_bfl_transformer_state_dict(P, seed=0), LAYERS)
    return (save_prefixed(sd, tmp / "klein-tiny-toy.safetensors", PREFIX), sd,
            save_prefixed(dequantized(sd, LAYERS), tmp / "klein-tiny-dequantized.safetensors", PREFIX))


def forward(model, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    img, txt = torch.randn(batch, 16, P.in_channels, generator=g), torch.randn(batch, 8, P.context_in_dim, generator=g)
    with torch.no_grad():
        return model(img, rope.image_ids(batch, 4, 4), torch.full((batch,), 0.7), txt, rope.text_ids(batch, 8))


def load(path):
    return weights.load_transformer(path, device=CPU, dtype=torch.float32)[0]


def test_without_registering_it_the_format_is_refused_by_name(files):
    assert formats.stored_format(NAME) is None
    with pytest.raises(Flux2Error, match=f"layer {PREFIX}{LAYERS[0]} uses the quantisation format '{NAME}'"):
        load(files[0])


def test_a_registered_format_loads_as_stored(files, toy):
    path, sd, _ = files
    assert formats.stored_format(NAME) is toy
    model = load(path)
    assert census(model)[toy.storage.kind] == len(LAYERS)
    for layer in LAYERS:
        ours = model.get_submodule(layer)
        assert isinstance(ours, Int16Linear)
        assert torch.equal(ours.weight, sd[layer + ".weight"]) and torch.equal(ours.row_scale, sd[layer + ".row_scale"])
    assert weights.transformer_bytes(path, torch.float32) == sum(t.numel() * t.element_size()
                                                                 for t in model.state_dict().values())


def test_it_runs_as_the_float_model_holding_its_dequantized_weights(files, toy):
    path, _, float_path = files
    want = forward(load(float_path), batch=2)
    got = forward(load(path), batch=2)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_its_blocks_stream(files, toy, monkeypatch):
    model = load(files[0])
    want = forward(model, batch=2)
    device = FakeDevice(monkeypatch)
    fixed, block_sizes = sizes(model)
    offload.stream_blocks(model, CPU, fixed + 2 * max(block_sizes))            # every block streams
    streamed = offload.streamed_blocks(model)
    assert len(streamed) == len(block_sizes) and isinstance(streamed[0].img_attn.qkv, Int16Linear)
    assert not device.on_device(streamed[0])                                   # its int16 codes wait in storage
    for _ in range(2):
        assert torch.equal(forward(model, batch=2), want)
    assert device.live == fixed


def test_it_takes_a_lora_as_the_float_model_merges_it(files, toy):
    path, _, float_path = files
    adapter = read_adapter(lora_state_dict(random_lora(P, LAYERS[:3], rank=4, seed=5), "kohya", alpha=4.0)[0], P,
                           name="l")
    model, reference = load(path), load(float_path)
    stored = {k: v.clone() for k, v in model.state_dict().items()}
    set_adapters(model, [(p, 0.8) for p in adapter.patches])                  # a branch beside the stored weight
    set_adapters(reference, [(p, 0.8) for p in adapter.patches])              # merged into the float weight
    assert reference.get_submodule(LAYERS[0]).merges_adapters and not model.get_submodule(LAYERS[0]).merges_adapters
    want = forward(reference)
    assert not torch.equal(want, forward(load(float_path)))                    # the LoRA changes the output
    assert (forward(model) - want).abs().max() <= 1e-5 * want.abs().max()
    set_adapters(model, [])
    assert all(torch.equal(v, stored[k]) for k, v in model.state_dict().items())


def test_its_matmul_rule_is_asked_where_the_model_runs(files, toy):
    """A format that multiplies in its own format says so in its record (``StoredFormat.matmul``): choose_matmuls
    asks it with the device and options, beside the other formats' rules, and reports what it answered."""
    from dataclasses import replace

    from flux2_core.storage.matmul import choose_matmuls

    seen = []

    def rule(model, device, dtype, asked):
        seen.append((device.type, dtype, asked["int8"]))
        return {toy.storage.kind: (False, "toy int16 matmul: off (no kernel)")}

    model = load(files[0])
    assert toy.storage.kind not in choose_matmuls(model, "cpu", torch.float32).used     # no rule: nothing said
    formats.unregister(toy)
    formats.register(with_rule := replace(toy, matmul=rule))
    try:
        choice = choose_matmuls(model, "cpu", torch.float32, int8=False)
    finally:
        formats.unregister(with_rule)
        formats.register(toy)
    assert seen == [("cpu", torch.float32, False)]
    assert choice.used[toy.storage.kind] is False
    assert choice.note_for(toy.storage.kind) == "toy int16 matmul: off (no kernel)"
