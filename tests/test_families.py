"""The registry of model families (flux2_core/families/): what each family record answers, checked against the
FLUX.2 model it describes and against values worked out by hand."""

import itertools
import re
from dataclasses import dataclass

import pytest
import torch

from flux2_core import families, weights
from flux2_core.errors import Flux2Error
from flux2_core.families import VARIANTS
from flux2_core.families.flux2 import FLUX2
from flux2_core.families.flux2.variants import KLEIN_4B, KLEIN_9B
from flux2_core.families.flux3 import FLUX3
from flux2_core.runtime import memory
from tests.tiny.transformer import TINY_TRANSFORMER, random_bfl_transformer_state_dict, save_comfyui_transformer


def test_every_variant_belongs_to_a_registered_family_of_its_parameters():
    for variant in VARIANTS.values():
        family = families.family_of(variant)
        assert family is families.family_of_params(variant.params)
        assert family is (FLUX3 if variant.name.startswith("flux3") else FLUX2)


def test_parameters_of_no_family_are_refused_with_the_known_ones():
    @dataclass(frozen=True)
    class OtherParams:
        hidden_size: int = 8

    with pytest.raises(Flux2Error, match="OtherParams is no model family's parameters; known: TransformerParams, Flux3Params"):
        families.family_of_params(OtherParams())
    with pytest.raises(Flux2Error, match="unknown model family 'flux9'; known: flux2, flux3"):
        families.get_family("flux9")


def test_a_file_is_read_by_its_family(tmp_path):
    """Detection from the keys, parameters from the shapes, the model built by the family: what the loader does."""
    path = save_comfyui_transformer(random_bfl_transformer_state_dict(TINY_TRANSFORMER), tmp_path / "klein.safetensors")
    model, variant = weights.load_transformer(path, "cpu", torch.float32)
    assert variant.family == "flux2" and model.params == TINY_TRANSFORMER


def test_a_file_without_its_familys_layout_key_is_refused_with_what_to_pass(tmp_path):
    state = random_bfl_transformer_state_dict(TINY_TRANSFORMER)
    del state[FLUX2.layouts[0].signature]
    path = save_comfyui_transformer(state, tmp_path / "cut.safetensors")
    with pytest.raises(Flux2Error, match=r"cut.safetensors is not a FLUX.2 or FLUX 3 Image Klein transformer: .* Pass a "
                                         r"FLUX.2 or FLUX 3 Image Klein diffusion model"):
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


def test_the_registry_holds_each_familys_variants_in_the_order_of_registration():
    import flux2_core

    assert list(families.VARIANTS) == [v.name for f in families.FAMILIES.values() for v in f.variants]
    assert list(families.FAMILIES) == ["flux2", "flux3"]          # FLUX.2's first: a models folder tries them first
    assert flux2_core.VARIANTS is families.VARIANTS                # the public API's registry is the families'
    assert all(v.family == f.name for f in families.FAMILIES.values() for v in f.variants)


def test_register_refuses_a_record_of_the_wrong_kind_naming_the_family_and_the_field():
    """Every field of a family is required (no default of another family's behaviour); ``register`` checks the kind of
    each, callables callable, a variant naming another family, and names already taken; nothing is added then."""
    from dataclasses import fields, replace

    from flux2_core.families import Family
    from tests.toy_family import TOY, TOY_VARIANT

    with pytest.raises(TypeError, match="missing 1 required positional argument: 'takes_layout'"):
        Family(**{f.name: getattr(TOY, f.name) for f in fields(Family) if f.name != "takes_layout"})
    for change, message in [({"schedule": "toy"}, "its schedule must be callable, got str 'toy'"),
                            ({"latent_dtype": torch.float32}, "its latent_dtype must be callable"),
                            ({"takes_layout": None}, "its takes_layout must be a bool"),
                            ({"dtypes": (torch.float32, "bf16")}, "its dtypes must be a tuple"),
                            ({"variants": [TOY_VARIANT]}, "its variants must be a tuple"),
                            ({"gguf_archs": ("toy", 1)}, "its gguf_archs must be a tuple"),
                            ({"references": None}, "its references must be a ReferenceFit")]:
        with pytest.raises(Flux2Error, match=r"the model family 'toy' cannot be registered: " + re.escape(message)):
            families.register(replace(TOY, **change))
    with pytest.raises(Flux2Error, match="its variant 'toy' says it is of the family 'flux3'"):
        families.register(replace(TOY, variants=(replace(TOY_VARIANT, family="flux3"),)))
    with pytest.raises(Flux2Error, match="'klein-4b' already registered"):
        families.register(replace(TOY, variants=(replace(TOY_VARIANT, name="klein-4b"),)))
    assert "toy" not in families.FAMILIES and "toy" not in families.VARIANTS


# --- a second family through the engine (tests/toy_family/: a family package of its own) -----------------------------

@pytest.fixture
def toy():
    from tests.toy_family import TOY

    families.register(TOY)
    try:
        yield TOY
    finally:
        if TOY.name in families.FAMILIES:
            families.unregister(TOY.name)


def toy_models(toy):
    """The toy transformer beside the demo's autoencoder and Qwen3 (prompt embeddings 96 wide), the Qwen3 read as the
    toy's text encoder says (its template, its padding)."""
    from flux2_core.app.demo import demo_models
    from flux2_core.models.text_encoder import PromptEncoder
    from flux2_core.pipeline import Models
    from tests.toy_family import ToyModel, ToyParams

    demo = demo_models("klein-base-4b")
    model = ToyModel(ToyParams())
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    variant = toy.variant_for(model.params, "")
    encoder = PromptEncoder(demo.prompt_encoder.model, demo.prompt_encoder.tokenizer, variant.text_encoder)
    return Models(model.eval(), variant, demo.autoencoder, encoder)


def euler_by_hand(model, embeds, noise, sigmas, cfg, kv=None):
    """The Euler loop with CFG written out: x += (s' - s) (v_neg + cfg (v_pos - v_neg)), the toy model called alone."""
    x = noise
    for s, s_next in itertools.pairwise(sigmas):
        t = torch.full((x.shape[0],), s)
        v_pos, v_neg = model(x, t, embeds[:1], kv=kv), model(x, t, embeds[1:], kv=kv)
        x = x + (s_next - s) * (v_neg + cfg * (v_pos - v_neg))
    return x


@pytest.mark.parametrize("storage", ["float", "int8"])
def test_a_second_family_runs_through_generate(toy, storage):
    """generate with a model of another family: its own schedule (2t / (1 + t) on thirds: 1, 0.8, 0.5, 0), its own
    noise (the seed's draw mirrored and negated), its own prompt padding (each prompt alone to a multiple of 16
    tokens: both prompts in the toy's template are 16 rows), CFG
    (the toy is not guidance-distilled), the memory estimate from its entry and, with int8, the storage its
    ``quantizable`` picks; the latents equal the Euler loop written out by hand around the toy model."""
    from flux2_core import pipeline
    from flux2_core.sampling.euler import make_noise
    from flux2_core.sampling.schedules import named_schedule
    from flux2_core.storage.protocol import census

    models = toy_models(toy)
    if storage == "int8":
        pipeline.optimize_transformer(models, int8=True)
        assert census(models.transformer).get("int8") == 1           # toy_out alone
    result = pipeline.generate(models, "a red fox", negative="", cfg=3.0, width=64, height=48, seed=5, steps=3)
    embeds = models.prompt_encoder.encode(["a red fox", ""]).embeds
    assert embeds.shape[1] == 16 and result.settings["sigmas"] == pytest.approx([1.0, 0.8, 0.5, 0.0])
    assert named_schedule(toy.schedule_name, 3, 12) == pytest.approx([1.0, 0.8, 0.5, 0.0])   # the Scheduler's lookup
    sigmas = [1.0, 0.8, 0.5, 0.0]
    noise = -make_noise(1, 48, 64, 5).flip(-1)                       # the toy's reading of seed 5's draw
    expected = euler_by_hand(models.transformer, embeds, noise, sigmas, 3.0)
    torch.testing.assert_close(result.latents, expected, rtol=1e-5, atol=1e-5)
    assert result.settings["steps"] == 3 and result.settings["variant"] == "toy"
    assert result.images.shape == (1, 48, 64, 3)


def test_a_second_familys_kv_references_are_made_once_and_read_every_step(toy):
    """The toy's references are K/V-style (its variant a KV edition): generate encodes the reference, the toy's
    reference pass runs once for the whole run (not once per step or per CFG half), and the latents equal the Euler
    loop by hand with the K/V made here from the reference's latent; joined reference tokens are refused in the toy's
    words."""
    from PIL import Image

    from flux2_core import pipeline
    from flux2_core.models import rope
    from flux2_core.sampling import euler
    from flux2_core.sampling.euler import make_noise
    from flux2_core.sampling.references import image_to_tensor

    models = toy_models(toy)
    model = models.transformer
    picture = Image.fromarray(torch.randint(0, 256, (64, 96, 3), generator=torch.Generator().manual_seed(1),
                                            dtype=torch.uint8).numpy())
    passes = []
    original = model.reference_kv
    model.reference_kv = lambda ref, ids: passes.append(ref.shape) or original(ref, ids)
    result = pipeline.generate(models, "a red fox", negative="", cfg=2.0, references=[picture], width=64, height=48,
                               seed=5, steps=3)
    assert passes == [(1, 24, 128)]                 # one pass, over the reference's 4 x 6 latent cells
    with torch.no_grad():
        tokens = rope.pack(models.autoencoder.encode(image_to_tensor(picture)))
        kv = original(tokens, None)
    embeds = models.prompt_encoder.encode(["a red fox", ""]).embeds
    expected = euler_by_hand(model, embeds, -make_noise(1, 48, 64, 5).flip(-1), [1.0, 0.8, 0.5, 0.0], 2.0, kv)
    torch.testing.assert_close(result.latents, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(Flux2Error, match="the toy model takes references only as K/V"):
        euler.denoise(model, torch.zeros(1, 128, 3, 4), [1.0, 0.0], embeds[:1], ref=tokens,
                      ref_ids=torch.zeros(1, 24, 4), kv=False)


def test_a_second_familys_file_loads_by_its_entry_and_is_refused_without_it(toy, tmp_path, monkeypatch):
    """The loader reads a toy file through the toy's layout, parameters and build, with int8 where its ``quantizable``
    says; without the toy's entry the same file is refused, naming what to pass."""
    from safetensors.torch import save_file

    from flux2_core.storage.protocol import census
    from tests.toy_family import ToyModel, ToyParams

    params = ToyParams(hidden=12)
    state = {k: torch.randn(v.shape) for k, v in ToyModel(params).state_dict().items()}
    path = tmp_path / "toy.safetensors"
    save_file({"model.diffusion_model." + k: v for k, v in state.items()}, str(path))    # behind ComfyUI's prefix
    model, variant = weights.load_transformer(path, "cpu", torch.float32, int8=True)
    assert isinstance(model, ToyModel) and model.params == params and variant.family == "toy"
    assert census(model) == {"float": 3, "int8": 1}
    assert torch.equal(model.toy_in.weight, state["toy_in.weight"])
    families.unregister(toy.name)
    with pytest.raises(Flux2Error, match=r"toy.safetensors is not a FLUX.2 or FLUX 3 Image Klein transformer: .*Pass "
                                         r"a FLUX.2 or FLUX 3 Image Klein diffusion model: flux-2-klein-\*.safetensors"):
        weights.load_transformer(path, "cpu", torch.float32)


def test_a_lora_on_a_second_family_matches_its_names_and_patches_its_model(toy):
    """An adapter file for the toy: its keys are matched against the toy's own linears (kohya's underscore naming
    behind its prefix), the report counts them in the toy's groups, and the patched model computes with
    W + (alpha / rank) up @ down worked out here; FLUX.2 keys match nothing of it and are refused."""
    from flux2_core.adapters.lora import read_adapter
    from flux2_core.adapters.patching import set_adapters
    from tests.toy_family import ToyModel, ToyParams

    params = ToyParams()
    model = ToyModel(params).eval()
    down, up = torch.randn(2, params.hidden), torch.randn(params.channels, 2)
    adapter = read_adapter({"lora_unet_toy_out.lora_down.weight": down, "lora_unet_toy_out.lora_up.weight": up,
                            "lora_unet_toy_out.alpha": torch.tensor(1.0)}, params, name="toy-lora")
    assert adapter.report.tensors == {"toy layers": 3, "other": 0, "text encoder": 0}
    assert "kohya/musubi (lora_unet_)" in adapter.report.formats
    x, t, txt = torch.randn(1, params.channels, 2, 3), torch.tensor([0.5]), torch.randn(1, 4, params.context_in_dim)
    expected = ToyModel(params).eval()
    expected.load_state_dict(model.state_dict())
    with torch.no_grad():
        expected.toy_out.weight += 0.5 * up @ down * 0.7
    set_adapters(model, [(p, 0.7) for p in adapter.patches])
    with torch.no_grad():
        torch.testing.assert_close(model(x, t, txt), expected(x, t, txt))
    with pytest.raises(Flux2Error, match=r"'lora_unet_toy_out' gives a weight change of shape \[4, 16\] but toy_out "
                                         r"is \[128, 16\]. The adapter was made for another model"):
        read_adapter({"lora_unet_toy_out.lora_down.weight": down, "lora_unet_toy_out.lora_up.weight": up[:4]},
                     params)
    with pytest.raises(Flux2Error, match="none of its 2 keys is a LoRA/LoKr weight of Toy"):
        read_adapter({"diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight": down,
                      "diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight": up}, params)


def test_a_second_family_runs_from_the_command_line(toy, tmp_path, capsys):
    """The main job with a toy transformer file beside FLUX.2's text encoder and autoencoder files: the file is read
    through the toy's entry, and the PNG equals pipeline.generate on the same files (itself proven above against the
    Euler loop by hand), with the toy's default steps in its metadata."""
    import numpy as np
    from PIL import Image
    from safetensors.torch import save_file

    from flux2_core import pipeline
    from flux2_core.app import cli
    from tests.test_cli import png_parameters, write_models_folder
    from tests.toy_family import ToyModel, ToyParams

    write_models_folder(tmp_path)
    g = torch.Generator().manual_seed(3)
    state = {k: torch.randn(v.shape, generator=g) / v.shape[1] ** 0.5
             for k, v in ToyModel(ToyParams()).state_dict().items()}
    toy_file = tmp_path / "diffusion_models" / "toy.safetensors"
    save_file(state, str(toy_file))
    files = (toy_file, tmp_path / "text_encoders" / "qwen_3_4b.safetensors", tmp_path / "vae" / "flux2-vae.safetensors")
    code = cli.main(["--transformer", str(files[0]), "--text-encoder", str(files[1]), "--ae", str(files[2]),
                     "--prompt", "a fox", "--cfg", "2.5", "--width", "48", "--height", "32", "--seed", "4",
                     "--device", "cpu", "--dtype", "float32", "--out", str(tmp_path / "out")])
    assert code == 0, capsys.readouterr().err
    size, params = png_parameters(tmp_path / "out" / "flux2_4.png")
    assert size == (48, 32) and params["variant"] == "toy" and params["steps"] == 3 and params["cfg"] == 2.5
    models = pipeline.load_models(*files, device="cpu", dtype=torch.float32)
    expected = pipeline.generate(models, "a fox", cfg=2.5, width=48, height=32, seed=4)
    assert np.array_equal(np.asarray(Image.open(tmp_path / "out" / "flux2_4.png")), expected.images[0].numpy())


def test_every_familys_transformer_answers_the_model_protocol(toy):
    """What runtime code asks of any transformer (``families.family.Transformer``): its params, its blocks in order,
    its device and compute dtype; each family's ``build`` on tiny parameters gives one."""
    from flux2_core.families.family import Transformer
    from flux2_core.models.layers import Layers
    from tests.tiny.flux3 import tiny_flux3
    from tests.toy_family import TOY_VARIANT

    for family, params in [(FLUX2, TINY_TRANSFORMER), (FLUX3, tiny_flux3()), (toy, TOY_VARIANT.params)]:
        model = family.build(params, Layers())
        assert isinstance(model, Transformer), family.name
        assert model.params is params and model.dtype == torch.float32 and model.device.type == "cpu"
        blocks = model.blocks()
        assert isinstance(blocks, list) and all(isinstance(block, torch.nn.Module) for block in blocks)
        assert blocks or family is toy                        # the toy runs its few layers as one piece
    assert not isinstance(torch.nn.Linear(2, 2), Transformer)


def test_encoder_messages_come_from_the_registry_and_an_unread_encoder_is_refused(toy):
    """The loader's hint lists each registered release's encoder (a family that joins is in it); an encoder whose
    language model no family reads gets no family by default."""
    from dataclasses import replace

    from flux2_core.families.flux2.variants import QWEN3_4B

    hint = families.encoder_hint()
    assert "FLUX.2 Klein 4B reads Qwen3-4B (qwen_3_4b.safetensors or a Qwen3-4B GGUF)" in hint
    assert "FLUX 3 Image Klein reads Qwen3-VL-4B-Instruct" in hint and "Toy reads Qwen3" in hint
    assert families.family_of_encoder(QWEN3_4B) is FLUX2
    with pytest.raises(Flux2Error, match=r"no model family reads prompts encoded by Gemma \(gemma\); FLUX.2 Klein 4B"):
        families.family_of_encoder(replace(QWEN3_4B, model="gemma", title="Gemma"))
