"""What a LoRA costs: per denoising step (none, merged, run-time branch) and to apply and remove on a model.

    python bench/lora.py                                  # CPU: steps on the "medium" config, apply/remove on Klein 4B
    python bench/lora.py --step-config tiny --apply-config medium --rounds 2     # a quick check

A random rank-16 LoRA (ai-toolkit format: every block linear, as ai-toolkit trains) is read with
``lora.read_adapter`` and applied with ``patching.set_adapters``:

    step        one transformer forward (1024 image + 512 text tokens on "medium"), median over rounds, for the
                model as loaded, with the LoRA merged (expected: the same), and as a run-time branch (fp8's way)
    apply       merging it into the weights (the originals are copied to CPU memory first)
    remove      restoring the originals; the weights are then checked to be bit-identical to the loaded ones
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import CONFIGS, machine, random_state  # bench/bench.py (this folder is first on sys.path)
from flux2_core.adapters.lora import read_adapter
from flux2_core.adapters.patching import set_adapters
from flux2_core.families.flux2.transformer import Flux2Transformer
from flux2_core.models import rope

RANK = 16


def build(params, dtype: torch.dtype) -> Flux2Transformer:
    with torch.device("meta"):
        model = Flux2Transformer(params)
    model.load_state_dict(random_state(model, 0, "cpu", dtype), assign=True)
    return model.eval()


def random_lora(model: Flux2Transformer, dtype: torch.dtype) -> list:
    """(patch, strength 1) pairs of a rank-RANK LoRA on every linear layer of the blocks."""
    g = torch.Generator().manual_seed(1)
    sd = {}
    for name, layer in model.named_modules():
        if isinstance(layer, torch.nn.Linear) and name.startswith(("double_blocks.", "single_blocks.")):
            sd[f"diffusion_model.{name}.lora_A.weight"] = torch.randn(RANK, layer.in_features, generator=g).to(dtype)
            sd[f"diffusion_model.{name}.lora_B.weight"] = (0.01 * torch.randn(layer.out_features, RANK, generator=g)
                                                           ).to(dtype)
    adapter = read_adapter(sd, model.params, name="random rank-16 LoRA")
    print(adapter.report.summary())
    return [(p, 1.0) for p in adapter.patches]


def step_times(model: Flux2Transformer, rounds: int, size: int) -> list[float]:
    g = torch.Generator().manual_seed(2)
    h = w = size // 16
    p, dtype = model.params, model.dtype
    img, txt = torch.randn(1, h * w, p.in_channels, generator=g).to(dtype), torch.randn(1, 512, p.context_in_dim,
                                                                                      generator=g).to(dtype)
    args = (img, rope.image_ids(1, h, w), torch.tensor([0.5], dtype=dtype), txt, rope.text_ids(1, 512))
    times = []
    with torch.no_grad():
        model(*args)                                         # warm-up (the first call after a change of adapters)
        for _ in range(rounds):
            start = time.perf_counter()
            model(*args)
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step-config", default="medium", choices=sorted(CONFIGS))
    ap.add_argument("--apply-config", default="klein-4b", choices=sorted(CONFIGS))
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    print(machine())

    cfg = CONFIGS[args.step_config]
    dtype = getattr(torch, cfg.dtype)
    model = build(cfg.transformer, dtype)
    patches = random_lora(model, dtype)
    times = {"none": [], "merged": [], "branch": []}
    for _ in range(args.rounds):                 # the modes take turns, so drifts of the machine hit all alike
        for mode, merge in (("none", None), ("merged", None), ("branch", False)):
            set_adapters(model, [] if mode == "none" else patches, key=mode, merge=merge)
            times[mode] += step_times(model, 1, cfg.size)
    medians = {mode: statistics.median(t) for mode, t in times.items()}
    print(f"\nstep ({args.step_config}, {cfg.dtype}, {cfg.size}^2): " + ", ".join(
        f"{mode} {t * 1000:.1f} ms ({t / medians['none']:.3f}x)" for mode, t in medians.items()))

    cfg = CONFIGS[args.apply_config]
    dtype = getattr(torch, cfg.dtype)
    model = build(cfg.transformer, dtype)
    loaded = {k: v.clone() for k, v in model.state_dict().items()}
    patches = random_lora(model, dtype)
    start = time.perf_counter()
    set_adapters(model, patches, key="lora")
    applied = time.perf_counter() - start
    start = time.perf_counter()
    set_adapters(model, [])
    removed = time.perf_counter() - start
    exact = all(torch.equal(v, loaded[k]) for k, v in model.state_dict().items())
    params = sum(t.numel() for t in loaded.values())
    print(f"apply/remove ({args.apply_config}, {params / 1e9:.2f} B parameters, {cfg.dtype}): apply {applied:.2f} s, "
          f"remove {removed:.2f} s, weights restored bit for bit: {exact}")
    if not exact:
        raise SystemExit("the weights were not restored exactly")


if __name__ == "__main__":
    main()
