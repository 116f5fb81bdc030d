"""The step cache's trade: model calls saved and time, against how far the picture moves from the uncached run.

    python bench/step_cache.py                                  # CPU: medium configs, 256^2, thresholds 0..0.9
    python bench/step_cache.py --size 512 --threshold 0.1 --threshold 0.3
    python bench/step_cache.py --only flux3-klein               # one of: flux2-base, flux3-klein, flux3-klein-base
    python bench/step_cache.py --only flux2-base --config klein-4b --device cuda --dtype bfloat16 --size 1024 \
        --threshold 0.5 --weights W --json out.json            # (gpu-check: the real 4B's shapes)

For each model: one uncached ``generate`` (threshold 0), then one per threshold on the same prompt and seed; each row
gives the model calls made (computed / steps), the time of the whole generation, and the picture's PSNR and largest
difference in 8-bit levels against the uncached one. The models: FLUX.2 Klein base (50 steps, CFG 4) at ``bench.py``'s
medium config, FLUX 3 Image Klein (16 steps) and its base (50 steps, CFG 3.5) at ``flux3.py``'s medium config, all
random weights in float32 (``--config`` / ``--device`` / ``--dtype`` change the FLUX.2 model's). Random weights make a velocity that changes much faster along the trajectory than a
trained model's does, so the thresholds that skip here are higher than the ones that serve a real model; the shape of
the trade (calls saved against PSNR) is what this measures.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPT = "a lighthouse on a cliff at dusk, waves breaking below, warm light in the windows"
THRESHOLDS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9)
MODELS = {"flux2-base": 50, "flux3-klein": 16, "flux3-klein-base": 50}     # name -> steps


def flux2_base(folder: Path, config: str, device: torch.device, dtype: torch.dtype):
    """FLUX.2 Klein base at ``bench.py``'s ``config``; a folder ``bench.py`` wrote (``--weights``) is reused."""
    from bench import CONFIGS, load_ours, set_distilled, write_weights

    if (folder / "model_index.json").exists():
        set_distilled(folder, False)
    else:
        write_weights(folder, replace(CONFIGS[config], dtype=str(dtype).removeprefix("torch.")), distilled=False,
                      device=str(device))
    return load_ours(folder, device, dtype, None)


def flux3(folder: Path, flow_map: bool):
    from flux3 import CONFIGS, files

    from tests.tiny.flux3 import our_models

    params = replace(CONFIGS["medium"], flow_map=flow_map)
    state, te, ae = files(folder, params)
    return our_models(params, state, te, ae)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = (a.double() - b.double()).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(255 ** 2 / mse)


def measure(models, steps: int, size: int, thresholds) -> list[dict]:
    """The uncached run, then one per threshold; a figure row each."""
    from flux2_core.pipeline import generate

    rows, plain = [], None
    for threshold in (0.0, *thresholds):
        start = time.perf_counter()
        result = generate(models, PROMPT, width=size, height=size, steps=steps, seed=11, cache=threshold)
        seconds = time.perf_counter() - start
        record = result.settings.get("cache", {"computed": steps, "skipped": 0})
        plain = plain or (result, seconds)
        diff = (result.images[0].int() - plain[0].images[0].int()).abs().max().item()
        rows.append({"threshold": threshold, "computed": record["computed"], "steps": steps, "seconds": seconds,
                     "speedup": plain[1] / seconds, "psnr": psnr(result.images[0], plain[0].images[0]),
                     "levels": diff})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=256, help="picture side in pixels (default 256)")
    ap.add_argument("--threshold", type=float, action="append", help="repeatable (default: 0.05 ... 0.9)")
    ap.add_argument("--only", choices=sorted(MODELS), action="append")
    ap.add_argument("--steps", type=int, help="override each model's steps")
    ap.add_argument("--config", default="medium", help="bench.py's config of the FLUX.2 model (default medium)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument("--weights", help="the FLUX.2 model's random-weight folder, reused (bench.py --weights W/CONFIG)")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    from flux3 import cpu_name

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type != "cpu" and set(args.only or MODELS) != {"flux2-base"}:
        ap.error("FLUX 3's medium config is built on the CPU: add --only flux2-base for another device")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    print(f"# step cache, {where}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"{args.size}x{args.size}, {args.dtype}, random weights\n")
    results = {}
    for name in args.only or MODELS:
        steps = args.steps or MODELS[name]
        with tempfile.TemporaryDirectory() as tmp:
            if name == "flux2-base":
                models = flux2_base(Path(args.weights) if args.weights else Path(tmp), args.config, device, dtype)
            else:
                models = flux3(Path(tmp), name == "flux3-klein")
            rows = results[name] = measure(models, steps, args.size, args.threshold or THRESHOLDS)
            del models
        print(f"## {name} ({steps} steps)\n")
        print("| threshold | model calls | time | speed-up | PSNR vs uncached | largest difference |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['threshold']:g} | {r['computed']} / {r['steps']} | {r['seconds']:.1f} s | "
                  f"{r['speedup']:.2f}x | {r['psnr']:.1f} dB | {r['levels']} levels |")
        print(flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": where, "size": args.size, "dtype": args.dtype,
                                               "models": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
