"""What every facet rule uses: a site from a ref, a call's input or output, refusals, and the
precision checks compute in."""

from __future__ import annotations

from typing import Any, overload

import torch
from torch import Tensor

from torchlens._analysis.graph import Graph
from torchlens._core.records import Dropped, ModuleCall, Ref
from torchlens._core.sites import FacetSite


def held(site: FacetSite | None) -> Tensor | None:
    """The tensor `site` holds now, without running its pending check."""
    return None if site is None else site._value


def wide(t: Tensor) -> Tensor:
    """`t` in the precision a check computes in: float64 stays float64, anything else is float32."""
    return t if t.dtype == torch.float64 else t.float()


@overload
def make_site(
    g: Graph, name: str, ref: Ref | Dropped, kind: str = "real", note: str = ""
) -> FacetSite: ...
@overload
def make_site(
    g: Graph, name: str, ref: Any, kind: str = "real", note: str = ""
) -> FacetSite | None: ...
def make_site(
    g: Graph, name: str, ref: Any, kind: str = "real", note: str = ""
) -> FacetSite | None:
    """A site for the tensor `ref` names; None when it names none (a `Ref` or `Dropped` always does)."""
    if type(ref) is Ref:  # most sites: an op's output (`g.meta` and `g.value`, inlined)
        op = g.ops[ref.op]
        shape, dtype, value = tuple(op.shapes[ref.slot]), op.dtypes[ref.slot], op.tensors[ref.slot]
        if value is None and g.dropped and ref in g.dropped:
            return FacetSite(name, "refused", shape, dtype, note=g.dropped[ref])
        return FacetSite(name, kind, shape, dtype, value, ref.op, None, note)
    if type(ref) is Dropped:
        return FacetSite(name, "refused", ref.shape, ref.dtype, note=ref.reason)
    m = g.meta(ref)
    if m is None:
        return None
    return FacetSite(name, kind, m[0], m[1], g.value(ref), None, None, note)


def io_ref(g: Graph, call: ModuleCall, which: str) -> Any:
    """A module call's input or output: the producing op's Ref, or the alias the hook kept.

    The Ref is preferred (it names the op); the alias is used when the op's tensor was not
    kept, e.g. a retained block whose input came from an op outside it.
    """
    ref, alias = (call.input_ref, call._in) if which == "in" else (call.output_ref, call._out)
    if type(alias) is Dropped and type(ref) is Ref:  # the Ref still leads through the graph
        if g.value(ref) is None:
            g.dropped[ref] = alias.reason
        return ref
    if type(ref) is Ref and (alias is None or g.value(ref) is not None):
        return ref
    return alias if alias is not None else ref


def refused(names: tuple[str, ...], reason: str) -> dict[str, FacetSite]:
    """Sites that are not served: their check failed or could not run. `FacetMap` keeps the
    reason, and asking for the facet raises `FacetNotFound` with it."""
    return {n: FacetSite(n, "refused", (), torch.float32, note=reason) for n in names}


def fits(t: Tensor, other: Tensor) -> bool:
    """Whether `t op= other` gives what `t op other` does: same dtype, and `other` broadcasts to `t`'s shape."""
    return (
        torch.result_type(t, other) == t.dtype
        and torch.broadcast_shapes(t.shape, other.shape) == t.shape
    )


def largest(diff: Tensor, rows: Tensor) -> float:
    """The largest entry of the absolute difference `diff` (overwritten) on the rows where `rows`
    holds: a NaN counts as infinitely large, an infinity as the dtype's largest finite value."""
    if not diff.numel():
        return 0.0
    if not bool(rows.all()):
        diff.masked_fill_(~rows, 0)
    m = float(diff.max())  # a NaN anywhere makes the max NaN
    return (
        float("inf") if m != m else float(torch.finfo(diff.dtype).max) if m == float("inf") else m
    )
