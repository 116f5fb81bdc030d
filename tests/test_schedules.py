"""Schedules against an independent float64 computation of BFL's documented formula, the documented example values,
and diffusers' own scheduler."""

import math

import numpy as np
import pytest
import torch

from flux2_core.errors import Flux2Error
from flux2_core.families.flux2.schedule import empirical_mu, flux2_schedule, max_image_tokens
from flux2_core.families.flux3.schedule import flux3_schedule
from flux2_core.sampling.schedules import (
    MODELS_OWN,
    SCHEDULES,
    check_sigmas,
    linear_schedule,
    named_schedule,
    power_schedule,
    truncate_for_strength,
)


def expected_schedule(steps, tokens):
    """BFL's get_schedule written out again in numpy float64 from the documented constants."""
    a1, b1, a2, b2 = 8.73809524e-05, 1.89833333, 0.00016927, 0.45666666
    if tokens > 4300:
        mu = a2 * tokens + b2
    else:
        m200, m10 = a2 * tokens + b2, a1 * tokens + b1
        a = (m200 - m10) / 190.0
        mu = a * steps + (m200 - 200.0 * a)
    t = np.linspace(1.0, 0.0, steps + 1)
    with np.errstate(divide="ignore"):
        return np.exp(mu) / (np.exp(mu) + (1.0 / t - 1.0))


# (width, height): 16 tokens, 1024 tokens, 4096 (1024^2), 4080 (1360x768), 4300 exactly, 8100, 16384 tokens
SIZES = [(64, 64), (512, 512), (1024, 1024), (1360, 768), (1376, 800), (1440, 1440), (2048, 2048)]


@pytest.mark.parametrize("steps", [1, 4, 50])
@pytest.mark.parametrize("size", SIZES)
def test_flux2_schedule_matches_formula(steps, size):
    tokens = (size[0] // 16) * (size[1] // 16)
    ours = np.array(flux2_schedule(steps, tokens))
    assert ours.shape == (steps + 1,)
    assert ours[-1] == 0.0   # ours[0] may be 1 - 6e-8: fp32 exp(mu) * (1 / exp(mu)), as in the reference
    np.testing.assert_allclose(ours, expected_schedule(steps, tokens), rtol=0, atol=1e-6)
    assert np.all(np.diff(ours) < 0)


def test_sizes_cover_both_sides_of_the_switch():
    tokens = [(w // 16) * (h // 16) for w, h in SIZES]
    assert min(tokens) < 4300 < max(tokens) and 4300 in tokens


def test_documented_example_values():
    # bfl-flux2-klein.md section 5.2
    for tokens, steps, mu in [(4300, 4, 2.3085), (4301, 4, 1.1847), (4096, 4, 2.29118), (4096, 50, 2.02335),
                              (1024, 4, 2.03069), (1024, 50, 1.70196), (8100, 4, 1.82775), (8100, 50, 1.82775)]:
        assert empirical_mu(tokens, steps) == pytest.approx(mu, abs=6e-5)
    np.testing.assert_allclose(flux2_schedule(4, 64 * 64), [1.0, 0.967384, 0.908144, 0.767200, 0.0], atol=6e-7)
    np.testing.assert_allclose(flux2_schedule(4, 85 * 48), [1.0, 0.967341, 0.908031, 0.766958, 0.0], atol=6e-7)
    # diffusers-oracle.md: 64x64, 2 steps
    assert empirical_mu(16, 2) == pytest.approx(1.960378, abs=1e-6)
    np.testing.assert_allclose(flux2_schedule(2, 16), [1.0, 0.876574, 0.0], atol=6e-7)


def test_schedule_values_are_float32():
    for s in flux2_schedule(50, 4096):
        assert np.float32(s) == s


@pytest.mark.parametrize("steps,tokens", [(4, 16), (4, 4096), (50, 4096), (28, 1024), (4, 16384)])
def test_matches_diffusers_scheduler(steps, tokens):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu
    sched = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type="exponential")
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=compute_empirical_mu(tokens, steps))
    np.testing.assert_allclose(flux2_schedule(steps, tokens), sched.sigmas.numpy(), rtol=0, atol=1e-6)


def test_linear_and_power():
    np.testing.assert_allclose(linear_schedule(4), [1.0, 0.75, 0.5, 0.25, 0.0])
    np.testing.assert_allclose(power_schedule(4, 1.0), linear_schedule(4))
    np.testing.assert_allclose(power_schedule(4, 2.0), [1.0, 0.5625, 0.25, 0.0625, 0.0], atol=1e-7)
    np.testing.assert_allclose(power_schedule(2, 0.5), [1.0, 0.5 ** 0.5, 0.0], atol=1e-7)


def test_bad_inputs():
    for steps in [0, -1, 2.5, True]:
        with pytest.raises(Flux2Error, match="steps"):
            flux2_schedule(steps, 16)
    with pytest.raises(Flux2Error, match="steps"):
        linear_schedule(0)
    with pytest.raises(Flux2Error, match="rho"):
        power_schedule(4, 0.0)


def test_check_sigmas():
    assert check_sigmas([1, 0.5, 0]) == [1.0, 0.5, 0.0]
    assert check_sigmas(np.array([0.8, 0.2])) == [pytest.approx(0.8), pytest.approx(0.2)]
    for bad, what in [([1.0], "two"), ([1.2, 0.0], r"\[0, 1\]"), ([1.0, float("nan")], r"\[0, 1\]"),
                      ([1.0, float("inf"), 0.0], "finite"),
                      ([1.0, 0.5, 0.5, 0.0], "decrease"), ([0.0, 1.0], "decrease")]:
        with pytest.raises(Flux2Error, match=what):
            check_sigmas(bad)


def test_truncate_for_strength():
    s = [1.0, 0.9, 0.7, 0.4, 0.0]
    assert truncate_for_strength(s, 1.0) == s
    assert truncate_for_strength(s, 0.5) == [0.7, 0.4, 0.0]
    assert truncate_for_strength(s, 0.6) == [0.9, 0.7, 0.4, 0.0]    # int(4 - 2.4) = 1 step skipped
    assert truncate_for_strength(s, 0.25) == [0.4, 0.0]
    for bad in [0.0, -0.1, 1.5]:
        with pytest.raises(Flux2Error, match="strength"):
            truncate_for_strength(s, bad)
    with pytest.raises(Flux2Error, match="no step"):
        truncate_for_strength(s, 1e-17)
    assert truncate_for_strength(s, 0.01) == [0.4, 0.0]   # any strength > 0 runs at least the last step


def bfl_get_schedule(steps, tokens):
    """BFL's get_schedule as its code runs it in torch (bfl-flux2-klein.md 5.2: time_shift with sigma 1.0 on an fp32
    linspace, exp(mu) a Python float), from the documented constants; NaN where exp(mu) leaves float64."""
    a1, b1, a2, b2 = 8.73809524e-05, 1.89833333, 0.00016927, 0.45666666
    m200, m10 = a2 * tokens + b2, a1 * tokens + b1
    mu = m200 if tokens > 4300 else (m200 - m10) / 190 * steps + m200 - 200 * (m200 - m10) / 190
    t = torch.linspace(1, 0, steps + 1)
    if mu > 709:
        return [float("nan")] * (steps + 1)
    return (math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** 1.0)).tolist()


@pytest.mark.parametrize("steps", [1, 4, 50, 200])
def test_the_largest_size_is_where_the_reference_stops_decreasing(steps):
    """At max_image_tokens the reference's float32 schedule still strictly decreases; one token more and two levels
    are equal (or NaN): flux2_schedule refuses from there, naming the limit, rather than run steps that do nothing."""
    limit = max_image_tokens(steps)
    good, bad = np.array(bfl_get_schedule(steps, limit)), np.array(bfl_get_schedule(steps, limit + 1))
    assert np.all(np.diff(good) < 0) and not np.all(np.diff(bad) < 0)
    assert flux2_schedule(steps, limit) == good.tolist()
    side = int(limit ** 0.5) * 16
    with pytest.raises(Flux2Error, match=f"at most about {side}x{side} px"):
        flux2_schedule(steps, limit + 1)


def test_sizes_past_float_range_are_refused_too():
    for tokens in [(16384 // 16) ** 2, (65536 // 16) ** 2]:        # exp(mu) overflows float32, then float64
        with pytest.raises(Flux2Error, match="overflows to NaN"):
            flux2_schedule(4, tokens)


def test_steps_and_named_schedules():
    with pytest.raises(Flux2Error, match="from 1 to 10000"):
        linear_schedule(10_001)
    assert named_schedule("flux2", 4, 4096) == flux2_schedule(4, 4096)
    assert named_schedule("flux3", 4, 4096) == flux3_schedule(4)
    # the Scheduler node's options, which saved workflows store as text: the model's own, the families' own, then the
    # shared ones (the names saved workflows hold before the model's own was added stay as they were)
    assert SCHEDULES == ("model's own", "flux2", "flux3", "linear", "power") and MODELS_OWN == SCHEDULES[0]
    assert named_schedule("power", 4, 4096, 2.0) == power_schedule(4, 2.0)
    assert named_schedule("linear", 4, 4096, float("nan")) == linear_schedule(4)     # rho only matters to power
    for name, rho, what in [("power", float("nan"), "rho"), ("power", float("inf"), "rho"), ("karras", 1, "unknown schedule 'karras'; use one of flux2, flux3, linear, power")]:
        with pytest.raises(Flux2Error, match=what):
            named_schedule(name, 4, 4096, rho)


def test_the_models_own_schedule_is_its_familys_and_needs_the_model():
    from flux2_core.families import FAMILIES

    assert named_schedule(MODELS_OWN, 4, 4096, family=FAMILIES["flux3"]) == flux3_schedule(4)
    assert named_schedule(MODELS_OWN, 4, 4096, family=FAMILIES["flux2"]) == flux2_schedule(4, 4096)
    assert flux3_schedule(4) != flux2_schedule(4, 4096)
    assert named_schedule("linear", 4, 4096, family=FAMILIES["flux3"]) == linear_schedule(4)   # a named one wins
    with pytest.raises(Flux2Error, match="connect the model, or pick one of flux2, flux3, linear, power$"):
        named_schedule(MODELS_OWN, 4, 4096)


def test_strength_needs_an_image_below_one():
    from flux2_core.sampling.schedules import check_strength
    assert check_strength(1.0, False) == 1.0 and check_strength(0.3, True) == 0.3
    for strength, image, what in [(0.3, False, "no image"), (float("nan"), True, "finite"), (0.0, True, r"\(0, 1\]")]:
        with pytest.raises(Flux2Error, match=what):
            check_strength(strength, image)
