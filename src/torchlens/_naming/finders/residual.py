"""What a sublayer adds to the residual stream, followed through the recorded ops: whether a
call's output is a summand of the layer's residual add, and the finder of a sublayer whose
output is (its `contribution`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from torchlens._core.ops import ADD_OPS, PASS_THROUGH_OPS, RESHAPE_OPS, SCALE_OPS
from torchlens._core.records import ModuleCall, Ref
from torchlens._naming.finders.calls import layer_of, sublayer

if TYPE_CHECKING:
    from torchlens._trace import Trace


def added_to_residual(
    trace: Trace, layer: int, sub: ModuleCall | None, reads: ModuleCall | None = None
) -> str | None:
    """Whether the call's output is a summand of what the layer adds to its residual stream:
    `"as_is"`, `"changed"` (the model reshapes it, or multiplies it by a constant, on the way:
    Llama-4, Granite, MiniCPM3), or None (it is not).

    Followed through casts, dropout and other sums (GPT-J adds attention and MLP outputs first),
    the output must meet an add whose other operand is the stream the sublayer read (a tensor its
    input, `reads`'s, by default `sub`'s own, is computed from), or a sum holding it. That is what makes the output the
    sublayer's contribution to the residual stream; BERT's self-attention returns the merged
    heads, and its output projection lies outside it. A sum that then goes through a norm is no
    contribution (Gemma-4 normalizes its MLP's and its experts' normed outputs once more before
    the add).
    """
    if sub is None or type(sub.output_ref) is not Ref:
        return None
    block = layer_of(trace, layer).call
    reads = reads or sub
    refs, changed = {sub.output_ref}, set()
    for op in trace.ops[sub.end_op : block.end_op]:
        hit = [r for r in op.inputs if r in refs]
        if not hit:
            continue
        out = Ref(op.index, 0)
        if op.name in ADD_OPS:
            if any(_holds_stream(trace, r, reads.input_ref) for r in op.inputs if r not in refs):
                return "changed" if any(r in changed for r in hit) else "as_is"
            refs.add(out)
            if any(r in changed for r in hit):  # a sum holding the changed output (Falcon-H1's
                changed.add(out)  # attention times its multiplier, plus the mixer's output)
        elif (
            op.name in PASS_THROUGH_OPS and op.inputs[0] in refs
        ):  # (`y.type_as(x)` passes y on, not x)
            refs.add(out)
            if op.inputs[0] in changed:
                changed.add(out)
        elif op.name in SCALE_OPS | RESHAPE_OPS and len(op.inputs) == 1 and op.inputs[0] in refs:
            # a product with a Python number, or a view: the only tensor argument is ours
            refs.add(out)
            changed.add(out)
    return None


def has_facet(call: ModuleCall | None, facet: str) -> bool:
    facets = call.facets if call is not None else None
    return facets is not None and (facet in facets.sites or facet in facets.refused)


def _holds_stream(trace: Trace, ref, read, depth: int = 4) -> bool:
    """Whether `ref` is the residual stream the tensor `read` was computed from, or a sum (through
    casts) one of whose terms is (a block adding a side branch and its MLP in one expression,
    `x + side(h) + mlp(h)`)."""
    if _computed_from(trace, ref, read):
        return True
    op = trace.ops[ref.op] if type(ref) is Ref else None
    if depth == 0 or op is None or op.name not in ADD_OPS | PASS_THROUGH_OPS or not op.inputs:
        return False
    terms = op.inputs if op.name in ADD_OPS else op.inputs[:1]
    return any(_holds_stream(trace, r, read, depth - 1) for r in terms if type(r) is Ref)


def _computed_from(trace: Trace, src, dst) -> bool:
    """Whether the tensor `dst` is computed from the tensor `src` (or is it)."""
    if type(src) is not Ref or type(dst) is not Ref:
        return False
    seen, todo = set(), [dst]
    while todo:
        r = todo.pop()
        if type(r) is not Ref or r.op < src.op or r.op in seen:
            continue
        if r.op == src.op:
            return r.slot == src.slot
        seen.add(r.op)
        todo.extend(trace.ops[r.op].inputs)
    return False


def contribution(which: str) -> Callable[[Trace, int], ModuleCall | None]:
    def find(trace: Trace, layer: int) -> ModuleCall | None:
        """The sublayer, where its output is what the layer adds to the stream, or the model changes
        it on the way and TorchLens found the changed tensor: its `contribution` facet (served
        or refused), which the names of the contribution read first."""
        sub = sublayer(trace, layer, which)
        how = added_to_residual(trace, layer, sub)
        if how == "changed" and not has_facet(sub, "contribution"):
            return None
        return sub if how is not None else None

    return find
