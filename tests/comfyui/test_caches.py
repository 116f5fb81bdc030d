"""Our process-wide caches and the Compile node in the real server.

* KV edits (a Klein 9B-KV model): a second run with the same reference image, a new prompt and a new seed does not
  run the reference pass (the Denoise node says so, and the server log); its latent equals a run that computed the
  reference K/V afresh.
* The K/V are a model under ComfyUI's model management: loaded as one ("Requested to load Flux2KleinReferenceKV"),
  unloaded with the models when the user frees memory, and loaded back for the next edit with the same reference.
* Prompts: a prompt that comes back after another one is not encoded again (the encode node says "(cached)").
* Compile: the blocks run through torch.compile (inductor on the CPU) and give the eager latent; a later plain run
  is eager again.
"""

from __future__ import annotations

import torch

from tests.comfyui import graphs

REUSED = "reference K/V: reused (no reference pass)"
COMPUTED = "reference K/V: computed"
LOG_LINE = "reference K/V reused from the previous edit"


def run(comfy, graph: dict) -> tuple[torch.Tensor, dict]:
    """(saved latent, history outputs) of one prompt, whose denoiser (node 8) must have run, not come from the
    server's cache of node outputs."""
    done = comfy.client.run(graph)
    assert not any("8" in m["nodes"] for m in done.of_type("execution_cached")), "the denoiser did not run"
    entry = comfy.client.history(done.prompt_id)
    return graphs.saved_latent(comfy.base, entry).float(), entry["outputs"]


def test_repeated_kv_edit_skips_the_reference_pass(comfy):
    a, b = comfy.images[:2]

    def edit(prompt: str, seed: int, reference: str) -> tuple[torch.Tensor, str]:
        latent, outputs = run(comfy, graphs.ours(comfy.files, prompt, seed=seed, steps=2, references=[reference],
                                                 model_file=comfy.files["transformer_kv"], output="latent"))
        (text,) = outputs["8"]["text"]
        return latent, text

    edit("make it night", 1, b)                               # whatever ran before: now b's K/V are cached
    logged = comfy.server.log().count(LOG_LINE)
    first, text = edit("make it night", 1, a)
    assert text == COMPUTED
    again, text = edit("make it snow", 2, a)                  # new prompt and seed, same reference
    assert text == REUSED and comfy.server.log().count(LOG_LINE) == logged + 1
    assert not torch.equal(first, again)
    _, text = edit("make it snow", 2, b)                      # another reference: computed (and it evicts a's)
    assert text == COMPUTED
    fresh, text = edit("make it snow", 2, a)                  # a again, computed afresh: the same latent as the reuse
    assert text == COMPUTED
    assert torch.equal(again, fresh)


def test_reference_kv_live_under_comfyuis_model_management(comfy):
    a = comfy.images[2]
    loads = "Requested to load Flux2KleinReferenceKV"

    def edit(prompt: str, seed: int) -> tuple[torch.Tensor, str]:
        latent, outputs = run(comfy, graphs.ours(comfy.files, prompt, seed=seed, steps=2, references=[a],
                                                 model_file=comfy.files["transformer_kv"], output="latent"))
        return latent, outputs["8"]["text"][0]

    before = comfy.server.log().count(loads)
    _, text = edit("a kv management test", 5)
    assert text == COMPUTED                                     # no other test uses this reference picture
    loaded = comfy.server.log().count(loads)
    assert loaded == before + 1                                 # the new K/V: registered as a model
    reused, text = edit("another kv management test", 6)
    assert text == REUSED and comfy.server.log().count(loads) == loaded      # still loaded: nothing to do
    # "Unload models": ComfyUI unloads every model it manages after the current prompt (a cheap prompt makes sure
    # that has happened before the next edit is queued; its other graph also makes the loader read the file again)
    comfy.client.post_json("/free", {"unload_models": True})
    comfy.client.run({"1": {"class_type": "Flux2KleinNoise", "inputs": {"seed": 0, "width": 16, "height": 16,
                                                                          "batch_size": 1}},
                      "2": {"class_type": "SaveLatent", "inputs": {"samples": ["1", 0], "filename_prefix": "free"}}})
    again, text = edit("another kv management test", 6)
    assert text == REUSED                          # still cached (on the offload device meanwhile), for the same weights
    assert comfy.server.log().count(loads) == loaded + 1        # and loaded back as a model
    assert torch.equal(again, reused)


def test_a_prompt_that_comes_back_is_not_encoded_again(comfy):
    def label(prompt: str) -> str:
        _, outputs = run(comfy, graphs.ours(comfy.files, prompt, seed=3, steps=1, output="latent"))
        (text,) = outputs["4"]["text"]
        return text

    first = label("a lighthouse at dusk, cache test")
    assert not first.endswith("(cached)")
    label("a lighthouse at dawn, cache test")
    assert label("a lighthouse at dusk, cache test") == first + " (cached)"


def test_compile_node_gives_the_eager_result(comfy):
    plain = graphs.ours(comfy.files, "a red fox", seed=4, steps=2, output="latent")
    compiled = graphs.ours(comfy.files, "a red fox", seed=4, steps=2, output="latent")
    compiled["30"] = {"class_type": "Flux2KleinCompile", "inputs": {"model": graphs.link("1")}}
    compiled["8"]["inputs"]["model"] = graphs.link("30")

    eager, _ = run(comfy, plain)
    fast, _ = run(comfy, compiled)
    err = (fast - eager).abs().max().item()
    print(f"compiled vs eager: max diff {err:.3g} (max {eager.abs().max().item():.3g})")
    assert err <= 1e-4 * eager.abs().max().item()
    again, _ = run(comfy, plain)
    assert torch.equal(again, eager)
