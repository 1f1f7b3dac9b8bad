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

from ._records import _storage_ptr

if TYPE_CHECKING:
    from ._capture import Recorder

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
    live: set[int] | None = None  # worked out on the first saved tensor (a save="none" trace has none)
    # Every place the finished trace holds a tensor on a live storage, grouped by storage: op
    # outputs, kept kernel arguments, facets and the inputs of their pending checks. Most saved
    # tensors are intermediates nothing else holds, and are left as they are.
    groups: dict[int, list[tuple[Any, Any]]] = {}  # storage -> [(holder, key)]; holder[key] is the tensor
    listed: list[Any] = []  # the ops whose `tensors` became a list (a tuple again at the end)
    for op in rec.ops:
        kept = False
        for i, t in enumerate(op.tensors):
            if t is not None:
                kept = True
                if live is None:
                    live = _live_storages(rec, model, reachable)
                ptr = _live_key(t, live)
                if ptr is not None:
                    if type(op.tensors) is not list:
                        op.tensors = list(op.tensors)
                        listed.append(op)
                    groups.setdefault(ptr, []).append((op.tensors, i))
        extra = op.extra
        if extra is None:
            continue
        if not kept:
            op.extra = None  # the op's output was not kept, so its arguments serve no rebuild
            continue
        # kept output: `live` is known
        op.extra = extra = {"args": list(extra["args"]), "kwargs": dict(extra["kwargs"])}
        for holder, keys in ((extra["args"], range(len(extra["args"]))), (extra["kwargs"], list(extra["kwargs"]))):
            for k in keys:
                a = holder[k]
                if isinstance(a, Tensor):
                    ptr = _live_key(a, live)
                    if ptr is not None:
                        groups.setdefault(ptr, []).append((holder, k))
    # A facet's stored tensor (`site.__dict__["tensor"]`: reading `site.tensor` would run a pending
    # check) and, while its check is pending, the tensors it will compute from (`site._inputs`,
    # one list per deferred check, weights included): they must stay as the forward left them.
    pending: set[int] = set()
    for call in rec.calls:
        if call.facets is None:
            continue
        for s in call.facets._sites.values():
            d = s.__dict__
            t = d.get("tensor")
            inputs = s._inputs
            if t is None and inputs is None:
                continue
            if live is None:
                live = _live_storages(rec, model, reachable)
            if t is not None:
                ptr = _live_key(t, live)
                if ptr is not None:
                    groups.setdefault(ptr, []).append((d, "tensor"))
            if inputs is not None and id(inputs) not in pending:
                pending.add(id(inputs))
                for i, t in enumerate(inputs):
                    if isinstance(t, Tensor):
                        ptr = _live_key(t, live)
                        if ptr is not None:
                            groups.setdefault(ptr, []).append((inputs, i))
    copied = 0
    for key, items in groups.items():
        tensors = [h[k] for h, k in items]
        whole = type(key) is int and len({id(t) for t in tensors}) > 1  # a storage several views share
        if whole:
            storage = tensors[0].untyped_storage()
            whole = storage.nbytes() <= sum(t.numel() * t.element_size() for t in tensors)
        if whole:  # one copy of the storage serves every view of it (and keeps them views of one another)
            new = storage.clone()
            copied += storage.nbytes()
            # One base tensor per dtype on the copy, and every view made from it, so the views share
            # its version counter (a write through one moves it for all, see `_Pending.seal`).
            bases: dict[torch.dtype, Tensor] = {}
        memo: dict[int, Tensor] = {}
        for (holder, key), t in zip(items, tensors):
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
            holder[key] = c
    for op in listed:
        op.tensors = tuple(op.tensors)
    for op in rec.ops:
        if op.extra is not None:  # every kept one was rebuilt above with its args as a list
            op.extra["args"] = tuple(op.extra["args"])
    return copied


def _live_key(t: Tensor, live: set[int]) -> Any:
    """The group key of a saved tensor that must be copied: its storage's data pointer when the
    caller can still reach that storage, `("own", id(t))` for a tensor with no storage of its own
    (whether the caller holds it cannot be told, so it is copied), else None."""
    ptr = _storage_ptr(t)
    if ptr is None:
        return ("own", id(t))
    return ptr if ptr in live else None


def _live_storages(rec: Recorder, model: nn.Module, reachable: Any) -> set[int]:
    """The storages (data pointers) the caller can still write into: the model's parameters and
    buffers, every tensor in `reachable` (through tuples, lists and mappings), and every recorded
    tensor still alive."""
    live: set[int] = set()

    def add(t: Tensor) -> None:
        ptr = _storage_ptr(t)
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
