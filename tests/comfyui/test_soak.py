"""Our caches under churn in a busy server: several clients queue prompts at once against one ComfyUI, alternating
models (float, fp8, 9B-KV), LoRAs and their strengths, references and sizes, some of them cancelled at a step (the
cancel aimed at that prompt alone). Every prompt that completes gives exactly the latent the same prompt gave when it
ran alone, every cancel leaves the next prompt working, and the server's memory after the soak stays near what it
was before. So the prompt cache, the reference-latent cache and the 9B-KV cache hit only on equal inputs.

FLUX2_SOAK_ROUNDS=N queues every job N times per client (default 1: the short version the suite keeps).
"""

from __future__ import annotations

import os
import random
import threading
import time

import torch

from tests.comfyui import graphs
from tests.comfyui.host import HostClient

CLIENTS = 3
MEMORY_SLACK = 1.25        # the server's RSS after the soak may exceed the one before by 25% (+ 64 MiB)


def jobs(comfy) -> dict[str, dict]:
    """Prompts that share caches in every way that could mix them up: the same prompt with and without a LoRA and
    at two strengths, two formats of a LoRA, the same reference on two models, two references on the KV model, fp8
    weights, another size; two seeds each."""
    f, (a, b) = comfy.files, comfy.images[:2]
    specs = {"plain": {}, "lora 0.5": {"loras": [(f["lora"], 0.5)]}, "lora 1.0": {"loras": [(f["lora"], 1.0)]},
             "kohya 0.8": {"loras": [(f["lora_kohya"], 0.8)]}, "ref a": {"references": [a]},
             "kv ref a": {"model_file": f["transformer_kv"], "references": [a]},
             "kv ref b": {"model_file": f["transformer_kv"], "references": [b]},
             "fp8": {"model_file": f["transformer_fp8"]}, "wide": {"width": 96, "height": 64}}
    return {f"{name} seed {seed}": graphs.ours(f, "a soak test", seed=seed, steps=3, output="latent", **spec)
            for name, spec in specs.items() for seed in (1, 2)}


def latent_of(comfy, client: HostClient, prompt_id: str) -> torch.Tensor:
    return graphs.saved_latent(comfy.base, client.history(prompt_id)).float()


def test_caches_under_churn_serve_only_equal_inputs(comfy):
    graphs_by_name = jobs(comfy)
    alone = {}
    for name, graph in graphs_by_name.items():                  # each prompt alone, one after the other
        alone[name] = latent_of(comfy, comfy.client, comfy.client.run(graph).prompt_id)
    before = comfy.server.rss_mib()

    rounds = int(os.environ.get("FLUX2_SOAK_ROUNDS", "1"))
    rng = random.Random(7)
    plans = []
    for client in range(CLIENTS):                               # each client: every job, shuffled, a third cancelled
        names = [n for _ in range(rounds) for n in graphs_by_name]
        rng.shuffle(names)
        plans.append([(n, rng.random() < 1 / 3) for n in names[: max(6, len(names) // CLIENTS)]])
    results, errors = [], []

    def client_loop(plan):
        client = HostClient(comfy.client.server, timeout=600)
        try:
            for name, cancel in plan:
                ran = True                      # our denoiser ran (not ComfyUI's cache of the same graph's outputs)
                if cancel:                      # the cancel names this prompt: never another client's
                    final, _ = client.run_interrupted(graphs_by_name[name], step=1, only_this=True)
                    prompt_id, ended = final["data"]["prompt_id"], final["type"]
                else:
                    done = client.run(graphs_by_name[name])
                    prompt_id, ended = done.prompt_id, "execution_success"
                    ran = not any("8" in m["nodes"] for m in done.of_type("execution_cached"))
                latent = latent_of(comfy, client, prompt_id) if ended == "execution_success" else None
                results.append((name, cancel, ended, latent, ran))
        except Exception as error:          # noqa: BLE001 - reported below, with the job that hit it
            errors.append(repr(error))

    started = time.monotonic()
    threads = [threading.Thread(target=client_loop, args=(plan,)) for plan in plans]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=900)
    seconds = time.monotonic() - started
    after = comfy.server.rss_mib()

    assert not errors, errors
    assert len(results) == sum(map(len, plans))
    completed = [(n, latent) for n, _, ended, latent, _ in results if latent is not None]
    cancelled = [n for n, cancel, ended, _, _ in results if ended == "execution_interrupted"]
    denoised = sum(ran for *_, latent, ran in results if latent is not None)
    wrong = [n for n, latent in completed if not torch.equal(latent, alone[n])]
    print(f"\nsoak: {len(results)} prompts from {CLIENTS} clients in {seconds:.0f} s: {len(completed)} completed "
          f"({denoised} of them denoised, the rest from ComfyUI's cache of an equal graph), {len(cancelled)} "
          f"cancelled; server RSS {before:.0f} MiB before, {after:.0f} MiB after")
    assert not wrong, f"latents differ from the prompt run alone: {wrong}"
    assert cancelled and completed and denoised >= len(completed) // 2   # cancels happened, and real work went on
    assert after <= before * MEMORY_SLACK + 64, (before, after)
    # after all of it, the first job once more: still what it was
    first = next(iter(graphs_by_name))
    assert torch.equal(latent_of(comfy, comfy.client, comfy.client.run(graphs_by_name[first]).prompt_id),
                       alone[first])
