"""Making a finished trace independent of the caller's tensors.

A saved tensor is a detached alias of what the model computed (see `torchlens._capture`). When
`trace` returns, the aliases that still share memory with something the caller can write into are
replaced by copies, here, once the trace is assembled, so only what the trace keeps is copied.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from torchlens._core.holdings import Holding, held_tensors, storage_ptr

if TYPE_CHECKING:
    from torchlens._capture.recorder import Recorder

__all__ = ["snapshot"]


def snapshot(rec: Recorder, model: nn.Module, reachable: Any) -> int:
    """Copy every tensor the finished trace holds that the caller could still write into.

    A saved tensor is a detached alias of what the model computed. Once the forward is over,
    most of those tensors are referenced by nothing but the trace; the others share storage
    with something the caller still holds: the model's parameters and buffers, the inputs
    and the returned output (`reachable`, walked through tuples, lists and mappings), or any
    recorded tensor still alive (a cache the model keeps, a tensor a hook stashed). Those
    aliases are replaced by copies, so no later in-place write (an optimizer step, editing
    `ids` to build a corrupted prompt, `trace.output.logits.zero_()`) changes the trace. The
    tensors a pending facet check will compute from (`FacetSite._inputs`: recorded tensors and
    the module weights it reads) are treated the same way, so a facet computed after an
    optimizer step still shows the forward that was traced.
    It runs once the trace is assembled, so only what the trace keeps is copied; several
    views of one storage (a KV cache's keys as each op saw them) share one copy of it when
    that costs no more than copying each view; they are views of one base tensor on the copy
    (per dtype), so they share its version counter, as the aliases they replace did.

    Args:
        model: the traced model.
        reachable: the forward's inputs and output, in any nesting of containers.

    Returns:
        The number of bytes copied (the memory this costs on top of the saved aliases).
    """
    for op in rec.ops:  # an op whose output was not kept: its arguments serve no rebuild
        if op.extra is not None and all(t is None for t in op.tensors):
            op.extra = None
    # Every place the finished trace holds a tensor (op outputs, kept kernel arguments, facets and
    # the inputs of their pending checks), grouped by the live storage it is on. Most saved
    # tensors are intermediates nothing else holds, and are left as they are.
    held = held_tensors(rec.ops, rec.calls)
    if not held:  # a save="none" trace: nothing to copy, no storage to look up
        return 0
    live = _live_storages(rec, model, reachable)
    groups: dict[Any, list[Holding]] = {}
    for h in held:
        key = _live_key(h.tensor, live)
        if key is not None:
            groups.setdefault(key, []).append(h)
    copied = 0
    for key, items in groups.items():
        tensors = [h.tensor for h in items]
        whole = type(key) is int and len({id(t) for t in tensors}) > 1  # a storage several views share
        if whole:
            storage = tensors[0].untyped_storage()
            whole = storage.nbytes() <= sum(t.numel() * t.element_size() for t in tensors)
        if whole:  # one copy of the storage serves every view of it (and keeps them views of one another)
            new = storage.clone()
            copied += storage.nbytes()
            # One base tensor per dtype on the copy, and every view made from it, so the views share
            # its version counter (a write through one moves it for all, see `Pending.seal`).
            bases: dict[torch.dtype, Tensor] = {}
        memo: dict[int, Tensor] = {}
        for h, t in zip(items, tensors):
            c = memo.get(id(t))
            if c is None:
                if whole:
                    base = bases.get(t.dtype)
                    if base is None:
                        base = bases[t.dtype] = torch.empty(0, dtype=t.dtype, device=t.device).set_(new, 0, (0,), (1,))
                    c = base.as_strided(t.size(), t.stride(), t.storage_offset())
                else:
                    c = t.clone()
                    copied += t.numel() * t.element_size()
                memo[id(t)] = c
            h.put(c)
    return copied


def _live_key(t: Tensor, live: set[int]) -> Any:
    """The group key of a saved tensor that must be copied: its storage's data pointer when the
    caller can still reach that storage, `("own", id(t))` for a tensor with no storage of its own
    (whether the caller holds it cannot be told, so it is copied), else None."""
    ptr = storage_ptr(t)
    if ptr is None:
        return ("own", id(t))
    return ptr if ptr in live else None


def _live_storages(rec: Recorder, model: nn.Module, reachable: Any) -> set[int]:
    """The storages (data pointers) the caller can still write into: the model's parameters and
    buffers, every tensor in `reachable` (through tuples, lists and mappings), and every recorded
    tensor still alive."""
    live: set[int] = set()

    def add(t: Tensor) -> None:
        ptr = storage_ptr(t)
        if ptr is not None:  # one without a storage of its own is copied whatever holds it
            live.add(ptr)

    for m in rec.names:  # every module of the model (`model.parameters()` and `buffers()`, in one pass)
        for t in itertools.chain(m._parameters.values(), m._buffers.values()):
            if t is not None:
                add(t)
    todo, seen = [(reachable, 0)], 0
    while todo and seen < 100_000:
        value, depth = todo.pop()
        seen += 1
        if isinstance(value, Tensor):
            add(value)
        elif depth < 8 and isinstance(value, (Mapping, tuple, list)):
            items = value.values() if isinstance(value, Mapping) else value
            todo.extend((v, depth + 1) for v in items)
    for _, ref, _ in rec.producer.values():
        t = ref()
        if t is not None:
            add(t)
    live.discard(0)  # empty tensors own no memory
    return live
