"""Speed and peak memory of our FLUX.2 Klein engine against diffusers 0.42.1, on the same random weights.

    python bench/bench.py                          # CPU: the "medium" config; with CUDA: full-size Klein 4B and 9B
    python bench/bench.py --config medium --rounds 3 --repeats 2
    python bench/bench.py --config klein-4b --config klein-9b          # GPU: bf16, 1024^2, 4 steps
    python bench/bench.py --mode base                                  # a base model: 2 passes per step (CFG)
    python bench/bench.py --mode kv                                    # ours only: 9B-KV reference edit vs joint

One run writes random weights once (a diffusers pipeline folder: both sides load the same bytes), then runs each side
in its own process, alternating ``--rounds`` times so that a busy machine slows both alike; each process loads, warms
up once and times ``--repeats`` generations. Per stage (prompt encode, every denoising step, AE decode, end to end) it
prints the median and best time of each side and ours/diffusers, and the peak memory: resident set size on CPU (the
kernel's high-water mark, reset at every stage), allocated memory on CUDA. It also checks that both sides computed the
same latents. Model FLOP/s is the transformer's matmul FLOPs per step (``transformer_flops``) over the step time,
against the matmul throughput measured on this device (fp32 on CPU, bf16 on CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flux2_core.families.flux2.transformer import TransformerParams
from flux2_core.families.flux2.variants import KLEIN_4B, KLEIN_9B
from flux2_core.variants import FLUX2_AE, AutoEncoderParams

OURS_OPTIONS = ("ours_fp8", "ours_int8", "ours_compile", "ours_compile_decoder", "ours_gguf", "ours_no_kitchen",
                "ours_no_fused", "ours_small_decoder", "ours_compute")
PROMPT = "A red fox standing in fresh snow at dawn, soft golden light, detailed fur, shallow depth of field"


@dataclass(frozen=True)
class Config:
    transformer: TransformerParams
    qwen3: dict                     # transformers Qwen3Config fields
    autoencoder: AutoEncoderParams
    size: int                       # output width = height, pixels
    dtype: str                      # transformer and text encoder (and, to match diffusers, the AE)


# Qwen3-4B / 8B as in their config.json (36 layers; diffusers runs all of them, we run 27).
QWEN3_4B = {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True}
QWEN3_8B = {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False}

CONFIGS = {
    # CPU: Klein's shapes scaled down. Head dim 128 and 4 RoPE axes of 32 as in the real models; 1024 image tokens
    # (512^2) + 512 text tokens; a 36-layer Qwen3 256 wide; the AE at a quarter of the real width.
    "medium": Config(
        TransformerParams(context_in_dim=3 * 256, hidden_size=512, num_heads=4, depth=2, depth_single_blocks=4),
        {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 36, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "tie_word_embeddings": True},
        AutoEncoderParams(ch=32), 512, "float32"),
    # The driver's own check (tests/test_bench.py): every code path of a GPU run, in seconds on a CPU.
    "tiny": Config(
        TransformerParams(context_in_dim=3 * 64, hidden_size=128, num_heads=1, depth=1, depth_single_blocks=1),
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 28, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 32, "tie_word_embeddings": True},
        AutoEncoderParams(ch=8, num_groups=4), 64, "float32"),
    "klein-4b": Config(KLEIN_4B, QWEN3_4B, FLUX2_AE, 1024, "bfloat16"),
    "klein-9b": Config(KLEIN_9B, QWEN3_8B, FLUX2_AE, 1024, "bfloat16"),
}


# ---------------------------------------------------------------------------------------------------------------
# Random weights, written once as a diffusers pipeline folder
# ---------------------------------------------------------------------------------------------------------------

def random_state(module: torch.nn.Module, seed: int, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random weights for every state-dict entry of a module built on meta (the demo's init rule), on the CPU in dtype.

    Drawn on ``device`` one tensor at a time (fast on a GPU, little memory)."""
    from flux2_core.app.demo import random_weights

    g = torch.Generator(device).manual_seed(seed)
    out = {}
    with torch.device(device):
        for key, tensor in module.state_dict().items():
            value = random_weights({key: tensor.shape}, g)[key]
            out[key] = (value.to(dtype) if value.is_floating_point() else value).cpu()
    return out


def write_weights(folder: Path, cfg: Config, distilled: bool, device: str) -> None:
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from flux2_core.models.tokenizer import build_qwen3_tokenizer
    from tests.tiny.transformer import diffusers_transformer_config

    dtype = getattr(torch, cfg.dtype)
    ae = cfg.autoencoder
    with torch.device("meta"):
        transformer = Flux2Transformer2DModel(**{k: v for k, v in diffusers_transformer_config(cfg.transformer).items()
                                                 if not k.startswith("_")})
        vae = AutoencoderKLFlux2(block_out_channels=tuple(ae.ch * m for m in ae.ch_mult),
                                 layers_per_block=ae.num_res_blocks, latent_channels=ae.z_channels,
                                 norm_num_groups=ae.num_groups)
        qwen_config = Qwen3Config(vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960,
                                  architectures=["Qwen3ForCausalLM"], **cfg.qwen3)
        qwen = Qwen3ForCausalLM(qwen_config)
    for name, module, seed in [("transformer", transformer, 1), ("vae", vae, 2)]:
        (folder / name).mkdir(parents=True)
        module.save_config(folder / name)
        save_file(random_state(module, seed, device, dtype if name == "transformer" else torch.float32),
                  str(folder / name / "diffusion_pytorch_model.safetensors"))
    (folder / "text_encoder").mkdir()
    qwen_config.save_pretrained(folder / "text_encoder")
    state = random_state(qwen, 3, device, dtype)
    if qwen_config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(folder / "text_encoder" / "model.safetensors"))
    build_qwen3_tokenizer().save_pretrained(folder / "tokenizer")
    FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                    base_image_seq_len=256, max_image_seq_len=4096,
                                    time_shift_type="exponential").save_config(folder / "scheduler")
    (folder / "model_index.json").write_text(json.dumps({
        "_class_name": "Flux2KleinPipeline", "_diffusers_version": "0.42.1", "is_distilled": distilled,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen3ForCausalLM"], "tokenizer": ["transformers", "Qwen2TokenizerFast"],
        "transformer": ["diffusers", "Flux2Transformer2DModel"], "vae": ["diffusers", "AutoencoderKLFlux2"]}))


GGUF_TYPES = ["Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q4_0", "Q3_K", "Q2_K"]


def write_gguf(folder: Path, qtype: str) -> Path:
    """The folder's transformer as ``transformer-<qtype>.gguf`` in the layout ComfyUI-GGUF / unsloth files have
    (tests/tiny/gguf.py: embedders and final layer F16, the rest ``qtype``)."""
    from gguf import GGMLQuantizationType

    from flux2_core import weights
    from tests.tiny.gguf import dit_types, save_gguf

    model, _ = weights.load_transformer(folder / "transformer", "cpu", torch.bfloat16)
    path = folder / f"transformer-{qtype}.gguf"
    save_gguf(model.state_dict(), path, dit_types(GGMLQuantizationType[qtype]), values=False)
    return path


# ---------------------------------------------------------------------------------------------------------------
# Measuring one process: stage clock and memory
# ---------------------------------------------------------------------------------------------------------------

class Meter:
    """Wall time and peak memory per stage. ``mark(name)`` closes the running stage and opens ``name``."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: dict[str, float] = {}
        self.peaks: dict[str, int] = {}
        self.highest = self.peak()          # over the process's life (the stage peaks are reset at every mark)
        self.stage, self.t0 = None, 0.0

    def mark(self, name: str | None) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        if self.stage is not None:
            self.times[self.stage] = self.times.get(self.stage, 0.0) + now - self.t0
            self.peaks[self.stage] = max(self.peaks.get(self.stage, 0), self.peak())
            self.highest = max(self.highest, self.peaks[self.stage])
        self.stage, self.t0 = name, now
        self.reset_peak()

    def peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return proc_status("VmHWM")

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            try:                        # Linux >= 4.0: "5" resets the resident-set high-water mark of this process
                Path("/proc/self/clear_refs").write_text("5")
            except OSError:
                pass


def proc_status(field_name: str) -> int:
    """A /proc/self/status memory field in bytes (0 where there is no /proc)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def timed(meter: Meter, name: str, fn, after: str = "other"):
    """fn wrapped so that its calls are stage ``name``."""
    def wrapper(*args, **kwargs):
        meter.mark(name)
        try:
            return fn(*args, **kwargs)
        finally:
            meter.mark(after)
    return wrapper


class StepClock:
    """Stage ``step{i}`` from the first transformer call of a step to that step's callback."""

    def __init__(self, meter: Meter):
        self.meter, self.index, self.open = meter, 0, False

    def before_forward(self, *_):
        if not self.open:
            self.meter.mark(f"step{self.index}")
            self.open = True

    def step_done(self):
        self.meter.mark("other")
        self.index, self.open = self.index + 1, False


# ---------------------------------------------------------------------------------------------------------------
# The two sides
# ---------------------------------------------------------------------------------------------------------------

def load_ours(folder: Path, device: torch.device, dtype: torch.dtype, variant: str | None, gguf: str | None = None,
              compute: str | None = None):
    """``compute``: the transformer's compute dtype, if not ``dtype`` ("auto": the device's choice); 16-bit weights
    under a wider one stay 16-bit."""
    from flux2_core import weights
    from flux2_core.pipeline import Models

    path = folder / f"transformer-{gguf}.gguf" if gguf else folder / "transformer"
    compute = dtype if compute is None else None if compute == "auto" else getattr(torch, compute)
    transformer, chosen = weights.load_transformer(path, device, compute, variant=variant)
    encoder = weights.load_text_encoder(folder / "text_encoder", device, dtype)
    ae = weights.load_autoencoder(folder / "vae", device, dtype)   # diffusers runs its VAE in the pipeline dtype too
    # No caches: every timed run encodes its prompt and references afresh, as diffusers does (the kv mode measures
    # the reference cache on its own).
    return Models(transformer, chosen, ae, encoder, prompt_cache=None, reference_cache=None)


def run_ours(models, meter: Meter, args, refs=(), reference_kv=None):
    """One ``pipeline.generate``; returns the final latents as tokens [B, h*w, 128]."""
    from flux2_core.models.rope import pack
    from flux2_core.pipeline import generate

    clock = StepClock(meter)
    handle = models.transformer.register_forward_pre_hook(clock.before_forward)
    wrapped = [(models.prompt_encoder, "encode", "encode"), (models.autoencoder, "decode", "decode"),
               (models.autoencoder, "encode", "ref-encode"), (models.transformer, "reference_kv", "ref-kv")]
    for obj, method, stage in wrapped:
        setattr(obj, method, timed(meter, stage, getattr(obj, method)))
    try:
        meter.mark("other")
        result = generate(models, PROMPT, width=args.size, height=args.size, steps=args.steps, seed=0,
                          cfg=args.cfg, references=refs, reference_kv=reference_kv,
                          callback=lambda step: clock.step_done())
        meter.mark(None)
    finally:
        handle.remove()
        for obj, method, _ in wrapped:
            delattr(obj, method)
    return pack(result.latents)


def apply_options(models, args) -> None:
    """Our opt-in speed-ups, as the --ours-* flags ask."""
    from flux2_core.families.flux2.files import quantizable
    from flux2_core.runtime.compile import compile_blocks
    from flux2_core.storage.int8 import quantize_blocks, use_int8_matmul
    from flux2_core.storage.quant import quantize_transformer, use_fp8_matmul

    dtype = models.transformer.dtype
    if args.ours_fp8:                   # where the GPU has fp8 tensor cores the matmuls run in fp8 too
        quantize_transformer(models.transformer, quantizable)
        print(use_fp8_matmul(models.transformer, "auto", models.device, dtype)[1])
    if args.ours_int8:                  # int8 matmuls where they are the faster path (GPUs from Turing on, CPU float32)
        quantize_blocks(models.transformer, quantizable)
        print(use_int8_matmul(models.transformer, "auto", models.device, dtype)[1])
    if args.ours_small_decoder:
        models.autoencoder = with_small_decoder(models.autoencoder)
    if args.ours_compile_decoder:
        from flux2_core.runtime.compile import compile_decoder

        compile_decoder(models.autoencoder, backend=args.compile_backend)
    if args.ours_compile:
        compile_blocks(models.transformer, backend=args.compile_backend)


def with_small_decoder(ae):
    """``ae`` with a decoder of BFL's small-decoder shape in its place: 3/4 of every block's channels (128, 256, 512,
    512 -> 96, 192, 384, 384), rounded to whole norm groups; the decoder's weights are PyTorch's initial ones (the
    bench times it; the pictures are noise either way)."""
    from dataclasses import replace

    from flux2_core.models.autoencoder import AutoEncoder

    groups = ae.params.num_groups
    narrow = tuple(max(groups, round(c * 3 / 4 / groups) * groups) for c in ae.params.encoder_chans)
    small = AutoEncoder(replace(ae.params, decoder_channels=narrow)).to(ae.device, ae.dtype).eval()
    small.encoder.load_state_dict(ae.encoder.state_dict())
    small.bn.load_state_dict(ae.bn.state_dict())
    return small


def load_diffusers(folder: Path, device: torch.device, dtype: torch.dtype):
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline.from_pretrained(str(folder), torch_dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_diffusers(pipe, meter: Meter, args):
    clock = StepClock(meter)
    handle = pipe.transformer.register_forward_pre_hook(clock.before_forward)
    pipe.encode_prompt = timed(meter, "encode", type(pipe).encode_prompt.__get__(pipe))
    pipe.vae.decode = timed(meter, "decode", type(pipe.vae).decode.__get__(pipe.vae))
    last = {}

    def on_step(pipe_, i, t, kwargs):
        last["latents"] = kwargs["latents"]
        clock.step_done()
        return {}
    try:
        meter.mark("other")
        pipe(prompt=PROMPT, height=args.size, width=args.size, num_inference_steps=args.steps,
             guidance_scale=args.cfg if args.cfg is not None else 4.0, generator=torch.Generator("cpu").manual_seed(0),
             output_type="pt", callback_on_step_end=on_step)
        meter.mark(None)
    finally:
        handle.remove()
        del pipe.encode_prompt, pipe.vae.decode
    return last["latents"].float()


def transformer_flops(p: TransformerParams, n_img: int, n_txt: int = 512, batch: int = 1) -> int:
    """Matmul FLOPs of one transformer forward (linears 2·in·out per token, attention 4·L²·hidden per block)."""
    H, M, L = p.hidden_size, p.mlp_hidden, n_img + n_txt
    double = L * 2 * (4 * H * H + 3 * M * H) + 4 * L * L * H            # per block: each token in its own stream
    single = L * 2 * (H * (3 * H + 2 * M) + (H + M) * H) + 4 * L * L * H
    ends = n_img * 2 * p.in_channels * H * 2 + n_txt * 2 * p.context_in_dim * H   # img_in, final linear, txt_in
    return batch * (p.depth * double + p.depth_single_blocks * single + ends)


def matmul_flops_per_s(device: torch.device, dtype: torch.dtype) -> float:
    """The best of torch.mm and our ``linear`` (oneDNN on CPU) on square matrices (2048 on CPU, 8192 on CUDA)."""
    from flux2_core.storage.linear import linear

    n, inner = (8192, 10) if device.type == "cuda" else (2048, 1)
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    best = float("inf")
    with torch.inference_mode():
        for fn in (torch.mm, linear):
            for _ in range(6):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t = time.perf_counter()
                for _ in range(inner):
                    fn(a, b)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                best = min(best, (time.perf_counter() - t) / inner)
    return 2 * n ** 3 / best


def worker(args) -> None:
    """One side in one process: load, warm up, time ``repeats`` generations; JSON to ``args.out``."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or CONFIGS[args.config].dtype)
    t = time.perf_counter()
    if args.worker == "ours":
        model, run = load_ours(Path(args.weights), device, dtype, None, args.ours_gguf, args.ours_compute), run_ours
        apply_options(model, args)
    else:
        model, run = load_diffusers(Path(args.weights), device, dtype), run_diffusers
    meter = Meter(device)
    report = {"side": args.worker, "load_s": time.perf_counter() - t, "runs": [], "threads": torch.get_num_threads()}
    for i in range(1 + args.repeats):          # each side under its own grad mode (both: torch.no_grad)
        meter.times, meter.peaks = {}, {}
        latents = run(model, meter, args)
        if i:
            report["runs"].append({"times": meter.times, "peaks": meter.peaks})
    report["max_memory"] = meter.highest
    if args.flops:
        report["flops"] = transformer_flops(CONFIGS[args.config].transformer, (args.size // 16) ** 2,
                                            batch=2 if args.cfg not in (None, 1.0) else 1)
        report["matmul_flops_per_s"] = matmul_flops_per_s(device, dtype)
    torch.save(latents.cpu(), args.out + ".latents.pt")
    Path(args.out).write_text(json.dumps(report))


def kv_worker(args) -> None:
    """Ours only: a single-reference edit on the 9B-KV scheme (reference K/V once per run) vs the joint scheme
    (reference tokens through every block at every step), and a repeated KV edit whose reference K/V come from a
    ``ReferenceKVCache`` keyed by the image (a hit runs neither the AE encoder nor the reference pass)."""
    from PIL import Image

    from flux2_core.families import get_variant
    from flux2_core.families.flux2 import FLUX2
    from flux2_core.runtime.cache import ReferenceKVCache
    from flux2_core.sampling.references import encode_references

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or CONFIGS[args.config].dtype)
    models = load_ours(Path(args.weights), device, dtype, None)
    noise = torch.rand(args.size, args.size, 3, generator=torch.Generator().manual_seed(0))
    ref = Image.fromarray((noise * 255).byte().numpy())
    variants = {"joint": replace(get_variant("klein-9b"), params=models.variant.params, name="joint"),
                "kv": replace(get_variant("klein-9b-kv"), params=models.variant.params, name="kv")}
    cache = ReferenceKVCache()
    report = {"side": "ours-kv", "runs": []}
    with torch.inference_mode():
        for i in range(1 + args.repeats):
            entry = {}
            for name in ["joint", "kv", "kv-cached"]:
                models.variant = variants[name.split("-")[0]]
                meter = Meter(device)
                t = time.perf_counter()
                kv = None
                if name == "kv-cached":
                    meter.mark("ref-lookup")
                    kv = cache.get_for_images(models.transformer, models.autoencoder, [ref], dtype,
                                              encode=lambda ae, images, dtype: encode_references(
                                                  ae, images, dtype, ids=FLUX2.reference_ids,
                                                  fit=FLUX2.references))
                run_ours(models, meter, args, refs=[ref], reference_kv=kv)
                entry[name] = {"total": time.perf_counter() - t, "times": meter.times, "peaks": meter.peaks}
            if i:
                report["runs"].append(entry)
    Path(args.out).write_text(json.dumps(report))


# ---------------------------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class Summary:
    median: dict[str, float] = field(default_factory=dict)
    best: dict[str, float] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)


def summarize(reports: list[dict]) -> Summary:
    """Per stage: median and best time over every timed run of every process; the highest peak."""
    runs = [r for rep in reports for r in rep["runs"]]
    stages = runs[0]["times"].keys()
    out = Summary()
    for stage in stages:
        values = [r["times"][stage] for r in runs]
        out.median[stage], out.best[stage] = statistics.median(values), min(values)
        out.peak[stage] = max(r["peaks"][stage] for r in runs)
    totals = [sum(r["times"].values()) for r in runs]
    steps = [sum(v for k, v in r["times"].items() if k.startswith("step")) for r in runs]
    out.median["steps"], out.best["steps"] = statistics.median(steps), min(steps)
    out.median["total"], out.best["total"] = statistics.median(totals), min(totals)
    out.peak["total"] = max(max(r["peaks"].values()) for r in runs)
    out.peak["process"] = max(rep["max_memory"] for rep in reports)
    return out


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs, {torch.get_num_threads()} torch threads (torch {torch.__version__})"


def spawn(args, side: str, out: Path, folder: Path, flops: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--worker", side, "--weights", str(folder), "--out", str(out),
           "--config", args.config[0], "--steps", str(args.steps), "--size", str(args.size),
           "--repeats", str(args.repeats), "--device", args.device] + (["--flops"] if flops else [])
    cmd += ["--dtype", args.dtype] if args.dtype else []
    for name in OURS_OPTIONS:                  # flags, and --ours-gguf with its type
        value = getattr(args, name)
        cmd += [f"--{name.replace('_', '-')}", *([value] if isinstance(value, str) else [])] if value else []
    cmd += ["--compile-backend", args.compile_backend]
    if args.cfg is not None:
        cmd += ["--cfg", str(args.cfg)]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return json.loads(out.read_text())


def fmt_bytes(n: int) -> str:
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.0f} MiB"


def print_comparison(ours: Summary, theirs: Summary, flops: int | None, peak_rate: float | None, steps: int):
    print(f"\n{'stage':<10} {'ours med':>9} {'diff med':>9} {'ratio':>6}   {'ours best':>9} {'diff best':>9} "
          f"{'ratio':>6}   {'ours peak':>10} {'diff peak':>10}")
    stages = ["encode"] + [f"step{i}" for i in range(steps)] + ["steps", "decode", "other", "total"]
    for s in stages:
        if s not in ours.median or s not in theirs.median:
            continue
        peak = (fmt_bytes(ours.peak[s]), fmt_bytes(theirs.peak[s])) if s in ours.peak else ("", "")
        print(f"{s:<10} {ours.median[s]:9.3f} {theirs.median[s]:9.3f} {ours.median[s] / theirs.median[s]:6.3f}   "
              f"{ours.best[s]:9.3f} {theirs.best[s]:9.3f} {ours.best[s] / theirs.best[s]:6.3f}   "
              f"{peak[0]:>10} {peak[1]:>10}")
    print(f"{'process':<10} peak memory incl. loading: ours {fmt_bytes(ours.peak['process'])}, "
          f"diffusers {fmt_bytes(theirs.peak['process'])}")
    if flops and peak_rate:
        for name, s in [("ours", ours), ("diffusers", theirs)]:
            step = s.median["steps"] / steps
            print(f"{name}: {flops / step / 1e12:.3f} TFLOP/s per step = {flops / step / peak_rate:.1%} of the "
                  f"measured matmul {peak_rate / 1e12:.3f} TFLOP/s")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", choices=sorted(CONFIGS),
                    help="medium (CPU default) or klein-4b / klein-9b (CUDA default: both); repeatable")
    ap.add_argument("--mode", choices=["distilled", "base", "kv"], default="distilled",
                    help="distilled: one pass per step; base: CFG 4.0 (2 passes); kv: ours only, reference edit")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--size", type=int, help="output side in pixels (default: the config's)")
    ap.add_argument("--rounds", type=int, default=3, help="processes per side, alternating")
    ap.add_argument("--repeats", type=int, default=2, help="timed generations per process (after one warm-up)")
    ap.add_argument("--weights", help="reuse (or keep) the random-weight folder here")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="override the config's dtype")
    ap.add_argument("--json", help="write the summaries to this file")
    ap.add_argument("--ours-fp8", action="store_true",
                    help="ours: fp8 weight storage for the transformer blocks (and fp8 matmuls on CUDA)")
    ap.add_argument("--ours-int8", action="store_true",
                    help="ours: int8 weight storage for the transformer blocks (and int8 matmuls where faster)")
    ap.add_argument("--ours-compile", action="store_true", help="ours: torch.compile the transformer blocks")
    ap.add_argument("--ours-compile-decoder", action="store_true", help="ours: torch.compile the AE's decoder")
    ap.add_argument("--ours-small-decoder", action="store_true",
                    help="ours: decode with a decoder of BFL's small-decoder shape (96/192/384/384 channels at full "
                         "size; diffusers keeps the full decoder, so the decode stage compares the two)")
    ap.add_argument("--ours-no-kitchen", action="store_true",
                    help="ours: without comfy-kitchen's kernels (the plain torch path everywhere: FLUX2_NO_KITCHEN)")
    ap.add_argument("--ours-no-fused", action="store_true",
                    help="ours: without the fused kernels of GGUF dequantization and fp8 activation quantization "
                         "(plain torch ops: FLUX2_NO_FUSED)")
    ap.add_argument("--ours-gguf", choices=GGUF_TYPES, help="ours: the transformer from a GGUF of this type (written "
                    "once from the same weights: Q8_0/Q4_0 quantized, K-quants random blocks: speed, not accuracy)")
    ap.add_argument("--ours-compute", choices=["auto", "float32", "bfloat16", "float16"],
                    help="ours: the transformer's compute dtype, the weights as written (--dtype): a bf16 file "
                         "computed in float32 keeps its blocks bf16, cast per layer; auto: the device's choice")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend for --ours-compile (default inductor; 'eager' checks the path quickly)")
    ap.add_argument("--cfg", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--flops", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.config = args.config or (["klein-4b", "klein-9b"] if args.device.startswith("cuda") else ["medium"])

    if args.worker:
        if args.ours_no_kitchen:
            os.environ["FLUX2_NO_KITCHEN"] = "1"
        if args.ours_no_fused:
            os.environ["FLUX2_NO_FUSED"] = "1"
        args.config = args.config[0]
        args.size = args.size or CONFIGS[args.config].size
        return kv_worker(args) if args.worker == "ours-kv" else worker(args)

    results = {"machine": machine(), "mode": args.mode, "steps": args.steps, "configs": {}, "dtype": args.dtype,
               "ours_options": [o for o in OURS_OPTIONS if getattr(args, o)]}
    print(results["machine"])
    for name in list(args.config):
        cfg = replace(CONFIGS[name], dtype=args.dtype or CONFIGS[name].dtype)
        args.size = args.size or cfg.size
        if args.mode == "base":
            args.cfg = 4.0
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(args.weights or tmp) / name
            if not (folder / "model_index.json").exists():
                t = time.perf_counter()
                write_weights(folder, cfg, distilled=args.mode != "base", device=args.device)
                print(f"{name}: random weights written in {time.perf_counter() - t:.1f} s")
            else:       # kept weights (--weights): the same random weights serve both modes; the index says which
                set_distilled(folder, args.mode != "base")
            if args.ours_gguf and not (folder / f"transformer-{args.ours_gguf}.gguf").exists():
                t = time.perf_counter()
                write_gguf(folder, args.ours_gguf)
                print(f"{name}: {args.ours_gguf} GGUF written in {time.perf_counter() - t:.1f} s")
            run_args = argparse.Namespace(**{**vars(args), "config": [name]})
            if args.mode == "kv":
                rep = spawn(run_args, "ours-kv", Path(tmp) / "kv.json", folder)
                results["configs"][name] = rep
                print_kv(name, rep)
                continue
            reports = {"ours": [], "diffusers": []}
            for r in range(args.rounds):
                for side in (["ours", "diffusers"] if r % 2 == 0 else ["diffusers", "ours"]):
                    out = Path(tmp) / f"{side}{r}.json"
                    reports[side].append(spawn(run_args, side, out, folder, flops=side == "ours" and r == 0))
            lat = {s: torch.load(Path(tmp) / f"{s}0.json.latents.pt") for s in reports}
            diff = ((lat["ours"] - lat["diffusers"]).abs().max() / lat["diffusers"].abs().max()).item()
            ours, theirs = summarize(reports["ours"]), summarize(reports["diffusers"])
            flops, rate = reports["ours"][0]["flops"], reports["ours"][0]["matmul_flops_per_s"]
            options = ", ".join(o.replace("_", "-") + (f" {getattr(args, o)}" if o == "ours_gguf" else "")
                                for o in OURS_OPTIONS if getattr(args, o)) or "none"
            print(f"\n{name}: {args.size}x{args.size}, {args.steps} steps, mode {args.mode}, {cfg.dtype}; "
                  f"ours' options: {options}; {args.rounds} processes x {args.repeats} runs per side; "
                  f"final latents differ by {diff:.1e} (relative to max|diffusers|)")
            print_comparison(ours, theirs, flops, rate, args.steps)
            results["configs"][name] = {"ours": asdict(ours), "diffusers": asdict(theirs), "latent_rel_diff": diff,
                                        "flops_per_step": flops, "matmul_flops_per_s": rate,
                                        "load_s": {s: [r["load_s"] for r in reports[s]] for s in reports}}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def set_distilled(folder: Path, distilled: bool) -> None:
    """Mark a kept weights folder distilled or base in its model_index.json (both sides read the variant there)."""
    index_path = folder / "model_index.json"
    index = json.loads(index_path.read_text())
    if index.get("is_distilled") != distilled:
        index_path.write_text(json.dumps({**index, "is_distilled": distilled}))


def print_kv(name: str, rep: dict) -> None:
    runs = rep["runs"]
    med = {k: statistics.median(r[k]["total"] for r in runs) for k in runs[0]}
    steps = {k: statistics.median(sum(v for s, v in r[k]["times"].items() if s.startswith("step")) for r in runs)
             for k in runs[0]}
    stages = {k: {s: statistics.median(r[k]["times"].get(s, 0.0) for r in runs) for s in ("ref-encode", "ref-kv",
                                                                                           "ref-lookup")}
              for k in runs[0]}
    print(f"\n{name}: single-reference edit, ours only (median of {len(runs)} runs)")
    for k, total in med.items():
        extra = ", ".join(f"{s} {v:.3f} s" for s, v in stages[k].items() if v)
        print(f"{k:<10} total {total:7.3f} s   steps {steps[k]:7.3f} s   ({extra})   speed-up vs joint: "
              f"total {med['joint'] / total:.2f}x, steps {steps['joint'] / steps[k]:.2f}x")


if __name__ == "__main__":
    main()
