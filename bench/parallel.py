"""Sequence parallelism (``flux2_core/runtime/parallel.py``, Ulysses): step time, peak memory and communication per rank.

    python bench/parallel.py                              # CPU: the medium config on 1 and 2 gloo ranks
    python bench/parallel.py --config medium --size 512 --steps 4 --repeats 3 --ranks 1 2
    python bench/parallel.py --model                      # no ranks: the expected speed-up for 9B at 2048^2, 2-8 GPUs

Measured mode: for each N of ``--ranks``, N processes join a gloo group on the CPU and build the same random
transformer (one seed); rank 0 drives ``euler.denoise`` (one warm-up denoise, then ``--repeats`` timed ones of
``--steps`` steps), the others follow (``parallel.serve``). The ranks share the machine's cores: each takes
cores // N torch threads (N = 1 runs twice: with 1 thread, and with all cores). Per rank it reports:

* step time (rank 0): every step of the timed denoises, from its start to its callback; best and median;
* communication: the time spent inside ``all_to_all_single``, ``broadcast`` and ``all_gather_into_tensor`` (the
  collectives parallel.py calls; wrapped with timers in each rank), and the bytes each rank received through them,
  per step; the share is that time over the step time. It includes waiting for the other ranks to arrive;
* memory: the resident set high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs`` after the warm-up)
  above the resident set once the weights are loaded, i.e. the activations and communication buffers of a step.

Results come back from the ranks as JSON files. ``--model`` computes, without any rank, what N GPUs should give for
a full-size model: compute split N ways at our measured single-H100 throughput plus the collectives' bytes over the
link (every assumption is printed with the figures). ``expected_step`` is that model.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

try:                    # imported as bench.parallel (the tests)
    from bench.bench import CONFIGS, fmt_bytes, machine, proc_status, random_state, transformer_flops
except ImportError:     # run as a script: bench.py is the module beside this file
    from bench import CONFIGS, fmt_bytes, machine, proc_status, random_state, transformer_flops

from flux2_core.families.flux2.transformer import TransformerParams
from flux2_core.families.flux2.variants import KLEIN_9B
from flux2_core.runtime.followers import free_port

COLLECTIVES = ("all_to_all_single", "broadcast", "all_gather_into_tensor")
MIB = 2 ** 20

# --- the model's constants (docs/benchmarks.md, "GPU: NVIDIA H100") ------------------------------------------------
H100_MATMUL = 776e12        # bf16 matmul measured on that H100 (8192^3: 765-786 TFLOP/s), the reference of our MFU
H100_9B_MFU = 0.607         # 9B distilled, eager bf16, 1024^2: 0.638 s for 4 steps
H100_DENSE_PEAK = 989e12    # NVIDIA's bf16 dense peak for the H100 SXM, for comparison only
LINKS = {                   # bytes per second per direction per GPU, as specified
    "NVLink 4 (H100 SXM, NVSwitch)": 450e9,
    "PCIe 5 x16 (no NVLink)": 64e9,
}


# ---------------------------------------------------------------------------------------------------------------
# The model: expected step time on N GPUs
# ---------------------------------------------------------------------------------------------------------------

def expected_step(p: TransformerParams, n_img: int, n_txt: int, world: int, flops_per_s: float,
                  link_bytes_per_s: float, latency_s: float, act_bytes: int = 2) -> dict:
    """One denoising step (batch 1, one transformer pass) spread over ``world`` ranks, as parallel.py runs it.

    Compute: ``transformer_flops`` / world at ``flops_per_s`` (linears on L/N tokens, attention on H/N heads of all
    L tokens: both split evenly). Communication, bytes each rank receives (sends as many: links are full duplex):
    per block 4 all-to-alls (q, k, v to heads, the output back) of [L, hidden], keeping 1/N and receiving (N-1)/N of
    its L/N share's size; per step the driver's broadcast of the inputs (img, txt, timestep in the activation dtype,
    img_ids and txt_ids int64 [L, 4]) and the all_gather of the velocities [n_img, in_channels]. Collectives do not
    overlap with compute (every one is waited for), each costs ``latency_s`` plus bytes / ``link_bytes_per_s``.
    """
    L, blocks = n_img + n_txt, p.depth + p.depth_single_blocks
    flops = transformer_flops(p, n_img, n_txt)
    result = {"world": world, "flops": flops, "compute_s": flops / world / flops_per_s, "bytes": 0,
              "collectives": 0, "comm_s": 0.0}
    if world > 1:
        if L % world or p.num_heads % world:
            raise ValueError(f"{world} ranks must divide the {L} tokens and the {p.num_heads} heads")
        kept = (world - 1) / world
        all_to_all = 4 * blocks * (L // world) * p.hidden_size * act_bytes * kept
        inputs = (n_img * p.in_channels + n_txt * p.context_in_dim + 1) * act_bytes + L * 4 * 8
        gather = n_img * p.in_channels * act_bytes * kept
        result["bytes"] = round(all_to_all + inputs + gather)
        result["collectives"] = 4 * blocks + 5 + 1
        result["comm_s"] = result["bytes"] / link_bytes_per_s + result["collectives"] * latency_s
    result["step_s"] = result["compute_s"] + result["comm_s"]
    return result


def model_report(args) -> dict:
    """``expected_step`` for Klein 9B at ``args.size`` on 1 and ``args.gpus`` GPUs over each link; printed."""
    p, n_img, n_txt = KLEIN_9B, (args.size // 16) ** 2, args.txt_tokens
    rate = H100_MATMUL * H100_9B_MFU
    links = {name: bw * args.link_efficiency for name, bw in LINKS.items()}
    latency = args.latency_us * 1e-6
    one = expected_step(p, n_img, n_txt, 1, rate, 1.0, latency)
    print(f"Expected speed-up of sequence parallelism for Klein 9B at {args.size}x{args.size} "
          f"({n_img} image + {n_txt} text tokens, batch 1, one pass per step): a model, not a measurement.")
    print("Assumptions:")
    print(f"- work per step: {one['flops'] / 1e12:.1f} TFLOP (bench.transformer_flops: 2*in*out per token for every "
          f"linear, 4*L^2*hidden per block for attention), split evenly over N GPUs (N divides the 32 heads)")
    print(f"- every GPU computes at {rate / 1e12:.0f} TFLOP/s: the {H100_9B_MFU:.1%} MFU of our 9B eager "
          f"bf16 step at 1024^2 on one H100, of the {H100_MATMUL / 1e12:.0f} TFLOP/s bf16 matmul measured there "
          f"({rate / H100_DENSE_PEAK:.0%} of the {H100_DENSE_PEAK / 1e12:.0f} TFLOP/s dense peak); attention "
          f"at 16.9k tokens and 1/N of the work per GPU are assumed to run at that same rate")
    print(f"- communication per step and GPU: 4 all-to-alls per block ({p.depth} + {p.depth_single_blocks} blocks) of "
          f"[L, {p.hidden_size}] bf16, each GPU receiving (N-1)/N of its L/N share; the inputs' broadcast (img "
          f"[{n_img}, {p.in_channels}] and txt [{n_txt}, {p.context_in_dim}] bf16, ids int64); the velocities' "
          f"all_gather; none of it overlaps compute (parallel.py waits for each collective)")
    print(f"- link: {args.link_efficiency:.0%} of the nominal bandwidth per direction is achieved, every GPU at once "
          f"(NVLink: through NVSwitch; PCIe: each GPU on its own x16 link with peer-to-peer, no shared uplink; "
          f"a box without P2P, or whose GPUs share a switch uplink, will be slower); {args.latency_us:g} us per "
          f"collective")
    print("- weights are not split: every GPU holds the whole model (9B: about 18 GB in bf16)")
    print(f"\none GPU: {one['step_s'] * 1e3:.0f} ms per step (compute only)\n")
    header = "| GPUs | compute ms | GB received per GPU | collectives |"
    for name in links:
        header += f" {name}: comm ms | step ms | speed-up |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    rows = []
    for n in args.gpus:
        row = {"gpus": n, "links": {}}
        line = ""
        for name, bw in links.items():
            r = expected_step(p, n_img, n_txt, n, rate, bw, latency)
            speedup = one["step_s"] / r["step_s"]
            row.update(compute_s=r["compute_s"], bytes=r["bytes"], collectives=r["collectives"])
            row["links"][name] = {"comm_s": r["comm_s"], "step_s": r["step_s"], "speedup": speedup}
            line += f" {r['comm_s'] * 1e3:.1f} | {r['step_s'] * 1e3:.0f} | {speedup:.2f}x |"
        print(f"| {n} | {row['compute_s'] * 1e3:.0f} | {row['bytes'] / 1e9:.2f} | {row['collectives']} |" + line)
        rows.append(row)
    return {"model": "klein-9b", "size": args.size, "n_img": n_img, "n_txt": n_txt, "flops_per_s": rate,
            "link_efficiency": args.link_efficiency, "latency_us": args.latency_us,
            "link_bytes_per_s": links, "one_gpu_step_s": one["step_s"], "rows": rows}


# ---------------------------------------------------------------------------------------------------------------
# Measured: one rank
# ---------------------------------------------------------------------------------------------------------------

class TimedCollectives:
    """torch.distributed as the ranks (runtime/parallel.py) and the model's token trades (models/shards.py) see it, with
    the collectives they call timed: seconds, calls and bytes received from the other ranks, per collective.
    Everything else is torch.distributed's."""

    def __init__(self, real, rank: int):
        self._real, self._rank = real, rank
        self.reset()

    def reset(self) -> None:
        self.stats = {name: {"s": 0.0, "calls": 0, "bytes": 0} for name in COLLECTIVES}

    def __getattr__(self, name):
        return getattr(self._real, name)

    def _timed(self, name: str, received: int, fn, *args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            s = self.stats[name]
            s["s"] += time.perf_counter() - t
            s["calls"] += 1
            s["bytes"] += received

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
        world = self._real.get_world_size(kwargs.get("group"))
        sizes = output_split_sizes or [output.numel() // world] * world
        received = (sum(sizes) - sizes[self._rank]) * output.element_size()
        return self._timed("all_to_all_single", received, self._real.all_to_all_single, output, input,
                           output_split_sizes, input_split_sizes, **kwargs)

    def broadcast(self, tensor, src, **kwargs):
        received = 0 if src == self._rank else tensor.numel() * tensor.element_size()
        return self._timed("broadcast", received, self._real.broadcast, tensor, src, **kwargs)

    def all_gather_into_tensor(self, output, input, **kwargs):
        received = output.numel() * output.element_size() - input.numel() * input.element_size()
        return self._timed("all_gather_into_tensor", received, self._real.all_gather_into_tensor, output, input,
                           **kwargs)

    def all_gather_single(self, output, input, **kwargs):      # its name from torch 2.13 on
        received = output.numel() * output.element_size() - input.numel() * input.element_size()
        return self._timed("all_gather_into_tensor", received, self._real.all_gather_single, output, input, **kwargs)


def build_transformer(p: TransformerParams, dtype: torch.dtype):
    """The transformer with bench.py's random weights (seed 1): the same in every rank."""
    from flux2_core.families.flux2.transformer import Flux2Transformer

    with torch.device("meta"):
        model = Flux2Transformer(p)
    model.load_state_dict(random_state(model, 1, "cpu", dtype), assign=True)
    return model.eval()


def reset_peak() -> None:
    try:                        # Linux >= 4.0: the resident-set high-water mark restarts from the current RSS
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _rank(rank: int, world: int, port: int, threads: int, job: dict, out: str) -> None:
    """One rank of a measured run: rank 0 times the denoises, every rank writes ``rank{rank}.json`` to ``out``."""
    from flux2_core.families.flux2.schedule import flux2_schedule
    from flux2_core.models import shards
    from flux2_core.runtime import parallel
    from flux2_core.sampling import euler

    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated")   # torch 2.13's notice
    torch.set_num_threads(threads)
    # a rank that never arrives (a port taken by another job in between) fails the run in 2 minutes, not 10
    sp = parallel.start(rank, world, "cpu", port=port, timeout=timedelta(seconds=job.get("timeout_s", 120))) \
        if world > 1 else None
    cfg = CONFIGS[job["config"]]
    dtype = getattr(torch, job["dtype"])
    model = build_transformer(cfg.transformer, dtype)
    weights_rss = proc_status("VmRSS")
    timed = TimedCollectives(parallel.dist, rank)
    parallel.dist = shards.dist = timed          # the ranks' calls and the model's trades around attention
    report = {"rank": rank, "world": world, "threads": threads, "weights_rss": weights_rss}

    def reset():
        timed.reset()
        reset_peak()

    def write():
        report.update(peak_rss=proc_status("VmHWM"), comm=timed.stats)
        report["peak_above_weights"] = report["peak_rss"] - weights_rss
        Path(out, f"rank{rank}.json").write_text(json.dumps(report))

    if sp is not None and not sp.driver:
        parallel.serve(model, sp, handlers={"reset": lambda extra: reset(), "report": lambda extra: write()})
        parallel.leave()
        return
    parallel.attach(model, sp)
    side = job["size"] // 16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 128, side, side, generator=g).to(dtype)
    txt = torch.randn(1, job["txt_tokens"], cfg.transformer.context_in_dim, generator=g).to(dtype)
    sigmas = flux2_schedule(job["steps"], side * side)
    steps = []
    with torch.no_grad():
        for i in range(1 + job["repeats"]):
            if i == 1:
                (sp.call(reset, "reset", {}) if sp else reset())
            marks = [time.perf_counter()]
            clock = marks.append
            euler.denoise(model, x, sigmas, txt, callback=lambda step, clock=clock: clock(time.perf_counter()))
            if i:
                steps += [b - a for a, b in itertools.pairwise(marks)]
    report["steps"] = steps
    (sp.call(write, "report", {}) if sp else write())
    if sp:
        sp.stop()


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def measure(world: int, threads: int, job: dict) -> list[dict]:
    """One run on ``world`` ranks of ``threads`` threads each: every rank's report, rank 0 first."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(world, free_port(), threads, job, out), nprocs=world, join=True)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def summarize(reports: list[dict], job: dict) -> dict:
    """Step time (rank 0) and, per rank, communication per step, its share, bytes received and peak memory."""
    steps = reports[0]["steps"]
    n_steps, wall = len(steps), sum(steps)
    ranks = []
    for rep in reports:
        comm = rep["comm"]
        comm_s = sum(c["s"] for c in comm.values())
        ranks.append({"rank": rep["rank"], "comm_s_per_step": comm_s / n_steps, "comm_share": comm_s / wall,
                      "per_collective_s_per_step": {k: c["s"] / n_steps for k, c in comm.items()},
                      "bytes_per_step": sum(c["bytes"] for c in comm.values()) / n_steps,
                      "calls_per_step": sum(c["calls"] for c in comm.values()) / n_steps,
                      "weights_rss": rep["weights_rss"], "peak_above_weights": rep["peak_above_weights"],
                      "peak_rss": rep["peak_rss"]})
    return {"world": reports[0]["world"], "threads": reports[0]["threads"], "step_best_s": min(steps),
            "step_median_s": statistics.median(steps), "timed_steps": n_steps, "ranks": ranks}


def print_runs(runs: list[dict], baseline: dict | None) -> None:
    print("| ranks | threads per rank | rank | step median | step best | speed-up vs 1 rank, all cores | comm per step "
          "| comm share | all-to-all / broadcast / all_gather per step | received per step | peak above weights "
          "| RSS with weights |")
    print("|" + "---|" * 12)
    for run in runs:
        for r in run["ranks"]:
            first = r["rank"] == 0
            c = r["per_collective_s_per_step"]
            speedup = f"{baseline['step_median_s'] / run['step_median_s']:.2f}x" if first and baseline else ""
            print(f"| {run['world'] if first else ''} | {run['threads'] if first else ''} | {r['rank']} | "
                  + (f"{run['step_median_s']:.3f} s | {run['step_best_s']:.3f} s | " if first else " |  | ")
                  + f"{speedup} | {r['comm_s_per_step'] * 1e3:.1f} ms | {r['comm_share']:.1%} | "
                  f"{c['all_to_all_single'] * 1e3:.1f} / {c['broadcast'] * 1e3:.1f} / "
                  f"{c['all_gather_into_tensor'] * 1e3:.1f} ms | {r['bytes_per_step'] / MIB:.2f} MiB | "
                  f"{fmt_bytes(r['peak_above_weights'])} | {fmt_bytes(r['weights_rss'])} |")


def measured_report(args) -> dict:
    cfg = CONFIGS[args.config]
    dtype = args.dtype or cfg.dtype
    size = args.size or cfg.size
    p = cfg.transformer
    job = {"config": args.config, "dtype": dtype, "size": size, "steps": args.steps, "repeats": args.repeats,
           "txt_tokens": args.txt_tokens}
    n_img = (size // 16) ** 2
    total = cores()
    plan = []
    for n in args.ranks:
        if n > 1 and p.num_heads % n:
            raise SystemExit(f"{n} ranks do not divide the {p.num_heads} heads of config {args.config}")
        plan += [(1, 1), (1, total)] if n == 1 and total > 1 else [(n, max(1, total // n))]
    print(machine().split(",")[0] + f", {total} cores for these runs; torch {torch.__version__}; load average "
          f"before: {os.getloadavg()[0]:.2f}")
    print(f"config {args.config}: hidden {p.hidden_size}, {p.num_heads} heads, {p.depth} double + "
          f"{p.depth_single_blocks} single blocks, {dtype}; {size}x{size} = {n_img} image + {args.txt_tokens} text "
          f"tokens; {args.steps} steps; 1 warm-up + {args.repeats} timed denoises; gloo on the CPU")
    print(f"threads: each of N ranks runs cores // N torch threads so that together they use the {total} cores "
          f"once ({', '.join(f'N={n}: {t}' for n, t in plan)})")
    print("memory: resident set high-water mark (VmHWM, reset after the warm-up) minus the resident set once the "
          "weights were loaded, per rank\n")
    runs = []
    for world, threads in plan:
        t = time.perf_counter()
        runs.append(summarize(measure(world, threads, job), job))
        print(f"  {world} rank(s) x {threads} thread(s): {time.perf_counter() - t:.1f} s, load average "
              f"{os.getloadavg()[0]:.2f}", flush=True)
    baseline = next((r for r in runs if r["world"] == 1 and r["threads"] == total), None)
    print()
    print_runs(runs, baseline)
    for run in runs:
        if run["world"] > 1:
            expected = expected_step(p, n_img, args.txt_tokens, run["world"], 1.0, 1.0, 0.0,
                                     act_bytes=torch.empty(0, dtype=getattr(torch, dtype)).element_size())
            follower = run["ranks"][1]
            print(f"\n{run['world']} ranks: a follower received {follower['bytes_per_step'] / MIB:.3f} MiB per step "
                  f"in {follower['calls_per_step']:.0f} collectives; expected_step counts "
                  f"{expected['bytes'] / MIB:.3f} MiB in {expected['collectives']}")
    return {"machine": machine(), "job": job, "cores": total, "runs": runs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="store_true", help="no ranks: the expected speed-up for 9B on N GPUs")
    ap.add_argument("--config", choices=sorted(CONFIGS), default="medium", help="transformer config (bench.py's)")
    ap.add_argument("--size", type=int, help="output side in pixels (default: the config's; 2048 with --model)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="timed denoises after one warm-up")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="numbers of ranks to run (1 runs twice: "
                    "1 thread and all cores)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="override the config's dtype")
    ap.add_argument("--txt-tokens", type=int, default=512)
    ap.add_argument("--gpus", type=int, nargs="+", default=[2, 4, 8], help="--model: GPU counts")
    ap.add_argument("--link-efficiency", type=float, default=0.7,
                    help="--model: the fraction of the nominal link bandwidth the collectives achieve")
    ap.add_argument("--latency-us", type=float, default=20.0, help="--model: fixed cost of one collective")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    if args.model:
        args.size = args.size or 2048
        figures = model_report(args)
    else:
        figures = measured_report(args)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
