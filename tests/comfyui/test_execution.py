"""How our nodes behave as ComfyUI runs them: progress per step with latent previews, interrupt, many prompts in a row."""

import io
import struct
import time

from PIL import Image

from tests.comfyui import graphs

PREVIEWS = {"preview_method": "latent2rgb"}     # what the frontend sends when previews are on
RSS_GROWTH_BOUND_MIB = 100                      # over 20 prompts, after one warm-up prompt


def test_one_progress_message_and_preview_per_step(comfy):
    steps = 6
    run = comfy.client.run(graphs.ours(comfy.files, "a lighthouse", seed=11, steps=steps), **PREVIEWS)
    progress = [(p["value"], p["max"]) for p in run.of_type("progress") if p["node"] == "8"]
    assert progress == [(i, steps) for i in range(1, steps + 1)]
    assert len(run.previews) == steps
    for frame in run.previews:                   # PREVIEW_IMAGE (1), JPEG (1), then the picture
        assert struct.unpack(">II", frame[:8]) == (1, 1)
        assert Image.open(io.BytesIO(frame[8:])).format == "JPEG"


def test_interrupt_stops_within_one_step(comfy):
    steps, stop_at = 200, 3
    prompt = graphs.ours(comfy.files, "a long run", seed=12, steps=steps, width=512, height=512)
    message, progress = comfy.client.run_interrupted(prompt, stop_at, **PREVIEWS)
    data = message["data"]
    seen, times = [value for value, _ in progress], [at for _, at in progress]
    assert message["type"] == "execution_interrupted", message
    assert data["node_id"] == "8" and data["node_type"] == "Flux2KleinDenoise"
    step_time = (times[stop_at - 1] - times[0]) / (stop_at - 1)
    stopped_after = time.monotonic() - times[stop_at - 1]
    print(f"\ninterrupt: progress seen {seen}; a step takes {step_time * 1000:.0f} ms, the run stopped "
          f"{stopped_after * 1000:.0f} ms after /interrupt")
    # The step running when /interrupt arrives may finish; no further step starts.
    assert seen[-1] <= stop_at + 1 and max(seen) < steps
    # The interrupt flag is cleared: the next prompt runs.
    assert comfy.client.run(graphs.ours(comfy.files, "after the interrupt", seed=13)).of_type("execution_success")


def test_twenty_prompts_back_to_back(comfy):
    client, count = comfy.client, 20

    def build(seed):
        return graphs.ours(comfy.files, "a red fox", seed=seed, width=128, height=128)
    client.run(build(1000))                                  # warm-up: models loaded, caches filled
    before = comfy.server.rss_mib()
    ws = client.connect()
    try:
        ids = [client.submit(build(2000 + i)) for i in range(count)]   # all queued before the first finishes
        for prompt_id in ids:                                # the queue runs them in order; raises on an error
            client.follow(ws, prompt_id)
    finally:
        ws.close()
    after = comfy.server.rss_mib()
    print(f"\n{count} prompts: server RSS {before:.0f} -> {after:.0f} MiB (+{after - before:.0f})")
    pictures = set()
    for prompt_id in ids:
        assert client.history(prompt_id)["status"]["status_str"] == "success"
        (png,) = client.image_bytes(prompt_id)
        pictures.add(png)
    assert len(pictures) == count                            # 20 seeds, 20 different images
    assert after - before < RSS_GROWTH_BOUND_MIB
