"""Sequence parallelism (flux2_core/runtime/parallel.py, models/shards.py) on 2 and 3 gloo ranks on the CPU equals one
process on the same tiny weights: text-to-image, CFG, three joint references and the 9B-KV scheme, FLUX 3 with CFG
over prompts of different lengths (masked) and two references, with token counts that do not divide evenly; and its
errors."""

import os

import pytest
import torch

from flux2_core.errors import Flux2Error
from flux2_core.models import rope
from flux2_core.runtime import memory, parallel
from tests.memory import peak_bytes
from tests.tiny.parallel_ranks import MEMORY_GRID, MEMORY_TXT, SIX_HEADS, build_model, job, run_ranks


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", ["t2i", "cfg", "refs", "kv", "small_ref", "flux3_refs"])
def test_ranks_equal_one_process(tmp_path, world, name):
    expected = job(build_model(name), name)
    got = run_ranks(world, name, tmp_path)
    assert got.keys() == expected.keys()
    for key in expected:
        assert relative(got[key], expected[key]) <= 1e-5, key


def test_shares_are_near_equal_and_cover_the_tokens():
    assert parallel.shares(7, 3) == (3, 2, 2)
    assert parallel.shares(2, 3) == (1, 1, 0)
    assert parallel.shares(4096, 8) == (512,) * 8


def test_world_must_divide_the_heads():
    model = build_model()
    sp = parallel.SequenceParallel(0, 4, "cpu", store=None)
    with pytest.raises(Flux2Error, match=r"4 ranks do not divide this model's 6 attention heads: use 2, 3, 6"):
        parallel.attach(model, sp)
    assert parallel.sequence_parallel_of(model) is None


def test_a_missing_backend_is_named():
    if torch.distributed.is_backend_available("nccl"):
        pytest.skip("this torch build has nccl")
    with pytest.raises(Flux2Error, match="the nccl backend is not in this torch build"):
        parallel.backend_for(torch.device("cpu"), "nccl")


@pytest.mark.slow
def test_stale_reference_kv_and_bad_input_are_refused_before_the_ranks_start(tmp_path):
    """Both are refused on the driver before the call is announced, so the followers never see them and the group
    then runs a denoise equal to one process's."""
    got = run_ranks(2, "stale_kv", tmp_path)
    assert "earlier reference pass" in bytes(got["error"].tolist()).decode()
    assert "text embeddings must be" in bytes(got["bad_input"].tolist()).decode()
    assert relative(got["latents"], job(build_model(), "t2i")["latents"]) <= 1e-5


@pytest.mark.slow
def test_a_rank_that_dies_fails_the_run_with_its_message(tmp_path):
    got = run_ranks(2, "rank_dies", tmp_path)
    message = bytes(got["error"].tolist()).decode()
    assert "sequence-parallel run failed" in message
    assert "rank 1: RuntimeError: simulated failure of this rank's GPU" in message


@pytest.mark.slow
def test_calls_without_collectives_wait_for_slow_followers(tmp_path):
    # the driver runs ahead of a follower that is still busy with earlier calls: their announcements must stay
    got = run_ranks(2, "quiet_calls", tmp_path)
    assert relative(got["latents"], job(build_model(), "t2i")["latents"]) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_denoise_memory_covers_each_ranks_measured_peak(tmp_path, world):
    """One pass of batch 2 over 1068 tokens: every rank's peak activation memory, measured on the CPU, is at most
    ``denoise_memory(..., ranks=world)`` and not far below it (within 1.5x), and the ranks together need less than
    one process would beside them (as each holds 1/world of the tokens); one process's own peak (within the single-
    process estimate) is the comparison."""
    tokens = MEMORY_TXT + MEMORY_GRID[0] * MEMORY_GRID[1]
    estimate = memory.denoise_memory(SIX_HEADS, tokens, 2, torch.float32, ranks=world)
    got = run_ranks(world, "memory", tmp_path)
    assert torch.isfinite(got["velocity"]).all()
    # the least of 6 passes: the profiler pairs a few allocations and frees wrongly around the collectives, which
    # only ever adds to a pass's figure
    peaks = [min(map(int, (tmp_path / f"peak{rank}.txt").read_text().split())) for rank in range(world)]
    print(f"{world} ranks: peaks {[round(p / 1e6, 2) for p in peaks]} MB, estimate {estimate / 1e6:.2f} MB")
    for rank, peak in enumerate(peaks):
        assert peak <= estimate <= 1.5 * peak, (rank, peak, estimate)

    model = build_model()
    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(2, tokens - MEMORY_TXT, 128, generator=g), rope.image_ids(2, *MEMORY_GRID),
              torch.full((2,), 0.5), torch.randn(2, MEMORY_TXT, SIX_HEADS.context_in_dim, generator=g),
              rope.text_ids(2, MEMORY_TXT))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                    # as each rank runs: the CPU kernels' per-thread scratch alike
    try:
        with torch.no_grad():
            model(*inputs)
            whole = peak_bytes(lambda: model(*inputs))
    finally:
        torch.set_num_threads(threads)          # later tests compare runs in this process with subprocesses
    assert whole <= memory.denoise_memory(SIX_HEADS, tokens, 2, torch.float32)
    assert max(peaks) < whole * (1 / world + 0.35)


def listening_addresses(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp and tcp6 write them) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:          # 0A: LISTEN
                    found.add(address)
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_a_store_served_on_loopback_listens_there_only():
    store = parallel.connect_store(0, 2, "127.0.0.1", 0, host=True)
    assert listening_addresses(store.port) == {"0100007F"}            # 127.0.0.1, not 0.0.0.0 or ::
    with pytest.raises(Flux2Error, match="could not reach the group's store"):
        parallel.connect_store(0, 2, "127.0.0.1", store.port, host=True)     # the port is taken
