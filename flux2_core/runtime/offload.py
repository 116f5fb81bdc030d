"""Low-VRAM block streaming: blocks that do not fit the device wait in CPU memory (pinned on CUDA) and visit the
device one at a time, just before they run; the forward is unchanged.

Resident: the non-block parts, then every block that fits beside room for two streamed blocks in flight (the next
one's copy overlaps compute on a side stream). Stream first, then compile: weight-swapping hooks cannot be inside a
``fullgraph`` graph.
"""

from __future__ import annotations

import contextlib
import itertools

import torch
from torch import Tensor, nn

from ..errors import Flux2Error
from ..models.run_state import run_state
from .memory import GIB, module_bytes

CPU = torch.device("cpu")


def stream_blocks(model: nn.Module, device, budget: int, storage=CPU) -> BlockStream:
    """``model`` runs on ``device`` with at most ``budget`` bytes of weights there; the rest stays on ``storage``."""
    device, storage = torch.device(device), torch.device(storage)
    if streaming(model) is not None:
        unstream(model)
    _, streamed = split_blocks(model, budget)
    if any(block in run_state(model).compiled_blocks for block in streamed):
        raise Flux2Error("the transformer's blocks are compiled: stream them first, then compile (compile_blocks then "
                         "compiles only the resident blocks); or call compile.uncompile_blocks before streaming")
    stream = run_state(model).stream = BlockStream(model, device, storage, streamed)
    return stream


def split_blocks(model: nn.Module, budget: int) -> tuple[list[nn.Module], list[nn.Module]]:
    """(resident, streamed) for a weight ``budget`` in bytes; a Flux2Error if not even the fixed parts fit."""
    blocks = model.blocks()
    sizes = [module_bytes(b) for b in blocks]
    fixed = module_bytes(model) - sum(sizes)
    if fixed + sum(sizes) <= budget:
        return blocks, []
    in_flight = 2 * max(sizes)
    left = budget - fixed - in_flight
    if left < 0:
        raise Flux2Error(
            f"the transformer does not fit the device even with its blocks streamed: it needs at least "
            f"{(fixed + in_flight) / GIB:.2f} GiB for its embedders, modulations and final layer "
            f"({fixed / GIB:.2f} GiB) and two blocks in flight, but only {max(budget, 0) / GIB:.2f} GiB are left "
            f"for weights after the image's working memory. Lower the resolution (--width/--height), store the "
            f"weights in fp8 (--fp8), offload the text encoder and stream the blocks (--offload blocks), or close "
            f"other programs using the GPU")
    resident, streamed = [], []
    for block, size in zip(blocks, sizes):
        if size <= left:
            resident.append(block)
            left -= size
        else:
            streamed.append(block)
    return resident, streamed


def streaming(model: nn.Module) -> BlockStream | None:
    return run_state(model).stream


def streamed_blocks(model: nn.Module) -> list[nn.Module]:
    stream = streaming(model)
    return list(stream.stored) if stream is not None else []


def unstream(model: nn.Module, resident: bool = False) -> nn.Module:
    """Every tensor back in storage (where ``pipeline.load_models`` had them), or on the device with ``resident``."""
    stream = streaming(model)
    if stream is not None:
        stream.close(resident)
        run_state(model).stream = None
    return model


def resident_parts(model: nn.Module) -> list[nn.Module]:
    streamed, blocks = set(streamed_blocks(model)), model.blocks()
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    others = [m for m in model.children() if not any(id(p) in in_blocks for p in m.parameters())]
    return others + [b for b in blocks if b not in streamed]


def place(model: nn.Module, device) -> nn.Module:
    """``model.to(device)`` that leaves streamed blocks in storage."""
    if streaming(model) is None:
        return model.to(device)
    for part in resident_parts(model):
        part.to(device)
    return model


# --- tensors of a module --------------------------------------------------------------------------------------------

def slots(module: nn.Module) -> list[tuple[nn.Module, str, Tensor]]:
    """(owning module, name, tensor) of every parameter and buffer."""
    return [(m, name, t) for m in module.modules()
            for name, t in itertools.chain(m._parameters.items(), m._buffers.items()) if t is not None]


def set_tensor(module: nn.Module, name: str, tensor: Tensor) -> None:
    """A parameter keeps its Parameter object (new data); a buffer is replaced."""
    if name in module._parameters:
        module._parameters[name].data = tensor
    else:
        module._buffers[name] = tensor


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """The one place weights are copied to the device: tests wrap it to count bytes and make CPU copies real."""
    return tensor.to(device, non_blocking=True)


def to_storage(tensor: Tensor, storage: torch.device, pin: bool) -> Tensor:
    """Pinned on the way to a CUDA device, so copies from it are asynchronous."""
    tensor = tensor.to(storage)
    return tensor.pin_memory() if pin and not tensor.is_pinned() else tensor


# --- the streaming --------------------------------------------------------------------------------------------------

class BlockStream:

    def __init__(self, model: nn.Module, device: torch.device, storage: torch.device, streamed: list[nn.Module]):
        self.model, self.device = model, device
        cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if cuda else None
        self.storage = storage
        self.stored = {block: [] for block in streamed}        # block -> [(module, name, stored tensor)]
        owners = {m: block for block in streamed for m in block.modules()}
        self.resident_bytes = 0
        for module, name, tensor in slots(model):
            owner = owners.get(module)
            if owner is None:
                moved = to_device(tensor, device)
                self.resident_bytes += moved.nbytes
            else:
                moved = to_storage(tensor, storage, pin=cuda)
                self.stored[owner].append((module, name, moved))
            set_tensor(module, name, moved)
        self.next = dict(itertools.pairwise(streamed))         # block -> the streamed block after it
        self.ready = {}                                        # block -> copy event (None on the CPU), copy started
        self.hooks = [model.register_forward_pre_hook(self.prefetch_first)]
        for block in streamed:
            self.hooks.append(block.register_forward_pre_hook(self.before))
            self.hooks.append(block.register_forward_hook(self.after))

    def prefetch_first(self, model, args):
        """Copy the first streamed block while the embedders and early blocks run."""
        if self.stored:
            self.load(next(iter(self.stored)))

    def load(self, block: nn.Module) -> None:
        """On the side stream on CUDA; once per visit."""
        if block in self.ready:
            return
        side = torch.cuda.stream(self.copy_stream) if self.copy_stream is not None else contextlib.nullcontext()
        with side:
            for module, name, stored in self.stored[block]:
                set_tensor(module, name, to_device(stored, self.device))
            event = self.copy_stream.record_event() if self.copy_stream is not None else None
        self.ready[block] = event

    def before(self, block, args):
        self.load(block)                                       # no-op when prefetched
        event = self.ready[block]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        if block in self.next:
            self.load(self.next[block])

    def after(self, block, args, output):
        self.ready.pop(block, None)
        compute = torch.cuda.current_stream(self.device) if self.copy_stream is not None else None
        for module, name, stored in self.stored[block]:
            if compute is not None:
                # allocated on the copy stream, read by the compute stream: not reusable until its kernels ran
                getattr(module, name).record_stream(compute)
            set_tensor(module, name, stored)

    def close(self, resident: bool) -> None:
        for hook in self.hooks:
            hook.remove()
        for block in list(self.ready):                        # a forward that raised may have left copies
            self.after(block, None, None)
        for module, name, tensor in slots(self.model):
            set_tensor(module, name, to_device(tensor, self.device) if resident
                       else to_storage(tensor, self.storage, pin=False))

    @property
    def streamed_bytes(self) -> int:
        return sum(t.nbytes for entries in self.stored.values() for _, _, t in entries)
