"""Each weight format a quantized file can hold, against the float model: one layer's call, one transformer step, the
memory each holds and the error it makes.

    python bench/quant_formats.py                                  # CPU: bench.py's medium config, float32 compute
    python bench/quant_formats.py --only nvfp4 --only int8 --size 256
    python bench/quant_formats.py --config klein-4b --device cuda --dtype bfloat16 --size 1024 --json out.json

The formats: ComfyUI's (written by comfy-kitchen's own quantizers, as ComfyUI's files are: int8 per row, int8 ConvRot,
NVFP4, MXFP8, ConvRot W4A4, W4A8; SVDQuant W4A4 and AWQ W4A16, which comfy-kitchen cannot quantize, by their layouts'
rules with bf16 scales: tests/tiny/layouts.py), GGUF's Q8_0 (gguf's quantizer) and Q4_K (random blocks: gguf cannot write K-quants
from values, so it has speed and memory, no error) and OrbitQuant's artifacts (its own quantizer, 4 and 3 bits), each over the layers the family quantizes
(its blocks), the rest kept as the float file has it. Each is written to a file, loaded by ``weights.load_transformer``
(the matmuls chosen as ``load_models`` chooses them), and timed on the same inputs: the layer is the first double
block's image qkv ([3 x hidden, hidden]) on the step's image tokens; the step is one transformer call with 512 text
tokens. The error is max |out - float out| / max |float out| of the step. Random weights (N(0, 1/fan-in)).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

COMFY = {"int8": "int8_rowwise", "int8 ConvRot": "int8_convrot", "nvfp4": "nvfp4", "mxfp8": "mxfp8",
         "W4A4 ConvRot": "convrot_w4a4"}          # our row name -> tests/tiny/layouts.py's comfy_quant kind
# our row name -> tests/tiny/layouts.py's w4_quant kind (SVDQuant's low-rank branch: rank 32, as its converter's)
W4 = {"W4A8": "asym_w4a8_int8", "SVDQuant W4A4": "svdquant_w4a4", "AWQ W4A16": "awq_w4a16"}
W4_RANK = 32
GGUF = ("Q8_0", "Q4_K")
RANDOM_BLOCKS = ("Q4_K",)        # gguf's Python package cannot quantize K-quants: the file holds random blocks
# OrbitQuant artifacts written by orbitquant's own quantizer over the family's block layers: our row name -> weight bits
# (activations 4-bit: its codebooks for 8 take minutes per width to make; the dequantized path does not quantize them)
ORBITQUANT = {"OrbitQuant W4": 4, "OrbitQuant W3": 3}
FORMATS = ("float", *COMFY, *W4, *GGUF, *ORBITQUANT)
LAYER = "double_blocks.0.img_attn.qkv"
TEXT_TOKENS = 512


def write_file(state: dict, fmt: str, quantizable, folder: Path, device: torch.device) -> Path:
    """The float state in ``fmt``, as a ComfyUI-prefixed safetensors file or a GGUF."""
    from safetensors.torch import save_file

    from tests.tiny.layouts import comfy_quant, w4_quant

    if fmt in GGUF:
        from gguf import GGMLQuantizationType

        from tests.tiny.gguf import dit_types, save_gguf

        path = folder / f"transformer-{fmt}.gguf"
        save_gguf({k: v.to(torch.bfloat16) for k, v in state.items()}, path, dit_types(GGMLQuantizationType[fmt]),
                  values=False)
        return path
    layers = [k.removesuffix(".weight") for k, v in state.items() if v.ndim == 2 and quantizable(k.removesuffix(".weight"))]
    if fmt in ORBITQUANT:
        return orbitquant_artifact(state, layers, ORBITQUANT[fmt], folder / fmt.replace(" ", "-"), device)
    if fmt == "float":
        out = state
    elif fmt in W4:            # SVDQuant and AWQ need inputs in multiples of their group (64): the others stay float
        fits = [layer for layer in layers if state[layer + ".weight"].shape[1] % 64 == 0]
        on_device = {k: v.to(device) if k.removesuffix(".weight") in fits else v for k, v in state.items()}
        out = {k: v.cpu() for k, v in w4_quant(on_device, fits, W4[fmt], torch.bfloat16, W4_RANK).items()}
    else:        # comfy-kitchen quantizes on the device (its eager code on a GPU is fast), the file is written from the CPU
        on_device = {k: v.to(device) if k.removesuffix(".weight") in layers else v for k, v in state.items()}
        out = {k: v.cpu() for k, v in comfy_quant(on_device, layers, COMFY[fmt], 256 if "ConvRot" in fmt else 0).items()}
    path = folder / f"transformer-{fmt.replace(' ', '-')}.safetensors"
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in out.items()}, str(path))
    return path


def orbitquant_artifact(state: dict, layers: list[str], bits: int, folder: Path, device: torch.device) -> Path:
    """The float state as our model, its ``layers`` quantized by orbitquant's own quantizer (on the device) and saved
    as its artifact folder."""
    import os

    from safetensors.torch import save_file

    os.environ.setdefault("ORBITQUANT_KERNELS_AUTOFETCH", "0")
    import orbitquant
    from orbitquant.artifacts import save_orbitquant_artifact

    from flux2_core import weights

    float_file = folder.with_suffix(".float.safetensors")
    save_file({k: v.contiguous() for k, v in state.items()}, str(float_file))
    model, _ = weights.load_transformer(float_file, device, torch.float32)
    float_file.unlink()
    config = orbitquant.OrbitQuantConfig(weight_bits=bits, activation_bits=4, target_policy="universal",
                                         modules_to_convert=layers)
    summary = orbitquant.quantize_model(model, config, quantization_device=str(device))
    save_orbitquant_artifact(model, folder, config=config, source_model_id="bench/random", source_revision="0" * 40,
                             source_license="apache-2.0", summary=summary)
    return folder


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(path: Path, inputs: dict, device: torch.device, dtype: torch.dtype, repeats: int) -> dict:
    from flux2_core import weights
    from flux2_core.storage.matmul import choose_matmuls
    from flux2_core.storage.protocol import census

    start = time.perf_counter()
    model, _ = weights.load_transformer(path, device, dtype)
    loaded = time.perf_counter() - start
    notes = choose_matmuls(model, device, dtype).notes
    layer = model.get_submodule(LAYER)
    x = torch.randn(1, inputs["img"].shape[1], layer.in_features, generator=torch.Generator().manual_seed(5)).to(
        device, dtype)
    with torch.no_grad():
        layer_s = timed(lambda: layer(x), device, repeats)
        step_s = timed(lambda: model(**inputs), device, repeats)
        out = model(**inputs).float().cpu()
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    row = {"kinds": census(model), "load_s": loaded, "layer_s": layer_s, "step_s": step_s, "bytes": held,
           "file_bytes": sum(f.stat().st_size for f in files if f.is_file()), "notes": notes, "out": out}
    return row


def main(argv=None) -> int:
    from flux3 import cpu_name

    from bench import CONFIGS, random_state
    from flux2_core import families
    from flux2_core.families.flux2.transformer import Flux2Transformer
    from flux2_core.models import rope

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="medium", help="bench.py's config (default medium)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument("--size", type=int, default=512, help="picture side: (size/16)^2 image tokens (default 512)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", choices=FORMATS, action="append", help="these formats (repeatable; float always runs)")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    params = CONFIGS[args.config].transformer
    with torch.device("meta"):
        meta = Flux2Transformer(params)
    state = {k: v.float() for k, v in random_state(meta, 0, str(device), torch.float32).items()}
    quantizable = families.FAMILIES["flux2"].quantizable
    side = args.size // 16
    g = torch.Generator().manual_seed(1)
    inputs = {"img": torch.randn(1, side * side, params.in_channels, generator=g),
              "img_ids": rope.image_ids(1, side, side), "timesteps": torch.tensor([0.7]),
              "txt": torch.randn(1, TEXT_TOKENS, params.context_in_dim, generator=g),
              "txt_ids": rope.text_ids(1, TEXT_TOKENS)}
    inputs = {k: v.to(device, dtype if v.is_floating_point() and k != "timesteps" else v.dtype) for k, v in inputs.items()}
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    print(f"# weight formats, {where}, {torch.get_num_threads()} threads, torch {torch.__version__}, {args.config}, "
          f"{side * side} image + {TEXT_TOKENS} text tokens, {args.dtype} compute, random weights\n")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in ("float", *[f for f in FORMATS if f != "float" and (not args.only or f in args.only)]):
            path = write_file(state, fmt, quantizable, Path(tmp), device)
            rows[fmt] = measure(path, inputs, device, dtype, args.repeats)
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            print(f"{fmt}: {rows[fmt]['kinds']}; {'; '.join(rows[fmt]['notes']) or 'no quantized matmul'}", flush=True)
    base, reference = rows["float"], rows["float"]["out"]
    for fmt, r in rows.items():     # gguf cannot write K-quants from values: their blocks are random (no error)
        out = r.pop("out")
        r["error"] = None if fmt in RANDOM_BLOCKS else ((out - reference).abs().max() / reference.abs().max()).item()
    print("\n| format | memory | one layer | / float | one step | / float | error vs float |")
    print("|---|---|---|---|---|---|---|")
    for fmt, r in rows.items():
        print(f"| {fmt} | {r['bytes'] / 2**20:.0f} MiB | {r['layer_s'] * 1e3:.2f} ms | "
              f"{r['layer_s'] / base['layer_s']:.2f}x | {r['step_s']:.3f} s | {r['step_s'] / base['step_s']:.2f}x | "
              f"{'random blocks' if r['error'] is None else format(r['error'], '.4f')} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": where, "config": args.config, "dtype": args.dtype,
                                               "size": args.size, "formats": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
