"""Batches of jobs over one or more ComfyUI servers: BatchClient, and the `queue` command's batch mode.

    from flux2_core import BatchClient, BatchJob

    client = BatchClient("workflows/api/flux2-klein-edit.json", servers=["127.0.0.1:8188", "127.0.0.1:8189"],
                         out="edits")
    summary = client.run([BatchJob(prompt="make it night", seed=1, images={"10": "photo.png"}), ...])
    summary.ok, summary.jobs[0].files, summary.text()

Jobs are checked before anything is queued; those an earlier run finished are skipped. Each goes to the server with
a free slot and the least work, counting other clients' prompts. A server that stops answering is dropped and its jobs
requeued, but a job that LOST_SERVERS servers stopped answering on fails (it may be what crashes them).
"""

from __future__ import annotations

import io
import json
import os
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from PIL import Image

from ..errors import Flux2Error
from .batch_jobs import BatchJob, PlannedJob, job_from_line, job_key, parse_sets, plan_jobs, read_batch
from .batch_progress import BatchProgress, duration
from .manifest import JobRecord, Manifest, image_suffix
from .queue_client import (
    ComfyClient,
    ServerError,
    ServerUnreachable,
    check_workflow,
    file_name,
    load_workflow,
    note,
    parse_server,
    shown,
)
from .queue_watch import POLL, QueueWatch, ask_queue
from .uploads import parse_pairs, upload

MAX_PER_SERVER = 64             # jobs queued at once on one server
LOST_SERVERS = 2                 # a job whose server stopped answering this many times fails (see _schedule)


@dataclass
class ServerSummary:
    """One server's part in a batch."""

    server: str
    done: int = 0
    failed: int = 0
    images: int = 0
    busy: float = 0.0            # seconds its jobs took, summed
    moved: int = 0               # jobs given to the other servers when it stopped answering
    dropped: str = ""            # why it was dropped ("" while it answered)


@dataclass
class BatchSummary:
    jobs: list[JobRecord]        # every job of the batch in order (those done before as they were recorded)
    skipped: int                 # jobs an earlier run had done
    servers: list[ServerSummary]
    seconds: float
    folder: Path

    @property
    def ok(self) -> bool:
        return all(job.status == "done" for job in self.jobs)

    @property
    def failed(self) -> list[JobRecord]:
        return [job for job in self.jobs if job.status == "failed"]

    @property
    def cancelled(self) -> list[JobRecord]:
        return [job for job in self.jobs if job.status == "cancelled"]

    def paths(self, job: JobRecord) -> list[Path]:
        return [self.folder / name for name in job.files]

    def text(self) -> str:
        ran = len(self.jobs) - self.skipped
        done = sum(job.status == "done" for job in self.jobs) - self.skipped
        images = sum(s.images for s in self.servers)
        rate = f" ({ran / self.seconds * 60:.1f} jobs/min)" if self.seconds > 0 and ran else ""
        skipped = f", {self.skipped} done before (skipped)" if self.skipped else ""
        cancelled = f", {len(self.cancelled)} cancelled" if self.cancelled else ""
        lines = [(f"batch of {len(self.jobs)} job(s): {done} done, {len(self.failed)} failed{cancelled}{skipped}; "
                  f"{images} image(s) in {duration(self.seconds)}{rate}, in {self.folder}")]
        for s in self.servers:
            line = f"  {s.server}: {s.done} done, {s.failed} failed, {s.images} image(s), {s.busy:.1f} s of jobs"
            if s.dropped:
                line += f"; dropped ({s.dropped})" + (f", {s.moved} job(s) went to the other servers" if s.moved
                                                       else "")
            lines.append(line)
        if self.failed:
            lines.append("failed:")
            lines += [f"  {job.error}" for job in self.failed]
        left = " and ".join(kind for kind, jobs in (("failed", self.failed), ("cancelled", self.cancelled)) if jobs)
        if left:
            lines.append(f"run the same batch again to retry the {left} jobs (the done ones are skipped)")
        return "\n".join(lines)


@dataclass
class _Server:
    """A server as the scheduler sees it. Only the scheduler thread changes `inflight`; `submitted` and `others`
    change under `lock`."""

    address: str                  # as given
    summary: ServerSummary
    index: int
    inflight: int = 0             # our jobs given to it and not ended yet (each takes a slot)
    submitted: int = 0            # of those, the ones whose prompt it has (counted in its queue_remaining)
    others: int = 0               # other clients' prompts queued or running there, as last seen
    uploaded: dict[str, str] = field(default_factory=dict)     # picture name -> the name the server answered
    uploading: dict[str, threading.Lock] = field(default_factory=dict)     # picture name -> held while it uploads
    lock: threading.Lock = field(default_factory=threading.Lock)
    watch: QueueWatch | None = None   # asks it for its queue while the batch runs; stopped when it is dropped

    @property
    def alive(self) -> bool:
        return not self.summary.dropped

    def load(self) -> int:
        return self.inflight + self.others

    def observe(self, remaining: int) -> None:
        """ComfyUI's queue_remaining counts our prompts too; what is left is the others' work."""
        with self.lock:
            self.others = max(0, remaining - self.submitted)

    def submitting(self, change: int) -> None:
        with self.lock:
            self.submitted += change


def check_servers(servers: Sequence[str]) -> list[str]:
    """The servers as given (an https:// one stays https); one given twice, however written, is refused."""
    seen = {}
    for server in servers:
        name = parse_server(server)[1]
        if name in seen:
            raise Flux2Error(f"--server {server} is given twice (also as {seen[name]}); give each server once (to "
                             "run more jobs at once on one server, use --per-server N)")
        seen[name] = server
    if not seen:
        raise Flux2Error("no --server given; give at least one HOST:PORT where ComfyUI listens")
    return list(seen.values())


def made_by(server: str, prompt_id: str, image: dict, data: bytes, workflow: dict) -> None:
    """Refuse a PNG whose saved workflow (SaveImage's "prompt" text) is not the one this job sent: another prompt's
    image. Images without one (JPEG, metadata off) pass."""
    if not data.startswith(b"\x89PNG"):
        return
    with Image.open(io.BytesIO(data)) as picture:
        saved = getattr(picture, "text", {}).get("prompt")
    if saved is None:
        return
    try:
        same = nodes_of(json.loads(saved)) == nodes_of(workflow)
    except (ValueError, RecursionError, TypeError, KeyError):
        same = False
    if not same:
        raise ServerError(server, f"the image {shown(image['filename'], 80)} it lists for prompt {prompt_id} was made "
                                  "by another prompt (the workflow saved in it is not the one this job sent); "
                                  "nothing was written")


def nodes_of(workflow: dict) -> dict:
    """{node: (class, inputs)}: what a prompt computes, without the keys ComfyUI adds when it saves (is_changed)."""
    return {nid: (node["class_type"], node["inputs"]) for nid, node in workflow.items()}


class BatchClient:
    """Runs batches of jobs of one API workflow over one or more ComfyUI servers, into one output folder.

    workflow: an API-format workflow file or dict. out: the folder for images and manifest.json. timeout: seconds to
    wait for a job's next message; server_timeout: silence after which a server is dropped. images / masks, sets,
    seed: defaults for jobs that give none. on_job(record, folder) is called as each job ends.
    """

    def __init__(self, workflow: str | dict, servers: str | Sequence[str] = "127.0.0.1:8188", out: str = "output",
                 *, per_server: int = 2, timeout: float = 600.0, server_timeout: float = 60.0,
                 images: dict[str, str] | None = None, masks: dict[str, str] | None = None,
                 sets: dict[str, object] | None = None, seed: int | None = None,
                 progress: bool | BatchProgress | None = None, on_job=None, mask_reading: str = "auto"):
        self.workflow_name = os.fspath(workflow) if isinstance(workflow, (str, os.PathLike)) else ""
        self.workflow = load_workflow(workflow) if isinstance(workflow, (str, os.PathLike)) else check_workflow(
            workflow, "the workflow given to BatchClient")
        self.servers = check_servers([servers] if isinstance(servers, str) else list(servers))
        if isinstance(per_server, bool) or not (isinstance(per_server, int) and 1 <= per_server <= MAX_PER_SERVER):
            raise Flux2Error(f"--per-server {per_server} must be a whole number from 1 to {MAX_PER_SERVER}")
        ComfyClient(self.servers[0], timeout=timeout, heartbeat=server_timeout)       # checks both timeouts
        self.out, self.per_server, self.timeout, self.server_timeout = out, per_server, timeout, server_timeout
        self.images, self.masks, self.sets, self.seed = dict(images or {}), dict(masks or {}), dict(sets or {}), seed
        self.progress, self.on_job, self.mask_reading = progress, on_job, mask_reading
        self.poll = POLL              # seconds between two questions to a server about its queue (queue_watch)
        self._turn = 0                # the server after the last one picked: the first to try among equals
        self._cancelled = threading.Event()
        self._results: queue.Queue | None = None      # what the scheduler of the run under way waits on

    def cancel(self) -> None:
        """Stop the run under way (or the next one), from any thread, as Ctrl-C does: running jobs write nothing
        (their prompts go on in ComfyUI) and unfinished ones are "cancelled", left for the next run."""
        self._cancelled.set()
        results = self._results
        if results is not None:
            results.put(None)         # wakes the scheduler if it waits for a job to end

    def plan(self, jobs: Iterable[BatchJob | dict]) -> list[PlannedJob]:
        """The jobs checked (see batch_jobs.plan_jobs), the client's seed and settings given to those without."""
        full = []
        for number, job in enumerate(jobs, start=1):
            if isinstance(job, dict):
                job = job_from_line(job, f"job {number}", Path("."))
            elif not isinstance(job, BatchJob):
                raise Flux2Error(f"job {number} is a {type(job).__name__}; give BatchJob(...) or a dict like a batch "
                                 "line")
            full.append(BatchJob(job.prompt, job.seed if job.seed is not None else self.seed, job.size, job.images,
                                 job.masks, {**self.sets, **job.sets}, job.id, job.source))
        return plan_jobs(self.workflow, full, self.images, self.masks, self.mask_reading)

    def run(self, jobs: Iterable[BatchJob | dict]) -> BatchSummary:
        """Run the jobs not done before; returns when each is done or failed. Bad input raises Flux2Error before
        anything is queued; Ctrl-C (KeyboardInterrupt) stops at once, the finished jobs recorded."""
        planned = self.plan(jobs)
        start = time.monotonic()
        manifest = Manifest.open(self.out, self.workflow_name, job_key(self.workflow))
        self._results = queue.Queue()
        try:
            records, pending = {}, deque()
            for job in planned:
                record = manifest.finished(job.key)
                if record is not None:            # under this batch's id: a line added above it shifts the ids
                    records[job.key] = replace(record, id=job.id, source=job.job.source)
                else:
                    pending.append(job)
            skipped = len(records)
            changed = manifest.begin({job.id: job.key for job in planned})
            servers = [_Server(address, ServerSummary(parse_server(address)[1]), i)
                       for i, address in enumerate(self.servers)]
            progress = self.progress if isinstance(self.progress, BatchProgress) else (
                BatchProgress(len(pending)) if self.progress else None)
            if progress is not None:
                progress.total = len(pending)
                if skipped:
                    rest = f"running the other {len(pending)}" if pending else "nothing left to run"
                    progress.note(f"{skipped} of the {len(planned)} jobs were done before (see {manifest.path}); "
                                  f"{rest}")
                if manifest.unread:
                    progress.note(f"{manifest.unread} record(s) of {manifest.path} are damaged (a field missing or "
                                  "of the wrong kind, or a file name outside the folder); their jobs run again")
                if changed:
                    progress.note(f"{len(changed)} job(s) changed since they ran in {manifest.folder} (the same id, "
                                  f"another prompt, seed, size, picture or setting: {', '.join(changed[:5])}"
                                  f"{', ...' if len(changed) > 5 else ''}); their new images replace the old ones")
            if pending:
                self._probe(servers, progress)
                for s in servers:
                    s.watch = QueueWatch(self._client(s), s.observe, self.poll) if s.alive else None
                    if s.watch is not None:
                        s.watch.start()
                try:
                    self._schedule(pending, servers, manifest, records, progress)
                finally:
                    for s in servers:
                        if s.watch is not None:
                            s.watch.stop()
            if progress is not None:
                progress.close()
        finally:
            manifest.end()                             # a job still running publishes nothing now
            self._results = None
            self._cancelled.clear()
        for job in planned:
            if job.key not in records:                 # cancelled: done if it published before the end, else not
                done = manifest.records.get(job.key)
                records[job.key] = replace(done, id=job.id) if done and done.status == "done" else JobRecord(
                    job.id, job.key, "cancelled", [], "", f"{job.where}: cancelled before it ended; run the batch "
                    "again to do it", 0.0, job.job.source)
        return BatchSummary([records[job.key] for job in planned], skipped, [s.summary for s in servers],
                            time.monotonic() - start, manifest.folder)

    # -- servers -----------------------------------------------------------------------------------------------------
    def _client(self, server: _Server) -> ComfyClient:
        return ComfyClient(server.address, timeout=self.timeout, heartbeat=self.server_timeout)

    def _probe(self, servers: list[_Server], progress) -> None:
        """Ask every server for its queue at once; those that do not answer are dropped."""
        def ask(server: _Server) -> None:
            try:
                server.observe(ask_queue(self._client(server)))
            except ServerUnreachable as e:
                server.summary.dropped = e.problem
            except ServerError:
                pass                 # it answers: an odd answer to this question is no reason to drop it
        threads = [threading.Thread(target=ask, args=(s,), daemon=True) for s in servers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        alive = [s for s in servers if s.alive]
        if not alive:
            raise Flux2Error("no server answers, nothing was queued:\n  " + "\n  ".join(
                f"ComfyUI at {s.summary.server}: {s.summary.dropped}" for s in servers))
        for server in servers:
            if not server.alive and progress is not None:
                progress.note(f"dropped {server.summary.server}: {server.summary.dropped}")

    def _pick(self, servers: list[_Server]) -> _Server | None:
        """The live server with a free slot and the least work; ties in turn after the last one picked."""
        free = [s for s in servers if s.alive and s.inflight < self.per_server]
        if not free:
            return None
        server = min(free, key=lambda s: (s.load(), (s.index - self._turn) % len(servers)))
        self._turn = server.index + 1
        return server

    def _drop(self, server: _Server, error: ServerUnreachable, progress) -> None:
        """Drop the server, noting ``error.problem`` (a refused connection is not a --server-timeout)."""
        if not server.alive:
            return
        server.summary.dropped = error.problem
        if server.watch is not None:
            server.watch.stop()                       # a dropped server is asked nothing more
        if progress is not None:
            progress.note(f"dropped {server.summary.server}: {error.problem}; its jobs go to the other servers")

    # -- the loop ----------------------------------------------------------------------------------------------------
    def _schedule(self, pending: deque, servers: list[_Server], manifest: Manifest, records: dict,
                  progress) -> None:
        results = self._results
        running = 0
        lost: dict[str, list[str]] = {}                # job key -> why each server it ran on stopped answering
        while pending or running:
            while pending and not self._cancelled.is_set():
                server = self._pick(servers)
                if server is None:
                    break
                job = pending.popleft()
                server.inflight += 1
                running += 1
                if progress is not None:
                    progress.started(job.id, server.summary.server)
                threading.Thread(target=self._work, args=(job, server, manifest, results, progress),
                                 daemon=True).start()
            if not running or self._cancelled.is_set():
                break                                   # jobs left and no server left, or cancelled
            ended = results.get()
            if ended is None:
                continue                                # cancel() woke us: the loop stops above
            job, server, result, seconds = ended
            running -= 1
            server.inflight -= 1
            server.summary.busy += seconds
            if isinstance(result, ServerUnreachable):
                self._drop(server, result, progress)
                lost.setdefault(job.key, []).append(str(result))
                if len(lost[job.key]) < LOST_SERVERS:
                    server.summary.moved += 1
                    pending.appendleft(job)
                    if progress is not None:
                        progress.requeued(job.id)
                    continue
                result = JobRecord(job.id, job.key, "failed", [], server.summary.server,
                                   f"{job.where}: {len(lost[job.key])} servers stopped answering while they ran it "
                                   f"({'; '.join(lost[job.key])}); it may be what stops them (look in their logs); "
                                   "it was not given to another. Run the batch again to retry it",
                                   round(seconds, 3), job.job.source)
            if isinstance(result, Flux2Error):
                # A ServerError names its server; any other is this machine's (e.g. --out disk full).
                result = JobRecord(job.id, job.key, "failed", [], server.summary.server, f"{job.where}: {result}",
                                   round(seconds, 3), job.job.source)
            elif isinstance(result, BaseException):
                raise result                           # a fault of this client, not of the server or the job
            self._ended(job, result, server.summary, manifest, records, progress)
        if self._cancelled.is_set():
            return                                      # the jobs not run are left out of the manifest (see run)
        for job in pending:                            # every server dropped
            reason = "; ".join(f"{s.summary.server} dropped" for s in servers)
            record = JobRecord(job.id, job.key, "failed", [], "", f"{job.where}: not run, no server left ({reason})",
                               0.0, job.job.source)
            self._ended(job, record, None, manifest, records, progress)

    def _ended(self, job: PlannedJob, record: JobRecord, summary: ServerSummary | None, manifest: Manifest,
               records: dict, progress) -> None:
        if record.status != "done":                    # a done job was recorded as it published (Manifest.publish)
            manifest.record(record)
        records[job.key] = record
        if summary is not None:
            summary.done += record.status == "done"
            summary.failed += record.status != "done"
            summary.images += len(record.files)
        if progress is not None:
            text = (f"{job.where} done on {record.server} in {record.seconds:.1f} s: " + ", ".join(record.files)
                    if record.status == "done" else f"failed: {record.error}")
            progress.ended(job.id, record.status == "done", len(record.files), text)
        if self.on_job is not None:
            self.on_job(record, manifest.folder)

    def _work(self, job: PlannedJob, server: _Server, manifest: Manifest, results: queue.Queue, progress) -> None:
        start = time.monotonic()
        try:
            result = self._run_job(job, server, manifest, progress)
        except Exception as e:  # noqa: BLE001 - handed to the scheduler, which decides (a fault of ours: raised there)
            result = e
        results.put((job, server, result, time.monotonic() - start))

    def _upload(self, client: ComfyClient, server: _Server, picture) -> str:
        """One upload of a picture per server: a lock per picture, so other pictures upload meanwhile."""
        with server.lock:
            lock = server.uploading.setdefault(picture.name, threading.Lock())
        with lock:
            with server.lock:
                name = server.uploaded.get(picture.name)
            if name is None:
                name = upload(client, picture)
                with server.lock:
                    server.uploaded[picture.name] = name
        return name

    def _run_job(self, job: PlannedJob, server: _Server, manifest: Manifest, progress) -> JobRecord:
        start = time.monotonic()
        client = self._client(server)                  # a client id of its own: one websocket per job
        names = {}
        for node, picture in job.pictures.items():
            names[node] = self._upload(client, server, picture)
        workflow = job.workflow(self.workflow, names)

        def on_message(message: dict) -> None:
            if progress is not None and message["type"] == "progress":
                progress.step(job.id, shown(message["data"].get("value"), 12), shown(message["data"].get("max"), 12))

        ws = client.connect()
        server.submitting(1)          # counted before ComfyUI has it: see _Server.observe
        try:
            prompt_id = client.submit(workflow)
            client.follow(ws, prompt_id, on_message)
        except ServerError:
            raise
        except Flux2Error as e:        # the prompt failed in ComfyUI (a node's error, an interrupt): say where
            raise ServerError(client.server, str(e)) from None
        finally:
            server.submitting(-1)
            ws.close()
        images = client.images(prompt_id)
        if not images:
            raise ServerError(client.server, f"prompt {prompt_id} ran, but ComfyUI lists no images for it; does the "
                                             "workflow end in a SaveImage node?")
        staged = []
        try:
            for image in images:
                name = file_name(client.server, image)
                data = client.download(image)
                made_by(client.server, prompt_id, image, data, workflow)
                staged.append(manifest.stage(data, image_suffix(name)))
            # published and recorded at once; refused if the batch was interrupted meanwhile
            return manifest.publish(JobRecord(job.id, job.key, "done", [], client.server, "",
                                              round(time.monotonic() - start, 3), job.job.source), staged)
        except BaseException:
            manifest.discard(staged)
            raise


# ---- The command: `queue` with --batch, several --prompt or several --server ----

def batch_main(args) -> int:
    try:
        if args.batch and args.prompt:
            raise Flux2Error("give the prompts either in --batch FILE or as --prompt, not both")
        sets = parse_sets(args.set, "--set")
        jobs = read_batch(args.batch) if args.batch else [BatchJob(prompt=p, source=f"--prompt {shown(p, 40)}")
                                                          for p in args.prompt or [None]]
        client = BatchClient(args.workflow, args.server or ["127.0.0.1:8188"], args.out, per_server=args.per_server,
                             timeout=args.timeout, server_timeout=args.server_timeout,
                             images=parse_pairs(args.image, "--image"), masks=parse_pairs(args.mask, "--mask"),
                             mask_reading=args.mask_reading,
                             sets=sets, seed=args.seed, progress=True,
                             on_job=lambda record, folder: [print(folder / name, flush=True)
                                                            for name in record.files])
        summary = client.run(jobs)
    except Flux2Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        note(f"\ninterrupted: the jobs that ended are recorded in {Path(args.out) / 'manifest.json'}; run the same "
             "command again to finish the batch (done jobs are skipped). Prompts already queued keep running in "
             "ComfyUI; cancel them in its queue if you do not want them")
        return 130
    note(summary.text())
    return 0 if summary.ok else 1
