"""What a run adds to a loaded model beside its weights, kept in one object per model (``run_state``): the adapters
applied (``patching``), the blocks streamed (``offload``), the compile options (``compile``) and the ranks its
passes are spread over (``parallel``). Each of those modules sets and reads its own field; the model's state dict,
its parameters and its class stay as loaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from .offload import BlockStream
    from .parallel import SequenceParallel
    from .patching import AppliedAdapters


@dataclass
class RunState:
    adapters: AppliedAdapters | None = None        # what to undo before the next set (patching.set_adapters)
    adapter_key: tuple = ()                        # names the applied set; the caches key by it (cache.fingerprint)
    stream: BlockStream | None = None              # the streamed blocks' hooks and stored tensors
    compiled: dict = field(default_factory=dict)   # torch.compile options of the compiled blocks ({}: eager)
    compiled_blocks: list[nn.Module] = field(default_factory=list)
    sequence_parallel: SequenceParallel | None = None


def run_state(model: nn.Module) -> RunState:
    """The model's run state, made empty on first use (a plain attribute: not a submodule, not in the state dict)."""
    state = model.__dict__.get("run_state")
    if state is None:
        state = model.__dict__["run_state"] = RunState()
    return state
