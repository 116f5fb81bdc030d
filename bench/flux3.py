"""FLUX 3 Image Klein on the CPU: our engine against flux3-mlx (mlx-cpu) on the same random weights.

    python bench/flux3.py                     # the medium config, 512^2, 4 steps
    python bench/flux3.py --config block --size 1024 --repeats 1
    python bench/flux3.py --config full --device cuda --dtype bfloat16 --ours-only --size 1024   # (gpu-check)

Both sides compute in float32 on the CPU. Reported: one transformer call (the median of ``--repeats``; the image,
a reference-free prompt of 80 tokens), and a whole generation (prompt encode, the denoising steps, decode; the
tiny Qwen3-VL tower and autoencoder, so the transformer dominates), each as ours / flux3-mlx, plus how far apart the
final latents are (they must agree: the same computation). ``block`` has the real model's width (3072, 24 heads of
128) with one block of each kind, to time the real block shapes at a size the CPU can hold. ``--ours-only`` times our
transformer call alone (flux3-mlx runs on the CPU only), on any device and dtype: ``full`` is the whole 5.6B model.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flux2_core.families.flux3.transformer import Flux3Params

CPU = torch.device("cpu")
CONFIGS = {   # transformer sizes; the text width is the tiny Qwen3-VL tower's 8 layers x 32
    "small": Flux3Params(context_in_dim=256, hidden_size=256, num_heads=2, depth=1, depth_single_blocks=2,
                         flow_map=True),
    "medium": Flux3Params(context_in_dim=256, hidden_size=768, num_heads=6, depth=2, depth_single_blocks=6,
                          flow_map=True),
    "block": Flux3Params(context_in_dim=256, hidden_size=3072, num_heads=24, depth=1, depth_single_blocks=1,
                         flow_map=True),
    "full": Flux3Params(flow_map=True),
}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def median_time(fn, repeats: int) -> float:
    fn()                                           # warm-up: allocation, kernel choice
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def files(folder: Path, params: Flux3Params):
    from tests.tiny.autoencoder import build_diffusers_autoencoder, save_bfl_autoencoder
    from tests.tiny.flux3 import random_flux3_state_dict, save_tiny_qwen3_vl

    state = random_flux3_state_dict(params, seed=6)
    te = save_tiny_qwen3_vl(folder / "text_encoder", seed=1)
    ae = save_bfl_autoencoder(build_diffusers_autoencoder(2), folder / "ae.safetensors")
    return state, te, ae


def transformer_call(params: Flux3Params, state, size: int, repeats: int, device: torch.device = CPU,
                     dtype: torch.dtype = torch.float32, theirs: bool = True, int8: bool = False) -> dict:
    """One velocity call on each side: (size/16)^2 image tokens with 80 text tokens, the flow map's t and t_next."""
    from flux2_core.families.flux3 import transformer as flux3

    h = w = size // 16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, h * w, params.in_channels, generator=g)
    txt = torch.randn(1, 80, params.context_in_dim, generator=g)
    if state is not None:
        model = flux3.Flux3Transformer(params).eval()
        model.load_state_dict(state)
        model.to(device, dtype)
    else:                           # random weights made where they run (the full model: 5.6B values)
        with torch.device("meta"):
            model = flux3.Flux3Transformer(params).eval()
        model.to_empty(device=device)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.normal_(1.0, 0.1) if name.endswith(".scale") else p.normal_(0.0, p.shape[-1] ** -0.5)
        model.to(dtype)
    notes = []
    if int8:                        # the family's blocks and modulations per-row int8, its int8 matmul where it pays
        from flux2_core.families.flux3 import FLUX3
        from flux2_core.storage.int8 import quantize_blocks, use_int8_matmul

        quantize_blocks(model, FLUX3.quantizable)
        notes.append(use_int8_matmul(model, "auto", device, dtype)[1])
    img_ids, txt_ids = flux3.image_ids(1, h, w), flux3.text_ids(1, 80)
    args = [a.to(device) for a in (x.to(dtype), img_ids, torch.tensor([0.7]), txt.to(dtype), txt_ids)]

    def ours():
        with torch.no_grad():
            model(*args, t_next=torch.tensor([0.5], device=device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    figures = {"ours_s": median_time(ours, repeats), "notes": notes}
    if device.type == "cuda":
        figures["ours_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    if theirs:
        import mlx.core as mx

        from tests.tiny.flux3 import flux3_mlx_at, mlx_dit, to_mlx

        with flux3_mlx_at(params) as dit:
            oracle = mlx_dit(dit, params, state)
            packed = dit.pack([[(to_mlx(txt[0]), txt_ids[0].numpy()), None, (to_mlx(x[0]), img_ids[0].numpy())]])
            figures["flux3_mlx_s"] = median_time(lambda: mx.eval(oracle(packed, 0.7, t_ref=0.5)), repeats)
    return figures


def whole_generation(params: Flux3Params, state, te, ae, size: int, steps: int) -> dict:
    """Prompt to picture on each side, the same noise; the final latents compared."""
    from flux2_core import pipeline
    from tests.tiny.flux3 import mlx_pipeline, our_models

    h = w = size // 16
    noise = torch.randn(h * w, 128, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16).float()
    prompt = "a red fox in the snow at dusk, pine trees behind it"
    models = our_models(params, state, te, ae)
    start = time.perf_counter()
    ours = pipeline.generate(models, prompt, width=size, height=size, steps=steps,
                             noise=noise.T.reshape(1, 128, h, w))
    ours_s = time.perf_counter() - start
    with mlx_pipeline(params, state, te, ae) as pipe:
        start = time.perf_counter()
        pipe.generate(prompt, [], size, size, steps, None, 0, noise=noise.numpy())
        theirs_s = time.perf_counter() - start
        theirs = pipe.latents[0]
    got = ours.latents[0].permute(1, 2, 0).reshape(-1, 128)
    return {"ours_s": ours_s, "flux3_mlx_s": theirs_s,
            "latents_max_diff_of_scale": float((got - theirs).abs().max() / theirs.abs().max())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="medium")
    ap.add_argument("--size", type=int, default=512, help="picture side in pixels (default 512)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="ours only (flux3-mlx computes in float32 here)")
    ap.add_argument("--ours-only", action="store_true", help="time our transformer call alone (no flux3-mlx)")
    ap.add_argument("--ours-int8", action="store_true", help="ours with int8 blocks (as --int8 quantizes them)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    params, device, dtype = CONFIGS[args.config], torch.device(args.device), getattr(torch, args.dtype)
    if not args.ours_only and (device.type != "cpu" or dtype != torch.float32):
        ap.error("flux3-mlx runs on the CPU in float32: add --ours-only to time another device or dtype")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    with tempfile.TemporaryDirectory() as tmp:
        state, te, ae = (None, None, None) if args.ours_only else files(Path(tmp), params)
        call = transformer_call(params, state, args.size, args.repeats, device, dtype, theirs=not args.ours_only,
                                int8=args.ours_int8)
        whole = None if args.ours_only else whole_generation(params, state, te, ae, args.size, args.steps)
    report = {"device": where, "threads": args.threads, "config": args.config, "size": args.size, "dtype": args.dtype,
              "steps": args.steps, "transformer_call": call, "generation": whole,
              "params": {k: v for k, v in asdict(params).items() if k != "axes_dim"}}
    print(f"FLUX 3 Image Klein, {args.config} config, {args.size}x{args.size}, {args.dtype}, {where} "
          f"({args.threads} threads)")
    if args.ours_only:
        print(f"  transformer call                 ours {call['ours_s']:8.3f} s"
              + (f" ({call['ours_peak_gib']:.1f} GiB peak)" if "ours_peak_gib" in call else ""))
    for note in call["notes"]:
        print(f"  {note}")
    for name, figures in (("transformer call", call), (f"whole generation ({args.steps} steps)", whole)):
        if figures is not None and "flux3_mlx_s" in figures:
            print(f"  {name:32s} ours {figures['ours_s']:8.3f} s   flux3-mlx {figures['flux3_mlx_s']:8.3f} s   "
                  f"ours/flux3-mlx {figures['ours_s'] / figures['flux3_mlx_s']:.2f}")
    if whole is not None:
        print(f"  final latents apart by {whole['latents_max_diff_of_scale']:.2g} of their scale")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
