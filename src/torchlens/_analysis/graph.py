"""The one data-flow graph over a finished recording: which op produced and consumed which tensor,
which call ran inside which, and the questions the structure and facet rules ask of it."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from torchlens._core import ops as _ops
from torchlens._core.records import ModuleCall, OpRecord, Ref

__all__ = ["Graph", "adds_own_input"]

#: Ops an attention kernel is recognized by: a softmax, or a fused attention op.
_KERNEL_OPS = _ops.SOFTMAX_OPS | _ops.FUSED_ATTENTION_OPS


class Graph:
    """Read helpers over the recorded ops and calls: producers, consumers, saved values, shapes,
    the calls made inside a call, and what is computed from what.

    Args:
        ops: the recorded ops, in execution order.
        calls: the recorded module calls, in the order they started.
        modules: address -> module, for the rules that read a module's weights or settings.
    """

    def __init__(
        self,
        ops: list[OpRecord],
        calls: Sequence[ModuleCall] = (),
        modules: dict[str, nn.Module] | None = None,
    ):
        self.ops = ops
        self.modules = modules if modules is not None else {}
        #: op index -> the indices of the ops that read one of its outputs
        self.consumers: dict[int, list[int]] = {}
        #: the positions of the attention kernels (`is_kernel`) in `ops`, ascending
        self._kernel_at: list[int] = []
        consumers, is_kernel = self.consumers, self.is_kernel
        for at, op in enumerate(ops):
            for r in op.inputs:
                if type(r) is Ref:
                    consumers.setdefault(r.op, []).append(op.index)
            if op.name in _KERNEL_OPS and is_kernel(op):
                self._kernel_at.append(at)
        #: id(call) -> the calls made directly inside it
        self.kids: dict[int, list[ModuleCall]] = {}
        for c in calls:
            if c.parent is not None:
                self.kids.setdefault(id(c.parent), []).append(c)
        #: a ref a facet rule fell back to because the alias the hook kept there was dropped -> why
        self.dropped: dict[Ref, str] = {}

    # -- tensors and their metadata ---------------------------------------------------------

    def value(self, ref: Any) -> Tensor | None:
        """The saved tensor `ref` names (a `Ref`, or a kept alias itself), or None."""
        if type(ref) is Ref:
            return self.ops[ref.op].tensors[ref.slot]
        return ref if isinstance(ref, Tensor) else None

    def meta(self, ref: Any) -> tuple[tuple[int, ...], torch.dtype] | None:
        """(shape, dtype) of the tensor `ref` names, saved or not; None for what is not a tensor."""
        if type(ref) is Ref:
            op = self.ops[ref.op]
            return tuple(op.shapes[ref.slot]), op.dtypes[ref.slot]
        if isinstance(ref, Tensor):
            return tuple(ref.shape), ref.dtype
        return None

    def shape(self, ref: Any) -> tuple[int, ...] | None:
        """The shape of the op output `ref` names, or None when `ref` is not a `Ref`."""
        return tuple(self.ops[ref.op].shapes[ref.slot]) if type(ref) is Ref else None

    def op(self, ref: Any) -> OpRecord | None:
        """The op that produced `ref`, or None when `ref` is not a `Ref`."""
        return self.ops[ref.op] if type(ref) is Ref else None

    # -- walks -------------------------------------------------------------------------------

    def follow(self, ref: Ref, names: frozenset[str], limit: int = 4) -> Ref:
        """Follow single consumers whose op name is in `names` (casts, dropout) from `ref`."""
        for _ in range(limit):
            nxt = [c for c in self.consumers.get(ref.op, []) if self.ops[c].name in names]
            if len(nxt) != 1 or len(self.consumers.get(ref.op, [])) != 1:
                break
            ref = Ref(nxt[0], 0)
        return ref

    def source(self, ref: Any, names: frozenset[str], limit: int = 4) -> Any:
        """Walk back from `ref` through producers whose op name is in `names` (dropout, casts) to
        the tensor they pass on: what `follow` does downstream, upstream."""
        for _ in range(limit):
            op = self.op(ref)
            if op is None or op.name not in names or not op.inputs or type(op.inputs[0]) is not Ref:
                break
            ref = op.inputs[0]
        return ref

    def ancestors(self, ref: Any, lo: int) -> dict[int, int]:
        """The ops upstream of `ref` (`ref`'s own op included), as index -> the output slot the
        walk reached, restricted to ops with index >= `lo`."""
        seen: dict[int, int] = {}
        todo = [ref]
        while todo:
            r = todo.pop()
            if type(r) is not Ref or r.op < lo or r.op in seen:
                continue
            seen[r.op] = r.slot
            todo.extend(self.ops[r.op].inputs)
        return seen

    def reaches(self, src: Any, dst: Any) -> bool:
        """Whether the tensor `dst` is computed from the tensor `src` (or is it)."""
        if type(src) is not Ref or type(dst) is not Ref:
            return False
        return src == dst or src.op in self.ancestors(dst, src.op)

    def descendants(self, call: ModuleCall) -> list[ModuleCall]:
        """Every call made inside `call`, breadth first."""
        kids = self.kids
        out = list(kids.get(id(call), ()))
        for c in out:  # `out` grows as it is read: each call's kids join the end of the queue
            more = kids.get(id(c))
            if more:
                out.extend(more)
        return out

    # -- questions the rules ask -------------------------------------------------------------

    def is_kernel(self, op: OpRecord) -> bool:
        """An attention kernel: a fused attention op, or a softmax over 3 or more dimensions."""
        return op.name in _KERNEL_OPS and (
            op.name in _ops.FUSED_ATTENTION_OPS or len(op.shape) >= 3
        )

    def kernels(self, call: ModuleCall) -> list[OpRecord]:
        """The attention kernels that ran inside `call`."""
        at, end = self._kernel_at, call.end_op
        if end < 0:  # as the slice `ops[first_op:end_op]` reads it (a call left open is -1)
            end += len(self.ops)
        lo = bisect_left(at, call.first_op)
        return [self.ops[i] for i in at[lo : bisect_left(at, end, lo)]]

    def follows(self, prev: ModuleCall, call: ModuleCall) -> bool:
        """Whether `call` reads `prev`'s output as the next layer would: computed from it, with no
        attention kernel and no op reading a parameter on the way. The query/value and output
        projections of one attention (same class, same width, wrapped as TransformerLens's bridge
        wraps them) are linked through the attention kernel, so they do not chain as layers do."""
        src, dst = prev.output_ref, call.input_ref
        if type(src) is not Ref or type(dst) is not Ref:
            return False
        if src == dst:
            return True
        upstream = self.ancestors(
            dst, src.op
        )  # one walk answers both questions (`reaches` would walk it again)
        if src.op not in upstream:
            return False
        # nor with a weight on the way: a layer's successor reads its output, not what a sublayer
        # between them made of it (XLM's attention modules, whose layers are no module of their
        # own, chain through the feed-forward network)
        return not any(
            self.is_kernel(self.ops[i]) or any(type(r) is str for r in self.ops[i].inputs)
            for i in upstream
            if prev.end_op <= i < call.first_op
        )

    def adds_own_input(self, call: ModuleCall) -> bool:
        """Whether the call adds its own input back (`adds_own_input`)."""
        return adds_own_input(self.ops, call)


def adds_own_input(ops: list[OpRecord], call: ModuleCall) -> bool:
    """Whether `call` adds its own input back (a residual connection inside it), directly or
    through value-preserving casts of it (`x.to(float32)`)."""
    if type(call.input_ref) is not Ref:
        return False
    same = {call.input_ref}
    for op in ops[call.first_op : call.end_op]:
        if op.name in _ops.ADD_OPS and same.intersection(op.inputs):
            return True
        if op.name in _ops.PASS_THROUGH_OPS and op.inputs and op.inputs[0] in same:
            same.add(Ref(op.index, 0))
    return False
