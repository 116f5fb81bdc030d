"""Headless batches: throughput over 1, 2 and 3 real ComfyUI servers, and the client's memory over a long batch.

    COMFYUI_DIR=... COMFYUI_PYTHON=... python bench/batch.py servers --jobs 12       # tiny-weight edits, 1/2/3 servers
    python bench/batch.py memory --jobs 1000                                         # a fake server, 1,000 jobs

`servers` starts the servers the real-host tests start (tests/comfyui: tiny random weights, one base directory each)
and runs the same batch of edits (64x64, 4 steps, a local picture uploaded) on 1, 2 and 3 of them, each batch into a
fresh folder with new seeds (so no server answers from its cache). It reports the wall time, jobs a minute, and the
client's own CPU time per job (this process's user + system time over the batch: uploads, websockets, downloads,
checks, the manifest).
`memory` runs the batch client against a fake ComfyUI in another process (tests/batch_fakes.py) and prints the
client's resident memory every 100 jobs: it should stay flat.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flux2_core import BatchClient, BatchJob

EDIT = ROOT / "workflows" / "api" / "flux2-klein-edit.json"


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def servers_bench(jobs: int, counts: list[int]) -> None:
    from PIL import Image

    from tests.comfyui.base_dir import build_base
    from tests.comfyui.conftest import share_base
    from tests.comfyui.host import ComfyServer, write_torch_stubs

    comfy_dir, python = Path(os.environ["COMFYUI_DIR"]), os.environ.get("COMFYUI_PYTHON", sys.executable)
    work = Path(tempfile.mkdtemp(prefix="bench-batch-"))
    first = work / "base-0"
    build_base(first, ROOT)
    stubs = write_torch_stubs(work / "stubs", python)
    bases = [first]
    for i in range(1, max(counts)):
        bases.append(work / f"base-{i}")
        share_base(bases[-1], first)
    servers = [ComfyServer(comfy_dir, python, base, stubs) for base in bases]
    threads = [threading.Thread(target=s.start) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    picture = work / "photo.png"
    Image.new("RGB", (96, 80), (120, 80, 40)).save(picture)
    try:
        warm = [BatchJob(prompt="warm up", seed=0, size=(64, 64), images={"10": str(picture)})]
        for server in servers:                     # models loaded once in each server before any timing
            BatchClient(str(EDIT), server.address, str(work / f"warm-{server.port}")).run(warm)
        print(f"{jobs} jobs (edit, 64x64, 4 steps, tiny weights), per server 2 at a time")
        print("servers  wall s  jobs/min  client CPU ms/job")
        for n, count in enumerate(counts):
            batch = [BatchJob(prompt=f"bench {n}", seed=1000 * (n + 1) + i, size=(64, 64), images={"10": str(picture)})
                     for i in range(jobs)]
            client = BatchClient(str(EDIT), [s.address for s in servers[:count]], str(work / f"out-{count}"))
            cpu, start = cpu_seconds(), time.monotonic()
            summary = client.run(batch)
            wall, cpu = time.monotonic() - start, cpu_seconds() - cpu
            assert summary.ok, summary.text()
            print(f"{count:7d}  {wall:6.1f}  {jobs / wall * 60:8.1f}  {cpu / jobs * 1000:17.1f}")
    finally:
        for server in servers:
            server.stop()


FAKE = """
import sys, time
sys.path.insert(0, {root!r})
from tests.batch_fakes import FakeServer
server = FakeServer(steps=4)
print(server.address, flush=True)
time.sleep(3600)
"""


def memory_bench(jobs: int) -> None:
    fake = subprocess.Popen([sys.executable, "-c", FAKE.format(root=str(ROOT))], stdout=subprocess.PIPE, text=True)
    try:
        address = fake.stdout.readline().strip()
        out = tempfile.mkdtemp(prefix="bench-batch-memory-")
        samples, done = [], [0]

        def on_job(record, folder):
            done[0] += 1
            if done[0] % 100 == 0:
                samples.append((done[0], rss_mib()))
        batch = [BatchJob(prompt=f"job {i}", seed=i) for i in range(jobs)]
        before, cpu, start = rss_mib(), cpu_seconds(), time.monotonic()
        summary = BatchClient(json.loads(EDIT.read_text()), address, out, on_job=on_job).run(batch)
        wall, cpu = time.monotonic() - start, cpu_seconds() - cpu
        assert summary.ok, summary.text()
        manifest = Path(out) / "manifest.json"
        print(f"{jobs} jobs on a fake server: {wall:.1f} s, client CPU {cpu / jobs * 1000:.1f} ms/job, "
              f"manifest {manifest.stat().st_size >> 10} KiB")
        print(f"client RSS before the batch: {before:.1f} MiB")
        for count, mib in samples:
            print(f"  after {count:5d} jobs: {mib:.1f} MiB")
    finally:
        fake.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["servers", "memory"])
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--servers", default="1,2,3", help="server counts to run (servers)")
    args = parser.parse_args()
    if args.what == "servers":
        servers_bench(args.jobs or 12, [int(n) for n in args.servers.split(",")])
    else:
        memory_bench(args.jobs or 1000)


if __name__ == "__main__":
    main()
