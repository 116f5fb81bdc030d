"""Follower ranks for a driver inside a long-running program (ComfyUI): ``FollowerGroup`` starts one process per extra
device, each loads the transformer as the driver did (``TransformerSource``) and serves its passes
(``parallel.serve``) until the driver closes the group, dies, or a follower fails.

torch's elastic launcher runs them, not torch.multiprocessing, whose spawn re-runs the parent's main module (in
ComfyUI: every custom node's start-up). A follower loads before it joins, so a bad file fails with its own message.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..adapters.lora import AdapterUse
from ..errors import Flux2Error
from . import parallel

START_TIMEOUT = 600.0       # seconds for every follower to load its transformer and report ready
ADAPTERS = "adapters"       # the call that gives the followers the driver's LoRAs (parallel.serve handler)
PACKAGE_ROOT = Path(__file__).resolve().parents[2]     # the folder holding flux2_core: the followers' import path


@dataclass(frozen=True)
class TransformerSource:
    """``weights.load_transformer``'s arguments as the driver loaded it, for every follower."""

    path: str
    dtype: str | None             # "bfloat16", "float16", "float32"; None: the device's default
    fp8: bool | None = None       # as load_transformer takes it
    variant: str | None = None
    stamp: str = ""               # the file's size and modification time as the driver loaded it ("": unchecked)
    int8: bool | str = False      # as load_transformer takes it

    @classmethod
    def of(cls, path, dtype: str | None, fp8: bool | None = None, variant: str | None = None,
           int8: bool | str = False) -> TransformerSource:
        """Call it when the driver loads the file: it stamps the file as it is now."""
        return cls(str(path), dtype, fp8, variant, file_stamp(path), int8)

    def load(self, device: torch.device, fp8_matmul="auto"):
        """``fp8_matmul``: the CLI's --fp8-matmul; ComfyUI's loader uses "auto"."""
        from ..storage.matmul import choose_matmuls
        from ..weights import load_transformer

        if self.stamp and Path(self.path).is_file() and file_stamp(self.path) != self.stamp:
            raise Flux2Error(f"{self.path} has changed since the driver loaded it: the ranks would compute with "
                             f"different weights. Load the model again (in ComfyUI: Unload models, then run)")
        model, _ = load_transformer(self.path, device, getattr(torch, self.dtype) if self.dtype else None,
                                    variant=self.variant, fp8=self.fp8, int8=self.int8)
        choose_matmuls(model, device, model.dtype, fp8=fp8_matmul)
        return model.eval()


def file_stamp(path) -> str:
    """"<size>:<mtime in ns>": changes when the file is replaced or rewritten."""
    stat = os.stat(path)
    return f"{stat.st_size}:{stat.st_mtime_ns}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FollowerGroup:

    def __init__(self, sp: parallel.SequenceParallel, context, recipe: TransformerSource, devices: list[str],
                 logs: Path):
        self.sp, self.context, self.recipe, self.devices, self.logs = sp, context, recipe, devices, logs
        self.adapters: list = []          # what the followers' transformers carry (set_adapters)
        sp.peers_alive = self.alive

    @classmethod
    def start(cls, recipe: TransformerSource, devices: list[str], timeout: float = START_TIMEOUT,
              cancel: Callable[[], None] = lambda: None) -> FollowerGroup:
        """Followers on devices[1:]; this process computes on devices[0]. What ``cancel`` raises while they load
        stops them and is raised."""
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

        world = len(devices)
        if world < 2:
            raise Flux2Error(f"a follower group needs at least 2 devices, got {devices}")
        store = parallel.connect_store(0, world, "127.0.0.1", 0, host=True)        # port 0: the system picks
        port = store.port
        logs = Path(tempfile.mkdtemp(prefix="flux2-followers-"))
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
               "FLUX2_DRIVER_PID": str(os.getpid()), "FLUX2_DEVICES": json.dumps(devices),
               "PYTHONPATH": os.pathsep.join([str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        context = start_processes(
            name="flux2-follower", entrypoint=sys.executable,
            args={i: ("-m", "flux2_core.runtime.followers", json.dumps(asdict(recipe))) for i in range(world - 1)},
            envs={i: {**env, "RANK": str(i + 1), "LOCAL_RANK": str(i + 1)} for i in range(world - 1)},
            logs_specs=DefaultLogsSpecs(log_dir=str(logs), redirects=Std.ALL, tee=Std.ERR))
        try:
            cls._wait_ready(store, world, context, timeout, cancel)
            sp = parallel.join(store, 0, world, devices[0])
        except BaseException:
            context.close()
            shutil.rmtree(logs, ignore_errors=True)
            raise
        return cls(sp, context, recipe, devices, logs)

    @staticmethod
    def _wait_ready(store, world: int, context, timeout: float, cancel: Callable[[], None]) -> None:
        """A follower that exits first fails the start with its last lines of output."""
        end = time.monotonic() + timeout
        while not all(store.check([f"ready/{rank}"]) for rank in range(1, world)):
            cancel()
            result = context.wait(0)
            if result is not None:
                raise Flux2Error(f"a follower process stopped while loading: {_last_words(result)}")
            if time.monotonic() > end:
                raise Flux2Error(f"the followers were not ready within {timeout:g} s (loading the transformer on "
                                 f"each device); see their logs")
            time.sleep(0.1)

    def alive(self) -> bool:
        return self.context is not None and self.context.wait(0) is None

    def usable(self) -> bool:
        """Every follower running, none left inside a pass cut short."""
        return self.alive() and not self.sp.broken

    def set_adapters(self, adapters: list[AdapterUse]) -> None:
        """A follower refuses a file whose content no longer has the driver's digest."""
        adapters = [a.shared() for a in adapters]
        if adapters != self.adapters:
            self.sp.announce(ADAPTERS, {}, {"adapters": adapters})
            self.adapters = adapters

    def close(self) -> None:
        """Safe to call twice. Followers stuck inside a pass cut short are terminated."""
        if self.context is None:
            return
        try:
            if self.usable():
                self.sp.stop()
                self.context.wait(30)
        finally:
            self.context.close()          # terminates what still runs, then waits for it
            self.context = None
            parallel.leave()
            shutil.rmtree(self.logs, ignore_errors=True)


def _last_words(result) -> str:
    notes = []
    for local, failure in result.failures.items():
        tail = ""
        path = result.stderrs.get(local)
        if path and Path(path).is_file():
            lines = [line for line in Path(path).read_text(errors="replace").splitlines() if line.strip()]
            tail = " | ".join(lines[-3:])
        notes.append(f"rank {local + 1} exited with {failure.exitcode}{f': {tail}' if tail else ''}")
    return "; ".join(notes) or "no output"


def _apply_adapters(model, extra: dict) -> None:
    from ..adapters.lora import read_adapter
    from ..adapters.patching import merge_asked, set_adapters

    read = []
    for use in (AdapterUse(**fields) for fields in extra["adapters"]):
        adapter = read_adapter(use.file, model.params)
        if adapter.digest(text_encoder=False) != use.digest:
            raise Flux2Error(f"the LoRA {use.file} has changed since the driver read it: the ranks would compute with "
                             f"different weights. Run again (ComfyUI reads it anew when its file changes)")
        read.append(replace(use, adapter=adapter))
    key = tuple((a.adapter.name, a.adapter.digest(), a.strength) for a in read)
    set_adapters(model, [(patch, a.strength) for a in read for patch in a.adapter.patches], key,
                 merge_asked(a.merge for a in read))


def _driver_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> int:
    recipe = TransformerSource(**json.loads((argv or sys.argv[1:])[0]))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device(json.loads(os.environ["FLUX2_DEVICES"])[rank])
    driver = int(os.environ["FLUX2_DRIVER_PID"])
    store = parallel.connect_store(rank, world, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), host=False)
    try:
        model = recipe.load(device)
    except Flux2Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    store.set(f"ready/{rank}", "1")
    sp = parallel.join(store, rank, world, device)
    parallel.serve(model, sp, {ADAPTERS: lambda extra: _apply_adapters(model, extra)},
                   alive=lambda: _driver_alive(driver))
    parallel.leave()
    return 0


if __name__ == "__main__":
    sys.exit(main())
