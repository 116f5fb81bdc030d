"""The engine's rules for careless or hostile input, each checked where it bites: settings refused before any model
runs, NaN / inf stopped at the stage that made them (never a black image), memory refused before it is allocated,
large work announced before it starts, and the one guidance rule the CLI and the nodes share.

The models are the demo's tiny random ones (``demo.demo_models``); each test that breaks a weight breaks a copy.
"""

import copy
import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from flux2_core import checks, pipeline, stages
from flux2_core.app import cli
from flux2_core.app.demo import demo_models
from flux2_core.errors import Flux2Error
from flux2_core.families import VARIANTS
from flux2_core.runtime import memory
from flux2_core.runtime.cache import PromptCache
from flux2_core.sampling import euler

SIZE = {"width": 64, "height": 64}


@pytest.fixture(scope="module")
def models():
    return demo_models("klein-4b", "cpu")


def with_copy(models, part: str, **changes):
    """The models with a deep copy of one part (transformer, autoencoder, prompt_encoder) and no caches."""
    return dataclasses.replace(models, **{part: copy.deepcopy(getattr(models, part))}, prompt_cache=None,
                               reference_cache=None, **changes)


def poison(module: torch.nn.Module, name: str, value: float) -> None:
    with torch.no_grad():
        dict(module.named_parameters())[name].view(-1)[0] = value


# --- numbers ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value,low,high,above,message", [
    (math.nan, 0, 1, False, "finite"), (math.inf, 0, None, False, "finite"), (-math.inf, None, 1, False, "finite"),
    (10 ** 400, 0, None, False, "finite"), (True, 0, 1, False, "a number"), ("2", 0, 5, False, "a number"),
    (0.0, 0, 1, True, r"\(0, 1\]"), (1.5, 0, 1, False, r"\[0, 1\]"), (-0.1, 0, None, False, r"\[0, inf\]"),
])
def test_number_refuses_what_comparisons_let_through(value, low, high, above, message):
    with pytest.raises(Flux2Error, match=message):
        checks.number("x", value, low, high, above_low=above)


def test_number_accepts_the_range_ends():
    assert checks.number("x", 0, 0, 1) == 0.0 and checks.number("x", 1, 0, 1, above_low=True) == 1.0


# --- the guidance rule ---------------------------------------------------------------------------------------------

KLEIN, BASE, KV, DEV = (VARIANTS[n] for n in ("klein-4b", "klein-base-4b", "klein-9b-kv", "dev"))


@pytest.mark.parametrize("variant,cfg,negative,cfg_on,embedded,noted", [
    # distilled models: one pass whatever cfg says; a value other than 1 is ignored, and said so
    (KLEIN, 1.0, True, False, None, False), (KLEIN, 4.0, True, False, None, True), (KV, 0.0, False, False, None, True),
    # base models: CFG whenever cfg is not 1 and a negative is at hand (below 1 too, as BFL and ComfyUI)
    (BASE, 4.0, True, True, None, False), (BASE, 0.5, True, True, None, False), (BASE, 1.0, True, False, None, False),
    (BASE, 4.0, False, False, None, True), (BASE, 1.0, False, False, None, False),
    # FLUX.2-dev: the guidance embedding takes the value
    (DEV, 3.5, True, False, 3.5, False),
])
def test_one_guidance_rule(variant, cfg, negative, cfg_on, embedded, noted):
    rule = euler.guidance_for(variant, cfg, negative)
    assert (rule.cfg, rule.embedded, bool(rule.note), rule.scale) == (cfg_on, embedded, noted, cfg)


@pytest.mark.parametrize("cfg", [math.nan, math.inf, -1.0, 1e30])
def test_guidance_refuses_absurd_scales_for_every_variant(cfg):
    for variant in (KLEIN, BASE, DEV):
        with pytest.raises(Flux2Error, match="cfg"):
            euler.guidance_for(variant, cfg)


# --- settings refused before any model runs -------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    ({"cfg": math.nan}, "cfg must be a finite number"), ({"cfg": 1e30}, r"cfg must be in \[0, 100\]"),
    ({"strength": 0.5}, "no image to start from"),
    ({"strength": math.nan, "image": Image.new("RGB", (64, 64))}, "strength must be a finite number"),
    ({"sigmas": [1.0, math.nan, 0.0]}, "finite numbers"), ({"sigmas": [1.0, math.inf, 0.0]}, "finite numbers"),
    ({"steps": 10 ** 9}, "steps must be a whole number from 1 to 10000"),
    ({"width": 16384, "height": 16384}, "at most about 4688x4688"),
    ({"batch": 0}, "batch"),
])
def test_bad_settings_are_refused_before_the_text_encoder_runs(models, monkeypatch, kwargs, message):
    monkeypatch.setattr(pipeline, "encode_prompts", lambda *a: pytest.fail("the text encoder ran"))
    with pytest.raises(Flux2Error, match=message):
        pipeline.generate(models, "a fox", **{**SIZE, **kwargs})


# --- NaN / inf at the stage boundaries ------------------------------------------------------------------------------

@pytest.mark.slow
def test_nan_in_the_transformer_stops_the_run_at_the_denoised_latents(models):
    broken = with_copy(models, "transformer")
    poison(broken.transformer, "final_layer.linear.weight", math.nan)
    with pytest.raises(Flux2Error, match="the denoised latents hold NaN.*transformer's weights hold NaN"):
        pipeline.generate(broken, "a fox", **SIZE, steps=2)


@pytest.mark.slow
def test_nan_in_the_text_encoder_stops_the_run_before_any_cache_keeps_it(models):
    broken = dataclasses.replace(with_copy(models, "prompt_encoder"), prompt_cache=PromptCache())
    poison(broken.prompt_encoder.model, "layers.3.mlp.down_proj.weight", math.inf)
    with pytest.raises(Flux2Error, match="the prompt embeddings hold NaN.*text encoder's weights"):
        pipeline.generate(broken, "a fox", **SIZE, steps=2)
    assert len(broken.prompt_cache.cache) == 0


def test_nan_in_the_autoencoder_stops_the_run_at_the_decoded_images(models):
    broken = with_copy(models, "autoencoder")
    poison(broken.autoencoder, "decoder.conv_out.weight", math.nan)
    with pytest.raises(Flux2Error, match="the decoded images hold NaN.*autoencoder's weights"):
        pipeline.generate(broken, "a fox", **SIZE, steps=2)


def test_float16_overflow_is_named_with_its_fix(models):
    """Activations past float16's 65504 (an input projection 3e4 times larger): float32 and bfloat16 run the same
    weights to a finite result, float16 overflows, and the message says to use bfloat16 or float32."""
    big = with_copy(models, "transformer")
    with torch.no_grad():
        big.transformer.img_in.weight.mul_(3e4)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.isfinite(pipeline.generate(dataclasses.replace(big, transformer=big.transformer.to(dtype)),
                                                "a fox", **SIZE, steps=2).latents).all()
    with pytest.raises(Flux2Error, match="float16, which overflowed.*use bfloat16 or float32"):
        pipeline.generate(dataclasses.replace(big, transformer=big.transformer.to(torch.float16)), "a fox", **SIZE,
                          steps=2)


def test_the_cli_writes_no_black_image(models, tmp_path, monkeypatch, capsys):
    broken = with_copy(models, "autoencoder")
    poison(broken.autoencoder, "decoder.conv_in.weight", math.inf)
    monkeypatch.setattr("flux2_core.app.demo.demo_models", lambda variant, device: broken)
    assert cli.main(["--demo", "--prompt", "a fox", "--steps", "1", "--width", "64", "--height", "64",
                     "--out", str(tmp_path / "out")]) == 2
    assert "error: the decoded images hold NaN" in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.png"))


# --- memory ------------------------------------------------------------------------------------------------------------

def test_memory_is_refused_before_it_is_allocated(models, monkeypatch, machine):
    made = []
    monkeypatch.setattr(stages, "make_noise", lambda *a, **k: made.append(1))
    machine.free(1 << 20)
    with pytest.raises(Flux2Error, match=r"generating 1 x 64x64 needs about .* GiB of working memory, but only 0\.0"):
        pipeline.generate(models, "a fox", **SIZE, steps=1)
    assert not made


def test_the_refusal_is_the_estimate_of_the_largest_stage(models, machine):
    """Exactly at the estimate the run goes on; one byte less is refused. The estimate is the largest of the
    denoiser's working memory and the autoencoder's least decode, each tested against measured peaks elsewhere."""
    h = w = 4
    needed = max(memory.denoiser_memory(models.transformer, models.variant, 1, h, w, torch.float32),
                 memory.least_decode_bytes(models.autoencoder, h, w))
    machine.free(needed)
    assert pipeline.generate(models, "a fox", **SIZE, steps=1).images.shape == (1, 64, 64, 3)
    machine.free(needed - 1)
    with pytest.raises(Flux2Error, match="working memory"):
        pipeline.generate(models, "a fox", **SIZE, steps=1)


def test_noise_that_cannot_fit_is_refused_before_it_is_drawn(machine):
    nbytes = 2 * 128 * (64 // 16) * (48 // 16) * 4                   # batch x channels x latent cells x float32
    machine.free(nbytes)
    assert euler.make_noise(2, 64, 48, 0).shape == (2, 128, 4, 3)
    machine.free(nbytes - 1)
    with pytest.raises(Flux2Error, match="noise for 2 x 48x64 on cpu"):
        euler.make_noise(2, 64, 48, 0)


@pytest.mark.real_machine
@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="needs Linux's /proc/meminfo")
def test_available_cpu_memory_is_what_linux_says():
    meminfo = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemAvailable:"))
    assert abs(memory.free_memory("cpu") - meminfo) < 0.05 * meminfo


# --- large work, announced first -----------------------------------------------------------------------------------

def test_large_work_thresholds():
    assert pipeline.large_work(2048, 2048, 200) == []
    size, steps = pipeline.large_work(2064, 2048, 201)
    assert "2064x2048 is 4.2 megapixels" in size and "201 steps" in steps


def test_large_work_is_said_before_the_first_step(models, monkeypatch):
    monkeypatch.setattr(pipeline, "LARGE_STEPS", 1)
    events = []
    result = pipeline.generate(models, "a fox", **SIZE, steps=2, warn=lambda note: events.append("note"),
                               callback=lambda step: events.append("step"))
    assert events == ["note", "step", "step"] and "2 steps" in result.warnings[0]


def test_the_cli_prints_notes_before_sampling(monkeypatch, tmp_path, capsys, models):
    monkeypatch.setattr("flux2_core.app.demo.demo_models", lambda variant, device: models)
    monkeypatch.setattr(pipeline, "LARGE_PIXELS", 1000)
    monkeypatch.setattr(cli.Progress, "__call__", lambda self, step: print("STEP", file=sys.stderr))
    assert cli.main(["--demo", "--prompt", "a fox", "--steps", "1", "--width", "64", "--height", "64", "--cfg", "3",
                     "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert err.index("note: 64x64 is 0.0 megapixels") < err.index("STEP")
    assert err.index("note: cfg 3 is ignored") < err.index("STEP")


# --- devices -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device,message", [
    pytest.param("cuda", "sees no CUDA GPU", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA")),
    ("gpu", "not a device name"),
])
def test_unusable_devices_are_said_before_loading(capsys, device, message):
    assert cli.main(["--demo", "--prompt", "x", "--device", device]) == 2
    assert message in capsys.readouterr().err


def test_out_of_memory_ends_in_a_message_not_a_traceback(monkeypatch, capsys, models):
    monkeypatch.setattr("flux2_core.app.demo.demo_models", lambda variant, device: models)

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    monkeypatch.setattr(pipeline, "generate", oom)
    assert cli.main(["--demo", "--prompt", "x"]) == 2
    assert "error: out of memory (CUDA out of memory. Tried to allocate 20.00 GiB)" in capsys.readouterr().err



def test_each_variant_has_its_edition_and_title_and_a_file_name_picks_it():
    """One registry: the edition (which the file name hints and CFG follows), the model family and the name that
    messages use."""
    from types import SimpleNamespace

    from flux2_core.families.flux2.variants import variant_for_params
    from flux2_core.weights import check_text_encoder_fits
    from tests.tiny.transformer import TINY_TRANSFORMER

    expected = {"klein-4b": ("distilled", "FLUX.2 Klein 4B"), "klein-9b": ("distilled", "FLUX.2 Klein 9B"),
                "klein-9b-kv": ("kv", "FLUX.2 Klein 9B KV"), "klein-base-4b": ("base", "FLUX.2 Klein Base 4B"),
                "klein-base-9b": ("base", "FLUX.2 Klein Base 9B")}
    for name, (edition, title) in expected.items():
        variant = VARIANTS[name]
        assert (variant.edition, variant.title, variant.uses_cfg) == (edition, title, edition == "base")
        assert variant.family == "flux2"
        assert variant_for_params(variant.params, f"flux-2-{name}-Q4_K_M.gguf") is variant
    custom = variant_for_params(TINY_TRANSFORMER, "my-base-finetune")
    assert (custom.name, custom.edition, custom.title) == ("custom", "base", "")
    qwen3_4b = SimpleNamespace(model=SimpleNamespace(embed_tokens=torch.nn.Embedding(1, 2560)))
    with pytest.raises(Flux2Error, match=r"this is FLUX.2 Klein 9B KV; it needs the .*Qwen3-8B"):
        check_text_encoder_fits(VARIANTS["klein-9b-kv"], qwen3_4b)
    with pytest.raises(Flux2Error, match=r"this is a FLUX.2 model taking \d+-wide text embeddings"):
        check_text_encoder_fits(custom, qwen3_4b)
