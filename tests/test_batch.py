"""Batches (flux2_core/app/batch.py, batch_jobs.py, manifest.py) against fake and misbehaving ComfyUI servers
(tests/batch_fakes.py): jobs spread over servers, each job's own images in its own files, a manifest that lets a
rerun skip what is done, servers that hang, die, refuse uploads or answer another job's images, and bad input
refused before anything is queued."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from PIL import Image

from flux2_core import BatchClient, BatchJob
from flux2_core.app import batch as batch_module
from flux2_core.app import manifest as manifest_module
from flux2_core.app import queue_client, queue_command
from flux2_core.app.batch_progress import BatchProgress
from flux2_core.errors import Flux2Error
from tests.batch_fakes import picture_for

ROOT = Path(__file__).resolve().parents[1]
EDIT = ROOT / "workflows" / "api" / "flux2-klein-edit.json"
WORKFLOW = json.loads(EDIT.read_text())


class CtrlC(BatchProgress):
    """Progress that presses Ctrl-C as the first job ends."""

    def ended(self, job_id, ok, images, text):
        super().ended(job_id, ok, images, text)
        raise KeyboardInterrupt


def made_for(path: Path) -> dict:
    """The prompt a fake server made this file for (saved in it as SaveImage does)."""
    with Image.open(path) as image:
        return json.loads(image.text["prompt"])


def jobs_file(tmp_path: Path, jobs: list[dict], name="jobs.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(job) + "\n" for job in jobs))
    return path


def run_cli(argv, capsys) -> tuple[int, str, str]:
    code = queue_command.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def wait_until(condition, seconds: float = 60) -> bool:
    """condition() once it holds, or its last answer after ``seconds``: a wait for another thread's work that does not
    depend on how fast this machine is (the bound only ends a hang)."""
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.01)
    return condition()


def manifest_of(out: Path) -> dict:
    return {job["id"]: job for job in json.loads((out / "manifest.json").read_text())["jobs"]}


# ---------------------------------------------------------------------------------------------------------------------
# A batch that goes well.

def test_a_batch_over_two_servers_gives_each_job_its_own_images(fakes, tmp_path, capsys):
    a, b = fakes(images=2), fakes(images=2)
    a.delay = b.delay = 0.1
    Image.new("RGB", (8, 8), (9, 9, 9)).save(tmp_path / "photo.png")
    jobs = [{"prompt": f"edit {i}", "seed": i, "images": {"10": "photo.png"}} for i in range(6)]
    jobs[2]["id"] = "fox"
    jobs[3]["size"] = "96x64"
    jobs[4]["set"] = {"6.steps": 8}
    out = tmp_path / "out"
    code, stdout, err = run_cli([str(EDIT), "--batch", str(jobs_file(tmp_path, jobs)), "--server", a.address,
                                 "--server", b.address, "--out", str(out)], capsys)
    assert code == 0, err
    assert len(a.prompts) + len(b.prompts) == 6 and a.prompts and b.prompts         # both servers worked
    assert len(a.uploads) == len(b.uploads) == 1                                    # one upload per server
    records = manifest_of(out)
    ids = ["0001", "0002", "fox", "0004", "0005", "0006"]
    assert sorted(records) == sorted(ids) and all(r["status"] == "done" for r in records.values())
    for number, job_id in enumerate(ids):
        files = records[job_id]["files"]
        assert files == [f"{job_id}-1.png", f"{job_id}-2.png"]
        for index, name in enumerate(files):            # each file is this job's own image, byte for byte
            sent = made_for(out / name)
            assert sent["4"]["inputs"]["prompt"] == f"edit {number}" and sent["5"]["inputs"]["seed"] == number
            assert (out / name).read_bytes() == picture_for(sent, index)
    assert made_for(out / "0004-1.png")["5"]["inputs"]["width"] == 96
    assert made_for(out / "0005-1.png")["6"]["inputs"]["steps"] == 8
    assert sorted(stdout.split()) == sorted(str(out / name) for r in records.values() for name in r["files"])
    summary = err[err.index("batch of 6 job(s)"):]
    assert summary.startswith("batch of 6 job(s): 6 done, 0 failed; 12 image(s) in ")
    assert f"  {a.address}: {len(a.prompts)} done, 0 failed, {2 * len(a.prompts)} image(s)" in summary
    assert f"  {b.address}: {len(b.prompts)} done, 0 failed, {2 * len(b.prompts)} image(s)" in summary
    progress = [line for line in err.splitlines() if line.startswith("batch: ")]   # not a terminal: one a job
    assert len(progress) == 6 and progress[-1].startswith("batch: 6/6 jobs, 12 images, ")
    assert re.fullmatch(r"batch: 3/6 jobs, 6 images, [\d.]+ jobs/min, \d+s, ~\d+s left( \| .*)?", progress[2])
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == \
        sorted(["manifest.json", *(name for r in records.values() for name in r["files"])])


def test_several_prompts_make_a_batch(fakes, tmp_path, capsys):
    server = fakes()
    code, _, err = run_cli([str(EDIT), "--prompt", "one", "--prompt", "two", "--seed", "5", "--server",
                            server.address, "--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert sorted(p["4"]["inputs"]["prompt"] for p in server.prompts) == ["one", "two"]
    assert [p["5"]["inputs"]["seed"] for p in server.prompts] == [5, 5]
    assert sorted(manifest_of(tmp_path)) == ["0001", "0002"]


def test_a_job_goes_to_the_server_with_the_least_queued_work(fakes, tmp_path):
    busy, idle = fakes(), fakes()
    busy.queue_remaining = 5                         # other clients' prompts wait there
    summary = BatchClient(WORKFLOW, [busy.address, idle.address], str(tmp_path), per_server=2).run(
        [BatchJob(seed=1), BatchJob(seed=2)])
    assert summary.ok and busy.prompts == [] and len(idle.prompts) == 2


def steps_seen(progress: BatchProgress) -> list[int]:
    """How many jobs were running at each step message the progress got, filled in as the batch runs."""
    seen = []
    original = progress.step

    def step(job_id, value, maximum):
        seen.append(len(progress.running))
        original(job_id, value, maximum)
    progress.step = step
    return seen


def test_a_server_busy_when_the_batch_starts_is_not_starved(fakes, tmp_path):
    """Its queue count came from the probe and was only refreshed by our own jobs' websockets there: a server busy
    at the start (its count at or past --per-server) never got a job, for the whole batch. A free slot is now
    always used, and the count is asked of the server itself as the batch runs."""
    busy, idle = fakes(), fakes()
    busy.queue_remaining = 5
    busy.delay = idle.delay = 0.2
    threading.Timer(0.3, setattr, (busy, "queue_remaining", 0)).start()     # the other clients' work ends
    summary = BatchClient(WORKFLOW, [busy.address, idle.address], str(tmp_path), per_server=1).run(
        [BatchJob(seed=i) for i in range(6)])
    assert summary.ok and len(busy.prompts) >= 2 and len(idle.prompts) >= 2, summary.text()


def test_outside_load_on_every_server_does_not_serialise_the_batch(fakes, tmp_path):
    """Every server with other clients' work at --per-server 1: the batch ran one job at a time across them all."""
    a, b = fakes(), fakes()
    a.queue_remaining = b.queue_remaining = 3
    a.delay = b.delay = 0.3
    progress = BatchProgress(0, io.StringIO(), tty=False)
    seen = steps_seen(progress)
    summary = BatchClient(WORKFLOW, [a.address, b.address], str(tmp_path), per_server=1, progress=progress).run(
        [BatchJob(seed=i) for i in range(4)])
    assert summary.ok and max(seen) == 2 and a.prompts and b.prompts, summary.text()
    assert a.most_pending == b.most_pending == 1


def test_equal_servers_take_turns(fakes, tmp_path):
    servers = [fakes() for _ in range(3)]
    summary = BatchClient(WORKFLOW, [s.address for s in servers], str(tmp_path), per_server=2).run(
        [BatchJob(seed=i) for i in range(3)])
    assert summary.ok and [len(s.prompts) for s in servers] == [1, 1, 1]


def test_the_queue_count_is_the_servers_own_without_our_prompts(fakes):
    """The watcher asks GET /prompt as the batch runs (a change is seen without any job of ours there); ComfyUI's
    count includes our prompts, which the scheduler does not count twice."""
    from flux2_core.app.batch import ServerSummary, _Server
    from flux2_core.app.queue_watch import QueueWatch
    server = fakes()
    server.queue_remaining = 4
    seen = _Server(server.address, ServerSummary(server.address), 0)
    watch = QueueWatch(queue_client.ComfyClient(server.address), seen.observe, every=0.02)
    watch.start()
    try:
        deadline = time.monotonic() + 5
        while seen.others != 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen.others == 4
        server.queue_remaining, server.pending = 1, 2      # two prompts of ours queued there meanwhile
        seen.submitting(2)
        while seen.others != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen.others == 1 and seen.load() == 1
        seen.inflight = 2
        assert seen.load() == 3                            # our two jobs, one of another client
    finally:
        watch.stop()
        server.pending = 0


def test_concurrency_per_server_is_bounded(fakes, tmp_path):
    server = fakes()
    server.delay = 0.3
    progress = BatchProgress(0, io.StringIO(), tty=False)
    most = steps_seen(progress)
    summary = BatchClient(WORKFLOW, server.address, str(tmp_path), per_server=2, progress=progress).run(
        [BatchJob(seed=i) for i in range(6)])
    assert summary.ok and max(most) == 2 and server.most_pending == 2


# ---------------------------------------------------------------------------------------------------------------------
# Resuming.

def test_a_rerun_skips_done_jobs_and_retries_failed_ones(fakes, tmp_path, capsys):
    server = fakes()
    server.fail_seeds = {2}
    batch = jobs_file(tmp_path, [{"prompt": "x", "seed": i} for i in range(4)])
    out = tmp_path / "out"
    argv = [str(EDIT), "--batch", str(batch), "--server", server.address, "--out", str(out)]
    code, _, err = run_cli(argv, capsys)
    assert code == 1
    records = manifest_of(out)
    assert [records[i]["status"] for i in ("0001", "0002", "0003", "0004")] == ["done", "done", "failed", "done"]
    assert records["0003"]["error"] == (f"job 0003 ({batch} line 3): ComfyUI at {server.address}: node 7 "
                                        "(Flux2KleinDenoise) failed: RuntimeError: boom")
    assert "failed:\n  job 0003" in err and "run the same batch again to retry the failed jobs" in err
    done_files = {name: (out / name).read_bytes() for name in ("0001-1.png", "0002-1.png", "0004-1.png")}
    server.fail_seeds = set()
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    assert len(server.prompts) == 5 and server.prompts[-1]["5"]["inputs"]["seed"] == 2      # only job 3 again
    assert "3 of the 4 jobs were done before" in err and "1 done, 0 failed, 3 done before (skipped)" in err
    assert manifest_of(out)["0003"]["status"] == "done" and manifest_of(out)["0003"]["files"] == ["0003-1.png"]
    assert all((out / name).read_bytes() == data for name, data in done_files.items())
    code, _, err = run_cli(argv, capsys)
    assert code == 0 and len(server.prompts) == 5 and "nothing left to run" in err


def test_a_changed_job_or_a_lost_file_runs_again(fakes, tmp_path):
    server = fakes()
    client = BatchClient(WORKFLOW, server.address, str(tmp_path))
    assert client.run([BatchJob(seed=1), BatchJob(seed=2)]).ok
    (tmp_path / "0002-1.png").unlink()
    summary = client.run([BatchJob(seed=1), BatchJob(seed=2), BatchJob(seed=3, prompt="new")])
    assert summary.skipped == 1 and sorted(p["5"]["inputs"]["seed"] for p in server.prompts) == [1, 2, 2, 3]
    assert [job.files for job in summary.jobs] == [["0001-1.png"], ["0002-1.png"], ["0003-1.png"]]


def test_a_changed_job_replaces_its_old_record_and_images(fakes, tmp_path):
    """The same id, another seed: it left its old record and images, and its new ones landed beside them as
    0002-1-1.png. Now the folder holds the new job's images under the id's names, and one record of it."""
    server = fakes(images=2)
    client = BatchClient(WORKFLOW, server.address, str(tmp_path))
    assert client.run([BatchJob(seed=1), BatchJob(seed=2)]).ok
    err = io.StringIO()
    client.progress = BatchProgress(0, err, tty=False)
    summary = client.run([BatchJob(seed=1), BatchJob(seed=3)])
    assert summary.ok and summary.skipped == 1
    assert "1 job(s) changed since they ran" in err.getvalue() and ": 0002); their new images replace" in \
        err.getvalue()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == \
        ["0001-1.png", "0001-2.png", "0002-1.png", "0002-2.png", "manifest.json"]
    assert made_for(tmp_path / "0002-1.png")["5"]["inputs"]["seed"] == 3
    records = json.loads((tmp_path / "manifest.json").read_text())["jobs"]
    assert sorted(r["id"] for r in records) == ["0001", "0002"]


def test_a_changed_job_that_fails_keeps_the_old_images_until_it_succeeds(fakes, tmp_path):
    server = fakes()
    client = BatchClient(WORKFLOW, server.address, str(tmp_path))
    assert client.run([BatchJob(seed=1)]).ok
    old = (tmp_path / "0001-1.png").read_bytes()
    server.fail_seeds = {2}
    assert not client.run([BatchJob(seed=2)]).ok
    assert (tmp_path / "0001-1.png").read_bytes() == old
    server.fail_seeds = set()
    assert client.run([BatchJob(seed=2)]).ok
    assert made_for(tmp_path / "0001-1.png")["5"]["inputs"]["seed"] == 2
    assert [(r["id"], r["status"]) for r in json.loads((tmp_path / "manifest.json").read_text())["jobs"]] == \
        [("0001", "done")]


def test_another_workflows_batch_in_the_same_out_is_refused(fakes, tmp_path):
    """Two batches in one --out shared one manifest: their ids named the same files (0001-1-1.png) and a rerun of
    either could not tell its jobs from the other's. The manifest names its workflow; another one is refused."""
    server = fakes()
    assert BatchClient(str(EDIT), server.address, str(tmp_path)).run([BatchJob(seed=1)]).ok
    other = json.loads(json.dumps(WORKFLOW))
    other["6"]["inputs"]["steps"] = 8
    with pytest.raises(Flux2Error, match=rf"--out {re.escape(str(tmp_path))}: .*manifest.json records a batch of "
                                         rf"another workflow \({re.escape(str(EDIT))}\), .*Give this batch another "
                                         r"--out, or remove .*manifest.json \(and the images it lists\)"):
        BatchClient(other, server.address, str(tmp_path)).run([BatchJob(seed=2)])
    assert len(server.prompts) == 1
    assert BatchClient(WORKFLOW, server.address, str(tmp_path)).run([BatchJob(seed=2)]).ok   # the same one: runs


def test_a_job_done_before_is_reported_under_its_id_in_this_batch(fakes, tmp_path):
    """A line put before the others shifts their ids (0001 -> 0002): the jobs done before are still skipped, but the
    summary gives each job its place in this batch, so no two jobs share an id in it."""
    server = fakes()
    client = BatchClient(WORKFLOW, server.address, str(tmp_path))
    assert client.run([BatchJob(seed=1, source="line 1"), BatchJob(seed=2, source="line 2")]).ok
    summary = client.run([BatchJob(seed=0, source="line 1"), BatchJob(seed=1, source="line 2"),
                          BatchJob(seed=2, source="line 3")])
    assert summary.ok and summary.skipped == 2 and len(server.prompts) == 3
    assert [(job.id, job.source) for job in summary.jobs] == [("0001", "line 1"), ("0002", "line 2"),
                                                             ("0003", "line 3")]
    assert [job.files for job in summary.jobs] == [["0001-1-1.png"], ["0001-1.png"], ["0002-1.png"]]


def test_set_in_a_batch_line_reads_values_as_the_set_option_does(fakes, tmp_path, capsys):
    server = fakes()
    batch = jobs_file(tmp_path, [{"seed": 1, "set": ["6.steps=8", "6.schedule=simple"]}, {"seed": 2}])
    code, _, err = run_cli([str(EDIT), "--batch", str(batch), "--server", server.address, "--set", "6.rho=7.5",
                            "--out", str(tmp_path / "out")], capsys)
    assert code == 0, err
    sent = {p["5"]["inputs"]["seed"]: p["6"]["inputs"] for p in server.prompts}
    assert (sent[1]["steps"], sent[1]["schedule"], sent[1]["rho"]) == (8, "simple", 7.5)
    assert (sent[2]["steps"], sent[2]["rho"]) == (4, 7.5)


def test_a_workflow_given_as_a_dict_is_checked(tmp_path):
    with pytest.raises(Flux2Error, match=r"the workflow given to BatchClient is not an API-format workflow"):
        BatchClient({"1": {"inputs": {}}}, "127.0.0.1:8188", str(tmp_path)).run([BatchJob(prompt="a fox")])


def test_an_interrupted_run_leaves_no_half_written_file(fakes, tmp_path):
    """A download that breaks after the first of a job's two images: nothing of that job is published, the temp
    file is gone; temp files left by a killed run are removed by the next one."""
    server = fakes(images=2)
    server.cut_view = "_1.png"
    (tmp_path / ".flux2-batch-killed.part").write_bytes(b"half an image")        # as a killed run leaves it
    summary = BatchClient(WORKFLOW, server.address, str(tmp_path)).run([BatchJob(seed=1)])
    assert summary.jobs[0].error.startswith(f"job 0001: ComfyUI at {server.address}: GET /view sent "
                                            "flux2-klein_00001_1.png as 40 bytes that are not a readable PNG picture")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".flux2-batch.lock", "manifest.json"]


def test_jobs_still_running_when_a_batch_is_interrupted_write_nothing(fakes, tmp_path):
    """Ctrl-C in a service that goes on living: the jobs still running on the servers must not drop files into the
    folder afterwards (the manifest does not list them; the next run does them again)."""
    fast, slow = fakes(), fakes()
    slow.delay = 0.5

    with pytest.raises(KeyboardInterrupt):
        BatchClient(WORKFLOW, [fast.address, slow.address], str(tmp_path), per_server=1,
                    progress=CtrlC(0, io.StringIO(), tty=False)).run([BatchJob(seed=1), BatchJob(seed=2)])
    assert wait_until(lambda: len(slow.history) == 1)   # the slow server's job ends meanwhile: it did finish there
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert names == ["0001-1.png", "manifest.json"] or names == ["0002-1.png", "manifest.json"]
    assert [r["status"] for r in manifest_of(tmp_path).values()] == ["done"]


def test_nothing_lands_in_the_folder_once_the_batch_has_ended(fakes, tmp_path, monkeypatch):
    """The race behind the test above: a job that found the batch still running, then published after Ctrl-C had
    ended it (its thread paused between the two), dropped files the manifest never lists. Publishing and ending now
    exclude each other: once run() has stopped, nothing more is written."""
    slow, fast = fakes(), fakes()
    slow.delay = 0.5
    publish = manifest_module.Manifest.publish

    def paused(self, record, staged):
        if record.id == "0002":                      # the fast job: past its last check, paused till the end
            self.ended.wait(5)
        return publish(self, record, staged)
    monkeypatch.setattr(manifest_module.Manifest, "publish", paused)

    with pytest.raises(KeyboardInterrupt):
        BatchClient(WORKFLOW, [slow.address, fast.address], str(tmp_path), per_server=1,
                    progress=CtrlC(0, io.StringIO(), tty=False)).run([BatchJob(seed=1), BatchJob(seed=2)])
    assert wait_until(lambda: len(fast.history) == 1)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["0001-1.png", "manifest.json"]


def test_a_job_published_when_ctrl_c_comes_is_recorded(fakes, tmp_path, monkeypatch):
    """Ctrl-C after a job's thread published its images but before the scheduler recorded the job left whole images
    no record lists (the next run made them again, as 0001-1-1.png): a job is now recorded as it publishes."""
    server = fakes()

    def ctrl_c(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(batch_module.BatchClient, "_ended", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        BatchClient(WORKFLOW, server.address, str(tmp_path)).run([BatchJob(seed=1)])
    assert manifest_of(tmp_path)["0001"]["files"] == ["0001-1.png"]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["0001-1.png",
                                                                                        "manifest.json"]
    monkeypatch.undo()
    summary = BatchClient(WORKFLOW, server.address, str(tmp_path)).run([BatchJob(seed=1)])
    assert summary.skipped == 1 and len(server.prompts) == 1


def test_an_image_whose_record_cannot_be_written_is_not_left(tmp_path, monkeypatch):
    manifest = manifest_module.Manifest.open(str(tmp_path))
    staged = manifest.stage(b"image", ".png")
    monkeypatch.setattr(manifest, "_replace", lambda *a: (_ for _ in ()).throw(Flux2Error("disk full")))
    with pytest.raises(Flux2Error, match="disk full"):
        manifest.publish(manifest_module.JobRecord("0001", "k1", "done"), [staged])
    manifest.discard([staged])
    assert sorted(p.name for p in tmp_path.iterdir()) == [".flux2-batch.lock"]
    manifest.close()


def test_a_half_written_manifest_never_replaces_the_last_one(tmp_path, monkeypatch):
    manifest = manifest_module.Manifest.open(str(tmp_path))
    manifest.record(manifest_module.JobRecord("a", "k1", "done", []))
    before = (tmp_path / "manifest.json").read_bytes()

    def disk_full(*args):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(manifest_module.os, "replace", disk_full)
    with pytest.raises(Flux2Error, match="No space left on device; check the free space"):
        manifest.record(manifest_module.JobRecord("b", "k2", "done", []))
    assert (tmp_path / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".flux2-batch.lock", "manifest.json"]
    manifest.close()


def test_two_jobs_never_write_the_same_file(tmp_path):
    """Names are claimed without replacing: a file already there keeps its bytes, the job takes the next name."""
    (tmp_path / "0001-1.png").write_bytes(b"mine")
    manifest = manifest_module.Manifest.open(str(tmp_path))
    names = [manifest.publish(manifest_module.JobRecord("0001", key, "done"), [manifest.stage(data, ".png")]).files
             for key, data in (("k1", b"one"), ("k2", b"two"))]
    assert names == [["0001-1-1.png"], ["0001-1-2.png"]]
    assert [(tmp_path / n).read_bytes() for n in ("0001-1.png", "0001-1-1.png", "0001-1-2.png")] == \
        [b"mine", b"one", b"two"]
    manifest.close()


def test_a_folder_in_use_or_an_unknown_manifest_is_refused(tmp_path):
    first = manifest_module.Manifest.open(str(tmp_path))
    with pytest.raises(Flux2Error, match="another batch is writing there now"):
        manifest_module.Manifest.open(str(tmp_path))
    first.close()
    (tmp_path / "manifest.json").write_text('{"something": "else"}')
    with pytest.raises(Flux2Error, match=r"manifest.json is not a batch manifest this client can read"):
        manifest_module.Manifest.open(str(tmp_path))


# ---------------------------------------------------------------------------------------------------------------------
# Servers that misbehave: a clear error naming the job and the server, and the batch goes on.

def test_a_refused_upload_fails_its_jobs_and_the_batch_goes_on(fakes, tmp_path):
    server = fakes()
    server.upload_answer = (500, b"Internal Server Error")
    Image.new("RGB", (8, 8)).save(tmp_path / "photo.png")
    summary = BatchClient(WORKFLOW, server.address, str(tmp_path / "out")).run(
        [BatchJob(seed=1, images={"10": str(tmp_path / "photo.png")}), BatchJob(seed=2)])
    assert [job.status for job in summary.jobs] == ["failed", "done"]
    assert summary.jobs[0].error.startswith(f"job 0001: ComfyUI at {server.address}: POST /upload/image refused "
                                            f"{tmp_path / 'photo.png'} (HTTP 500)")
    assert len(server.prompts) == 1


def test_an_odd_upload_answer_fails_the_job(fakes, tmp_path):
    server = fakes()
    server.upload_answer = (200, b'{"name": "../../etc/passwd"}')
    Image.new("RGB", (8, 8)).save(tmp_path / "photo.png")
    summary = BatchClient(WORKFLOW, server.address, str(tmp_path / "out")).run(
        [BatchJob(seed=1, images={"10": str(tmp_path / "photo.png")})])
    assert summary.jobs[0].error == (f"job 0001: ComfyUI at {server.address}: the answer to POST /upload/image "
                                     "names no usable file: b'{\"name\": \"../../etc/passwd\"}'")
    assert server.prompts == []


def test_a_server_that_answers_another_jobs_images(fakes, tmp_path):
    swapper, good = fakes(), fakes()
    swapper.swap = True
    summary = BatchClient(WORKFLOW, [swapper.address, good.address], str(tmp_path), per_server=1).run(
        [BatchJob(seed=i) for i in range(4)])
    failed = summary.failed
    assert failed and all(job.server == swapper.address for job in failed)
    assert all(re.fullmatch(rf"job \d+: ComfyUI at {swapper.address}: the image flux2-klein_\d+_0.png it lists for "
                            r"prompt p-\d+ was made by another prompt \(the workflow saved in it is not the one this "
                            r"job sent\); nothing was written", job.error) for job in failed)
    for job in summary.jobs:
        if job.status == "done":
            assert made_for(tmp_path / job.files[0])["5"]["inputs"]["seed"] == int(job.id) - 1
    assert not any(list(tmp_path.glob(f"{job.id}-*")) for job in failed)


@pytest.mark.slow
def test_a_server_that_hangs_is_dropped_and_its_jobs_go_to_the_other(fakes, tmp_path):
    hangs, good = fakes(), fakes()
    hangs.hang_after = 1                            # takes one prompt, then answers nothing (not even pings)
    good.delay = 0.2
    err = io.StringIO()
    summary = BatchClient(WORKFLOW, [hangs.address, good.address], str(tmp_path), per_server=1, server_timeout=1,
                          progress=BatchProgress(0, err, tty=False)).run([BatchJob(seed=i) for i in range(4)])
    assert summary.ok and len(hangs.prompts) == 1 and len(good.prompts) == 4
    hung = summary.servers[0]
    assert hung.server == hangs.address and hung.done == 0 and hung.moved == 1
    assert "stopped answering on the websocket" in hung.dropped or "no answer within 1 s" in hung.dropped, \
        hung.dropped                                 # whichever it was waiting for: a ping's answer or an HTTP one
    assert f"dropped {hangs.address}: {hung.dropped}; its jobs go to the other servers" in err.getvalue()
    assert "1 job(s) went to the other servers" in summary.text()


def test_a_dropped_server_is_no_longer_asked_for_its_queue(fakes, tmp_path, monkeypatch):
    """Its watcher stops when it is dropped (before, it asked every second until the batch ended): the dropped
    server's watcher is stopped twice (when dropped, then with the others at the end), the good one's once."""
    hangs, good = fakes(), fakes()
    hangs.hang_after, good.delay = 1, 0.2
    stops = []

    class CountedWatch(batch_module.QueueWatch):
        def stop(self):
            stops.append(self.client.server)
            super().stop()
    monkeypatch.setattr(batch_module, "QueueWatch", CountedWatch)
    summary = BatchClient(WORKFLOW, [hangs.address, good.address], str(tmp_path), per_server=1,
                          server_timeout=1).run([BatchJob(seed=i) for i in range(4)])
    assert summary.ok and summary.servers[0].dropped
    assert sorted(stops) == sorted([summary.servers[0].server] * 2 + [summary.servers[1].server])


@pytest.mark.slow
def test_a_server_that_dies_mid_batch_loses_no_job(fakes, tmp_path):
    dies, good = fakes(), fakes()
    dies.delay = good.delay = 0.3

    class KillOnFirstStep(BatchProgress):
        def step(self, job_id, value, maximum):
            if self.running.get(job_id, ("",))[0] == dies.address:
                threading.Thread(target=dies.stop).start()
            super().step(job_id, value, maximum)
    summary = BatchClient(WORKFLOW, [dies.address, good.address], str(tmp_path), per_server=1,
                          progress=KillOnFirstStep(0, io.StringIO(), tty=False)).run(
        [BatchJob(seed=i) for i in range(4)])
    assert summary.ok, summary.text()
    assert summary.servers[0].dropped and summary.servers[0].done == 0
    assert sorted(made_for(tmp_path / job.files[0])["5"]["inputs"]["seed"] for job in summary.jobs) == [0, 1, 2, 3]


def test_a_dropped_server_is_said_to_refuse_connections_when_it_does(fakes, tmp_path, monkeypatch):
    """It read "no answer within 60 s" whatever happened, here a connection refused at once."""
    gone, good = fakes(), fakes()
    probe = batch_module.BatchClient._probe

    def probe_then_stop(self, servers, progress):
        probe(self, servers, progress)
        gone.stop()                                  # answered the probe, then stopped: nothing listens there now
    monkeypatch.setattr(batch_module.BatchClient, "_probe", probe_then_stop)
    summary = BatchClient(WORKFLOW, [gone.address, good.address], str(tmp_path), per_server=1).run(
        [BatchJob(seed=i) for i in range(3)])
    assert summary.ok, summary.text()
    dropped = summary.servers[0].dropped
    assert "cannot connect (connection refused)" in dropped and "no answer within" not in dropped, dropped
    assert f"{gone.address}: 0 done, 0 failed, 0 image(s), " in summary.text()
    assert f"; dropped ({dropped}), 1 job(s) went to the other servers" in summary.text()


def test_local_failures_are_not_said_to_be_the_servers(fakes, tmp_path, monkeypatch):
    """A picture changed on disk and a full --out were reported as "ComfyUI at HOST:PORT: ..."; they name the
    local file now, and what to do."""
    server = fakes()
    photo = tmp_path / "photo.png"
    Image.new("RGB", (8, 8), (9, 9, 9)).save(photo)

    class ChangesThePicture(BatchProgress):
        def started(self, job_id, where):
            super().started(job_id, where)
            if job_id == "0001":
                Image.new("RGB", (8, 8), (200, 0, 0)).save(photo)
    summary = BatchClient(WORKFLOW, server.address, str(tmp_path / "out"), images={"10": str(photo)},
                          progress=ChangesThePicture(0, io.StringIO(), tty=False)).run([BatchJob(seed=1)])
    assert summary.jobs[0].error == (f"job 0001: the picture {photo} on this machine changed after it was checked "
                                     "(its bytes are no longer the ones checked), so it was not sent; put the "
                                     "original back, or run again to send it as it is now")

    mkstemp = manifest_module.tempfile.mkstemp
    calls = []

    def disk_full(*args, **kwargs):              # the image's temp file: the disk is full; then room again
        calls.append(1)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return mkstemp(*args, **kwargs)
    monkeypatch.setattr(manifest_module.tempfile, "mkstemp", disk_full)
    summary = BatchClient(WORKFLOW, server.address, str(tmp_path / "full")).run([BatchJob(seed=2)])
    assert summary.jobs[0].error == (f"job 0001: cannot write in {tmp_path / 'full'}: No space left on device; "
                                     "check the free space and the folder's permissions")


def test_different_pictures_upload_at_once_on_one_server(fakes, tmp_path):
    """One lock for every upload to a server, held across the network, made them go one at a time."""
    server = fakes()
    server.upload_delay = 0.3
    jobs = []
    for i in range(2):
        Image.new("RGB", (8, 8), (i, 9, 9)).save(tmp_path / f"p{i}.png")
        jobs.append(BatchJob(seed=i, images={"10": str(tmp_path / f"p{i}.png")}))
    jobs.append(BatchJob(seed=5, images={"10": str(tmp_path / "p0.png")}))       # the same picture: sent once
    summary = BatchClient(WORKFLOW, server.address, str(tmp_path / "out"), per_server=3).run(jobs)
    assert summary.ok and server.most_uploads == 2 and len(server.uploads) == 2


def test_a_run_is_cancelled_from_another_thread(fakes, tmp_path):
    """A service stops a batch (cancel()): no job starts any more, run() returns at once, the jobs still running
    write nothing, and the next run does what is left."""
    server = fakes()
    server.delay = 1.0
    client = BatchClient(WORKFLOW, server.address, str(tmp_path), per_server=1,
                         on_job=lambda record, folder: threading.Thread(target=client.cancel).start())
    summary = client.run([BatchJob(seed=i) for i in range(4)])
    assert len(server.history) == 1 and not summary.ok      # returned without waiting for the job still running
    assert [job.status for job in summary.jobs] == ["done", "cancelled", "cancelled", "cancelled"]
    assert summary.jobs[1].error == "job 0002: cancelled before it ended; run the batch again to do it"
    assert summary.failed == [] and len(summary.cancelled) == 3          # not counted as failed
    assert summary.text().startswith("batch of 4 job(s): 1 done, 0 failed, 3 cancelled; ")
    assert len(server.prompts) <= 2
    assert wait_until(lambda: len(server.history) == len(server.prompts))   # a job still running there ends
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["0001-1.png",
                                                                                        "manifest.json"]
    assert list(manifest_of(tmp_path)) == ["0001"]
    client.on_job = None
    summary = client.run([BatchJob(seed=i) for i in range(4)])
    assert summary.ok and summary.skipped == 1


def test_when_every_server_is_gone_the_jobs_left_are_recorded_as_not_run(fakes, tmp_path):
    server = fakes()
    server.hang_after = 1
    summary = BatchClient(WORKFLOW, server.address, str(tmp_path), per_server=1, server_timeout=0.5).run(
        [BatchJob(seed=1), BatchJob(seed=2)])
    assert [job.status for job in summary.jobs] == ["failed", "failed"]
    assert summary.jobs[1].error == f"job 0002: not run, no server left ({server.address} dropped)"


def test_a_job_that_brings_servers_down_is_not_given_to_every_server(fakes, tmp_path):
    """A job that stops each server it runs on (a size that crashes ComfyUI, a node that hangs it) fails after the
    second such server, rather than going on to take down every server and leave the batch with none."""
    servers = [fakes() for _ in range(3)]
    for server in servers:
        server.hang_seeds = {666}
    summary = BatchClient(WORKFLOW, [s.address for s in servers], str(tmp_path), per_server=1,
                          server_timeout=0.5).run([BatchJob(seed=666), *(BatchJob(seed=i) for i in range(1, 5))])
    assert [job.status for job in summary.jobs] == ["failed", "done", "done", "done", "done"], summary.text()
    assert sum(bool(s.dropped) for s in summary.servers) == 2
    error = summary.jobs[0].error
    assert error.startswith("job 0001: 2 servers stopped answering while they ran it (") and error.endswith(
        "); it may be what stops them (look in their logs); it was not given to another. Run the batch again to "
        "retry it")
    assert sum(s.address in error for s in servers) == 2


def test_a_slow_job_fails_alone_and_its_server_is_kept(fakes, tmp_path):
    """No message for --timeout while the server answers its pings: the job is too slow (or stuck in ComfyUI), not
    the server gone; the job fails, and the server is not dropped (which would hand the slow job to the next)."""
    server = fakes(steps=1)
    server.delay = 3.0                               # seconds before its one progress message
    summary = BatchClient(WORKFLOW, server.address, str(tmp_path), per_server=1, timeout=1.0,
                          server_timeout=0.2).run([BatchJob(seed=1), BatchJob(seed=2)])
    assert summary.servers[0].dropped == "" and len(server.prompts) == 2, summary.text()
    assert [job.error for job in summary.jobs] == [
        f"job {n}: ComfyUI at {server.address}: waiting for the prompt's messages on the websocket: no message "
        "for 1 s, though the server answers; is a step (or a model load) slower than that, or is the prompt stuck? "
        "--timeout SECONDS waits longer" for n in ("0001", "0002")]


def test_an_https_server_is_spoken_to_over_https(fakes, tmp_path):
    """https:// is kept (it was cut to HOST:PORT, and the batch then spoke plain HTTP to it): here, to a server that
    only speaks HTTP, the TLS handshake fails, and nothing is sent in the clear."""
    server = fakes()
    with pytest.raises(Flux2Error, match=rf"no server answers, nothing was queued:\n  ComfyUI at {server.address}: "
                                         "GET /prompt: "):
        BatchClient(WORKFLOW, [f"https://{server.address}"], str(tmp_path)).run([BatchJob(seed=1)])
    assert server.prompts == []


def test_no_server_answering_stops_the_batch_before_anything(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]                  # nothing listens there once closed
    with pytest.raises(Flux2Error, match=rf"no server answers, nothing was queued:\n  ComfyUI at 127.0.0.1:{port}: "
                                         r"GET /prompt: cannot connect \(connection refused\)"):
        BatchClient(WORKFLOW, f"127.0.0.1:{port}", str(tmp_path)).run([BatchJob(seed=1)])


# ---------------------------------------------------------------------------------------------------------------------
# Bad input: one clear error, nothing queued.

def bad_input(fakes, tmp_path, capsys, lines: list[str] | None = None, extra=(), servers=None) -> str:
    server = fakes()
    Image.new("RGB", (8, 8)).save(tmp_path / "photo.png")
    batch = tmp_path / "jobs.jsonl"
    batch.write_text("\n".join(lines or ['{"seed": 1}']) + "\n")
    argv = [str(EDIT), "--batch", str(batch), "--out", str(tmp_path / "out"), *extra]
    for address in servers or [server.address]:
        argv += ["--server", address.replace("SERVER", server.address)]
    code, _, err = run_cli(argv, capsys)
    assert code == 1 and err.startswith("error: ") and "Traceback" not in err, err
    assert server.prompts == [] and server.uploads == []
    return err[len("error: "):].rstrip("\n")


@pytest.mark.parametrize("line, says", [
    ('{"seed": 1', "jobs.jsonl line 1 is not JSON (Expecting ',' delimiter"),
    ('["a fox"]', "jobs.jsonl line 1 is not a JSON object; each line is one job"),
    ('{"promt": "a fox"}', "jobs.jsonl line 1: unknown key(s) 'promt'; a job has id, prompt, seed, size"),
    ('{"seed": "one"}', 'jobs.jsonl line 1: "seed" "one" must be a whole number'),
    ('{"size": "big"}', 'jobs.jsonl line 1: "size" "big" is not WIDTHxHEIGHT'),
    ('{"set": {"99.steps": 8}}', "jobs.jsonl line 1: set 99.steps: the workflow has no node 99; its nodes are 1, 2,"),
    ('{"set": {"6.step": 8}}', ("jobs.jsonl line 1: set 6.step: node 6 (Flux2KleinScheduler) has no input step; "
                                "its inputs are latent, rho, schedule, steps")),
    ('{"images": {"7": "photo.png"}}', "jobs.jsonl line 1: --image 7=",),
    ('{"images": {"10": "missing.png"}}', "cannot read"),
    ('{"id": "a/b"}', 'jobs.jsonl line 1: "id" "a/b" must be 1 to 100 letters'),
])
def test_a_bad_batch_line_is_refused_before_anything_is_queued(fakes, tmp_path, capsys, line, says):
    error = bad_input(fakes, tmp_path, capsys, ['{"seed": 5}', line])
    assert says.replace("line 1", "line 2") in error


def test_every_bad_line_is_listed_at_once(fakes, tmp_path, capsys):
    error = bad_input(fakes, tmp_path, capsys, ["{", '{"seed": 1}', "[]", '{"seed": "x"}'])
    assert error.startswith("3 job(s) of the batch are wrong; nothing was queued:\n  ")
    assert "line 1 is not JSON" in error and "line 3 is not a JSON object" in error and "line 4: \"seed\"" in error
    error = bad_input(fakes, tmp_path, capsys, ['{"seed": 1}', '{"seed": 2}', '{"seed": 1}', '{"seed": 2}'])
    assert error.startswith("2 job(s) of the batch are wrong; nothing was queued:\n  ")
    assert "line 3: the same job as " in error and "line 1 (the same workflow, prompt, seed and pictures)" in error


@pytest.mark.parametrize("make, says", [
    (lambda p: p.write_text("not a picture"), "is not a readable picture"),
    (lambda p: Image.new("RGB", (300, 300)).save(p), "pixels, over the"),
])
def test_a_bad_picture_is_refused_before_anything_is_queued(fakes, tmp_path, capsys, monkeypatch, make, says):
    from flux2_core.app import uploads
    monkeypatch.setattr(uploads, "PIXEL_LIMIT", 256 * 256)
    make(tmp_path / "bad.png")
    error = bad_input(fakes, tmp_path, capsys, ['{"images": {"10": "bad.png"}}'])
    assert error.startswith(f"{tmp_path / 'jobs.jsonl'} line 1: --image 10={tmp_path / 'bad.png'}: ") and says in error


def test_the_same_server_twice_is_refused(fakes, tmp_path, capsys):
    error = bad_input(fakes, tmp_path, capsys, servers=["SERVER", "http://SERVER/"])
    assert error.startswith("--server http://127.0.0.1:") and "is given twice (also as 127.0.0.1:" in error


def test_an_out_that_is_not_writable_is_refused(fakes, tmp_path, capsys):
    (tmp_path / "taken").write_text("a file")
    error = bad_input(fakes, tmp_path, capsys, extra=["--out", str(tmp_path / "taken")])
    assert error == f"--out {tmp_path / 'taken'} is a file, not a folder; give a folder for the images (it is " \
                    "created if missing)"


def test_duplicate_ids_and_prompts_with_batch_are_refused(fakes, tmp_path, capsys):
    error = bad_input(fakes, tmp_path, capsys, ['{"id": "a", "seed": 1}', '{"id": "a", "seed": 2}'])
    assert 'line 2: "id" a is also the id of' in error and "two jobs would write the same files" in error
    error = bad_input(fakes, tmp_path, capsys, extra=["--prompt", "x"])
    assert error == "give the prompts either in --batch FILE or as --prompt, not both"


# ---------------------------------------------------------------------------------------------------------------------
# The README's example.

def test_the_readme_batch_example_runs(fakes, tmp_path, monkeypatch):
    """README's "Headless batches" Python example as written, its two servers pointed at fakes."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Headless batches"):]
    (example,) = re.findall(r"```py\n(.*?)```", section[:section.index("\n## ", 5)], re.DOTALL)
    a, b = fakes(), fakes()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "workflows" / "api").mkdir(parents=True)
    (tmp_path / "workflows" / "api" / EDIT.name).write_text(EDIT.read_text())
    for name in re.findall(r'"([\w-]+\.png)"', example):
        Image.new("RGB", (8, 8)).save(tmp_path / name)
    example = example.replace('"127.0.0.1:8188"', f'"{a.address}"').replace('"127.0.0.1:8189"', f'"{b.address}"')
    namespace = {}
    exec(compile(example, "README.md", "exec"), namespace)                 # noqa: S102 - our own README
    summary = namespace["summary"]
    assert summary.ok and len(a.prompts) + len(b.prompts) == len(summary.jobs) >= 2
    assert all(path.is_file() for job in summary.jobs for path in summary.paths(job))


def test_the_queue_help_lists_the_batch_options():
    text = subprocess.run([sys.executable, "-m", "flux2_core", "queue", "--help"], capture_output=True, text=True,
                          check=True, cwd=ROOT).stdout
    for option in ("--batch FILE", "--image NODE=PATH", "--mask NODE=PATH", "--per-server N", "--server-timeout"):
        assert option in text


def test_the_manifest_file_always_holds_the_records_even_after_a_failed_write(tmp_path, monkeypatch):
    """Each save writes every job's record (the lines of unchanged records are reused): a job recorded again replaces
    its line, and a write that failed leaves nothing of its record behind for the next save."""
    manifest = manifest_module.Manifest.open(str(tmp_path))
    first = manifest_module.JobRecord("0001", "k1", "failed", error="server gone")
    manifest.record(first)
    manifest.record(manifest_module.JobRecord("0002", "k2", "done", ["0002-1.png"], seconds=1.5, source="ünïcode"))
    real_replace = manifest_module.os.replace

    def disk_full(*args):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(manifest_module.os, "replace", disk_full)
    with pytest.raises(Flux2Error, match="No space left"):
        manifest.record(manifest_module.JobRecord("0001", "k1", "done", ["0001-1.png"]))
    monkeypatch.setattr(manifest_module.os, "replace", real_replace)
    manifest.record(manifest_module.JobRecord("0003", "k3", "done", ["0003-1.png"]))
    assert manifest_of(tmp_path)["0001"] == dataclasses.asdict(first)     # not the record whose write failed
    manifest.record(manifest_module.JobRecord("0001", "k1", "done", ["0001-1.png"]))
    manifest.close()
    reopened = manifest_module.Manifest.open(str(tmp_path))
    assert reopened.records == manifest.records and len(reopened.records) == 3
    assert reopened.records["k1"].status == "done" and reopened.records["k2"].source == "ünïcode"
    reopened.close()
