"""Batches on real ComfyUI servers: edits with local pictures over two servers give, job by job, the images a single
queue of the same jobs gives on a third; a server killed mid-batch loses no job; a rerun after an interruption runs
only what was missing.

The session's server (`comfy`) makes the reference images, one `queue` command a job, as a user would without
batches; two more servers (conftest.more_comfy: the same tiny models, folders of their own) run the batches.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flux2_core import BatchClient, BatchJob
from flux2_core.app import queue_client, queue_command
from flux2_core.app.batch_jobs import plan_jobs
from flux2_core.app.batch_progress import BatchProgress
from flux2_core.app.queue_client import load_workflow
from flux2_core.app.queue_watch import ask_queue
from flux2_core.app.uploads import read_picture, upload

ROOT = Path(__file__).resolve().parents[2]
EDIT = ROOT / "workflows" / "api" / "flux2-klein-edit.json"
SIZE = (64, 64)
SEEDS = range(1, 15)                 # the jobs of this module, by seed: each test takes its own

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> list[Path]:
    folder = tmp_path_factory.mktemp("local-pictures")
    rng = np.random.default_rng(5)
    paths = []
    for i, (w, h) in enumerate([(96, 80), (80, 96)]):
        path = folder / f"local-{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def job(seed: int, pictures: list[Path]) -> BatchJob:
    return BatchJob(prompt=f"edit number {seed}", seed=seed, size=SIZE, images={"10": str(pictures[seed % 2])})


@pytest.fixture(scope="module")
def reference(comfy, pictures, tmp_path_factory) -> dict[int, bytes]:
    """{seed: PNG bytes}: each job queued alone on the session's server with the plain `queue` command."""
    out = tmp_path_factory.mktemp("reference")
    images = {}
    for seed in SEEDS:
        spec = job(seed, pictures)
        folder = out / str(seed)
        argv = [str(EDIT), "--server", comfy.server.address, "--out", str(folder), "--prompt", spec.prompt,
                "--seed", str(seed), "--image", f"10={spec.images['10']}", "--set", f"5.width={SIZE[0]}",
                "--set", f"5.height={SIZE[1]}"]
        assert queue_command.main(argv) == 0, comfy.server.log()[-4000:]
        (path,) = folder.glob("*.png")
        images[seed] = path.read_bytes()
    return images


@pytest.fixture(scope="module")
def two(more_comfy):
    return more_comfy(2)


def idle(*servers, seconds: float = 300.0) -> None:
    """Wait until nothing is queued or running on the servers: prompts of an interrupted batch go on running in
    ComfyUI, and a test starts from empty queues whatever ran before it."""
    deadline = time.monotonic() + seconds
    while any(ask_queue(queue_client.ComfyClient(s.address)) for s in servers):
        assert time.monotonic() < deadline, "the servers' queues did not empty"
        time.sleep(0.5)


def pixels(data: bytes) -> np.ndarray:
    from io import BytesIO
    with Image.open(BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))


def check_against(reference: dict[int, bytes], summary, seeds) -> None:
    """Each job's one image is the reference's, byte for byte (the same pixels, the same workflow saved in it)."""
    by_seed = {json.loads(Image.open(summary.paths(j)[0]).text["prompt"])["5"]["inputs"]["seed"]: j
               for j in summary.jobs}
    assert sorted(by_seed) == sorted(seeds)
    for seed, record in by_seed.items():
        (path,) = summary.paths(record)
        data = path.read_bytes()
        assert np.array_equal(pixels(data), pixels(reference[seed])), f"job {record.id} (seed {seed})"
        assert data == reference[seed], f"job {record.id} (seed {seed}): same pixels, other PNG bytes"


def test_a_batch_over_two_servers_gives_the_images_of_a_single_queue(two, reference, pictures, tmp_path):
    b, c = two
    summary = BatchClient(str(EDIT), [b.address, c.address], str(tmp_path), per_server=1).run(
        [job(seed, pictures) for seed in SEEDS[:4]])
    assert summary.ok, summary.text() + b.log()[-3000:] + c.log()[-3000:]
    assert all(s.done >= 1 for s in summary.servers), summary.text()       # both servers took jobs
    check_against(reference, summary, SEEDS[:4])
    names = {read_picture(str(path), "test").name for path in pictures}
    for server in (b, c):                     # each picture stored once, under its content name
        uploaded = {p.name for p in (server.base_dir / "input").iterdir() if re.fullmatch(r"flux2-[0-9a-f]{32}.*",
                                                                                         p.name)}
        assert uploaded and uploaded <= names, uploaded


def test_a_rerun_after_an_interruption_finishes_only_what_was_missing(two, reference, pictures, tmp_path):
    b, c = two
    seeds = SEEDS[4:8]

    class CtrlCAfterTwo(BatchProgress):
        def ended(self, job_id, ok, images, text):
            super().ended(job_id, ok, images, text)
            if self.done == 2:
                raise KeyboardInterrupt

    client = BatchClient(str(EDIT), [b.address, c.address], str(tmp_path), per_server=1)
    client.progress = CtrlCAfterTwo(0, open(os.devnull, "w"), tty=False)           # noqa: SIM115
    with pytest.raises(KeyboardInterrupt):
        client.run([job(seed, pictures) for seed in seeds])
    recorded = json.loads((tmp_path / "manifest.json").read_text())["jobs"]
    assert [r["status"] for r in recorded] == ["done", "done"]
    client.progress = None
    summary = client.run([job(seed, pictures) for seed in seeds])
    assert summary.ok and summary.skipped == 2, summary.text()
    assert sum(s.done for s in summary.servers) == 2                  # only the two missing jobs ran
    assert {r.key: r.files for r in summary.jobs if r.key in {r["key"] for r in recorded}} == \
        {r["key"]: r["files"] for r in recorded}                     # the two done before: as they were
    check_against(reference, summary, seeds)
    assert not list(tmp_path.glob(".flux2-batch-*.part"))
    names = [name for r in summary.jobs for name in r.files]
    assert len(names) == len(set(names)) == 4


def test_killing_a_server_mid_batch_loses_no_job(two, reference, pictures, tmp_path):
    """Both servers get a job at once (a free slot is never left idle), so c is killed in the middle of one. It
    failed once when c, busy at the start with an interrupted batch's prompts, was passed over for the whole batch
    (its queue count was never refreshed): here c starts with another client's prompt on purpose."""
    b, c = two
    seeds = SEEDS[8:14]
    idle(b, c)
    other = queue_client.ComfyClient(c.address)                        # another client of c
    (planned,) = plan_jobs(load_workflow(str(EDIT)), [job(99, pictures)])
    other.submit(planned.workflow(load_workflow(str(EDIT)), {node: upload(other, picture)
                                                              for node, picture in planned.pictures.items()}))

    class KillC(BatchProgress):
        killed = False

        def step(self, job_id, value, maximum):
            super().step(job_id, value, maximum)
            if not self.killed and self.running.get(job_id, ("",))[0] == c.address:
                self.killed = True
                os.killpg(c.process.pid, signal.SIGKILL)

    progress = KillC(0, open(os.devnull, "w"), tty=False)                             # noqa: SIM115
    summary = BatchClient(str(EDIT), [b.address, c.address], str(tmp_path), per_server=1, server_timeout=10,
                          progress=progress).run([job(seed, pictures) for seed in seeds])
    assert progress.killed and summary.ok, summary.text()
    dropped = summary.servers[1]
    assert dropped.server == c.address and dropped.dropped and dropped.moved >= 1
    assert summary.servers[0].done == 6 - dropped.done
    check_against(reference, summary, seeds)
