"""The benchmark's own arithmetic: the FLOP count behind its MFU figures, its per-stage summary and its stage meter."""

from __future__ import annotations

import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from bench import bench
from flux2_core import rope
from flux2_core.transformer import Flux2Transformer
from flux2_core.variants import TransformerParams


def test_transformer_flops_matches_torch_count():
    """torch's FlopCounterMode (F.linear and math attention under autograd) minus the per-item vector layers (time
    embedding, modulations, final adaLN: 2·(256·H + H·H + 15·H·H + 2·H·H) per item), which the formula leaves out."""
    p = TransformerParams(context_in_dim=96, hidden_size=64, num_heads=2, depth=2, depth_single_blocks=3,
                          axes_dim=(8, 8, 8, 8))
    model = Flux2Transformer(p)
    batch, h, w, n_txt = 2, 4, 5, 7
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(torch.zeros(batch, h * w, 128), rope.image_ids(batch, h, w), torch.full((batch,), 0.5),
              torch.zeros(batch, n_txt, 96), rope.text_ids(batch, n_txt))
    H = p.hidden_size
    vectors = batch * 2 * (256 * H + H * H + 15 * H * H + 2 * H * H)
    assert bench.transformer_flops(p, h * w, n_txt, batch) == counter.get_total_flops() - vectors


def test_summary_takes_medians_bests_and_peaks():
    def run(t, peak):
        return {"times": {"encode": t, "step0": 2 * t, "step1": 2 * t, "decode": t},
                "peaks": {"encode": peak, "step0": peak, "step1": peak + 1, "decode": peak}}
    reports = [{"runs": [run(1.0, 10), run(3.0, 10)], "max_memory": 50},
               {"runs": [run(2.0, 20)], "max_memory": 40}]
    s = bench.summarize(reports)
    assert s.median["encode"] == 2.0 and s.best["encode"] == 1.0
    assert s.median["steps"] == 8.0 and s.best["steps"] == 4.0
    assert s.median["total"] == 12.0
    assert s.peak["step1"] == 21 and s.peak["total"] == 21 and s.peak["process"] == 50


def test_meter_splits_time_between_stages():
    meter = bench.Meter(torch.device("cpu"))
    meter.mark("a")
    time.sleep(0.02)
    meter.mark("b")
    time.sleep(0.01)
    meter.mark("a")
    meter.mark(None)
    assert set(meter.times) == {"a", "b"}
    assert meter.times["a"] >= 0.02 and 0.01 <= meter.times["b"] < meter.times["a"]
    if sys.platform.startswith("linux"):
        assert meter.peaks["a"] > 0 and meter.highest >= meter.peaks["a"]


def test_driver_runs_end_to_end_on_the_tiny_config(tmp_path, capsys):
    """The whole driver as a GPU session would run it (random weights written as a diffusers folder, both sides in
    their own processes, the stage tables, MFU, the JSON; then the KV mode), on the tiny config: ours and diffusers
    must have computed the same latents."""
    import json

    out = tmp_path / "results.json"
    bench.main(["--config", "tiny", "--rounds", "1", "--repeats", "1", "--steps", "2", "--device", "cpu",
                "--weights", str(tmp_path), "--json", str(out)])
    result = json.loads(out.read_text())["configs"]["tiny"]
    assert result["latent_rel_diff"] < 1e-5
    assert {"encode", "step0", "step1", "decode", "total"} <= set(result["ours"]["median"])
    assert result["flops_per_step"] == bench.transformer_flops(bench.CONFIGS["tiny"].transformer, 16)
    printed = capsys.readouterr().out
    assert "of the measured matmul" in printed and "step1" in printed

    bench.main(["--config", "tiny", "--mode", "kv", "--repeats", "1", "--steps", "2", "--device", "cpu",
                "--weights", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "kv-cached" in printed and "speed-up vs joint" in printed
