"""Follower processes for a driver inside another program (flux2_core/followers.py, what the ComfyUI node uses): this
test process drives, a follower started by torch's elastic launcher loads the same file; the denoise equals one
process's, LoRAs reach the follower, closing frees it, and failures come back as messages, not hangs."""

import os
import signal
import time

import pytest
import torch

from flux2_core import parallel
from flux2_core.errors import Flux2Error
from flux2_core.followers import FollowerGroup, Recipe
from flux2_core.patching import set_adapters
from flux2_core.weights import load_transformer
from tests.tiny.adapters import lora_state_dict, random_lora, save_adapter
from tests.tiny.parallel_ranks import SIX_HEADS, build_model, job
from tests.tiny.transformer import save_bfl_transformer

pytestmark = pytest.mark.slow


def relative(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"          # a zombie has exited
    except FileNotFoundError:
        return True


@pytest.fixture
def weights(tmp_path):
    return save_bfl_transformer(build_model().state_dict(), tmp_path / "six.safetensors")


def test_a_follower_group_denoises_as_one_process_with_loras(tmp_path, weights):
    model, _ = load_transformer(weights, "cpu", torch.float32)
    lora = save_adapter(lora_state_dict(random_lora(SIX_HEADS, ["double_blocks.0.img_attn.qkv",
                                                                "single_blocks.1.linear1"]), "ai-toolkit")[0],
                        tmp_path / "lora.safetensors")
    from flux2_core.adapters import read_adapter

    patches = read_adapter(lora, SIX_HEADS).patches
    plain = job(model, "cfg")["latents"]
    set_adapters(model, [(p, 0.8) for p in patches])
    with_lora = job(model, "kv")
    set_adapters(model, [])

    group = FollowerGroup.start(Recipe(str(weights), "float32"), ["cpu", "cpu"])
    pids = group.context.pids()
    try:
        parallel.attach(model, group.sp)
        assert relative(job(model, "cfg")["latents"], plain) <= 1e-5
        set_adapters(model, [(p, 0.8) for p in patches])
        group.set_adapters([(str(lora), 0.8, None)])
        got = job(model, "kv")
        for key in with_lora:
            assert relative(got[key], with_lora[key]) <= 1e-5, key
        assert relative(got["latents"], job(build_model(), "kv")["latents"]) > 1e-3     # the LoRA did something
    finally:
        parallel.attach(model, None)
        group.close()
    assert not torch.distributed.is_initialized()
    end = time.monotonic() + 10
    while not all(gone(pid) for pid in pids.values()) and time.monotonic() < end:
        time.sleep(0.1)
    assert all(gone(pid) for pid in pids.values())


def test_a_follower_that_cannot_load_fails_the_start_with_its_message(tmp_path):
    with pytest.raises(Flux2Error, match=r"a follower process stopped while loading: rank 1 exited with 2: error: "):
        FollowerGroup.start(Recipe(str(tmp_path / "missing.safetensors"), "float32"), ["cpu", "cpu"])
    assert not torch.distributed.is_initialized()


def test_a_follower_killed_between_runs_fails_the_next_run_at_once(weights):
    model, _ = load_transformer(weights, "cpu", torch.float32)
    group = FollowerGroup.start(Recipe(str(weights), "float32"), ["cpu", "cpu"])
    try:
        parallel.attach(model, group.sp)
        job(model, "t2i")
        os.kill(next(iter(group.context.pids().values())), signal.SIGKILL)
        end = time.monotonic() + 10
        while group.alive() and time.monotonic() < end:
            time.sleep(0.05)
        started = time.monotonic()
        with pytest.raises(Flux2Error, match="sequence-parallel run failed: a rank stopped"):
            job(model, "t2i")
        assert time.monotonic() - started < 5
    finally:
        parallel.attach(model, None)
        group.close()
    assert not torch.distributed.is_initialized()
