"""GGUF files, loaded as users have them: Klein DiTs (ComfyUI-GGUF / unsloth, arch "flux"; stable-diffusion.cpp's,
without an architecture, behind "model.diffusion_model."), and Qwen3 text encoders (llama.cpp's names).

Quantized layers stay GGUF blocks in memory (``ggml_layers``), and a GGUF model computes what the float model
holding the file's dequantized values computes (``gguf.quants.dequantize`` is the independent side, tests/tiny/gguf.py
writes the files): <= 1e-5 relative. Bad files get a Flux2Error saying what they are.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter
from safetensors.torch import save_file

from flux2_core import weights
from flux2_core.adapters.lora import read_adapter
from flux2_core.adapters.patching import set_adapters
from flux2_core.errors import Flux2Error
from flux2_core.families import VARIANTS
from flux2_core.families.flux2.transformer import TransformerParams
from flux2_core.models import rope
from flux2_core.models.autoencoder import AutoEncoder
from flux2_core.models.tokenizer import build_qwen3_tokenizer
from flux2_core.pipeline import Models, generate
from flux2_core.storage.ggml_layers import GGMLEmbedding, GGMLLinear, gguf_types
from tests.fused import fused_on, graphs, ran_fused  # noqa: F401 (fixtures)
from tests.tiny.adapters import adapter_state_dict, lora_state_dict, random_lora
from tests.tiny.autoencoder import TINY_AE_PARAMS, bfl_state_dict, build_diffusers_autoencoder
from tests.tiny.gguf import dit_types, encoder_types, hf_names, llama_cpp_names, qwen3_tokens, save_gguf
from tests.tiny.text_encoder import TINY_QWEN3_CONFIG, build_tiny_qwen3, comfyui_state_dict
from tests.tiny.transformer import TINY_TRANSFORMER, random_bfl_transformer_state_dict, save_bfl_transformer

CPU = torch.device("cpu")
BOUND = 1e-5
# K-quants need rows of 256 values: a tiny transformer 256 wide (every block input is a multiple of 256)
WIDE = TransformerParams(in_channels=128, context_in_dim=256, hidden_size=256, num_heads=8, depth=1,
                         depth_single_blocks=1, mlp_ratio=3.0, axes_dim=(8, 8, 8, 8), theta=2000)
WIDE_QWEN3 = {**TINY_QWEN3_CONFIG, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64}
PROMPTS = ["a red fox in the snow", ""]


def rel_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max()).item()


def dit_inputs(params: TransformerParams, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    h, w, n_txt = 3, 4, 8
    return (torch.randn(1, h * w, params.in_channels, generator=g), rope.image_ids(1, h, w), torch.tensor([0.7]),
            torch.randn(1, n_txt, params.context_in_dim, generator=g), rope.text_ids(1, n_txt))


def run(model, inputs):
    with torch.no_grad():
        return model(*inputs)


def state_bytes(model) -> int:
    return sum(t.numel() * t.itemsize for t in model.state_dict().values())


# ---------------------------------------------------------------------------------------------------------------
# the transformer
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q5_0, T.Q5_1, T.Q4_0, T.Q4_1, T.Q6_K, T.Q5_K, T.Q4_K, T.Q3_K, T.Q2_K])
def test_dit_computes_what_its_dequantized_values_compute(tmp_path, qtype):
    """Every quant type: blocks kept (no float copy), the variant read from the tensors, and the output of the float
    model loaded from the file's dequantized values, to 1e-5."""
    params = WIDE if qtype.name.endswith("_K") else TINY_TRANSFORMER
    sd = random_bfl_transformer_state_dict(params, seed=1)
    path, values = save_gguf(sd, tmp_path / f"flux-2-klein-tiny-{qtype.name}.gguf", dit_types(qtype))
    model, _ = weights.load_transformer(path, CPU, torch.float32)
    reference, _ = weights.load_transformer(save_bfl_transformer(values, tmp_path / "f.safetensors"), CPU,
                                            torch.float32)
    quantized = [m for m in model.modules() if isinstance(m, GGMLLinear)]
    assert {m.qtype for m in quantized} == {qtype}
    assert len(quantized) == 3 + 8 * params.depth + 2 * params.depth_single_blocks      # blocks + 3 modulations
    assert model.params == params
    assert state_bytes(model) < state_bytes(reference) * 0.6
    inputs = dit_inputs(params)
    assert rel_diff(run(model, inputs), run(reference, inputs)) <= BOUND


@pytest.mark.usefixtures("fused_on")
def test_fused_dequantization_leaves_a_forward_unchanged_with_one_graph_per_type(tmp_path, monkeypatch):
    """A Q4_K file with its MLPs in Q6_K (as Q4_K_M files have some layers): the forward with the fused kernels
    (flux2_core/storage/kernels.py; on the CPU for every layer size here) equals the plain ops' to the bit, at two image sizes, and the
    model's layers of five different shapes compile one graph per type and dtype: two."""
    from flux2_core.storage import ggml, kernels

    q4_k = dit_types(T.Q4_K)
    path, _ = save_gguf(random_bfl_transformer_state_dict(WIDE, seed=6), tmp_path / "k-m.gguf",
                        lambda name, shape: T.Q6_K if "mlp" in name and q4_k(name, shape) == T.Q4_K else q4_k(name, shape))
    model, _ = weights.load_transformer(path, CPU, torch.float32)
    assert gguf_types(model) == {"Q4_K": 3 + 4 + 2, "Q6_K": 4}
    monkeypatch.setattr(ggml, "CPU_FUSED_MIN_VALUES", 0)          # the CPU takes them for large layers only
    small, large = dit_inputs(WIDE), dit_inputs(WIDE, seed=2)
    large = (torch.randn(1, 20, WIDE.in_channels), rope.image_ids(1, 4, 5), *large[2:])
    monkeypatch.setenv(kernels.OFF_VARIABLE, "1")
    plain = [run(model, small), run(model, large)]
    monkeypatch.delenv(kernels.OFF_VARIABLE)
    kernels.forget()
    before = graphs()
    assert torch.equal(run(model, small), plain[0]) and torch.equal(run(model, large), plain[1])
    assert all(ran_fused(ggml.blocks_kernel(q, torch.float32), CPU) for q in (T.Q4_K, T.Q6_K))
    assert graphs() - before == 2


def test_sd_cpp_file_without_architecture_quantizing_every_matrix(tmp_path):
    """stable-diffusion.cpp's files have no general.architecture and keep ComfyUI's key prefix; a file that quantizes
    the embedders and final layer too loads them dequantized (the model's dtype is read from img_in)."""
    sd = random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=2)
    prefixed = {f"model.diffusion_model.{k}": v for k, v in sd.items()}
    path, values = save_gguf(prefixed, tmp_path / "flux-2-klein-4b-Q4_0.gguf",
                             lambda name, shape: T.Q4_0 if len(shape) == 2 else T.F32, arch=None)
    model, _ = weights.load_transformer(path, CPU, torch.float32)
    assert model.img_in.weight.dtype == torch.float32 and isinstance(model.single_blocks[0].linear1, GGMLLinear)
    reference, _ = weights.load_transformer(save_bfl_transformer(
        {k.removeprefix("model.diffusion_model."): v for k, v in values.items()}, tmp_path / "f.safetensors"), CPU,
        torch.float32)
    inputs = dit_inputs(TINY_TRANSFORMER)
    assert rel_diff(run(model, inputs), run(reference, inputs)) <= BOUND


def test_q8_0_stays_near_the_float_model(tmp_path):
    """Q8_0 against the float weights it was quantized from (not its own values): the bound users can expect."""
    sd = random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=3)
    path, _ = save_gguf(sd, tmp_path / "q8.gguf", dit_types(T.Q8_0))
    model, _ = weights.load_transformer(path, CPU, torch.float32)
    reference, _ = weights.load_transformer(save_bfl_transformer(sd, tmp_path / "f.safetensors"), CPU, torch.float32)
    inputs = dit_inputs(TINY_TRANSFORMER)
    error = rel_diff(run(model, inputs), run(reference, inputs))
    print(f"Q8_0 vs float: {error:.2e}")
    assert error <= 2e-2


def test_transformer_bytes_counts_blocks_as_the_file_has_them(tmp_path):
    sd = random_bfl_transformer_state_dict(WIDE, seed=4)
    path, _ = save_gguf(sd, tmp_path / "k.gguf", dit_types(T.Q4_K))
    model, _ = weights.load_transformer(path, CPU, torch.bfloat16)
    assert weights.transformer_bytes(path, torch.bfloat16) == state_bytes(model)
    blocks = sum(m.weight.numel() for m in model.modules() if isinstance(m, GGMLLinear))
    assert blocks == sum(t.n_bytes for t in GGUFReader(path).tensors if t.tensor_type == T.Q4_K)


def test_bf16_model_dequantizes_to_bf16(tmp_path):
    sd = random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=5)
    path, values = save_gguf(sd, tmp_path / "q.gguf", dit_types(T.Q8_0))
    model, _ = weights.load_transformer(path, CPU, torch.bfloat16)
    reference, _ = weights.load_transformer(save_bfl_transformer(values, tmp_path / "f.safetensors"), CPU,
                                            torch.bfloat16)
    inputs = [t.to(torch.bfloat16) if t.is_floating_point() and t.ndim == 3 else t
              for t in dit_inputs(TINY_TRANSFORMER)]
    assert torch.equal(run(model, inputs), run(reference, inputs))


# ---------------------------------------------------------------------------------------------------------------
# the text encoder
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vocabulary():
    return build_qwen3_tokenizer(), qwen3_tokens(TINY_QWEN3_CONFIG["vocab_size"])


@pytest.mark.slow
@pytest.mark.parametrize("qtype,config", [(T.Q8_0, TINY_QWEN3_CONFIG), (T.Q4_K, WIDE_QWEN3)])
def test_encoder_computes_what_its_dequantized_values_compute(tmp_path, vocabulary, qtype, config):
    tokenizer, tokens = vocabulary
    hf = comfyui_state_dict(build_tiny_qwen3(seed=6, config=config))
    path, values = save_gguf(llama_cpp_names(hf), tmp_path / f"Qwen3-tiny-{qtype.name}.gguf", encoder_types(qtype),
                             arch="qwen3", tokens=tokens)
    save_file(hf_names(values, hf), str(tmp_path / "f.safetensors"))
    encoder = weights.load_text_encoder(path, CPU, torch.float32)
    reference = weights.load_text_encoder(tmp_path / "f.safetensors", CPU, torch.float32, tokenizer=tokenizer)
    assert isinstance(encoder.model.embed_tokens, GGMLEmbedding) and encoder.dtype == torch.float32
    stored = {k for k, v in llama_cpp_names(hf).items() if encoder_types(qtype)(k, tuple(v.shape)) == qtype
              and k.startswith("blk.") and int(k.split(".")[1]) < 27}
    assert len([m for m in encoder.model.modules() if isinstance(m, GGMLLinear)]) == len(stored) >= 27 * 5
    assert state_bytes(encoder.model) < state_bytes(reference.model) * 0.6
    got, want = encoder.encode(PROMPTS).embeds, reference.encode(PROMPTS).embeds
    assert rel_diff(got, want) <= BOUND


@pytest.mark.slow
def test_generate_with_gguf_transformer_and_encoder(tmp_path, vocabulary):
    """The whole pipeline: a GGUF transformer and GGUF encoder give the latents of their dequantized float twins."""
    tokenizer, tokens = vocabulary
    hf = comfyui_state_dict(build_tiny_qwen3(seed=7))
    te_path, te_values = save_gguf(llama_cpp_names(hf), tmp_path / "te.gguf", encoder_types(T.Q8_0), arch="qwen3",
                                   tokens=tokens)
    save_file(hf_names(te_values, hf), str(tmp_path / "te.safetensors"))
    dit = replace(TINY_TRANSFORMER, context_in_dim=3 * TINY_QWEN3_CONFIG["hidden_size"])
    dit_path, dit_values = save_gguf(random_bfl_transformer_state_dict(dit, seed=8), tmp_path / "dit.gguf",
                                     dit_types(T.Q5_1))
    variant = replace(VARIANTS["klein-4b"], params=dit)
    autoencoder = AutoEncoder(TINY_AE_PARAMS).eval()
    autoencoder.load_state_dict(bfl_state_dict(build_diffusers_autoencoder(seed=4)))
    results = []
    for transformer, encoder in [(dit_path, te_path), (save_bfl_transformer(dit_values, tmp_path / "dit.safetensors"),
                                                      tmp_path / "te.safetensors")]:
        models = Models(weights.load_transformer(transformer, CPU, torch.float32)[0], variant, autoencoder,
                        weights.load_text_encoder(encoder, CPU, torch.float32, tokenizer=tokenizer))
        results.append(generate(models, PROMPTS[0], width=32, height=32, steps=2, seed=1).latents)
    assert rel_diff(*results) <= BOUND


@pytest.mark.slow
def test_vocabulary_is_checked(tmp_path, vocabulary):
    _, tokens = vocabulary
    tokens = list(tokens)
    tokens[1000] = "not-qwen"
    hf = comfyui_state_dict(build_tiny_qwen3(seed=9))
    path, _ = save_gguf(llama_cpp_names(hf), tmp_path / "other.gguf", encoder_types(T.Q8_0), arch="qwen3",
                        tokens=tokens)
    with pytest.raises(Flux2Error, match="vocabulary is not Qwen3's.*token 1000 is 'not-qwen'"):
        weights.load_text_encoder(path, CPU)


# ---------------------------------------------------------------------------------------------------------------
# bad files
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_wrong_architectures_are_named(tmp_path, vocabulary):
    _, tokens = vocabulary
    hf = comfyui_state_dict(build_tiny_qwen3(seed=10))
    llm, _ = save_gguf(llama_cpp_names(hf), tmp_path / "llm.gguf", encoder_types(T.Q8_0), arch="qwen3", tokens=tokens)
    with pytest.raises(Flux2Error, match=r"GGUF of a Qwen3 language model .*not a FLUX.2 or FLUX 3 Image Klein transformer"):
        weights.load_transformer(llm, CPU)
    sd3, _ = save_gguf({"joint_blocks.0.x_block.attn.qkv.weight": torch.randn(96, 64)}, tmp_path / "sd3.gguf",
                       dit_types(T.Q8_0), arch="sd3")
    with pytest.raises(Flux2Error, match="Stable Diffusion 3"):
        weights.load_transformer(sd3, CPU)
    flux1, _ = save_gguf({"double_blocks.0.img_mod.lin.weight": torch.randn(64, 64)}, tmp_path / "flux1.gguf",
                         dit_types(T.Q8_0))
    with pytest.raises(Flux2Error, match="FLUX.1 transformer"):
        weights.load_transformer(flux1, CPU)
    dit, _ = save_gguf(random_bfl_transformer_state_dict(TINY_TRANSFORMER), tmp_path / "dit.gguf", dit_types(T.Q8_0))
    with pytest.raises(Flux2Error, match="GGUF of a FLUX transformer .* not a Qwen3 text encoder"):
        weights.load_text_encoder(dit, CPU)


def test_truncated_and_corrupt_files(tmp_path):
    path, _ = save_gguf(random_bfl_transformer_state_dict(TINY_TRANSFORMER), tmp_path / "dit.gguf", dit_types(T.Q8_0))
    data = path.read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 40):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(Flux2Error, match="download it again"):
            weights.load_transformer(tmp_path / "cut.gguf", CPU)


def test_tensors_sharing_bytes_are_refused(tmp_path):
    """A header that points a tensor into another tensor's bytes (each still inside the file) is refused by name."""
    sd = {"double_blocks.0.img_attn.qkv.weight": torch.randn(96, 64), "double_blocks.0.img_attn.proj.weight":
          torch.randn(64, 64)}
    path, _ = save_gguf(sd, tmp_path / "dit.gguf", dit_types(T.Q8_0))
    data = bytearray(path.read_bytes())
    second = b"double_blocks.0.img_attn.proj.weight"
    at = data.index(second) + len(second)                     # then: n_dims u32, dims u64 each, type u32, offset u64
    n_dims = int.from_bytes(data[at:at + 4], "little")
    offset_at = at + 4 + 8 * n_dims + 4
    assert int.from_bytes(data[offset_at:offset_at + 8], "little") > 0    # the writer put it after the first one
    data[offset_at:offset_at + 8] = (0).to_bytes(8, "little")            # now both start at the data section's start
    (tmp_path / "shared.gguf").write_bytes(bytes(data))
    with pytest.raises(Flux2Error, match="overlap"):
        weights.load_transformer(tmp_path / "shared.gguf", CPU)


def test_unsupported_quant_type_is_named(tmp_path):
    blocks = np.random.default_rng(0).integers(0, 256, size=(64, 136), dtype=np.uint8)   # IQ4_XS: 136 B / 256
    path = tmp_path / "iq.gguf"
    writer = GGUFWriter(str(path), "flux")
    writer.add_tensor("double_blocks.0.img_attn.qkv.weight", blocks, raw_dtype=T.IQ4_XS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(Flux2Error, match="IQ4_XS"):
        weights.load_transformer(path, CPU)


# ---------------------------------------------------------------------------------------------------------------
# adapters on GGUF models
# ---------------------------------------------------------------------------------------------------------------

def test_lora_and_dora_on_gguf_equal_the_float_model_of_its_values(tmp_path):
    """A LoRA on GGUF layers runs as a branch, a DoRA (or merge=True) is merged as the weight is dequantized; both
    give what the float model of the file's values gives with the adapter merged, and removal restores the model."""
    modules = ["double_blocks.0.img_attn.qkv", "single_blocks.1.linear2", "double_stream_modulation_img.lin"]
    raw = random_lora(TINY_TRANSFORMER, modules, rank=4, seed=11)
    sd, _ = lora_state_dict(raw, "kohya", alpha=8.0)
    lora = read_adapter(sd, TINY_TRANSFORMER, name="lora")
    out = TINY_TRANSFORMER.hidden_size * 6
    dora_scale = 1 + 0.1 * torch.randn(out, 1, generator=torch.Generator().manual_seed(12))
    down, up = raw["double_stream_modulation_img.lin"]
    dora = read_adapter(adapter_state_dict({"double_stream_modulation_img.lin": {
        "lora_down.weight": down, "lora_up.weight": up, "dora_scale": dora_scale}}, "lora_unet_", underscore=True),
        TINY_TRANSFORMER, name="dora")
    path, values = save_gguf(random_bfl_transformer_state_dict(TINY_TRANSFORMER, seed=13), tmp_path / "q.gguf",
                             dit_types(T.Q4_1))
    model, _ = weights.load_transformer(path, CPU, torch.float32)
    reference, _ = weights.load_transformer(save_bfl_transformer(values, tmp_path / "f.safetensors"), CPU,
                                            torch.float32)
    inputs = dit_inputs(TINY_TRANSFORMER)
    original = run(model, inputs)
    for patches, merge in [(lora.patches, None), (lora.patches, True), (dora.patches, None)]:
        set_adapters(model, [(p, 0.8) for p in patches], key=("x", merge), merge=merge)
        set_adapters(reference, [(p, 0.8) for p in patches], key=("x", merge))
        assert rel_diff(run(model, inputs), run(reference, inputs)) <= BOUND
        assert all(m.weight_patch is None for m in model.modules() if isinstance(m, GGMLLinear)) == (
            merge is None and patches is lora.patches)
    set_adapters(model, [])
    assert torch.equal(run(model, inputs), original)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q6_K, T.Q4_K, T.Q3_K])
def test_dequantizing_needs_the_memory_the_estimate_gives(tmp_path, qtype):
    """storage.protocol.call_bytes bounds the peak of what dequantizing the largest layer allocates (every tensor
    ggml.dequantize makes for it into bf16, counted while its storage lives)."""
    import weakref

    from flux2_core.storage import ggml
    from flux2_core.storage.protocol import call_bytes

    path, _ = save_gguf(random_bfl_transformer_state_dict(WIDE, seed=14), tmp_path / "k.gguf", dit_types(qtype))
    model, _ = weights.load_transformer(path, CPU, torch.float32)
    largest = max((m for m in model.modules() if isinstance(m, GGMLLinear)), key=lambda m: m.out_features * m.in_features)
    memory = {"live": 0, "peak": 0, "storages": set()}

    def freed(size, ptr):
        memory["live"] -= size
        memory["storages"].discard(ptr)

    class Count(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in memory["storages"]:
                storage = out.untyped_storage()
                memory["storages"].add(storage.data_ptr())
                memory["live"] += storage.nbytes()
                memory["peak"] = max(memory["peak"], memory["live"])
                weakref.finalize(storage, freed, storage.nbytes(), storage.data_ptr())
            return out

    with Count():
        weight = ggml.dequantize(largest.weight, largest.qtype, (largest.out_features, largest.in_features),
                                 torch.bfloat16)
    values = largest.out_features * largest.in_features
    print(f"{qtype.name} dequantize peak: {memory['peak'] / values:.1f} bytes per value")
    assert weight.dtype == torch.bfloat16
    assert values * 4 < memory["peak"] <= call_bytes(model, torch.bfloat16)
