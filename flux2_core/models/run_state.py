"""What a run adds to a loaded model beside its weights, kept in one object per model (``run_state``): the adapters
applied (``patching``), the blocks streamed (``offload``), the compile options (``compile``) and the ranks its
passes are spread over (``runtime/parallel``). Each of those modules sets and reads its own field; the model's state dict,
its parameters and its class stay as loaded."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn


# The fields' classes live in the modules that set them; this module imports none of them (it is below them all),
# so each field names its class in a comment.
@dataclass
class RunState:
    adapters: object | None = None                 # patching.AppliedAdapters: what to undo before the next set
    adapter_key: tuple = ()                        # names the applied set; the caches key by it (cache.fingerprint)
    stream: object | None = None                   # offload.BlockStream: the streamed blocks' hooks and tensors
    compiled: dict = field(default_factory=dict)   # torch.compile options of the compiled blocks ({}: eager)
    compiled_blocks: list[nn.Module] = field(default_factory=list)
    sequence_parallel: object | None = None        # parallel.SequenceParallel: the ranks its passes spread over


def run_state(model: nn.Module) -> RunState:
    """The model's run state, made empty on first use (a plain attribute: not a submodule, not in the state dict)."""
    state = model.__dict__.get("run_state")
    if state is None:
        state = model.__dict__["run_state"] = RunState()
    return state
