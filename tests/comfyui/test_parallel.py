"""Klein Parallel in the real server (--cpu): the model's denoising spread over 2 ranks (this server process
and one follower process on gloo) equals the single-process Denoise node's, for text-to-image and for a 9B-KV edit
with three references; the follower stops when ComfyUI unloads the models ("Unload models"), freeing its memory."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from tests.comfyui import graphs

CASE = {"prompt": "a red fox on two ranks", "seed": 12, "steps": 3, "width": 64, "height": 48}


def follower_pids() -> list[int]:
    """The running follower processes (python -m flux2_core.runtime.followers) on this machine."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if (proc.name.isdigit() and b"flux2_core.runtime.followers" in (proc / "cmdline").read_bytes()
                    and (proc / "stat").read_text().split()[2] != "Z"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def latent(comfy, graph) -> tuple[torch.Tensor, dict]:
    run = comfy.client.run(graph)
    entry = comfy.client.history(run.prompt_id)
    return graphs.saved_latent(comfy.base, entry).float(), entry["outputs"]


def on_two_ranks(graph: dict) -> dict:
    """The graph with Klein Parallel (2 ranks) between the model loader and the denoiser."""
    graph["45"] = {"class_type": "Flux2KleinParallel", "inputs": {"model": ["1", 0], "gpus": 2}}
    graph["8"]["inputs"]["model"] = ["45", 0]
    return graph


def test_parallel_node_equals_one_process_and_frees_its_follower(comfy):
    model_file = comfy.files["transformer_two_heads"]
    one, _ = latent(comfy, graphs.ours(comfy.files, **CASE, model_file=model_file, output="latent"))
    two, outputs = latent(comfy, on_two_ranks(graphs.ours(comfy.files, **CASE, model_file=model_file,
                                                           output="latent")))
    assert "denoised on 2 ranks" in outputs["8"]["text"][0]
    relative = ((two - one).abs().max() / one.abs().max()).item()
    print(f"\nParallel node (2 ranks) vs Denoise alone: relative {relative:.3g}")
    assert relative <= 1e-5
    assert len(follower_pids()) == 1

    comfy.client.post_json("/free", {"unload_models": True})
    comfy.client.run({"1": {"class_type": "Flux2KleinNoise", "inputs": {"seed": 0, "width": 16, "height": 16,
                                                                          "batch_size": 1}},
                      "2": {"class_type": "SaveLatent", "inputs": {"samples": ["1", 0], "filename_prefix": "free"}}})
    end = time.monotonic() + 30
    while follower_pids() and time.monotonic() < end:
        time.sleep(0.2)
    assert follower_pids() == []

    again, _ = latent(comfy, on_two_ranks(graphs.ours(comfy.files, **{**CASE, "seed": 13}, model_file=model_file,
                                                      output="latent")))
    assert again.shape == one.shape and not torch.equal(again, two)   # a new follower started for this run


def test_parallel_node_equals_one_process_for_a_kv_edit_with_three_references(comfy):
    case = {**CASE, "prompt": "a kv edit on two ranks", "references": comfy.images[:3],
            "model_file": comfy.files["transformer_two_heads_kv"], "output": "latent"}
    one, alone = latent(comfy, graphs.ours(comfy.files, **case))
    assert "reference K/V" in alone["8"]["text"][0]                   # the KV scheme: its file name says kv
    two, outputs = latent(comfy, on_two_ranks(graphs.ours(comfy.files, **case)))
    assert "denoised on 2 ranks" in outputs["8"]["text"][0]
    relative = ((two - one).abs().max() / one.abs().max()).item()
    print(f"\nParallel node, 9B-KV edit with 3 references: relative {relative:.3g}")
    assert relative <= 1e-5


def test_a_parallel_run_cancelled_midway_leaves_the_next_run_working(comfy):
    # ComfyUI's layers check for a cancel inside the transformer pass: the follower is then left inside it. The node
    # must close that group (not wait in a collective for the group timeout), and the next run must start afresh
    model_file = comfy.files["transformer_two_heads"]
    long_run = on_two_ranks(graphs.ours(comfy.files, "a long parallel run", seed=3, steps=200, width=512, height=512,
                                        model_file=model_file))
    message, _ = comfy.client.run_interrupted(long_run, 2)
    assert message["type"] == "execution_interrupted", message

    started = time.monotonic()
    case = {**CASE, "seed": 21}
    two, outputs = latent(comfy, on_two_ranks(graphs.ours(comfy.files, **case, model_file=model_file,
                                                           output="latent")))
    took = time.monotonic() - started
    print(f"\nthe parallel run after a cancel took {took:.1f} s")
    assert took < 120
    assert "denoised on 2 ranks" in outputs["8"]["text"][0]
    assert len(follower_pids()) == 1
    one, _ = latent(comfy, graphs.ours(comfy.files, **case, model_file=model_file, output="latent"))
    assert ((two - one).abs().max() / one.abs().max()).item() <= 1e-5
