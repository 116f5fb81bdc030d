"""How much work waits on a ComfyUI server, as a batch sees it: GET /prompt every POLL seconds on a thread of its own.

One watcher per server is the batch's source of truth for the work there: it sees other clients' prompts too, and
keeps counting while no job of ours runs there (a job's websocket reports only while it runs). queue_remaining
counts ours too; the batch takes them out (``batch._Server.observe``). A watcher never drops a server: deciding that
one is gone is left to the jobs running there, whose errors say what they were doing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .queue_client import ComfyClient, ServerError, parse_json, shown

POLL = 1.0                       # seconds between two questions to one server


def parse_queue(server: str, body: bytes) -> int:
    """{"exec_info": {"queue_remaining": N}} -> N."""
    answer = parse_json(server, "the answer to GET /prompt", body)
    info = answer.get("exec_info") if isinstance(answer, dict) else None
    remaining = info.get("queue_remaining") if isinstance(info, dict) else None
    if not (isinstance(remaining, int) and not isinstance(remaining, bool) and remaining >= 0):
        raise ServerError(server, f'the answer to GET /prompt is not {{"exec_info": {{"queue_remaining": N}}}}: '
                                  f"{shown(body)}")
    return remaining


def ask_queue(client: ComfyClient) -> int:
    return parse_queue(client.server, client.request("/prompt"))


class QueueWatch:
    """Calls on_count(queue_remaining) with each answer of the server, every `every` seconds until stop()."""

    def __init__(self, client: ComfyClient, on_count: Callable[[int], None], every: float = POLL):
        self.client, self.on_count, self.every = client, on_count, every
        self.stopped = threading.Event()
        # A daemon: a question to a server that hangs may outlive the batch by up to the client's answer timeout,
        # and must not keep the process alive.
        self.thread = threading.Thread(target=self._loop, daemon=True, name=f"queue of {client.server}")

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()

    def _loop(self) -> None:
        while not self.stopped.wait(self.every):
            try:
                remaining = ask_queue(self.client)
            except ServerError:
                continue         # no answer, or an odd one: the last count stands (see the module's note)
            if not self.stopped.is_set():
                self.on_count(remaining)
