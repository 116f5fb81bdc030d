"""What a batch shows while it runs: one line for the whole batch (jobs done, images, rate, time left, each running
job's step) and a line for each job that ends. On a terminal the batch line is redrawn in place (at most ten times a
second); elsewhere (a log, a pipe) it is printed once per job that ends.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

REDRAW = 0.1                     # seconds between two redraws on a terminal


def duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


class BatchProgress:
    """Events come from the batch's worker threads."""

    def __init__(self, total: int, stream: TextIO | None = None, tty: bool | None = None, width: int = 160):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.total, self.width = total, width
        self.done = self.failed = self.images = 0
        self.running: dict[str, tuple[str, str]] = {}      # job id -> (server, step)
        self.start = time.monotonic()
        self.drawn = 0.0
        self.lock = threading.Lock()

    # -- events ------------------------------------------------------------------------------------------------------
    def started(self, job_id: str, server: str) -> None:
        with self.lock:
            self.running[job_id] = (server, "queued")
            self._draw()

    def step(self, job_id: str, value, maximum) -> None:
        with self.lock:
            if job_id in self.running:
                self.running[job_id] = (self.running[job_id][0], f"{value}/{maximum}")
                self._draw()

    def ended(self, job_id: str, ok: bool, images: int, text: str) -> None:
        """A job is done (ok) or failed; `text` is printed on a line of its own."""
        with self.lock:
            self.running.pop(job_id, None)
            self.done += ok
            self.failed += not ok
            self.images += images
            self._print(text)
            if not self.tty:
                self._print(self.line())
            self._draw(force=True)

    def requeued(self, job_id: str) -> None:
        with self.lock:
            self.running.pop(job_id, None)

    def note(self, text: str) -> None:
        with self.lock:
            self._print(text)
            self._draw(force=True)

    def close(self) -> None:
        with self.lock:
            if self.tty:
                self.stream.write("\r\x1b[K")
                self.stream.flush()

    # -- the line ----------------------------------------------------------------------------------------------------
    def line(self) -> str:
        elapsed = time.monotonic() - self.start
        ended = self.done + self.failed
        rate = ended / elapsed if elapsed > 0 and ended else 0.0
        left = f", ~{duration((self.total - ended) / rate)} left" if rate and ended < self.total else ""
        failed = f" ({self.failed} failed)" if self.failed else ""
        text = (f"batch: {ended}/{self.total} jobs{failed}, {self.images} images, "
                f"{rate * 60:.1f} jobs/min, {duration(elapsed)}{left}")
        steps = "  ".join(f"{job}@{server.rsplit(':', 1)[-1]} {step}" for job, (server, step) in self.running.items())
        return f"{text} | {steps}" if steps else text

    def _print(self, text: str) -> None:
        self.stream.write(("\r\x1b[K" if self.tty else "") + text + "\n")
        self.stream.flush()

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.tty or (not force and now - self.drawn < REDRAW):
            return
        self.drawn = now
        self.stream.write("\r\x1b[K" + self.line()[:self.width])
        self.stream.flush()
