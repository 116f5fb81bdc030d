"""Sequence-parallel runs on CPU gloo ranks for the tests: each rank builds the same tiny transformer, rank 0 runs a
denoise (text-to-image, CFG, three joint references, 9B-KV; FLUX 3 with CFG and references) and writes its latents to a safetensors file; the others
follow (``parallel.serve``). ``job`` also runs in one process, without ranks, as the expectation."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from flux2_core.errors import Flux2Error
from flux2_core.families.flux2.transformer import Flux2Transformer, TransformerParams
from flux2_core.families.flux3 import transformer as flux3
from flux2_core.families.flux3.transformer import Flux3Params, Flux3Transformer
from flux2_core.models import rope
from flux2_core.runtime import parallel
from flux2_core.runtime.followers import free_port
from flux2_core.sampling import euler
from tests.memory import peak_bytes
from tests.tiny.transformer import random_bfl_transformer_state_dict

# 6 heads: 2 and 3 ranks both divide them; 16-wide heads in four RoPE axes of 4
SIX_HEADS = TransformerParams(in_channels=128, context_in_dim=48, hidden_size=96, num_heads=6, depth=2,
                              depth_single_blocks=2, axes_dim=(4, 4, 4, 4))
TXT_TOKENS = 7                  # uneven over 2 and 3 ranks, as is the 3x5 latent grid and each reference
SIGMAS = [1.0, 0.75, 0.4, 0.0]


# FLUX 3 Image Klein (flow map) at the same width: 6 heads of 16
FLUX3_SIX_HEADS = Flux3Params(in_channels=128, context_in_dim=48, hidden_size=96, num_heads=6, depth=1,
                              depth_single_blocks=2, axes_dim=(4, 4, 4, 4), flow_map=True)


def build_model(name: str = "") -> Flux2Transformer | Flux3Transformer:
    """FLUX.2's tiny transformer, or FLUX 3's for the jobs named flux3_*; the same random weights on every rank."""
    if not name.startswith("flux3"):
        model = Flux2Transformer(SIX_HEADS)
        model.load_state_dict(random_bfl_transformer_state_dict(SIX_HEADS, seed=3))
        return model.eval()
    model = Flux3Transformer(FLUX3_SIX_HEADS)
    g = torch.Generator().manual_seed(3)
    model.load_state_dict({k: torch.randn(v.shape, generator=g) * (0.3 if v.ndim > 1 else 0.1) + (v.ndim == 1)
                           for k, v in model.state_dict().items()})
    return model.eval()


def job(model: Flux2Transformer, name: str) -> dict[str, torch.Tensor]:
    """The denoise called ``name`` on ``model``; its latents (and for "kv", a second run reusing the K/V)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, 128, 3, 5, generator=g)
    txt = torch.randn(1, TXT_TOKENS, SIX_HEADS.context_in_dim, generator=g)
    if name == "t2i":
        return {"latents": euler.denoise(model, x, SIGMAS, txt)}
    if name == "cfg":
        negative = torch.randn(1, TXT_TOKENS, SIX_HEADS.context_in_dim, generator=g)
        return {"latents": euler.denoise(model, x.repeat(2, 1, 1, 1), SIGMAS, txt, negative_txt=negative, cfg=3.5)}
    if name == "small_ref":         # 2 reference tokens over 3 ranks: the reference pass leaves one rank none
        ref, ref_ids = torch.randn(1, 2, 128, generator=g), rope.reference_ids([(1, 2)])
        kv = model.reference_kv(ref, ref_ids)
        return {"latents": euler.denoise(model, x, SIGMAS, txt, ref_kv=kv, kv=True)}
    grids = [(2, 3), (3, 3), (1, 5)]
    ref = torch.randn(1, sum(h * w for h, w in grids), 128, generator=g)
    ref_ids = rope.reference_ids(grids)
    if name == "refs":
        return {"latents": euler.denoise(model, x, SIGMAS, txt, ref=ref, ref_ids=ref_ids)}
    if name == "kv":
        kv = model.reference_kv(ref, ref_ids)
        first = euler.denoise(model, x, SIGMAS, txt, ref_kv=kv, kv=True)
        other = torch.randn(1, TXT_TOKENS, SIX_HEADS.context_in_dim, generator=g)
        return {"latents": first, "again": euler.denoise(model, x, SIGMAS, other, ref_kv=kv, kv=True)}
    if name == "quiet_calls":       # calls with no collectives, which slow followers read late, then a denoise
        sp = parallel.sequence_parallel_of(model)
        for _ in range(3):
            sp.call(lambda: None, "nothing", {})
        return {"latents": euler.denoise(model, x, SIGMAS, txt)}
    if name == "memory":            # one pass over many tokens, each rank's peak measured (measure_passes)
        img = torch.randn(2, MEMORY_GRID[0] * MEMORY_GRID[1], 128, generator=g)
        txt = torch.randn(2, MEMORY_TXT, SIX_HEADS.context_in_dim, generator=g)
        inputs = (img, rope.image_ids(2, *MEMORY_GRID), torch.full((2,), 0.5), txt, rope.text_ids(2, MEMORY_TXT))
        with torch.no_grad():
            return {"velocity": [model(*inputs) for _ in range(MEMORY_PASSES)][-1]}
    if name == "stale_kv":        # refused on the driver before the followers hear of it: the group runs on
        old = model.reference_kv(ref, ref_ids)
        model.reference_kv(ref[:, :6], ref_ids[:, :6])
        said = {}
        for key, call in (("error", lambda: euler.denoise(model, x, SIGMAS, txt, ref_kv=old, kv=True)),
                          ("bad_input", lambda: euler.denoise(model, x, SIGMAS, txt[..., :-1]))):
            try:
                call()
            except Flux2Error as e:
                said[key] = torch.tensor(list(str(e).encode()), dtype=torch.uint8)
        return said | {"latents": euler.denoise(model, x, SIGMAS, txt)}
    if name == "flux3_refs":      # the prompt and CFG's negative of different lengths (masked), two references:
        # 3x5 image tokens, 7 and 4 text tokens, 6 + 4 reference tokens
        negative = torch.randn(1, 4, SIX_HEADS.context_in_dim, generator=g)
        grids = [(2, 3), (1, 4)]
        ref = torch.randn(1, sum(h * w for h, w in grids), 128, generator=g)
        return {"latents": euler.denoise(model, x, SIGMAS, txt, negative_txt=negative, cfg=3.0, ref=ref,
                                         ref_ids=flux3.reference_ids(grids))}
    if name == "rank_dies":
        try:
            euler.denoise(model, x, SIGMAS, txt)
        except Flux2Error as e:
            return {"error": torch.tensor(list(str(e).encode()), dtype=torch.uint8)}
        return {}
    raise ValueError(name)


MEMORY_GRID, MEMORY_TXT = (31, 33), 45      # 1068 tokens, uneven over 2 and 3 ranks
MEMORY_PASSES = 6


def measure_passes(model: Flux2Transformer, folder: str, rank: int) -> None:
    """Record the peak memory of each of this rank's transformer passes (inputs and weights excluded) in
    ``folder/peak<rank>.txt``, one line per pass."""
    velocity = model._velocity

    def measured(*args, **kwargs):
        result = []
        peak = peak_bytes(lambda: result.append(velocity(*args, **kwargs)), collectives=True)
        with open(Path(folder) / f"peak{rank}.txt", "a") as f:
            f.write(f"{peak}\n")
        return result[0]
    model._velocity = measured


def _rank(rank: int, world: int, port: int, name: str, out: str) -> None:
    torch.set_num_threads(1)
    sp = parallel.start(rank, world, "cpu", port=port)
    model = build_model(name)
    if name == "memory":
        measure_passes(model, out, rank)
    if not sp.driver:
        if name == "rank_dies" and rank == world - 1:
            calls = {"n": 0}
            velocity = model._velocity

            def failing(*args, **kwargs):
                calls["n"] += 1
                if calls["n"] == 2:
                    raise RuntimeError("simulated failure of this rank's GPU")
                return velocity(*args, **kwargs)
            model._velocity = failing
        try:
            parallel.serve(model, sp, {"nothing": lambda extra: time.sleep(0.3)})
        except RuntimeError:
            # the simulated failure: the process ends at once, as a crashed rank would (a normal exit tears down its
            # gloo group, whose threads, still inside the collective it left, can abort it: spawn counts that)
            os._exit(0)
        parallel.leave()
        return
    parallel.attach(model, sp)
    result = job(model, name)
    save_file({k: v.contiguous() for k, v in result.items()}, str(Path(out) / "rank0.safetensors"))
    if name == "rank_dies":
        parallel.leave()
        return
    sp.stop()


def run_ranks(world: int, name: str, folder: Path) -> dict[str, torch.Tensor]:
    """``job(name)`` with the transformer spread over ``world`` gloo ranks on the CPU: rank 0's results. The memory job
    runs under torch's memory profiler, which has once died of SIGSEGV in a rank (in torch, outside this code, 1 run
    in 4 here): a rank killed by a signal there gets one more try; an exception in our code never does."""
    for attempt in range(2 if name == "memory" else 1):
        try:
            mp.spawn(_rank, args=(world, free_port(), name, str(folder)), nprocs=world, join=True)
            break
        except mp.ProcessExitedException as e:
            if attempt or e.signal_name is None:
                raise
    return load_file(str(folder / "rank0.safetensors"))
