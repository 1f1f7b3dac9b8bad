"""Rolled stacks: the layers of a stack whose recorded op sequences are the same are one group,
drawn once with x N; a layer that differs, or a second call of one block, is a group of its own,
with the reason it is apart."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchlens._core.records import ModuleCall, Ref

if TYPE_CHECKING:
    from torchlens._trace import Trace


@dataclass
class Group:
    stack: str
    layers: list[int]  # layer indices in the stack
    calls: list[ModuleCall]
    reason: str = ""
    #: its layers read a tensor made outside the forward (a buffer), whose values no record holds,
    #: so two layers reading different ones (GPT-Neo's global and local masks) look the same
    buffers: bool = False

    @property
    def rep(self) -> ModuleCall:
        return self.calls[0]


#: How many elements of a constant made outside the layers `op_signature` compares by value.
_CONSTANT_NUMEL = 64


def _outside(trace: Trace, r: Ref, prev: ModuleCall | None) -> tuple:
    """Where a layer's input from outside the layer came from, as `op_signature` compares it: an
    op of the layer before by offset (a layer handed the residual of the previous one besides its
    input); a small constant made from nothing in the forward (`torch.tensor(2)`, one per layer of
    a cache) by its values, where they were kept; else the op itself."""
    if prev is not None and prev.first_op <= r.op < prev.end_op:
        return ("previous_layer", r.op - prev.first_op, r.slot)
    op = trace.ops[r.op]
    t = op.tensors[r.slot] if r.slot < len(op.tensors) else None
    if (
        t is not None
        and not any(type(i) is Ref or isinstance(i, str) for i in op.inputs)
        and t.numel() <= _CONSTANT_NUMEL
    ):
        return ("constant", op.name, tuple(t.shape), str(t.dtype), tuple(t.flatten().tolist()))
    return ("outside", r.op, r.slot)


def op_signature(trace: Trace, call: ModuleCall, prev: ModuleCall | None = None) -> tuple:
    """What a layer call computed, with nothing layer-specific in it: per op its name, its module
    (relative to the layer) and class, output shapes and dtypes, whether it wrote in place, and
    where each input came from (an op of the layer by offset, the layer's input, a parameter of
    the layer by relative name, an op of the layer before, `prev`, by offset, a small constant
    made outside by its values, or another op or parameter outside the layer by identity). A
    tensor made outside the forward (a buffer) is not told apart: its values are not recorded."""
    lo, hi = call.first_op, call.end_op
    prefix = call.address + "."
    sig = []
    for op in trace.ops[lo:hi]:
        mod = op.module
        rel = (
            mod[len(prefix) :]
            if mod.startswith(prefix)
            else ("." if mod == call.address else "@" + mod)
        )
        cls = trace.modules[mod].class_name if mod in trace.modules else ""
        ins: list[tuple[object, ...]] = []
        for r in op.inputs:
            if type(r) is Ref:
                if lo <= r.op < hi:
                    ins.append(("op", r.op - lo, r.slot))
                elif r == call.input_ref:
                    ins.append(("input",))
                else:
                    ins.append(_outside(trace, r, prev))
            elif isinstance(r, str):
                ins.append(
                    ("param", r[len(prefix) :]) if r.startswith(prefix) else ("outside_param", r)
                )
            else:
                ins.append(("none",))
        sig.append(
            (
                op.name,
                rel,
                cls,
                tuple(tuple(s) for s in op.shapes),
                tuple(str(d) for d in op.dtypes),
                bool(op.mutated),
                tuple(ins),
            )
        )
    return tuple(sig)


_FROM_OUTSIDE = ("outside", "constant", "previous_layer")


def _source(trace: Trace, entry: tuple) -> str:
    """An input's place in an op signature, in words."""
    kind = entry[0]
    if kind == "outside":
        return f"{describe_op(trace, entry[1])} (computed outside the layers)"
    if kind == "constant":
        return f"a `{entry[1]}` of value {list(entry[4])} made outside the layers"
    if kind == "previous_layer":
        return f"op {entry[1]} of the layer before"
    if kind == "input":
        return "the layer's input"
    if kind in ("param", "outside_param"):
        return f"parameter {entry[1]}"
    if kind == "op":
        return f"its own op {entry[1]}"
    return "a tensor made outside the forward"


def describe_op(trace: Trace, i: int) -> str:
    op = trace.ops[i]
    return f"#{i} `{op.name}` in {op.module or '<root>'}"


def difference(trace: Trace, a: ModuleCall, b: ModuleCall, sa: tuple, sb: tuple, la: int) -> str:
    """Why layer call `b` is not drawn as layer `la` (call `a`): the first thing their op
    sequences disagree on, in words."""
    ra, rb = trace.modules[a.address], trace.modules[b.address]
    if ra.class_name != rb.class_name:
        return f"it is a {rb.class_name}, layer {la} a {ra.class_name}"
    subs_a, subs_b = sub_calls(trace, a), sub_calls(trace, b)
    counts = f"; it runs {len(sb)} ops, layer {la} {len(sa)}"
    for rel, cls in subs_b.items():
        if rel in subs_a and subs_a[rel] != cls:
            return f"its {rel} is a {cls} where layer {la}'s is a {subs_a[rel]}{counts}"
    for rel, cls in subs_b.items():
        if rel not in subs_a:
            return f"it runs {rel} ({cls}), which layer {la} does not{counts}"
    for rel, cls in subs_a.items():
        if rel not in subs_b:
            return f"it does not run {rel} ({cls}), which layer {la} runs{counts}"
    for k, (x, y) in enumerate(zip(sa, sb)):
        if x == y:
            continue
        name_x, rel_x, cls_x = x[:3]
        name_y, rel_y, cls_y = y[:3]

        def where(rel, cls):
            return ("the layer itself" if rel == "." else rel.lstrip("@")) + (
                f" ({cls})" if cls else ""
            )

        if (name_x, rel_x) != (name_y, rel_y):
            return (
                f"its op {k} is `{name_y}` in {where(rel_y, cls_y)} where layer {la}'s is `{name_x}` in "
                f"{where(rel_x, cls_x)}; it runs {len(sb)} ops, layer {la} {len(sa)}"
            )
        if x[3] != y[3]:

            def shape(s):
                return "×".join(map(str, s[0])) if s else "-"

            return f"its op {k} (`{name_y}`) returns {shape(y[3])} where layer {la}'s returns {shape(x[3])}"
        if x[4] != y[4]:
            return f"its op {k} (`{name_y}`) returns {y[4][0]} where layer {la}'s returns {x[4][0]}"
        if x[5] != y[5]:
            return f"its op {k} (`{name_y}`) {'writes' if y[5] else 'does not write'} its input in place"
        outside = [
            (p, q)
            for p, q in zip(x[6], y[6])
            if p != q and (p[0] in _FROM_OUTSIDE or q[0] in _FROM_OUTSIDE)
        ]
        if outside:
            p, q = outside[0]
            return (
                f"its op {k} (`{name_y}` in {where(rel_y, cls_y)}) reads {_source(trace, q)} where "
                f"layer {la}'s reads {_source(trace, p)}"
            )
        return f"its op {k} (`{name_y}`) reads its inputs from other places than layer {la}'s"
    return f"it runs {len(sb)} ops, layer {la} {len(sa)}; the first {min(len(sa), len(sb))} are the same"


def sub_calls(trace: Trace, call: ModuleCall) -> dict[str, str]:
    """Relative address -> class of the module calls made inside a layer call, in run order."""
    out: dict[str, str] = {}
    prefix = call.address + "."
    for op in trace.ops[call.first_op : call.end_op]:
        a = op.module
        while a.startswith(prefix):
            rel = a[len(prefix) :]
            if rel not in out:
                out[rel] = trace.modules[a].class_name
            a = a.rsplit(".", 1)[0]
    return out


def roll(trace: Trace) -> dict[str, list[Group]]:
    """The groups of each stack's layers: layers with one op signature form a group (drawn once,
    `×N`), in the order their first layer ran. A layer whose block already ran as an earlier layer
    (one module called twice) is a group of its own kind, drawn apart: its weights are the
    earlier layer's."""
    out: dict[str, list[Group]] = {}
    structure = trace.structure
    if structure is None:
        return out
    for name, stack in structure.stacks.items():
        if len(stack.layers) < 2:
            continue
        seen_address: dict[str, int] = {}
        by_key: dict[tuple, Group] = {}
        sigs: dict[int, tuple] = {}
        groups: list[Group] = []
        prev: ModuleCall | None = None
        for i, layer in enumerate(stack.layers):
            call = layer.call
            if call.end_op <= call.first_op:
                continue
            sig = op_signature(trace, call, prev)
            prev = call
            again = seen_address.get(call.address)
            seen_address.setdefault(call.address, i)
            key = (sig, again is not None)
            g = by_key.get(key)
            if g is None:
                g = by_key[key] = Group(name, [], [], buffers=any(("none",) in op[6] for op in sig))
                groups.append(g)
                sigs[id(g)] = sig
            g.layers.append(i)
            g.calls.append(call)
        if not groups:
            continue
        firsts = [g for g, key in zip(groups, by_key) if not key[1]]
        main = max(firsts or groups, key=lambda g: (len(g.layers), -g.layers[0]))
        for g, key in zip(groups, by_key):
            if g is main:
                continue
            if key[1]:
                earlier = [(seen_address[c.address], c.address) for c in g.calls]
                j, address = earlier[0]
                more = ", …" if len({a for _, a in earlier}) > 1 else ""
                g.reason = (
                    f"{'each of these layers calls' if len(g.calls) > 1 else 'it calls'} a block that "
                    f"already ran as an earlier layer ({address} as layer {j}{more}), so its weights are "
                    f"that layer's"
                )
            else:
                g.reason = difference(
                    trace, main.rep, g.rep, sigs[id(main)], sigs[id(g)], main.layers[0]
                )
        out[name] = groups
    return out
