"""Peak memory of a piece of CPU code, from torch's own allocator records (for checking memory estimates).

``peak_bytes(fn)`` runs ``fn`` under ``torch.profiler`` with memory profiling and replays the allocator's timeline of
tensor storages: +size when one is created, -size when it is freed, in time order. The highest running sum is the
peak of the memory ``fn`` allocated on top of what already existed (its inputs and the weights do not count).

The per-op ``self_cpu_memory_usage`` totals of the profiler cannot give this: a free is charged to the op that
started before it (often the outermost one), so summing them in start order moves frees ahead of allocations.
"""

from __future__ import annotations

from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import Action, DataFlowGraph


def peak_bytes(fn, collectives: bool = False) -> int:
    """The peak of the tensor memory allocated (and not yet freed) while ``fn()`` runs on the CPU, in bytes.

    ``collectives``: ``fn`` runs torch.distributed collectives (a sequence-parallel pass). The profiler then fails
    its own consistency check of the op graph it infers ("duplicate outputs" of an op whose output's memory a
    collective's buffer reused moments before), which the timeline below does not use: it is skipped."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    check = DataFlowGraph.validate
    if collectives:
        DataFlowGraph.validate = lambda self: None
    try:
        timeline = prof._memory_profile().timeline
    finally:
        DataFlowGraph.validate = check
    created, running, peak = set(), 0, 0
    for _, action, (key, _), size in timeline:
        if action == Action.CREATE:
            created.add(key)
            running += size
        elif action == Action.DESTROY and key in created:      # storages that existed before fn do not count
            running -= size
        peak = max(peak, running)
    return peak
