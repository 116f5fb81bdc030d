"""Sequence parallelism (Ulysses): one transformer pass spread over the ranks of a torch.distributed group.

The model sees the ranks only as a token split with trades around attention (``models/shards.py``). Rank 0 drives
the whole pipeline; ``attach`` makes its model announce each call to the followers (``serve``) through the store,
so a follower can wait indefinitely between generations. Tensors go by broadcast; reference K/V stay on each rank
(its heads' share, [B, H/P, Lref, D]) and go by name. A failing rank's message is left in the store for the driver.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import socket
import time
import uuid
import weakref
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from ..errors import Flux2Error
from ..models.run_state import run_state
from ..models.shards import TokenShards, shares

__all__ = ["SequenceParallel", "TokenShards", "attach", "check_world", "connect_store", "join", "leave",
           "sequence_parallel_of", "serve", "shares", "start", "start_from_env", "world_of"]

DRIVER = 0
GROUP_TIMEOUT = timedelta(minutes=10)   # a collective waiting this long means a rank is stuck: the pass fails
POLL = timedelta(seconds=1)             # how often an idle follower checks that the driver is still there
# the calls a driver announces and ``serve`` runs (other modules add theirs through ``serve``'s handlers)
FORWARD, REFERENCE_KV, RELEASE, STOP = "forward", "reference_kv", "release", "stop"
KEPT = "kept"         # the extra field naming a call's arguments that are K/V each rank kept from a reference pass
VALUES = "values"     # the extra field holding a call's arguments that are neither tensors nor kept K/V
DTYPES = {str(t).removeprefix("torch."): t for t in (torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                                     torch.int32, torch.uint8)}


class SequenceParallel:

    def __init__(self, rank: int, world: int, device: torch.device, store, group=None):
        self.rank, self.world, self.device = rank, world, torch.device(device)
        self.store, self.group = store, group
        self.calls = 0                # calls announced (driver) or followed (followers)
        self.forgotten = 0            # the driver's announcements up to this call are dropped from the store
        self.token = uuid.uuid4().hex     # this group, among the groups a process may join over time
        self.last_kv: str | None = None   # "<token>/<call>": the call that made the reference K/V the followers keep
        self.peers_alive: Callable[[], bool] = lambda: True   # the driver's check that its followers still run
        self.broken = False           # a call ended early on the driver: the followers are stuck inside it

    @property
    def driver(self) -> bool:
        return self.rank == DRIVER

    def shards(self, n_txt: int, n_rest: int) -> TokenShards:
        return TokenShards(self.group, self.rank, shares(n_txt, self.world), shares(n_rest, self.world))

    # --- the driver's side ------------------------------------------------------------------------------------------

    def call(self, run: Callable, name: str, tensors: dict[str, Tensor | None], extra: dict | None = None):
        """Run ``run(**tensors)`` on every rank. A call cut short on the driver leaves the followers stuck inside
        it, so the group becomes ``broken`` and refuses further calls."""
        if not self.driver:
            return run(**tensors)
        self.announce(name, tensors, extra or {})
        with self.cut_short_on_failure():
            return run(**tensors)

    def announce(self, name: str, tensors: dict[str, Tensor | None], extra: dict) -> None:
        if self.broken:
            raise Flux2Error("an earlier sequence-parallel pass was cut short (cancelled or failed) while the other "
                             "ranks were inside it, so they cannot follow another: start the ranks again")
        if not self.peers_alive():
            self.broken = True
            raise Flux2Error(self.failure(RuntimeError("a follower process has stopped")))
        self.calls += 1
        header = {"call": name, "extra": extra,
                  "tensors": [[key, None if t is None else [list(t.shape), str(t.dtype).removeprefix("torch.")]]
                              for key, t in tensors.items()]}
        self.store.set(f"call/{self.calls}", json.dumps(header))
        self.forget()
        with self.cut_short_on_failure():
            for t in tensors.values():
                if t is not None:
                    dist.broadcast(t.to(self.device).contiguous(), DRIVER, group=self.group)

    @contextlib.contextmanager
    def cut_short_on_failure(self):
        """A failed collective becomes a Flux2Error quoting the other ranks; the driver's own errors pass as is."""
        try:
            yield
        except BaseException as e:
            self.broken = True
            if isinstance(e, torch.OutOfMemoryError) or not isinstance(e, RuntimeError | dist.DistError):
                raise
            raise Flux2Error(self.failure(e)) from None

    def forget(self) -> None:
        """Drop the announcements every follower has read (each counts itself in ``read/<call>``)."""
        while self.forgotten < self.calls - 1:
            call = self.forgotten + 1
            if self.store.add(f"read/{call}", 0) < self.world - 1:
                return
            self.store.delete_key(f"call/{call}")
            self.store.delete_key(f"read/{call}")
            self.forgotten = call

    def release(self) -> None:
        """The followers drop their share of the last reference K/V and their cached GPU memory."""
        if self.driver and not self.broken:
            self.announce(RELEASE, {}, {})
            self.last_kv = None

    def failure(self, error: Exception) -> str:
        notes = []
        for rank in range(1, self.world):
            if self.store.check([f"error/{rank}"]):
                notes.append(f"rank {rank}: {self.store.get(f'error/{rank}').decode()}")
        said = "; ".join(notes) if notes else f"{type(error).__name__}: {str(error).splitlines()[0]}"
        return (f"sequence-parallel run failed: a rank stopped or lost its connection ({said}). Every rank must stay "
                f"up for the whole run: check each rank's log and free memory, then start them all again")

    def stop(self) -> None:
        """A broken group's followers cannot hear the stop; the group is left either way."""
        try:
            if self.driver and not self.broken:
                self.announce(STOP, {}, {})
                self.wait_read(self.calls)      # this process serves the store: it must outlive their reading
        finally:
            leave()

    def wait_read(self, call: int, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while self.store.add(f"read/{call}", 0) < self.world - 1 and self.peers_alive() and time.monotonic() < end:
            time.sleep(0.01)

    # --- the followers' side ------------------------------------------------------------------------------------

    def next_call(self, alive: Callable[[], bool] = lambda: True) -> tuple[str, dict[str, Tensor | None], dict]:
        self.calls += 1
        key = f"call/{self.calls}"
        while True:
            try:
                self.store.wait([key], POLL)
                break
            except (RuntimeError, dist.DistStoreError) as e:
                if "timeout" not in str(e).lower() and "wait timeout" not in str(e).lower():
                    raise Flux2Error(f"rank {self.rank} lost the driver (rank 0): {str(e).splitlines()[0]}") from None
                if not alive():
                    raise Flux2Error(f"rank {self.rank}: the driver process is gone") from None
        header = json.loads(self.store.get(key))
        self.store.add(f"read/{self.calls}", 1)            # the driver may now drop it
        tensors = {}
        for name, spec in header["tensors"]:
            if spec is None:
                tensors[name] = None
                continue
            shape, dtype = spec
            tensors[name] = torch.empty(shape, dtype=DTYPES[dtype], device=self.device)
            dist.broadcast(tensors[name], DRIVER, group=self.group)
        return header["call"], tensors, header["extra"]

    def report(self, error: BaseException) -> None:
        with contextlib.suppress(RuntimeError, dist.DistError):     # the store went with the driver: none to tell
            self.store.set(f"error/{self.rank}", f"{type(error).__name__}: {error}")


def check_world(heads: int, world: int) -> None:
    if world > 1 and heads % world:
        fits = [p for p in range(2, heads + 1) if heads % p == 0]
        if not fits:
            raise Flux2Error(f"this model has {heads} attention head{'s' * (heads != 1)}, which cannot be split over "
                             f"ranks: run it in one process")
        raise Flux2Error(f"{world} ranks do not divide this model's {heads} attention heads: use "
                         f"{', '.join(map(str, fits[:6]))} ranks (processes / GPUs) instead")


def attach(model, sp: SequenceParallel | None) -> None:
    """Spread ``model``'s passes over ``sp``'s ranks (whose count must divide the heads); None: run it whole."""
    if sp is not None:
        check_world(model.params.num_heads, sp.world)
    sp = sp if sp is not None and sp.world > 1 else None
    run_state(model).sequence_parallel = sp
    for name in (FORWARD, REFERENCE_KV):
        if getattr(model.__dict__.get(name), ANNOUNCING, False):
            del model.__dict__[name]                        # ours goes: the class's own method again
        if sp is not None and sp.driver and hasattr(type(model), name):
            model.__dict__[name] = _announcing(model, sp, name)


def sequence_parallel_of(model) -> SequenceParallel | None:
    """The ranks ``model``'s passes are spread over (None: it runs whole)."""
    return run_state(model).sequence_parallel


def world_of(model) -> int:
    sp = sequence_parallel_of(model)
    return 1 if sp is None else sp.world


ANNOUNCING = "flux2_announcing"      # marks the methods ``attach`` put on a model (and only those are taken off)


def _announcing(model, sp: SequenceParallel, name: str) -> Callable:
    """``model.<name>`` on the driver: checked first (bad input fails here alone, the group stays usable), then
    announced and run on every rank. A value with a ``parallel_id`` is kept reference K/V, which must be the last
    pass's (the followers keep only that one). The model is held weakly."""
    method = getattr(type(model), name)
    check = getattr(type(model), f"check_{name}", None)
    signature = inspect.signature(method)
    owner = weakref.ref(model)

    @functools.wraps(method)
    def announced(*args, **kwargs):
        me = owner()
        arguments = signature.bind(me, *args, **kwargs).arguments
        del arguments[next(iter(signature.parameters))]             # self
        if check is not None:
            check(me, **arguments)
        tensors = {k: v for k, v in arguments.items() if v is None or isinstance(v, Tensor)}
        kept = {k: v for k, v in arguments.items() if hasattr(v, "parallel_id")}
        values = {k: v for k, v in arguments.items() if k not in tensors and k not in kept}
        for value in kept.values():
            if value.parallel_id != sp.last_kv:
                raise Flux2Error("these reference K/V come from an earlier reference pass, and the other ranks keep "
                                 "only their share of the last one: compute them again with model.reference_kv")
        result = sp.call(lambda **given: method(me, **given, **kept, **values), name, tensors,
                         {KEPT: sorted(kept), VALUES: values})
        if name == REFERENCE_KV:
            result.parallel_id = sp.last_kv = f"{sp.token}/{sp.calls}"    # the followers keep this one (only)
        return result
    setattr(announced, ANNOUNCING, True)
    return announced


def serve(model, sp: SequenceParallel, handlers: dict[str, Callable[[dict], None]] | None = None,
          alive: Callable[[], bool] = lambda: True) -> None:
    """A follower's loop. ``handlers`` run the other calls a driver may make (e.g. "adapters")."""
    attach(model, sp)
    kv = None
    try:
        with torch.no_grad():
            while True:
                name, tensors, extra = sp.next_call(alive)
                if name == STOP:
                    return
                if name == FORWARD:
                    model(**tensors, **dict.fromkeys(extra.get(KEPT, ()), kv), **extra.get(VALUES, {}))
                elif name == REFERENCE_KV:
                    kv = None                                   # the last one goes before the new one is made
                    kv = model.reference_kv(**tensors, **extra.get(VALUES, {}))
                elif name == RELEASE:
                    kv = None
                    if sp.device.type == "cuda":
                        torch.cuda.empty_cache()
                elif handlers and name in handlers:
                    handlers[name](extra)
                else:
                    raise Flux2Error(f"rank {sp.rank} got an unknown call {name!r} from the driver")
    except BaseException as e:
        sp.report(e)
        raise


# --- starting and leaving a group -------------------------------------------------------------------------------

def backend_for(device: torch.device, backend: str | None = None) -> str:
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if not dist.is_available():
        raise Flux2Error("this torch build has no torch.distributed: install a torch wheel from pytorch.org")
    if not dist.is_backend_available(backend):
        hint = "use gloo (the CPU) or a CUDA build of torch" if backend == "nccl" else "use a standard torch build"
        raise Flux2Error(f"the {backend} backend is not in this torch build: {hint}")
    return backend


def start(rank: int, world: int, device, *, address: str = "127.0.0.1", port: int = 29500, backend: str | None = None,
          host_store: bool | None = None, timeout: timedelta = GROUP_TIMEOUT) -> SequenceParallel:
    """``host_store``: this process serves the store (default: rank 0; False under torchrun, whose agent serves it)."""
    store = connect_store(rank, world, address, port, rank == DRIVER if host_store is None else host_store, timeout)
    return join(store, rank, world, device, backend, timeout)


def connect_store(rank: int, world: int, address: str, port: int, host: bool,
                  timeout: timedelta = GROUP_TIMEOUT):
    """Port 0: the system picks. On a loopback address the store listens only there (TCPStore alone binds every
    interface), since the store tells processes what to run."""
    try:
        listen = None
        if host and address in ("127.0.0.1", "localhost"):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port))
                sock.listen(128)
                port, listen = sock.getsockname()[1], sock.detach()     # the store owns the descriptor now
        return dist.TCPStore(address, port, world, host, timeout=timeout, wait_for_workers=False,
                             master_listen_fd=listen)
    except (RuntimeError, dist.DistError, OSError) as e:
        raise Flux2Error(f"rank {rank} of {world} could not reach the group's store at {address}:{port} "
                         f"({str(e).splitlines()[0]}): is the port free, and are all {world} ranks started?") from None


def join(store, rank: int, world: int, device, backend: str | None = None,
         timeout: timedelta = GROUP_TIMEOUT) -> SequenceParallel:
    device = torch.device(device)
    backend = backend_for(device, backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)       # nothing of this rank (NCCL's own buffers included) lands on cuda:0
    if dist.is_initialized():
        raise Flux2Error("this process already belongs to a torch.distributed group (another tool started one): "
                         "run the parallel denoiser in its own processes")
    try:
        dist.init_process_group(backend, store=dist.PrefixStore("group", store), rank=rank, world_size=world,
                                timeout=timeout, device_id=device if backend == "nccl" else None)
    except (RuntimeError, dist.DistError) as e:
        raise Flux2Error(f"rank {rank} of {world} could not join the group ({str(e).splitlines()[0]}): are all "
                         f"{world} ranks started?") from None
    return SequenceParallel(rank, world, device, dist.PrefixStore("calls", store), dist.group.WORLD)


def start_from_env(device=None, backend: str | None = None) -> SequenceParallel:
    """The group torchrun describes in the environment; on CUDA each rank takes the GPU LOCAL_RANK."""
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise Flux2Error(f"{', '.join(missing)} not set: start the ranks with torchrun --nproc-per-node N")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if device is None:
        device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    elif str(device) == "cuda":
        device = f"cuda:{local}"
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return start(rank, world, device, address=os.environ["MASTER_ADDR"], port=int(os.environ["MASTER_PORT"]),
                 backend=backend, host_store=False if agent_store else None)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
