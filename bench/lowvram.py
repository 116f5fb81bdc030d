"""Peak GPU memory and time of a generation on a smaller card, simulated on a large one.

    python bench/lowvram.py --config klein-9b --card-gib 12        # 9B on a 12 GB card: blocks stream as needed
    python bench/lowvram.py --config klein-4b --offload-encoder    # 4B with the text encoder resting on the CPU

A "card" of ``--card-gib`` is made by allocating the rest of the GPU's free memory first (a ballast tensor), so that
``pipeline.load_models`` sees exactly what such a card would leave free and decides block streaming and the encoder's
place by its own rules ("auto"). The report: what was decided (streamed blocks, the encoder's place), the peak memory
allocated by the generation beyond the ballast (loading included), and the warm time of one 1024x1024 generation.
Random full-size weights come from bench.py's folder layout (``--weights``; written when missing).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 2**30


def ballast_for(card_bytes: int | None, device: torch.device) -> torch.Tensor | None:
    """A tensor holding all of the device's free memory but ``card_bytes`` (None: no ballast)."""
    if card_bytes is None:
        return None
    free, _ = torch.cuda.mem_get_info(device)
    if free <= card_bytes:
        raise SystemExit(f"the GPU has only {free / GIB:.1f} GiB free, no more than the {card_bytes / GIB:.1f} GiB card")
    return torch.empty(free - card_bytes, dtype=torch.uint8, device=device)


def main(argv=None) -> int:
    from bench import CONFIGS, PROMPT, write_weights  # bench.py beside this file
    from flux2_core import pipeline
    from flux2_core.runtime.offload import streamed_blocks

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=["klein-4b", "klein-9b"], default="klein-9b")
    ap.add_argument("--card-gib", type=float, help="simulate a card with this much free memory (default: the GPU's)")
    ap.add_argument("--offload-encoder", action="store_true", help="rest the text encoder on the CPU (else: auto)")
    ap.add_argument("--weights", required=True, help="the random-weight folder (bench.py's; written when missing)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this measures GPU memory: it needs a CUDA device")

    device, cfg = torch.device("cuda"), CONFIGS[args.config]
    folder = Path(args.weights) / args.config
    if not (folder / "model_index.json").exists():
        t = time.perf_counter()
        write_weights(folder, cfg, distilled=True, device="cuda")
        print(f"{args.config}: random weights written in {time.perf_counter() - t:.1f} s")
    torch.cuda.empty_cache()          # writing the weights drew on the GPU: its cached blocks would enlarge the "card"
    ballast = ballast_for(None if args.card_gib is None else int(args.card_gib * GIB), device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)

    t = time.perf_counter()
    rest = True if args.offload_encoder else "auto"        # load_models and generate both take it, as the CLI does
    models = pipeline.load_models(folder / "transformer", folder / "text_encoder", folder / "vae", device=device,
                                  dtype=torch.bfloat16, offload_encoder=rest,
                                  offload_blocks="auto", size=(cfg.size, cfg.size))
    load_s = time.perf_counter() - t
    times = []
    for _ in range(2):                                     # a warm-up, then the timed one
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        pipeline.generate(models, PROMPT, width=cfg.size, height=cfg.size, steps=args.steps, seed=0,
                          offload_encoder=rest)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    figures = {
        "config": args.config, "card_gib": args.card_gib, "offload_encoder": args.offload_encoder,
        "streamed_blocks": len(streamed_blocks(models.transformer)),
        "blocks": len(models.transformer.double_blocks) + len(models.transformer.single_blocks),
        "encoder_rests_on": str(next(models.prompt_encoder.model.parameters()).device),
        "peak_gib": (torch.cuda.max_memory_allocated(device) - base) / GIB, "load_s": load_s,
        "first_s": times[0], "warm_s": times[1], "ballast_gib": 0 if ballast is None else ballast.numel() / GIB,
        "device": torch.cuda.get_device_name(device),
    }
    print(json.dumps(figures, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
