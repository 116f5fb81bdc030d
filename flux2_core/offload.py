"""Low-VRAM block streaming: the transformer's blocks that do not fit the device wait in CPU memory and visit the
device one at a time, just before they run.

    stream_blocks(model, device, budget)     # budget: bytes of the model's weights allowed on the device at once
    model(img, ...)                          # the forward is unchanged; streamed blocks are copied in and dropped
    unstream(model)                          # every weight back where stream_blocks found it

What stays on the device (resident): the embedders (img_in, txt_in, time_in, guidance_in), the three shared
modulations, the final layer (together a few hundred MB: they run every step and are small) and, in execution order
(double blocks, then single blocks), every block that still fits the budget after those and after room for two
streamed blocks in flight (the one running and the next one, being copied meanwhile). The rest are *streamed*: their
parameters and buffers (``quant.Fp8Linear`` keeps its fp8 weight and scale as buffers) live on the storage device
(the CPU; pinned on CUDA so that copies run asynchronously), and forward hooks on each streamed block

* before it runs: wait for its copy (started earlier, or now if nothing started it), then start copying the next
  streamed block, so the copy overlaps this block's compute;
* after it ran: point its weights back at the stored tensors, dropping the device copy.

On CUDA copies run on a side stream: the compute stream waits on an event recorded after a block's copy, and each
device copy is marked as used by the compute stream (``record_stream``) before it is dropped, so the allocator does
not hand its memory to the next copy while kernels still read it. On the CPU the same code runs in order.

Klein 9B in bf16 (18 GB of weights: 8 double blocks of 0.87 GB, 24 single blocks of 0.44 GB, 0.6 GB resident parts)
on a 12 GB card keeps about half its blocks resident and copies the rest each step. How the budget is chosen from
the free memory is ``memory.weight_budget``; ``pipeline.load_models`` applies it.

Compiling: ``compile.compile_blocks`` compiles only the resident blocks (hooks that swap weights cannot be inside a
``fullgraph`` graph); streamed blocks run eagerly, their time is mostly the copy anyway. A compiled block cannot be
streamed: stream first, then compile.
"""

from __future__ import annotations

import contextlib
import itertools

import torch
from torch import Tensor, nn

from .errors import Flux2Error
from .memory import GIB, module_bytes
from .runtime import run_state

CPU = torch.device("cpu")


def stream_blocks(model: nn.Module, device, budget: int, storage=CPU) -> BlockStream:
    """Make ``model`` (a ``Flux2Transformer``, anywhere) run on ``device`` with at most ``budget`` bytes of its weights
    there at once: the always-resident parts and the blocks that fit stay on ``device``, the others are kept on
    ``storage`` and streamed (see the module docstring). A model already streamed is unstreamed first. Returns the
    handle (also ``run_state(model).stream``)."""
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
    """(resident, streamed) blocks for a weight ``budget`` in bytes: the always-resident parts first, then room for
    two blocks in flight (the largest block twice) if any block streams, then each block in execution order that
    still fits. Raises a Flux2Error if not even the always-resident parts and the room fit."""
    blocks = [*model.double_blocks, *model.single_blocks]
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
    """The model's ``BlockStream`` if its blocks are streamed, else None."""
    return run_state(model).stream


def streamed_blocks(model: nn.Module) -> list[nn.Module]:
    stream = streaming(model)
    return list(stream.stored) if stream is not None else []


def unstream(model: nn.Module, resident: bool = False) -> nn.Module:
    """Undo ``stream_blocks``: the hooks removed and every parameter and buffer in storage (the CPU), where
    ``pipeline.load_models`` had them before streaming; ``resident=True`` puts every one on the device instead (the
    model fully resident, if it fits)."""
    stream = streaming(model)
    if stream is not None:
        stream.close(resident)
        run_state(model).stream = None
    return model


def resident_parts(model: nn.Module) -> list[nn.Module]:
    """The modules of a (maybe streamed) transformer that stay on the device: everything but the streamed blocks."""
    streamed = set(streamed_blocks(model))
    others = [m for m in model.children() if m is not model.double_blocks and m is not model.single_blocks]
    return others + [b for b in [*model.double_blocks, *model.single_blocks] if b not in streamed]


def place(model: nn.Module, device) -> nn.Module:
    """``model.to(device)`` that leaves streamed blocks in storage (``model.to`` would copy them all to the device):
    how the transformer steps aside to the CPU and back while the text encoder visits the device."""
    if streaming(model) is None:
        return model.to(device)
    for part in resident_parts(model):
        part.to(device)
    return model


# --- tensors of a module --------------------------------------------------------------------------------------------

def slots(module: nn.Module) -> list[tuple[nn.Module, str, Tensor]]:
    """(owning module, name, tensor) of every parameter and buffer under ``module``."""
    return [(m, name, t) for m in module.modules()
            for name, t in itertools.chain(m._parameters.items(), m._buffers.items()) if t is not None]


def set_tensor(module: nn.Module, name: str, tensor: Tensor) -> None:
    """Point a parameter (same Parameter object, new data) or a buffer at ``tensor``."""
    if name in module._parameters:
        module._parameters[name].data = tensor
    else:
        module._buffers[name] = tensor


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """The one place weights are copied to the compute device (tests wrap it, and ``to_storage``, to make CPU-to-CPU
    "copies" real and count the bytes on the "device")."""
    return tensor.to(device, non_blocking=True)


def to_storage(tensor: Tensor, storage: torch.device, pin: bool) -> Tensor:
    """A streamed weight's stored copy: pinned on the way to a CUDA device, so copies from it are asynchronous."""
    tensor = tensor.to(storage)
    return tensor.pin_memory() if pin and not tensor.is_pinned() else tensor


# --- the streaming --------------------------------------------------------------------------------------------------

class BlockStream:
    """The hooks and stored tensors of a streamed model (made by ``stream_blocks``)."""

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
        """The model's forward starts: copy the first streamed block while the embedders and early blocks run."""
        if self.stored:
            self.load(next(iter(self.stored)))

    def load(self, block: nn.Module) -> None:
        """Start copying ``block``'s weights to the device (on the side stream on CUDA); once per visit."""
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
        """Remove the hooks; every tensor to the device (``resident``) or to storage."""
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
