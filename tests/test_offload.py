"""Block streaming (offload.py) on the CPU with a faked device: CPU-to-CPU moves are invisible, so the two move
functions are wrapped to make real copies, and the bytes on the "device" are counted while those copies are alive
(a finalizer on each copy's storage, which lives as long as a parameter or buffer points at it)."""

import weakref
from dataclasses import replace

import pytest
import torch

from flux2_core.errors import Flux2Error
from flux2_core.families.flux2.files import quantizable
from flux2_core.families.flux2.transformer import Flux2Transformer
from flux2_core.models import rope
from flux2_core.runtime import compile as compiling
from flux2_core.runtime import memory, offload
from flux2_core.storage import quant
from flux2_core.storage.protocol import call_bytes
from tests.tiny.transformer import TINY_TRANSFORMER, random_bfl_transformer_state_dict

PARAMS = replace(TINY_TRANSFORMER, depth=3, depth_single_blocks=3)
CPU = torch.device("cpu")


class FakeDevice:
    """Copies to the 'device' are clones counted until their storage is freed; copies to storage are plain clones."""

    def __init__(self, monkeypatch):
        self.live = self.peak = 0
        self.storages = set()          # data pointers of the live device copies
        monkeypatch.setattr(offload, "to_device", self.to_device)
        monkeypatch.setattr(offload, "to_storage", lambda tensor, storage, pin: tensor.clone())

    def to_device(self, tensor, device):
        assert device == CPU
        copy = tensor.clone()
        size, ptr = copy.untyped_storage().nbytes(), copy.data_ptr()
        self.live += size
        self.peak = max(self.peak, self.live)
        self.storages.add(ptr)
        weakref.finalize(copy.untyped_storage(), self.freed, size, ptr)
        return copy

    def freed(self, size, ptr):
        self.live -= size
        self.storages.discard(ptr)

    def on_device(self, module) -> bool:
        """Whether all of the module's weights are live device copies (False if none or only some are)."""
        return all(t.data_ptr() in self.storages for _, _, t in offload.slots(module))


def tiny_model(fp8=False):
    model = Flux2Transformer(PARAMS)
    model.load_state_dict(random_bfl_transformer_state_dict(PARAMS, seed=1))
    if fp8:
        quant.quantize_transformer(model, quantizable)
    return model.eval().requires_grad_(False)


def inputs(batch=1, h=4, w=6, n_txt=5):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch, h * w, PARAMS.in_channels, generator=g), rope.image_ids(batch, h, w),
            torch.full((batch,), 0.7), torch.randn(batch, n_txt, PARAMS.context_in_dim, generator=g),
            rope.text_ids(batch, n_txt))


def blocks(model):
    return [*model.double_blocks, *model.single_blocks]


def sizes(model):
    """(always-resident bytes, [bytes of each block])."""
    block_sizes = [memory.module_bytes(b) for b in blocks(model)]
    return memory.module_bytes(model) - sum(block_sizes), block_sizes


def test_the_blocks_that_fit_stay_resident_and_the_rest_visit_one_after_another(monkeypatch):
    device = FakeDevice(monkeypatch)
    model = tiny_model()
    fixed, block_sizes = sizes(model)
    double, single = block_sizes[0], block_sizes[-1]
    assert double > 1.5 * single                           # a double block has two streams' weights
    # room for the fixed parts, two blocks in flight, the first double block and one single block (+ a little)
    budget = fixed + 2 * double + double + single + single // 2
    stream = offload.stream_blocks(model, CPU, budget)

    resident = [i for i, b in enumerate(blocks(model)) if device.on_device(b)]
    assert resident == [0, 3]                               # double 0; doubles 1, 2 do not fit what is left; single 0
    assert [blocks(model).index(b) for b in offload.streamed_blocks(model)] == [1, 2, 4, 5]
    rest = [m for m in model.children() if m not in (model.double_blocks, model.single_blocks)]
    assert all(device.on_device(m) for m in rest)
    resident_bytes = fixed + double + single
    assert device.live == resident_bytes == stream.resident_bytes

    # inside each streamed block: it and the next streamed one are on the device; after it: only the next one
    seen = []
    streamed = offload.streamed_blocks(model)
    for i, block in enumerate(streamed):
        following = streamed[i + 1] if i + 1 < len(streamed) else None
        block.register_forward_pre_hook(lambda b, a, f=following: seen.append(
            ("in", device.on_device(b), f is None or device.on_device(f), device.live)))
        block.register_forward_hook(lambda b, a, o: seen.append(("after", device.on_device(b), None, device.live)))
    model(*inputs())
    expected_live = [resident_bytes + double + double, resident_bytes + double,      # double 1 (+ double 2)
                     resident_bytes + double + single, resident_bytes + single,      # double 2 (+ single 1)
                     resident_bytes + single + single, resident_bytes + single,      # single 1 (+ single 2)
                     resident_bytes + single, resident_bytes]                        # single 2, the last
    assert [s[3] for s in seen] == expected_live
    assert all(s[1] and s[2] for s in seen if s[0] == "in") and not any(s[1] for s in seen if s[0] == "after")
    assert device.peak <= resident_bytes + 2 * double <= budget
    assert device.live == resident_bytes                    # every streamed copy dropped after the forward


@pytest.mark.parametrize("fp8", [False, True])
def test_streamed_output_is_bit_identical(monkeypatch, fp8):
    FakeDevice(monkeypatch)
    model = tiny_model(fp8)
    if fp8:       # the fp8 weights and scales are buffers: they must stream too
        assert {n for n, _ in blocks(model)[0].named_buffers()} >= {"img_attn.qkv.weight", "img_attn.qkv.weight_scale"}
    args = inputs(batch=2)
    ref = model.reference_kv(args[0][:1], args[1][:1])
    want, want_kv = model(*args), model(*args, ref_kv=ref)
    fixed, block_sizes = sizes(model)
    offload.stream_blocks(model, CPU, fixed + 2 * max(block_sizes))            # every block streams
    assert len(offload.streamed_blocks(model)) == len(block_sizes)
    for _ in range(2):                                                         # two steps
        assert torch.equal(model(*args), want)
    assert torch.equal(model(*args, ref_kv=model.reference_kv(args[0][:1], args[1][:1])), want_kv)


def test_gguf_blocks_stream_and_the_output_is_bit_identical(monkeypatch, tmp_path):
    """A GGUF model's blocks (uint8 buffers, dequantized at each call) stream like any weights."""
    from gguf import GGMLQuantizationType

    from flux2_core import weights
    from flux2_core.storage.ggml_layers import GGMLLinear
    from tests.tiny.gguf import dit_types, save_gguf

    path, _ = save_gguf(random_bfl_transformer_state_dict(PARAMS, seed=1), tmp_path / "q.gguf",
                        dit_types(GGMLQuantizationType.Q4_0))
    model, _ = weights.load_transformer(path, CPU, torch.float32)
    device = FakeDevice(monkeypatch)
    args = inputs(batch=2)
    want = model(*args)
    fixed, block_sizes = sizes(model)
    offload.stream_blocks(model, CPU, fixed + 2 * max(block_sizes))
    streamed = offload.streamed_blocks(model)
    assert len(streamed) == len(block_sizes) and isinstance(streamed[0].img_attn.qkv, GGMLLinear)
    assert not device.on_device(streamed[0])
    assert torch.equal(model(*args), want)
    assert device.live == fixed


def test_unstream_restores_the_placement_and_removes_the_hooks(monkeypatch):
    device = FakeDevice(monkeypatch)
    model = tiny_model()
    args = inputs()
    want = model(*args)
    fixed, block_sizes = sizes(model)
    offload.stream_blocks(model, CPU, fixed + 2 * max(block_sizes) + block_sizes[0])
    assert device.live > 0
    offload.unstream(model)
    assert device.live == 0 and offload.streaming(model) is None        # every weight back in storage
    assert not model._forward_pre_hooks and not any(b._forward_pre_hooks or b._forward_hooks for b in blocks(model))
    assert torch.equal(model(*args), want)
    # streamed again, then made fully resident
    offload.stream_blocks(model, CPU, fixed + 2 * max(block_sizes))
    offload.unstream(model, resident=True)
    assert device.live == memory.module_bytes(model) and device.on_device(model)
    assert torch.equal(model(*args), want)


def test_a_budget_that_fits_everything_streams_nothing(monkeypatch):
    device = FakeDevice(monkeypatch)
    model = tiny_model()
    offload.stream_blocks(model, CPU, memory.module_bytes(model))
    assert offload.streamed_blocks(model) == [] and device.on_device(model)


def test_a_budget_below_the_resident_parts_says_what_is_needed(monkeypatch):
    FakeDevice(monkeypatch)
    model = tiny_model()
    fixed, block_sizes = sizes(model)
    needed = fixed + 2 * max(block_sizes)
    with pytest.raises(Flux2Error, match=r"at least .* GiB.*--width/--height.*--fp8.*--offload blocks"):
        offload.stream_blocks(model, CPU, needed - 1)
    offload.stream_blocks(model, CPU, needed)               # exactly enough


def test_any_budget_is_kept_and_used():
    """For every budget from 'just enough' to 'everything fits': the resident weights plus two blocks in flight
    never exceed it, and no streamed block would still have fitted (blocks are kept greedily in run order)."""
    model = tiny_model()
    fixed, block_sizes = sizes(model)
    in_flight = 2 * max(block_sizes)
    for budget in range(fixed + in_flight, fixed + sum(block_sizes) + 1, max(1, sum(block_sizes) // 40)):
        resident, streamed = offload.split_blocks(model, budget)
        kept = fixed + sum(memory.module_bytes(b) for b in resident)
        assert len(resident) + len(streamed) == len(block_sizes)
        if streamed:
            assert kept + in_flight <= budget
            assert all(kept + in_flight + memory.module_bytes(b) > budget for b in streamed)
        else:
            assert kept <= budget


def test_place_moves_only_the_resident_parts(monkeypatch):
    FakeDevice(monkeypatch)
    model = tiny_model()
    fixed, block_sizes = sizes(model)
    offload.stream_blocks(model, CPU, fixed + 2 * max(block_sizes) + block_sizes[0])
    moved = []
    for module in [*model.children(), *blocks(model)]:
        monkeypatch.setattr(module, "to", lambda device, m=module: moved.append(m) or m)
    offload.place(model, "cpu")
    assert set(moved) == set(offload.resident_parts(model))
    assert model.double_blocks[0] in moved and not set(moved) & set(offload.streamed_blocks(model))
    assert model.double_blocks not in moved and model.img_in in moved and model.final_layer in moved


@pytest.mark.usefixtures("plain_ops")
def test_compile_skips_streamed_blocks_and_streaming_refuses_compiled_blocks(monkeypatch):
    """With hooks that swap weights a streamed block cannot be a fullgraph graph: compile_blocks compiles only the
    resident ones (run here with the 'eager' backend: dynamo traces them with fullgraph=True, no inductor)."""
    FakeDevice(monkeypatch)
    model = tiny_model()
    args = inputs()
    want = model(*args)
    fixed, block_sizes = sizes(model)
    offload.stream_blocks(model, CPU, fixed + 2 * max(block_sizes) + block_sizes[0])
    compiling.compile_blocks(model, backend="eager")
    compiled = ["forward" in vars(b) for b in blocks(model)]                 # a compiled forward of its own
    assert compiled == [b not in offload.streamed_blocks(model) for b in blocks(model)] and any(compiled)
    assert compiling.is_compiled(model, fullgraph=True)          # the resident blocks, in one graph each
    torch._dynamo.reset()
    assert torch.equal(model(*args), want)
    # the other order: compiled blocks cannot be streamed
    offload.unstream(model)
    compiling.compile_blocks(model, backend="eager")
    with pytest.raises(Flux2Error, match="stream them first, then compile"):
        offload.stream_blocks(model, CPU, fixed + 2 * max(block_sizes))
    compiling.uncompile_blocks(model)
    torch._dynamo.reset()


# --- loading: pipeline.load_models and the decision -------------------------------------------------------------------

CUDA = torch.device("cuda")    # only a name here: the memory query is faked, nothing runs on it
MIB = 1 << 20


@pytest.mark.parametrize("choice,free,expected", [
    (True, 1 << 40, True),                    # asked: always (a budget that fits everything then streams nothing)
    (False, 0, False),                        # asked not to: never
    ("auto", 2000 * MIB, False),              # 2000 - 512 margin - 500 working memory >= 900 of weights
    ("auto", 1900 * MIB, True),               # 1900 - 512 - 500 < 900: stream
    ("auto", None, False),                    # unknown free memory: load as usual
])
def test_stream_decision(choice, free, expected):

    asked = []
    decision = memory.should_stream(choice, CUDA, 500 * MIB, lambda: 900 * MIB,
                                      free=lambda d: asked.append(d) or free)
    assert decision is expected and asked == ([CUDA] if choice == "auto" else [])
    assert memory.should_stream(True, CPU, 0, lambda: 1 << 40) is False        # nowhere to stream from
    with pytest.raises(Flux2Error, match="offload_blocks"):
        memory.should_stream("yes", CUDA, 0, lambda: 0)


@pytest.mark.parametrize("fp8", [None, True])
def test_load_models_streams_from_cpu_memory_and_generate_runs_unchanged(tmp_path, monkeypatch, fp8):
    """The decision is made from the headers (transformer_bytes equals the loaded model's bytes), the transformer
    is read to the CPU, the budget comes from weight_budget(free memory, working memory and the largest layer call's
    memory), and generate gives the same latents as an unstreamed load. The device is the faked one; the decision is
    forced (on a CPU device nothing streams)."""
    from flux2_core import pipeline, weights
    from tests.tiny.autoencoder import build_diffusers_autoencoder, save_bfl_autoencoder
    from tests.tiny.text_encoder import build_tiny_qwen3, save_comfyui_text_encoder
    from tests.tiny.transformer import save_bfl_transformer

    files = [save_bfl_transformer(random_bfl_transformer_state_dict(PARAMS, seed=3),
                                  tmp_path / "flux-2-klein-tiny.safetensors"),
             save_comfyui_text_encoder(build_tiny_qwen3(seed=5), tmp_path / "qwen_3_tiny.safetensors"),
             save_bfl_autoencoder(build_diffusers_autoencoder(seed=4), tmp_path / "ae.safetensors")]
    load = {"device": "cpu", "dtype": torch.float32, "fp8": fp8, "size": (64, 32)}
    plain = pipeline.load_models(*files, **load)
    args = {"width": 64, "height": 32, "steps": 2, "seed": 1}
    want = pipeline.generate(plain, "a fox", **args).latents

    device = FakeDevice(monkeypatch)
    fixed, block_sizes = sizes(plain.transformer)
    needed = memory.working_memory(plain.variant, (64, 32), torch.float32)
    calls = call_bytes(plain.transformer, torch.float32)         # an fp8 layer's weight cast for its matmul
    free = needed + calls + memory.STREAM_MARGIN + fixed + 2 * max(block_sizes) + block_sizes[0]
    decided, loaded_to = [], []
    monkeypatch.setattr(memory, "should_stream", lambda choice, dev, need, weight_bytes: decided.append(
        (choice, dev, need, weight_bytes())) or True)
    monkeypatch.setattr(memory, "free_memory", lambda d: free)
    real_load = weights.load_transformer
    monkeypatch.setattr(weights, "load_transformer", lambda path, dev, *a, **kw: loaded_to.append(dev) or real_load(
        path, dev, *a, **kw))
    models = pipeline.load_models(*files, **load, offload_blocks=True)

    assert decided == [(True, CPU, needed, memory.module_bytes(plain.transformer))]
    assert loaded_to == [CPU]
    assert [blocks(models.transformer).index(b) for b in offload.streamed_blocks(models.transformer)] == [1, 2, 3, 4, 5]
    assert device.live == fixed + block_sizes[0] and models.device == CPU
    assert quant.count_fp8(models.transformer) == quant.count_fp8(plain.transformer)
    assert torch.equal(pipeline.generate(models, "a fox", **args).latents, want)
    assert device.live == fixed + block_sizes[0]


def test_quantizing_a_streamed_model_is_refused(monkeypatch):
    from flux2_core import pipeline

    FakeDevice(monkeypatch)
    model = tiny_model()
    fixed, block_sizes = sizes(model)
    offload.stream_blocks(model, CPU, fixed + 2 * max(block_sizes))
    models = pipeline.Models(model, None, None, None)
    with pytest.raises(Flux2Error, match="quantize before streaming"):
        pipeline.optimize_transformer(models, fp8=True)
    assert quant.count_fp8(model) == 0
    offload.unstream(model)
    pipeline.optimize_transformer(models, fp8=True)
    assert quant.count_fp8(model) > 0
