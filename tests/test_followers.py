"""Follower processes for a driver inside another program (flux2_core/runtime/followers.py, what the ComfyUI node uses): this
test process drives, a follower started by torch's elastic launcher loads the same file; the denoise equals one
process's, LoRAs reach the follower, closing frees it, and failures come back as messages, not hangs."""

import os
import signal
import time

import pytest
import torch

from flux2_core.adapters.lora import AdapterUse, read_adapter
from flux2_core.adapters.patching import set_adapters
from flux2_core.errors import Flux2Error
from flux2_core.models import rope
from flux2_core.runtime import parallel
from flux2_core.runtime.followers import FollowerGroup, TransformerSource
from flux2_core.sampling import euler
from flux2_core.weights import load_transformer
from tests.tiny.adapters import lora_state_dict, random_lora, save_adapter
from tests.tiny.parallel_ranks import SIGMAS, SIX_HEADS, build_model, job
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
    patches = read_adapter(lora, SIX_HEADS).patches
    plain = job(model, "cfg")["latents"]
    set_adapters(model, [(p, 0.8) for p in patches])
    with_lora = job(model, "kv")
    set_adapters(model, [])

    group = FollowerGroup.start(TransformerSource(str(weights), "float32"), ["cpu", "cpu"])
    pids = group.context.pids()
    try:
        parallel.attach(model, group.sp)
        assert relative(job(model, "cfg")["latents"], plain) <= 1e-5
        set_adapters(model, [(p, 0.8) for p in patches])
        group.set_adapters([AdapterUse(str(lora), read_adapter(lora, SIX_HEADS).digest(text_encoder=False), 0.8)])
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
        FollowerGroup.start(TransformerSource(str(tmp_path / "missing.safetensors"), "float32"), ["cpu", "cpu"])
    assert not torch.distributed.is_initialized()


def test_a_follower_killed_between_runs_fails_the_next_run_at_once(weights):
    model, _ = load_transformer(weights, "cpu", torch.float32)
    group = FollowerGroup.start(TransformerSource(str(weights), "float32"), ["cpu", "cpu"])
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


class Cancelled(Exception):
    """What ComfyUI raises inside a layer when the user cancels (InterruptProcessingException)."""


@pytest.mark.parametrize("error", [Cancelled("the user cancelled"), torch.OutOfMemoryError("CUDA out of memory")])
def test_a_pass_cut_short_on_the_driver_breaks_the_group_which_closes_at_once(weights, error):
    # the followers are left inside the pass, waiting for the driver: the group must refuse the next pass (it would
    # hang until the group timeout) and close without waiting for them; a new group then works
    model, _ = load_transformer(weights, "cpu", torch.float32)
    expected = job(model, "t2i")["latents"]
    group = FollowerGroup.start(TransformerSource.of(weights, "float32"), ["cpu", "cpu"])
    pids = group.context.pids()
    block = model.single_blocks[0]
    try:
        parallel.attach(model, group.sp)
        block.forward = lambda *args, **kwargs: (_ for _ in ()).throw(error)
        with pytest.raises(type(error)) as raised:
            job(model, "t2i")
        assert raised.value is error                      # the driver's own error, not a message about the ranks
        del block.forward
        assert group.sp.broken and not group.usable()
        started = time.monotonic()
        with pytest.raises(Flux2Error, match="cut short .* start the ranks again"):
            job(model, "t2i")
        group.close()
        assert time.monotonic() - started < 30
    finally:
        parallel.attach(model, None)
        group.close()
    assert not torch.distributed.is_initialized()
    assert all(gone(pid) for pid in pids.values())
    assert not group.logs.exists()

    again = FollowerGroup.start(TransformerSource.of(weights, "float32"), ["cpu", "cpu"])
    try:
        parallel.attach(model, again.sp)
        assert relative(job(model, "t2i")["latents"], expected) <= 1e-5
    finally:
        parallel.attach(model, None)
        again.close()


def test_a_model_file_changed_since_the_driver_loaded_it_is_refused(weights):
    recipe = TransformerSource.of(weights, "float32")
    later = os.stat(weights).st_mtime_ns + 5_000_000_000
    os.utime(weights, ns=(later, later))
    with pytest.raises(Flux2Error, match=r"six.safetensors has changed since the driver loaded it"):
        FollowerGroup.start(recipe, ["cpu", "cpu"])
    assert not torch.distributed.is_initialized()


def test_a_lora_changed_since_the_driver_read_it_is_refused_and_release_drops_the_kv(tmp_path, weights):
    model, _ = load_transformer(weights, "cpu", torch.float32)
    lora = save_adapter(lora_state_dict(random_lora(SIX_HEADS, ["single_blocks.1.linear1"]), "ai-toolkit")[0],
                        tmp_path / "lora.safetensors")
    group = FollowerGroup.start(TransformerSource.of(weights, "float32"), ["cpu", "cpu"])
    try:
        parallel.attach(model, group.sp)
        g = torch.Generator().manual_seed(1)
        ref, ref_ids = torch.randn(1, 6, 128, generator=g), rope.reference_ids([(2, 3)])
        kv = model.reference_kv(ref, ref_ids)
        group.sp.release()                                  # the followers dropped their shares: kv is stale now
        x, txt = torch.randn(1, 128, 3, 5, generator=g), torch.randn(1, 7, SIX_HEADS.context_in_dim, generator=g)
        with pytest.raises(Flux2Error, match="earlier reference pass"):
            euler.denoise(model, x, SIGMAS, txt, ref_kv=kv, kv=True)

        group.set_adapters([AdapterUse(str(lora), "a digest of another file", 1.0)])
        with pytest.raises(Flux2Error, match=r"rank 1: Flux2Error: the LoRA .*lora.safetensors has changed"):
            job(model, "t2i")
    finally:
        parallel.attach(model, None)
        group.close()
    assert not torch.distributed.is_initialized()


def test_followers_import_path_holds_the_engine():
    """Followers run ``python -m flux2_core.runtime.followers`` with PACKAGE_ROOT on their path: inside ComfyUI the
    pack is not installed, so that folder must hold the engine package."""
    from flux2_core.runtime import followers

    assert (followers.PACKAGE_ROOT / "flux2_core" / "runtime" / "followers.py").is_file()
