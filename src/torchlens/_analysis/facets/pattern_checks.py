"""The checks of an attention's facets read after its softmax: `z` served only where it equals
`pattern @ v`, and, for a softmax over more columns than keys (attention sinks), `scores` and
`pattern` served only once the pattern is shown to be the softmax's key columns."""

from __future__ import annotations

from typing import Any

import torch

from torchlens._analysis.facets.common import held, make_site, refused, wide
from torchlens._analysis.graph import Graph
from torchlens._core import ops as _ops
from torchlens._core.pending import Pending
from torchlens._core.records import ModuleCall, Ref
from torchlens._core.sites import FacetSite


def sink_columns(
    g: Graph,
    call: ModuleCall,
    sites: dict[str, FacetSite | None],
    scores_ref: Any,
    pattern_ref: Ref,
    key_slice: int,
) -> None:
    """Scores and pattern of a softmax over more columns than there are keys (GPT-OSS's attention
    sinks: softmax over `cat([scores, sink])`, then the sink column dropped before `@ v`).

    The spec's `[batch, heads, query, key]` holds keys only, so `pattern` is the index op's output
    (the weights that multiply v; its rows sum below 1, the rest is the sinks' mass) and `scores`
    the softmax input's first columns, when the softmax input comes from a `cat` whose first part
    has exactly that many columns. Served only once the pattern is shown, on first read, to equal
    those first columns of the softmax output; refused when the key columns cannot be told.
    """
    n = g.ops[key_slice].shape[-1]
    s_meta = g.meta(scores_ref)
    up = g.ancestors(scores_ref, call.first_op) if type(scores_ref) is Ref else {}
    cat = next(
        (
            i
            for i in sorted(up, reverse=True)
            if g.ops[i].name in ("cat", "concat", "concatenate")
            and s_meta is not None
            and tuple(g.ops[i].shape) == s_meta[0]
            and g.ops[i].inputs
            and (m := g.meta(g.ops[i].inputs[0])) is not None
            and m[0] == s_meta[0][:-1] + (n,)
        ),
        None,
    )
    if cat is None or s_meta is None:
        sites.update(
            refused(
                ("scores", "pattern"),
                (
                    f"the softmax runs over {s_meta[0][-1] if s_meta else '?'} columns but {n} of them multiply v, and "
                    f"which columns are keys was not found in the data flow"
                ),
            )
        )
        return
    note = (
        f"the softmax's first {n} columns, the keys (the softmax also covers {s_meta[0][-1] - n} column(s) that are not keys, "
        "e.g. attention sinks, whose weight is not in the pattern: rows sum below 1)"
    )
    pattern = make_site(g, "pattern", Ref(key_slice, 0), note="weights that multiply v: " + note)
    scores_full = g.value(scores_ref)
    scores = FacetSite(
        "scores",
        "real",
        s_meta[0][:-1] + (n,),
        s_meta[1],
        None if scores_full is None else scores_full[..., :n],
        scores_ref.op if type(scores_ref) is Ref else None,
        None,
        "input of the softmax, " + note,
    )
    sites["scores"], sites["pattern"] = scores, pattern
    soft_out = g.value(pattern_ref)
    if soft_out is None or held(pattern) is None:
        scores.tensor = pattern.tensor = None  # the key columns cannot be shown, so not served
        return

    def run(inputs: list) -> tuple:
        p, full = inputs
        if not torch.equal(p, full[..., :n].to(p.dtype)):
            return (
                {},
                None,
                f"the weights that multiply v are not the softmax's first {n} columns (the keys)",
            )
        return {}, 0.0, None

    Pending(run, [held(pattern), soft_out], [scores, pattern])


def check_z(
    g: Graph, pattern: FacetSite | None, v_ref: Any, z: FacetSite | None
) -> dict[str, FacetSite]:
    """Refuse `z` unless `pattern @ v` equals it (it does not when dropout ran between them).
    The check is deferred to the first read of `z`."""
    if z is None or held(z) is None:
        return {}
    v = g.value(v_ref)
    if pattern is None or held(pattern) is None or v is None:
        z.tensor = None  # cannot be checked, so not served
        return {}
    dtype = z.dtype

    def run(inputs: list) -> tuple:
        p, v, zt = inputs
        if p.dim() == 4 and v.dim() == 3 and v.shape[0] == p.shape[0] * p.shape[1]:
            v = v.reshape(p.shape[0], p.shape[1], *v.shape[1:])  # merged [batch * heads] rows
        if v.shape[-3] != p.shape[-3] and v.dim() == 4 and p.shape[-3] % v.shape[-3] == 0:
            v = v.repeat_interleave(p.shape[-3] // v.shape[-3], dim=-3)
        try:
            err = float((wide(torch.matmul(p.to(v.dtype), v)) - wide(zt)).abs().max())
        except RuntimeError as exc:
            return {}, None, f"pattern @ v could not be formed ({exc})"
        tol = _ops.reconstruction_tolerance(dtype) * max(1.0, float(v.abs().max()))
        if not err <= tol:
            return (
                {},
                err,
                f"pattern @ v differs from z by {err:.3g} (> {tol:.3g}), e.g. dropout ran between them",
            )
        return {}, err, None

    Pending(run, [held(pattern), v, held(z)], [z])
    return {}
