"""The module calls a finder walks: a layer and its sublayers, the calls inside a call, and the
calls outside every layer, all read from the trace's structure (`torchlens._analysis.structure`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchlens._analysis.structure import Layer, Structure
from torchlens._core.errors import TorchLensError
from torchlens._core.ops import ADD_OPS
from torchlens._core.records import ModuleCall, Ref
from torchlens._core.roles import WEIGHT_LAYOUT

if TYPE_CHECKING:
    from torchlens._trace import Trace


def structure_of(trace: Trace) -> Structure:
    """The trace's structure (`trace()` always finds one; a finder never runs on a trace without it)."""
    if trace.structure is None:
        raise TorchLensError(
            "this trace has no structure (its records are incomplete); trace the model again."
        )
    return trace.structure


def layer_of(trace: Trace, layer):
    """The LM stack's layer `layer`, or `layer` itself when `find_call` already picked one of another stack."""
    return layer if isinstance(layer, Layer) else structure_of(trace).layers[layer]


def stack_of_kind(trace: Trace, kind: str):
    """The one stack of that kind (`"encoder"` / `"decoder"`), or None."""
    stacks = (
        [s for s in trace.structure.stacks.values() if s.kind == kind] if trace.structure else []
    )
    return stacks[0] if len(stacks) == 1 else None


def _children(trace: Trace, call: ModuleCall) -> list[ModuleCall]:
    return structure_of(trace).children.get(id(call), [])


def calls_below(trace: Trace, call: ModuleCall) -> list[ModuleCall]:
    """Every call made inside `call`, in the order they started."""
    out, todo = [], list(_children(trace, call))
    while todo:
        c = todo.pop(0)
        out.append(c)
        todo.extend(_children(trace, c))
    return sorted(out, key=lambda c: c.first_op)


def sublayer(trace: Trace, layer: int, which: str) -> ModuleCall | None:
    """The layer's sublayer `which` (`"attention"`, `"cross_attention"`, `"mlp"`), or None."""
    return getattr(layer_of(trace, layer), which)


def own_output(trace: Trace, layer: int, which: str) -> ModuleCall | None:
    """The layer's sublayer `which` where its output is its own, or None where the module adds the
    residual itself (BLOOM's attention and MLP end in `dropout_add(x, residual)`): its last op is
    an add of a tensor made inside it and a tensor of its output's shape made before it ran."""
    sub = sublayer(trace, layer, which)
    if sub is None or type(sub.output_ref) is not Ref:
        return sub
    op = trace.ops[sub.output_ref.op]
    if op.name not in ADD_OPS or not (
        op.module == sub.address or op.module.startswith(sub.address + ".")
    ):
        return sub
    refs = [r for r in op.inputs if type(r) is Ref]
    inside = any(r.op >= sub.first_op for r in refs)
    before = any(
        r.op < sub.first_op and trace.ops[r.op].shapes[r.slot] == op.shapes[0] for r in refs
    )
    return None if inside and before else sub


def outside_layers(trace: Trace, role: str) -> list[ModuleCall]:
    """Every call of that role made outside the layers of every stack (and outside their calls)."""
    inside = {
        id(c)
        for s in structure_of(trace).stacks.values()
        for layer in s.layers
        for c in [layer.call] + calls_below(trace, layer.call)
    }
    return [
        c
        for rec in trace.modules.values()
        for c in rec.calls
        if c.role == role and id(c) not in inside
    ]


def weighted_leaves(trace: Trace, call: ModuleCall) -> list[ModuleCall]:
    """The calls inside `call` of a module with a known weight layout that make no call themselves."""
    return [
        c
        for c in calls_below(trace, call)
        if c.class_name in WEIGHT_LAYOUT and not calls_below(trace, c)
    ]
