"""Time and peak memory of loading a transformer file, per weight storage (``weights.load_transformer(fp8=...)``).

    python bench/load.py                        # CPU: a 1.0 B-parameter Klein-shaped model (hidden 2048, 3+12 blocks)
    python bench/load.py --config klein-4b      # the real Klein 4B shapes (on CUDA: read straight to the GPU)

One bf16 file and one fp8 file (BFL layout: e4m3 weights with per-row scales) of random weights are written once;
each case then loads in a fresh process, which reports its wall time and peak memory: the resident set's high-water
mark on CPU (the process's own, interpreter and torch included: a baseline is printed), allocated memory on CUDA.

    bf16 file, fp8=False    the plain load: every weight in bf16
    bf16 file, fp8=True     blocks quantized to fp8 as they are read (never the whole bf16 model in memory)
    bf16 file, then quantize_transformer: the old way to the same fp8 model (the bf16 model first)
    fp8 file, fp8=None      the file's fp8 layers kept as stored
    fp8 file, fp8=False     dequantized to bf16
    Q8_0 / Q4_K GGUF        a GGUF of the same model (tests/tiny/gguf.py's layout), blocks kept as stored
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flux2_core.families.flux2.transformer import TransformerParams
from flux2_core.families.flux2.variants import KLEIN_4B, KLEIN_9B

CONFIGS = {
    "medium": TransformerParams(context_in_dim=7680, hidden_size=2048, num_heads=16, depth=3, depth_single_blocks=12),
    "klein-4b": KLEIN_4B,
    "klein-9b": KLEIN_9B,
}
CASES = {  # name -> (file, fp8 argument, quantize after loading)
    "bf16 file, fp8=False": ("bf16", False, False),
    "bf16 file, fp8=True": ("bf16", True, False),
    "bf16 file + quantize_transformer": ("bf16", False, True),
    "fp8 file, fp8=None (kept)": ("fp8", None, False),
    "fp8 file, fp8=False": ("fp8", False, False),
    "Q8_0 GGUF": ("Q8_0", None, False),
    "Q4_K GGUF": ("Q4_K", None, False),
}
GGUF_FILES = ("Q8_0", "Q4_K")


def file_path(folder: Path, file: str) -> Path:
    return folder / (f"{file}.gguf" if file in GGUF_FILES else f"{file}.safetensors")


def peak_bytes(device: torch.device) -> int:
    from bench import proc_status  # bench/bench.py (this folder is first on sys.path)

    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else proc_status("VmHWM")


def write_files(folder: Path, params: TransformerParams) -> None:
    """Random bf16 weights (bench.py's, the demo's init rule) and their BFL fp8 version of the block layers."""
    from safetensors.torch import save_file

    from bench import random_state  # bench/bench.py (this folder is first on sys.path)
    from flux2_core.families.flux2.files import quantizable
    from flux2_core.families.flux2.transformer import Flux2Transformer
    from flux2_core.storage.quant import quantize_fp8

    with torch.device("meta"):
        model = Flux2Transformer(params)
    bf16 = random_state(model, seed=0, device="cpu", dtype=torch.bfloat16)
    save_file(bf16, str(folder / "bf16.safetensors"))
    fp8 = dict(bf16)
    for name, layer in model.named_modules():
        if isinstance(layer, torch.nn.Linear) and quantizable(name):
            fp8[name + ".weight"], fp8[name + ".weight_scale"] = quantize_fp8(bf16[name + ".weight"])
    save_file(fp8, str(folder / "fp8.safetensors"))
    from gguf import GGMLQuantizationType

    from tests.tiny.gguf import dit_types, save_gguf
    for qtype in GGUF_FILES:
        save_gguf(bf16, file_path(folder, qtype), dit_types(GGMLQuantizationType[qtype]), values=False)


def worker(args) -> None:
    device = torch.device(args.device)
    report = {"baseline": peak_bytes(device)}
    if args.case == "baseline":
        print(json.dumps(report))
        return
    from flux2_core import weights
    from flux2_core.families.flux2.files import quantizable
    from flux2_core.runtime.memory import module_bytes
    from flux2_core.storage import quant
    from flux2_core.storage.ggml_layers import gguf_types

    file, fp8, quantize_after = CASES[args.case]
    t = time.perf_counter()
    model, _ = weights.load_transformer(file_path(Path(args.folder), file), device, torch.bfloat16,
                                        params=CONFIGS[args.config], fp8=fp8)
    if quantize_after:
        quant.quantize_transformer(model, quantizable)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    report.update(seconds=time.perf_counter() - t, peak=peak_bytes(device),
                  weights=module_bytes(model),
                  fp8_layers=quant.count_fp8(model), gguf_layers=sum(gguf_types(model).values()))
    print(json.dumps(report))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=sorted(CONFIGS), default="medium")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=2, help="processes per case (the best time, the highest peak)")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        return worker(args)

    params = CONFIGS[args.config]
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        write_files(Path(tmp), params)
        sizes = {f: file_path(Path(tmp), f).stat().st_size for f in ("bf16", "fp8", *GGUF_FILES)}
        print(f"{args.config}: files written in {time.perf_counter() - t:.0f} s ("
              f"{', '.join(f'{f} {n / 2**30:.2f} GiB' for f, n in sizes.items())}); device {args.device}, "
              f"torch {torch.__version__}")

        def run(case: str) -> dict:
            cmd = [sys.executable, __file__, "--case", case, "--folder", tmp, "--config", args.config,
                   "--device", args.device]
            return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)

        base = run("baseline")["baseline"]
        print(f"{'case':<34} {'time s':>7} {'peak GiB':>9} {'weights GiB':>12} {'fp8 layers':>11} {'GGUF layers':>12}")
        print(f"{'(process before loading)':<34} {'':>7} {base / 2**30:9.2f}")
        for case in CASES:
            reports = [run(case) for _ in range(args.rounds)]
            best, peak = min(r["seconds"] for r in reports), max(r["peak"] for r in reports)
            r = reports[0]
            print(f"{case:<34} {best:7.2f} {peak / 2**30:9.2f} {r['weights'] / 2**30:12.2f} {r['fp8_layers']:11d} "
                  f"{r['gguf_layers']:12d}")


if __name__ == "__main__":
    main()
