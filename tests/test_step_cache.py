"""The step cache (``sampling/step_cache.py``): its decisions against hand-computed ones on velocities whose changes
are known in closed form, its per-sample decisions in a batch, threshold 0 as the uncached run bit for bit, and the
whole pipeline with it (reported calls, model calls really saved, inpainting's kept region, KV references, batches,
FLUX 3, the command line)."""

import pytest
import torch

from flux2_core.errors import Flux2Error
from flux2_core.pipeline import generate
from flux2_core.sampling import euler as euler_module
from flux2_core.sampling.euler import denoise, euler
from flux2_core.sampling.references import image_to_tensor
from flux2_core.sampling.step_cache import StepCache
from tests import test_pipeline
from tests.device import assert_close
from tests.test_pipeline import PROMPT, box_mask, counting, photo

tiny = test_pipeline.tiny        # the fixture: the pipeline tests' tiny Klein models (distilled, base, KV)

TENTHS = [1 - i / 10 for i in range(11)]        # 10 steps of 0.1


def scaled_velocity(rates: list[float]):
    """v = -a_i x per sample: each Euler step moves sample i by a_i * 0.1 of itself (relative), and its velocity
    changes exactly as its input does (rate 1)."""
    a = torch.tensor(rates).view(-1, 1, 1, 1)
    calls = []

    def velocity(x, t, t_next):
        calls.append(x.shape[0])
        return -a.to(x.dtype) * x
    return velocity, calls


def test_decisions_follow_the_rule_by_hand():
    """Steps 0 and 1 compute (warm-up; rate 1). Step 2: the input moved 0.1 of itself since step 1 -> 0.1 < 0.15,
    reuse. Step 3: 0.1 + 0.1 = 0.2 since step 1 -> compute. So every other step, and step 9 is the guard."""
    cache = StepCache(0.15)
    velocity, calls = scaled_velocity([1.0])
    euler(cache.wrap(velocity, 10), torch.ones(1, 4, 2, 2), TENTHS)
    assert cache.computed_steps == [0, 1, 3, 5, 7, 9] and cache.skipped_steps == [2, 4, 6, 8]
    assert len(calls) == 6 and cache.report().record() == {"threshold": 0.15, "computed": 6, "skipped": 4}
    assert cache.report().line() == "step cache 0.15: 4 of 10 model calls skipped (6 computed)"


def test_warmup_and_guard_bound_the_reuse():
    """A constant velocity never changes (rate 0): every step inside the window reuses it, 15% of the steps at the
    start (3 of 20) and 5% at the end (1) compute; the result is the uncached one exactly (v is the same)."""
    sigmas = [1 - i / 20 for i in range(21)]
    v = torch.randn(2, 4, 2, 2)
    cache = StepCache(0.01)
    x = torch.randn(2, 4, 2, 2)
    got = euler(cache.wrap(lambda x, t, t_next: v.clone(), 20), x, sigmas)
    assert cache.computed_steps == [0, 1, 2, 19] and cache.skipped_steps == list(range(3, 19))
    assert torch.equal(got, euler(lambda x, t, t_next: v.clone(), x, sigmas))


def test_each_sample_of_a_batch_decides_alone():
    """Sample 2 moves twice as fast (0.2 per step, over the threshold): the model runs at every step, but sample 1
    still reuses its velocity at its own skip steps, so each equals its run alone, bit for bit."""
    x = torch.ones(2, 4, 2, 2) * torch.tensor([1.0, 3.0]).view(-1, 1, 1, 1)
    batch_cache = StepCache(0.15)
    velocity, calls = scaled_velocity([1.0, 2.0])
    together = euler(batch_cache.wrap(velocity, 10), x, TENTHS)
    assert batch_cache.skipped_steps == [] and calls == [2] * 10
    alone = []
    for i, rate in enumerate([1.0, 2.0]):
        cache = StepCache(0.15)
        alone.append(euler(cache.wrap(scaled_velocity([rate])[0], 10), x[i:i + 1], TENTHS))
        assert cache.skipped_steps == ([2, 4, 6, 8] if i == 0 else [])
    assert torch.equal(together, torch.cat(alone))


@pytest.mark.parametrize("threshold", [-0.1, 1.5, float("nan"), "0.1", True])
def test_bad_thresholds_are_refused(threshold):
    with pytest.raises(Flux2Error, match="cache must be"):
        StepCache(threshold)


def test_bad_thresholds_are_refused_before_any_work(tiny, monkeypatch):
    models = tiny[0]["base"]
    calls = counting(monkeypatch, models.transformer, "forward")
    with pytest.raises(Flux2Error, match=r"cache must be .*0 turns the step cache off"):
        generate(models, PROMPT, width=32, height=32, steps=4, seed=1, cache=2.0)
    assert calls == []


# --- the pipeline with it ---------------------------------------------------------------------------------------------

def test_threshold_zero_is_the_uncached_run(tiny):
    """CFG base model, 12 steps: StepCache(0) computes every step and gives the uncached latent bit for bit."""
    models = tiny[0]["base"]
    x = euler_module.make_noise(1, 48, 32, seed=3).to(models.transformer.dtype)
    txt, neg = (models.prompt_encoder.encode([p]).row(0) for p in (PROMPT, ""))
    sigmas = [1 - i / 12 for i in range(13)]
    cache = StepCache(0.0)
    cached = denoise(models.transformer, x, sigmas, txt, negative_txt=neg, cfg=3.0, cache=cache)
    plain = denoise(models.transformer, x, sigmas, txt, negative_txt=neg, cfg=3.0)
    assert torch.equal(cached, plain) and cache.computed_steps == list(range(12))


def test_generate_saves_model_calls_and_reports_them(tiny, monkeypatch):
    """A 20-step CFG run: the transformer runs exactly once per computed step (both CFG halves in that call), the
    report counts every step once, and a higher threshold skips more and moves further from the uncached latent
    (on these random weights the velocity changes several times faster than the latent, so it takes thresholds
    higher than real models do)."""
    models = tiny[0]["base"]
    args = {"width": 48, "height": 32, "steps": 20, "cfg": 3.0, "seed": 2}
    plain = generate(models, PROMPT, **args)
    assert "cache" not in plain.settings
    skipped, errors = [], []
    for threshold in (0.5, 0.7):
        calls = counting(monkeypatch, models.transformer, "forward")
        result = generate(models, PROMPT, cache=threshold, **args)
        record = result.settings["cache"]
        assert record["threshold"] == threshold and record["computed"] + record["skipped"] == 20
        assert len(calls) == record["computed"] and all(x.shape[0] == 2 for x in calls)      # [negative, prompt]
        skipped.append(record["skipped"])
        errors.append(((result.latents - plain.latents).norm() / plain.latents.norm()).item())
        monkeypatch.undo()
    assert 0 < skipped[0] < skipped[1] <= 20 - 3 - 1            # never in the warm-up (3) or the guard (1)
    assert 0 < errors[0] < errors[1] < 0.2


def test_a_batch_with_the_cache_equals_single_runs(tiny):
    models = tiny[0]["base"]
    args = {"width": 48, "height": 32, "steps": 20, "cfg": 2.5, "negative": "blurry", "cache": 0.5}
    batch = generate(models, PROMPT, seed=7, batch=2, **args)
    singles = [generate(models, PROMPT, seed=7 + i, **args) for i in range(2)]
    assert sum(s.settings["cache"]["skipped"] for s in singles) > 0
    for i, single in enumerate(singles):
        assert_close(batch.latents[i:i + 1], single.latents, "transformer", rtol=0, atol=1e-5)


def test_inpainting_with_the_cache_keeps_the_source_outside_the_mask(tiny):
    models = tiny[0]["distilled"]
    image = photo(80, 64, seed=9)
    result = generate(models, PROMPT, image=image, mask=box_mask((80, 64), (16, 16, 48, 48)), strength=0.9,
                      steps=20, seed=1, cache=0.6)
    assert result.settings["cache"]["skipped"] > 0
    source = models.autoencoder.encode(image_to_tensor(image).to(models.device)).float().cpu()
    keep = torch.ones(4, 5, dtype=torch.bool)
    keep[1:3, 1:3] = False
    assert torch.equal(result.latents[0][:, keep], source[0][:, keep])


def test_kv_references_are_computed_once_and_skipped_steps_call_nothing(tiny, monkeypatch):
    models = tiny[0]["kv"]
    refs = [photo(64, 64, 2)]
    passes = counting(monkeypatch, models.transformer, "reference_kv")
    calls = counting(monkeypatch, models.transformer, "forward")
    result = generate(models, PROMPT, references=refs, width=32, height=32, steps=20, seed=3, cache=0.6)
    assert len(passes) == 1 and result.settings["cache"]["skipped"] > 0
    assert len(calls) == result.settings["cache"]["computed"]


def test_flux3_with_the_cache(tmp_path):
    """FLUX 3's flow map is told each step's t_next: a reused velocity is the last one the model gave, and the run
    is reported like FLUX.2's (the tiny random model's velocity changes fast: it takes a high threshold)."""
    pytest.importorskip("mlx.core", reason="the FLUX 3 tiny files come from tests/tiny/flux3.py (needs mlx)")
    from tests.test_flux3 import flux3_files
    from tests.tiny.flux3 import our_models

    params, state, te, ae = flux3_files(tmp_path, flow_map=True)
    models = our_models(params, state, te, ae)
    args = {"width": 64, "height": 48, "steps": 16, "seed": 3}
    plain = generate(models, "a fox", **args)
    cached = generate(models, "a fox", cache=0.9, **args)
    record = cached.settings["cache"]
    assert record["computed"] + record["skipped"] == 16 and record["skipped"] > 0
    assert not torch.equal(cached.latents, plain.latents)


def test_the_command_line_takes_a_threshold_and_records_it(tmp_path, capsys):
    from flux2_core.app import cli
    from tests.test_cli import png_parameters, write_models_folder

    write_models_folder(tmp_path)
    out = tmp_path / "out"
    code = cli.main(["--models", str(tmp_path), "--prompt", "a fox", "--width", "32", "--height", "32", "--steps",
                     "12", "--seed", "1", "--device", "cpu", "--cache", "0.3", "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    _, params = png_parameters(out / "flux2_1.png")
    assert params["cache"]["threshold"] == 0.3 and params["cache"]["computed"] + params["cache"]["skipped"] == 12
    assert f"step cache 0.3: {params['cache']['skipped']} of 12 model calls skipped" in printed.err
    with pytest.raises(SystemExit):
        cli.main(["--models", str(tmp_path), "--prompt", "x", "--cache", "-1", "--out", str(tmp_path / "b")])
    assert "--cache" in capsys.readouterr().err
