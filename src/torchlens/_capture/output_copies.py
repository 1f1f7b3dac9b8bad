"""The model's output: the trace's tensors on its memory copied when the caller first reads it.

`trace` hands the caller the model's return value only as `Trace.output`, while the trace's own
records (op outputs, facets) hold aliases of the same memory: the logits above all, 25 MiB of
GPT-2 small at 128 tokens and 196 MiB at 1024, which a copy also makes the system map page by
page. A write into the output after the trace must not change what the trace serves, but memory
the caller can reach only through `Trace.output` cannot be written before `Trace.output` is read.
So (the steps, in order):

1. `_capture.snapshot` leaves each storage that only the output's tensors share with the trace
   (found through tuples, lists and dicts, a `ModelOutput`'s items and attributes; held by
   nothing else alive, not saved by the autograd graph) uncopied, as one `snapshot.Guarded`
   group (`snapshot.OUTPUT_REASON`), armed like the others: the first read of any of the trace's
   tensors on it (`OpRecord.tensors`, `FacetSite.tensor`) copies it.
2. `settle`, when `trace` is about to return (its own references to the output dropped), proves
   that nothing but the returned `Trace` holds the output: every container and tensor of it has
   exactly the references the output's own containers give it, and the root only the trace's
   (`_core.ownership.sole_tree`), and each storage exactly the tensors of the output and of the
   trace (`step_copies._held_elsewhere`: no other tensor, view, NumPy array or storage object on
   it). Then the groups wait for the first read of `Trace.output`, which copies them before
   handing the output over (`Trace._output_guards`). Otherwise (a hook kept the output, the model
   keeps a view of its logits, no reference count to read) they are copied now, as every other
   storage the caller can reach is.

A caller who never reads `Trace.output` (reading the logits as the `logits` facet) never pays for
the copy; one who does pays it then, as before.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch

from torchlens._capture.snapshot import Guarded
from torchlens._capture.step_copies import _baseline, _held_elsewhere
from torchlens._core.holdings import storage_ptr
from torchlens._core.ownership import sole_tree

__all__ = ["settle"]


def settle(trace: Any, groups: list[Guarded]) -> None:
    """Leave each of `groups` (the snapshot's groups on memory only the output shares) for the
    first read of `trace.output` where nothing but `trace` holds the output and that memory; copy
    the others now.

    Args:
        trace: the `Trace` about to be returned, its caller holding no other reference to the
            output.
        groups: `Recorder.output_groups`, armed.
    """
    waiting = [g for g in groups if not g.done]
    if not waiting:
        return
    # inside another trace's forward, the probes and copies here are none of its ops
    nested = torch._C._len_torch_function_stack() > 0
    with torch._C.DisableTorchFunction() if nested else contextlib.nullcontext():
        _settle(trace, waiting)


def _settle(trace: Any, waiting: list[Guarded]) -> None:
    found = sole_tree(trace.__dict__, "_output")
    sole, others = found if found is not None else ([], [])
    base = _baseline() if found is not None else None
    kept = []
    for group in waiting:
        if found is not None and _sole(group, sole, others, base):
            kept.append(group)
        else:
            group.resolve()
    if kept:
        trace._output_guards = kept


def _sole(group: Guarded, sole: list, others: list, base: Any) -> bool:
    """Whether nothing but the trace's tensors in `group` and the output's tensors, each held by
    the output alone (`sole`, not `others`), holds the group's storage."""
    mine = group.tensors()
    if not mine:
        return False
    ptr = storage_ptr(mine[0])
    if any(storage_ptr(t) == ptr for t in others):
        return False
    if weakref.getweakrefcount(mine[0].untyped_storage()):  # one Python object per storage
        return False  # a weak reference to the storage reaches it without counting
    on_it = {id(t): t for t in mine}
    on_it.update((id(t), t) for t in sole if storage_ptr(t) == ptr)
    return not _held_elsewhere(list(on_it.values()), base)
