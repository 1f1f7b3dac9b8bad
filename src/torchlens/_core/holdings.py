"""Where a trace holds tensors, and the memory they live in.

`held_tensors` is the one walk over every tensor a trace (or a recorder, during capture) holds:
op outputs, the arguments kept for rebuilding a fused kernel (`OpRecord.extra`), module
inputs/outputs the hooks kept, facets' stored tensors (and their gradients' on a trace taken
with `grads=`), and what pending checks compute from.
Each is a `Holding`, whose `put` replaces the tensor in its holder: the snapshot copies, the
stores move, the sealing of pending checks reads, and loading checks them all through it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch

__all__ = [
    "Holding",
    "arg_slots",
    "extent",
    "get_arg",
    "held_tensors",
    "memory_key",
    "set_arg",
    "storage_ptr",
    "trace_calls",
    "trace_holdings",
]


def storage_ptr(t: torch.Tensor) -> int | None:
    """The data pointer of `t`'s storage, or None for a tensor with no storage of its own to point
    to (a sparse tensor; a wrapper subclass, whose data lives in the tensors it wraps)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def memory_key(t: torch.Tensor, _depth: int = 0) -> int | None:
    """What identifies the memory `t`'s values live in, to tell which tensors a write changes: its
    storage's data pointer; for a wrapper subclass (one with `__tensor_flatten__`, such as
    `TwoTensor`), its first inner tensor's, which a write into the wrapper writes too; None for
    a tensor with neither (a sparse tensor)."""
    ptr = storage_ptr(t)
    if ptr is not None or _depth > 4 or not hasattr(type(t), "__tensor_flatten__"):
        return ptr
    try:
        names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]  # only on wrapper subclasses
        inner = next(
            (x for x in (getattr(t, n) for n in names) if isinstance(x, torch.Tensor)), None
        )
    except Exception:  # a subclass whose flattening fails here: nothing to key it by
        return None
    return None if inner is None else memory_key(inner, _depth + 1)


def extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage `t` can reach, as [start, end) (empty for an empty tensor)."""
    item = t.element_size()
    start = int(t.storage_offset()) * item
    if t.numel() == 0:
        return start, start
    last = sum((int(n) - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * item


def arg_slots(extra: dict) -> list[tuple[tuple[str, Any], torch.Tensor]]:
    """(key, tensor) for each tensor a rebuilt op's kept arguments (`OpRecord.extra`) hold; a key
    is `("args", position)` or `("kwargs", name)`."""
    found = [(("args", k), a) for k, a in enumerate(extra["args"]) if isinstance(a, torch.Tensor)]
    return found + [
        (("kwargs", k), v) for k, v in extra["kwargs"].items() if isinstance(v, torch.Tensor)
    ]


def get_arg(extra: dict, key: tuple[str, Any]) -> Any:
    """The kept argument `key` (an `arg_slots` key) of a rebuilt op."""
    return extra[key[0]][key[1]]


def set_arg(extra: dict, key: tuple[str, Any], value: torch.Tensor | None) -> None:
    """Replace the kept argument `key` (an `arg_slots` key) of a rebuilt op by `value`."""
    part, k = key
    if part == "args":
        args = list(extra["args"])
        args[k] = value
        extra["args"] = tuple(args)
    else:
        extra["kwargs"][k] = value


class Holding(NamedTuple):
    """One place a trace holds a tensor: `holder[key]` is `tensor`.

    `holder` is an `OpRecord` (key: the output slot), a rebuilt op's kept arguments
    (`OpRecord.extra`; key: an `arg_slots` key), a `ModuleCall` (key: `"_in"` or `"_out"`, the
    module input/output alias a hook kept), a `FacetSite` (key: `"tensor"`, its stored tensor, not
    a lazily computed one), or a pending check's input list (key: the position; `FacetSite._inputs`).
    """

    holder: Any
    key: Any
    tensor: torch.Tensor

    def put(self, new: torch.Tensor | None) -> None:
        """Hold `new` here instead of `tensor` (same values; a copy, a move, a mapped view), or
        None (the tensor is dropped)."""
        holder, key = self.holder, self.key
        if isinstance(holder, list):
            holder[key] = new
        elif isinstance(holder, dict):
            set_arg(holder, key, new)
        elif isinstance(
            key, int
        ):  # `_tensors`: what the op holds, a guarded output left unresolved
            tensors = list(holder._tensors)
            tensors[key] = new
            holder._tensors = tuple(tensors)
        elif key == "tensor":
            holder._value = new  # the stored value (`FacetSite.tensor` is a property)
        else:
            setattr(holder, key, new)

    def current(self) -> Any:
        """What the holder holds here now (`tensor` until something else was put there; None
        once a check ran and let go of its inputs, or the output was dropped)."""
        holder, key = self.holder, self.key
        if isinstance(holder, list):
            return holder[key] if key < len(holder) else None
        if isinstance(holder, dict):
            return get_arg(holder, key)
        if isinstance(key, int):
            return holder._tensors[key]
        if key == "tensor":
            return holder._value
        return getattr(holder, key)


#: `Holding(holder, key, tensor)` without the Python-level `__new__` a `NamedTuple` adds (the
#: walks below make one per tensor a trace holds, several hundred per trace)
_new_holding = tuple.__new__


def held_tensors(
    ops: Iterable[Any], calls: Iterable[Any] = (), hooks: Iterable[tuple[Any, str]] = ()
) -> list[Holding]:
    """Every tensor held by `ops` (their outputs and kept arguments), by the facets of `calls`
    (their stored tensors, and the inputs of their pending checks, each list once) and by the
    module input/output aliases `hooks` names (`(call, "_in" or "_out")`), in that order."""
    found: list[Holding] = []
    new = _new_holding
    for op in ops:
        for slot, t in enumerate(
            op._tensors
        ):  # as held: a guarded output is not resolved by this walk
            if t is not None:
                found.append(new(Holding, (op, slot, t)))
        if op.extra is not None:
            found += [new(Holding, (op.extra, key, t)) for key, t in arg_slots(op.extra)]
    for call, side in hooks:
        t = getattr(call, side)
        if isinstance(t, torch.Tensor):
            found.append(new(Holding, (call, side, t)))
    lists: set[int] = set()
    for call in calls:
        # a call's facets, and the gradients of a trace taken with `grads=` (`ModuleCall.grads`)
        for sites in (call.facets, getattr(call, "grads", None)):
            if sites is not None:
                found += _site_holdings(sites, lists)
    return found


def _site_holdings(facets: Any, lists: set[int]) -> list[Holding]:
    """The stored tensors of a facet map's sites and the inputs of their pending checks (each
    list once: `lists` holds the ids of the lists seen)."""
    found: list[Holding] = []
    new, tensor = _new_holding, torch.Tensor
    for site in facets._sites.values():
        t = site._value
        if isinstance(t, tensor):
            found.append(new(Holding, (site, "tensor", t)))
        inputs = site._inputs
        if inputs is not None and id(inputs) not in lists:
            lists.add(id(inputs))
            found += [
                new(Holding, (inputs, i, x)) for i, x in enumerate(inputs) if isinstance(x, tensor)
            ]
    return found


def trace_calls(trace: Any) -> Iterator[Any]:
    """Every module call of a finished trace."""
    for rec in trace.modules.values():
        yield from rec.calls


def trace_holdings(trace: Any) -> list[Holding]:
    """Every tensor a finished trace holds (`held_tensors` of its ops and calls)."""
    return held_tensors(trace.ops, trace_calls(trace))
