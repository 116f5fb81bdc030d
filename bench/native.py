"""Denoising steps of ComfyUI's own FLUX.2 Klein path against our Klein Denoise node, in one ComfyUI process.

Run it in ComfyUI's Python, naming the ComfyUI source tree (v0.12.1+):

    python bench/native.py --comfyui /path/to/ComfyUI                          # CPU, the "medium" config, float32
    python bench/native.py --comfyui /path/to/ComfyUI --config medium --dtype bfloat16 --repeats 5 --json out.json
    python bench/native.py --comfyui /path/to/ComfyUI --device cuda --config klein-4b
    python bench/native.py --comfyui /path/to/ComfyUI --comfyui-args "--use-pytorch-cross-attention"

Both sides run inside the same real ComfyUI, imported in-process (as tests/comfyui/model_management_probe.py does),
with the pack imported as ComfyUI imports it, on one random-weight transformer file in BFL's layout (a bench.py config:
``--config``), the same latent size, the same sigmas (our Scheduler node, flux2 schedule), the same starting noise
(ComfyUI's RandomNoise and our Noise node draw the same numbers for one image) and the same conditioning tensor (random
prompt embeddings of Klein's 512 tokens: the text encoder is out of the comparison). Distilled Klein, no CFG.

* native: ComfyUI's loader (``comfy.sd.load_diffusion_model``, what UNETLoader calls, with the dtype asked for),
  BasicGuider, KSamplerSelect("euler"), RandomNoise, EmptyFlux2LatentImage, SamplerCustomAdvanced: the graph of the
  real-host parity tests (tests/comfyui/graphs.py, ``native``).
* ours: Klein Load Model, Noise, Scheduler and Denoise.

Only the sampler call of each side is timed (SamplerCustomAdvanced, Denoise), after one warm-up call each, the sides
alternating ``--repeats`` times. Per side: median and best seconds per step (the call over the steps), the peak memory
the call took above what was in use when it began (resident set on the CPU, allocated memory on CUDA), and ours/native;
then how far apart the two final latents are (max |ours - native| over max |native|).

ComfyUI decides its compute dtype itself: on a CPU it computes bfloat16 weights in float32 (its rule: bfloat16 is slow
on CPUs). ``--native-cast off`` drops that cast so that ComfyUI computes in ``--dtype`` as ours does. ComfyUI's own
options (attention: sub-quadratic by default on a CPU, --use-pytorch-cross-attention for SDPA; ...) go through
``--comfyui-args``.

Reading the results:
* float32: the final latents agree to float32 rounding (as in the parity tests). bfloat16: they do not, by design: ours
  gives the model the sigma rounded to bfloat16, as BFL's reference does, and ComfyUI the float32 sigma; random weights
  turn that small change of the time embedding into a large one of the latents (about 13% of max|native| on "medium").
* Few cores: two torch threads slow down many times over when another process takes a core. The report says how many
  cores other processes kept busy while timing (``other_processes_cores``); keep a timing only with that near 0.
* Memory on the CPU is the resident set, which does not grow where the allocator reuses what the other side's call
  freed: compare peaks on CUDA, or read them on the CPU as a lower bound.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
MODEL_FILE = "flux-2-klein-native-bench.safetensors"    # no "base" / "kv" in it: our loader reads distilled Klein
TEXT_TOKENS = 512                  # Klein pads every prompt to 512 tokens (ComfyUI's tokenizer and ours)
SEED = 0
SIDES = ("native", "ours", "cli")    # cli: the engine as the command line runs it (its default dtype)
DTYPES = ("float32", "bfloat16")


# ---------------------------------------------------------------------------------------------------------------
# Modules by file, and sys.path: ComfyUI's modules before the repository's
# ---------------------------------------------------------------------------------------------------------------

def load_module(name: str, path: Path, package: bool = False):
    """A module (with ``package``: a package whose submodules use relative imports) from its file, as ``name``."""
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=[str(path.parent)]
                                                  if package else None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module          # before running it: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def load_bench():
    """bench.py: its CONFIGS, its random-weight writer and its meter. It puts the repository first on sys.path for its
    own imports; the repository must come after ComfyUI's tree (ComfyUI's nodes.py against our nodes/ package, its
    tests/ against ours), so it goes last, where ``flux2_core`` still resolves for bench.py's own later imports."""
    module = load_module("flux2_bench", HERE / "bench.py")
    sys.path[:] = [p for p in sys.path if p not in (str(ROOT), str(HERE))] + [str(ROOT)]
    return module


# ---------------------------------------------------------------------------------------------------------------
# ComfyUI in this process
# ---------------------------------------------------------------------------------------------------------------

def stub_torch_extras(folder: Path) -> None:
    """ComfyUI imports torchvision, torchaudio and PyAV at start-up and FLUX.2 uses none of them; where they do not
    import, the real-host tests' stand-ins (tests/comfyui/host.py) let ComfyUI import. Using a stubbed name raises."""
    host = load_module("flux2_tests_host", ROOT / "tests" / "comfyui" / "host.py")
    stubs = host.write_torch_stubs(folder, sys.executable)
    if any(stubs.iterdir()):
        sys.path.insert(0, str(stubs))      # before site-packages, where a torchvision that fails to import may be
        names = ", ".join(sorted(p.name for p in stubs.iterdir()))
        print(f"{names} do not import here: test-only stubs from {stubs} stand in (FLUX.2 uses none of them)",
              flush=True)


def start_comfyui(comfy_dir: Path, device: str, extra: str):
    """ComfyUI's modules, with its command line read as main.py reads it (--cpu on the CPU, then ``extra``) before
    comfy.model_management picks the device; ComfyUI's own ``utils`` package first, as main.py and the probe do
    (nodes.py puts comfy/ on sys.path, where comfy/utils.py would shadow it)."""
    sys.path.insert(0, str(comfy_dir))
    argv = sys.argv
    sys.argv = [str(comfy_dir / "main.py"), *(["--cpu"] if device == "cpu" else []), *shlex.split(extra)]
    try:
        import comfy.options

        comfy.options.enable_args_parsing()     # before comfy.cli_args is imported: it parses the command line then
        import comfy.cli_args
        import utils.extra_config  # noqa: F401
    finally:
        sys.argv = argv
    import comfy.model_management as mm
    import comfy.utils

    # SamplerCustomAdvanced's text progress bar (a tqdm on stderr) off: ours has none outside a server either
    comfy.utils.PROGRESS_BAR_ENABLED = False
    if mm.get_torch_device().type != device:
        raise SystemExit(f"ComfyUI computes on {mm.get_torch_device()}, not {device}: see --device and --comfyui-args")


def import_pack():
    """Our nodes, from the pack imported as ComfyUI imports it: a package from its folder (relative imports)."""
    load_module("flux2_pack", ROOT / "__init__.py", package=True)
    return {name: importlib.import_module(f"flux2_pack.nodes.{name}") for name in ("loaders", "noise", "scheduler", "denoise")}


def run_node(node, **inputs) -> tuple:
    """A V3 node's outputs, its execute called as ComfyUI's executor calls it: on a locked clone of the class (no
    hidden inputs), in inference mode."""
    from comfy_api.internal import make_locked_method_func

    node.VALIDATE_CLASS()
    with torch.inference_mode():
        return make_locked_method_func(node, "execute", node.PREPARE_CLASS_CLONE(None))(**inputs).args


# ---------------------------------------------------------------------------------------------------------------
# The shared inputs
# ---------------------------------------------------------------------------------------------------------------

def write_transformer(bench, folder: Path, params, dtype: torch.dtype, device: str) -> Path:
    """Random weights for ``params`` as a BFL single file (our Flux2Transformer's state dict has exactly BFL's keys),
    drawn by bench.py's writer (the demo's init rule, bench.py's transformer seed); both sides load this file."""
    from safetensors.torch import save_file

    from flux2_core.families.flux2.transformer import Flux2Transformer

    with torch.device("meta"):
        model = Flux2Transformer(params)
    path = folder / MODEL_FILE
    save_file(bench.random_state(model, 1, device, dtype), str(path))
    return path


def register_models(folder: Path) -> None:
    """The temp folder first among ComfyUI's diffusion_models paths: UNETLoader's and our loader's lookups find the
    file there, as in a server whose base directory holds it."""
    import folder_paths

    folder_paths.add_model_folder_path("diffusion_models", str(folder), is_default=True)


def prompt_conditioning(context_in_dim: int) -> list:
    """A CONDITIONING of random prompt embeddings [1, 512, context_in_dim] on the CPU, as a prompt node hands it on;
    both samplers take the same tensor. ComfyUI's FLUX models read ``pooled_output`` (None for FLUX.2, as both text
    encode nodes give it)."""
    g = torch.Generator().manual_seed(SEED + 1)
    return [[torch.randn(1, TEXT_TOKENS, context_in_dim, generator=g), {"pooled_output": None}]]


# ---------------------------------------------------------------------------------------------------------------
# The two sides: each a loaded model and its sampler call
# ---------------------------------------------------------------------------------------------------------------

def native_side(dtype: torch.dtype, cast: str, cond: list, sigmas: torch.Tensor, size: int):
    """ComfyUI's path: (the sampler call, what it computes in, its attention function).

    UNETLoader offers no float32 / bfloat16 choice (its "default" lets ComfyUI pick: float32 on a CPU, bfloat16 on
    recent GPUs), so this is the call it makes, with ComfyUI's own dtype option set to ``dtype``. ``cast`` "off" drops
    ComfyUI's manual cast (on a CPU: bfloat16 weights computed in float32), so that it computes in ``dtype``;
    "loader" leaves the dtype to ComfyUI as UNETLoader's "default" does (on a CPU: the weights made float32)."""
    import comfy.ldm.flux.math
    import comfy.sd
    import folder_paths
    from comfy_extras import nodes_custom_sampler as custom
    from comfy_extras import nodes_flux

    with torch.inference_mode():           # as ComfyUI's executor runs every node
        patcher = comfy.sd.load_diffusion_model(folder_paths.get_full_path_or_raise("diffusion_models", MODEL_FILE),
                                                model_options={} if cast == "loader" else {"dtype": dtype})
    if cast == "off":
        patcher.model.manual_cast_dtype = None
    compute = patcher.model.manual_cast_dtype or patcher.model.get_dtype()
    (guider,) = run_node(custom.BasicGuider, model=patcher, conditioning=cond)
    (sampler,) = run_node(custom.KSamplerSelect, sampler_name="euler")
    (noise,) = run_node(custom.RandomNoise, noise_seed=SEED)
    (latent,) = run_node(nodes_flux.EmptyFlux2LatentImage, width=size, height=size, batch_size=1)

    def call() -> torch.Tensor:
        out, _ = run_node(custom.SamplerCustomAdvanced, noise=noise, guider=guider, sampler=sampler, sigmas=sigmas,
                          latent_image=latent)
        return out["samples"]
    attention = comfy.ldm.flux.math.optimized_attention
    return call, compute, getattr(attention, "__name__", type(attention).__name__), patcher.model_size()


def our_side(pack: dict, dtype_name: str, cond: list, sigmas: torch.Tensor, size: int):
    """Our nodes: (the sampler call, what it computes in)."""
    (model,) = run_node(pack["loaders"].ModelLoader, model_name=MODEL_FILE, dtype=dtype_name)
    (noise,) = run_node(pack["noise"].Noise, seed=SEED, width=size, height=size, batch_size=1)

    def call() -> torch.Tensor:
        (out,) = run_node(pack["denoise"].Denoise, model=model, positive=cond, noise=noise, sigmas=sigmas, cfg=1.0,
                          denoise=1.0)
        return out["samples"]
    return call, model.dtype, model.patcher.model_size()


def cli_side(device: str, cond: list, sigmas: torch.Tensor, size: int):
    """The engine as ``flux2-klein`` runs it with no --dtype (the device's own choice): (the denoise call, its compute
    dtype, its weight bytes). The same file, conditioning, noise and sigmas as the nodes."""
    from flux2_core import weights
    from flux2_core.sampling.euler import denoise, make_noise

    model, _ = weights.load_transformer(folder_paths_file(), device)
    dtype = model.dtype
    noise = make_noise(1, size, size, SEED, device=device)
    txt = cond[0][0].to(device)

    def call() -> torch.Tensor:
        return denoise(model, noise, sigmas.tolist(), txt, dtype=dtype)
    return call, dtype, sum(t.nbytes for t in [*model.parameters(), *model.buffers()])


def folder_paths_file() -> str:
    import folder_paths

    return folder_paths.get_full_path_or_raise("diffusion_models", MODEL_FILE)


# ---------------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------------

def memory_in_use(device: torch.device) -> int:
    """What the process holds now: allocated CUDA memory, or the resident set on the CPU (the meter's peak measure)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return BENCH.proc_status("VmRSS")


def timed(meter, side: str, call) -> tuple[torch.Tensor, float, int]:
    """(the call's latents, its seconds, its peak memory above what was in use when it began), by bench.py's meter
    (synchronised on CUDA; the peak reset at the start)."""
    gc.collect()                        # garbage of the previous call is not this one's
    meter.times, meter.peaks = {}, {}
    before = memory_in_use(meter.device)
    meter.mark(side)
    out = call()
    meter.mark(None)
    return out, meter.times[side], max(0, meter.peaks[side] - before)


def measure(calls: dict, meter, repeats: int) -> tuple[dict, dict]:
    """One warm-up call per side, then ``repeats`` rounds, the order alternating so that drift in the machine's speed
    falls on both sides alike: ({side: [(seconds, peak bytes)]}, {side: its last latents})."""
    runs, last = {side: [] for side in calls}, {}
    for side, call in calls.items():
        last[side] = call()
    for r in range(repeats):
        for side in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
            last[side], seconds, peak = timed(meter, side, call=calls[side])
            runs[side].append((seconds, peak))
    return runs, last


def cpu_seconds() -> tuple[float, float, float] | None:
    """(wall clock, CPU seconds of the whole machine, of this process), for ``other_processes_cores``; None where
    there is no /proc/stat."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return None
    busy = sum(fields[:3]) + fields[5] + fields[6]      # user, nice, system, irq, softirq (not steal), clock ticks
    own = os.times()
    return time.perf_counter(), busy / os.sysconf("SC_CLK_TCK"), own.user + own.system


def other_processes_cores(start, end) -> float | None:
    """How many cores other processes kept busy on average between two ``cpu_seconds``: with a CPU's few cores, two
    torch threads slow down many times over when another process takes one (their threads wait on each other), so
    a timing is only worth keeping with this near 0."""
    if start is None or end is None:
        return None
    return max(0.0, ((end[1] - start[1]) - (end[2] - start[2])) / (end[0] - start[0]))


def summarize(runs: list[tuple[float, int]], steps: int) -> dict:
    times = [seconds for seconds, _ in runs]
    return {"call_s": times, "step_median_s": statistics.median(times) / steps, "step_best_s": min(times) / steps,
            "peak_bytes": max(peak for _, peak in runs)}


def latent_difference(ours: torch.Tensor, native: torch.Tensor) -> dict:
    """max |ours - native| and that over max |native| (bench.py's measure against diffusers)."""
    diff = (ours.float() - native.float()).abs().max().item()
    return {"latent_max_abs_diff": diff, "latent_rel_diff": diff / native.float().abs().max().item()}


def print_table(result: dict) -> None:
    sides, r = result["sides"], result
    print(f"\n{r['config']}: {r['size']}x{r['size']} ({r['image_tokens']} image + {TEXT_TOKENS} text tokens), "
          f"{r['steps']} steps, {r['dtype']} weights on {r['device']}; {r['repeats']} timed calls per side after one "
          f"warm-up, alternating; ComfyUI {r['comfyui_version']}, native attention {r['native_attention']}")
    others = "unknown" if r["other_processes_cores"] is None else f"{r['other_processes_cores']:.2f}"
    print(f"{r['threads']} torch threads; other processes kept {others} cores busy on average while timing "
          f"(a busy machine slows both sides, and unevenly)")
    print(f"{'side':<8} {'computes':>9} {'median s/step':>14} {'best s/step':>12} {'peak above start':>17} "
          f"{'weights':>10}")
    for side in SIDES:
        s = sides[side]
        print(f"{side:<8} {s['compute_dtype']:>9} {s['step_median_s']:14.4f} {s['step_best_s']:12.4f} "
              f"{BENCH.fmt_bytes(s['peak_bytes']):>17} {BENCH.fmt_bytes(s['weight_bytes']):>10}")
    print(f"{'ours/native':<18} {r['ratio']['median']:14.3f} {r['ratio']['best']:12.3f} {'':>17} "
          f"{r['weight_ratio']:10.3f}")
    print(f"{'cli/native':<18} {r['cli_ratio']['median']:14.3f} {r['cli_ratio']['best']:12.3f} {'':>17} "
          f"{r['cli_weight_ratio']:10.3f}")
    print(f"final latents: max|ours - native| {r['latent_max_abs_diff']:.3g}, relative to max|native| "
          f"{r['latent_rel_diff']:.3g}")


# ---------------------------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------------------------

BENCH = load_bench()


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--comfyui", type=Path, required=True, help="a ComfyUI source tree (v0.12.1+)")
    ap.add_argument("--config", choices=sorted(BENCH.CONFIGS), default="medium",
                    help="bench.py's model shapes and image size (default medium)")
    ap.add_argument("--dtype", choices=DTYPES, help="weights (and ours' compute) dtype; default: the config's")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="timed sampler calls per side, after one warm-up each")
    ap.add_argument("--size", type=int, help="image side in pixels, a multiple of 16 (default: the config's)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cpu (ComfyUI's --cpu) or cuda (ComfyUI's default GPU)")
    ap.add_argument("--native-cast", choices=["comfyui", "off", "loader"], default="comfyui",
                    help="comfyui: ComfyUI's own compute dtype (on a CPU, bfloat16 weights computed in float32); "
                         "off: ComfyUI computes in --dtype, as ours; loader: as UNETLoader's default loads the file "
                         "(ComfyUI picks the weights' dtype too: float32 on a CPU)")
    ap.add_argument("--ours-dtype", choices=["auto", *DTYPES],
                    help="our loader's dtype option (default: --dtype); auto: the device's choice, as users run it")
    ap.add_argument("--comfyui-args", default="", help="more ComfyUI command-line options, one string")
    ap.add_argument("--json", type=Path, help="write the results to this file")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.repeats < 1:
        ap.error("--steps and --repeats must be at least 1")
    if args.size is not None and (args.size < 16 or args.size % 16):
        ap.error("--size must be a positive multiple of 16 (one latent cell is 16 pixels)")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: this torch sees no CUDA device")
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    started = time.perf_counter()
    cfg = BENCH.CONFIGS[args.config]
    dtype_name = args.dtype or cfg.dtype
    dtype, size = getattr(torch, dtype_name), args.size or cfg.size
    with tempfile.TemporaryDirectory(prefix="flux2-native-bench-") as tmp:
        stub_torch_extras(Path(tmp) / "stubs")
        start_comfyui(args.comfyui.resolve(), args.device, args.comfyui_args)
        pack = import_pack()
        import comfyui_version

        t = time.perf_counter()
        write_transformer(BENCH, Path(tmp), cfg.transformer, dtype, args.device)
        written = time.perf_counter() - t
        register_models(Path(tmp))
        cond = prompt_conditioning(cfg.transformer.context_in_dim)
        (sigmas,) = run_node(pack["scheduler"].Scheduler, steps=args.steps, schedule="flux2", rho=2.0, width=size,
                             height=size)
        t = time.perf_counter()
        native, native_dtype, attention, native_bytes = native_side(dtype, args.native_cast, cond, sigmas, size)
        loaded = {"native": time.perf_counter() - t}
        t = time.perf_counter()
        ours, ours_dtype, ours_bytes = our_side(pack, args.ours_dtype or dtype_name, cond, sigmas, size)
        loaded["ours"] = time.perf_counter() - t
        t = time.perf_counter()
        cli, cli_dtype, cli_bytes = cli_side(args.device, cond, sigmas, size)
        loaded["cli"] = time.perf_counter() - t
        meter = BENCH.Meter(torch.device(args.device))
        cpu = cpu_seconds()
        runs, last = measure({"native": native, "ours": ours, "cli": cli}, meter, args.repeats)
        others = other_processes_cores(cpu, cpu_seconds())
    sides = {side: summarize(runs[side], args.steps) for side in SIDES}
    for side, compute, held in (("native", native_dtype, native_bytes), ("ours", ours_dtype, ours_bytes),
                                ("cli", cli_dtype, cli_bytes)):
        sides[side]["compute_dtype"] = str(compute).removeprefix("torch.")
        sides[side]["weight_bytes"] = held
        sides[side]["load_s"] = loaded[side]
    result = {
        "machine": BENCH.machine(), "comfyui_version": comfyui_version.__version__, "config": args.config,
        "size": size, "image_tokens": (size // 16) ** 2, "text_tokens": TEXT_TOKENS, "steps": args.steps,
        "dtype": dtype_name, "device": args.device, "repeats": args.repeats, "native_cast": args.native_cast,
        "comfyui_args": args.comfyui_args, "native_attention": attention, "threads": torch.get_num_threads(),
        "sides": sides,
        "ratio": {k: sides["ours"][f"step_{k}_s"] / sides["native"][f"step_{k}_s"] for k in ("median", "best")},
        "weight_ratio": ours_bytes / native_bytes,
        "cli_ratio": {k: sides["cli"][f"step_{k}_s"] / sides["native"][f"step_{k}_s"] for k in ("median", "best")},
        "cli_weight_ratio": cli_bytes / native_bytes,
        **latent_difference(last["ours"], last["native"]),
        "other_processes_cores": others, "weights_written_s": written,
        "wall_s": time.perf_counter() - started,
    }
    print(result["machine"])
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
