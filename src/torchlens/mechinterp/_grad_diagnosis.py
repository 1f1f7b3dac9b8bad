"""What an engine's gradient is, when it is not d loss / d the tensor its name reads.

`compare(..., of="grad")` calls `diagnose_grad` for a row that fails. The search runs over the
trace's own gradients (`trace.modules[address].calls[i].grads`), in the classes peers have shipped
(each candidate says which):

1. all zeros: the hook held a tensor the model never consumed (a reshaped view), so no gradient
   reached it (TransformerLens PR #1750: `retain_grad()` on such a view stays `None` or zero);
2. a constant multiple of the right gradient: the loss reduced another way (a mean over `N`
   elements instead of a sum gives `1/N`);
3. the right gradient summed over the heads axis (one gradient for all heads);
4. the gradient of another site: the same module's other facets (before instead of after a norm:
   the norm's input for its output), the same facet at the neighbouring layer, any other site;
5. a residual site's gradient without the residual path: `d/d resid_pre - d/d resid_mid`, only
   what flows through the sublayer; also at a site that reads the same tensor under another
   module's name (a norm's input is the block's `resid_mid`), as a hook on a copy that only the
   norm consumes gives it (the TransformerLens 4.x bridge's backward hook at `ln2.hook_in`);
6. a norm's `normalized` gradient with its mean over the features removed: the engine folded the
   norm's weights into the layers that read it and centered them (TransformerLens's `fold_ln`
   does), which leaves the forward unchanged (the normalized vector has mean zero) but drops the
   gradient's component along the all-ones direction.

Candidates are ranked by relative error; an exact match on another named site outranks a scale
fit (a factor of 1 is no scale).
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor

from torchlens._core.facet_spec import BY_NAME
from torchlens._naming.diagnose import Candidate
from torchlens._naming.layouts import fitting
from torchlens._naming.results import AliasResolution
from torchlens._trace import Trace
from torchlens.mechinterp._translate import names_by_site

__all__ = ["diagnose_grad"]


def _named(trace: Trace, generation: str | None) -> dict[tuple, str]:
    """(module, call, facet) -> the generation's name for it, for the explanation."""
    if generation is None:
        return {}
    return {
        (address, call or 0, facet): rs[0].query
        for (address, call, facet), rs in names_by_site(trace, generation).items()
    }


def _grads(trace: Trace) -> Iterator[tuple[str, int, str, Tensor]]:
    """Every gradient the trace serves: (module, call, facet, tensor)."""
    for address, rec in trace.modules.items():
        for i, call in enumerate(rec.calls):
            grads = call.grads
            if grads is None:
                continue
            for facet in list(grads.sites):
                try:
                    g = grads[facet]
                except Exception:  # refused when read: no candidate
                    continue
                if isinstance(g, Tensor) and g.is_floating_point():
                    yield address, i, facet, g.detach().cpu()


def _fits(engine: Tensor, ref: Tensor, facet: str | None) -> Iterator[Tensor]:
    """`ref` in each accepted layout with the engine's shape."""
    for _, t in fitting(ref, tuple(engine.shape), facet):
        yield t


def _rel(e: Tensor, c: Tensor) -> tuple[float, float]:
    d = (e.double() - c.double()).abs()
    norm = float(e.double().norm()) or 1.0
    return float(d.norm()) / norm, float(d.max()) if d.numel() else 0.0


def _close(e: Tensor, c: Tensor, atol: float, rtol: float) -> bool:
    return bool(((e.double() - c.double()).abs() <= atol + rtol * c.double().abs()).all())


def _same(x: Tensor, y: Tensor) -> bool:
    """Whether two gradients are the same values (one tensor read under two names)."""
    return x.shape == y.shape and bool((x == y).all())


def _against(
    e: Tensor,
    t: Tensor,
    site: str,
    relation: str,
    atol: float,
    rtol: float,
    factor: float | None = None,
    address: str | None = None,
    facet: str | None = None,
) -> Candidate:
    """The candidate `t` (already transformed) for the engine's gradient `e`."""
    err, worst = _rel(e, t)
    return Candidate(site, relation, err, worst, _close(e, t, atol, rtol), factor, address, facet)


def _reduction(factor: float) -> str:
    inverse = 1.0 / factor if factor else float("inf")
    k = round(inverse)
    if k > 1 and abs(inverse - k) <= 1e-3 * k:
        return f"1/{k} of it: a loss reduced by a mean over {k} elements instead of a sum"
    return f"{factor:.4g} times it: a loss scaled differently"


def diagnose_grad(
    trace: Trace,
    engine: Tensor,
    res: AliasResolution,
    ref: Tensor | None,
    generation: str | None,
    atol: float,
    rtol: float,
) -> tuple[str, tuple[Candidate, ...]]:
    """The explanation and the ranked candidates for an engine gradient that is not `ref`.

    Args:
        trace: a trace taken with `grads=`.
        engine: the engine's gradient at the name.
        res: the name's resolution on `trace`.
        ref: the trace's gradient at that site (None where it has none).
        generation: the generation whose names the explanation uses.
        atol: the row's absolute tolerance.
        rtol: the row's relative tolerance.
    """
    e = engine.detach().cpu()
    names = _named(trace, generation)
    here = (res.module_address, res.call or 0, res.facet)

    def label(key: tuple) -> str:
        return names.get(key) or f"{key[0] or '<root>'}:{key[2]}"

    found: list[Candidate] = []
    if e.numel() and not bool(e.any()) and (ref is None or bool(ref.any())):
        found.append(
            Candidate(
                "all zeros",
                "no gradient reached the engine's tensor: its hook held a tensor the model never "
                "consumed (a reshaped view of the site), so no gradient flows into it",
                0.0,
                0.0,
                True,
            )
        )
    if ref is not None:
        for t in _fits(e, ref, res.facet):
            denom = float((t.double() * t.double()).sum())
            if denom == 0.0:
                continue
            factor = float((e.double() * t.double()).sum()) / denom
            if abs(factor - 1.0) < 1e-6 or abs(factor) < 1e-12:  # no scale, or no tensor at all
                continue
            found.append(
                _against(
                    e,
                    factor * t,
                    label(here),
                    _reduction(factor),
                    atol,
                    rtol * abs(factor),
                    factor,
                    res.module_address,
                    res.facet,
                )
            )
        if res.facet == "normalized" and ref.dim() and ref.shape[-1] > 1:
            centered = ref - ref.double().mean(-1, keepdim=True).to(ref.dtype)
            found += [
                _against(
                    e,
                    t,
                    label(here),
                    "with its mean over the features removed: the engine folded the norm's "
                    "weights into the layers that read it and centered them (as TransformerLens's "
                    "fold_ln does), so no change along the all-ones direction reaches the loss; "
                    "the two agree on every change that keeps the normalized vector's mean zero",
                    atol,
                    rtol,
                    address=res.module_address,
                    facet=res.facet,
                )
                for t in _fits(e, centered, res.facet)
            ]
        spec = BY_NAME.get(res.facet or "")
        if spec is not None and spec.heads_axis is not None and ref.dim() > spec.heads_axis:
            summed = ref.sum(spec.heads_axis)
            found += [
                _against(
                    e,
                    t,
                    label(here),
                    "summed over the heads: one gradient for all heads instead of one per head",
                    atol,
                    rtol,
                    address=res.module_address,
                    facet=res.facet,
                )
                for t in _fits(e, summed, None)
            ]
    everything = list(_grads(trace))
    by_key: dict[tuple, Tensor] = {(a, i, f): g for a, i, f, g in everything}
    for address, i, facet, g in everything:
        key = (address, i, facet)
        if key == here:
            continue
        relation = (
            f"the gradient of this module's {facet} instead of its {res.facet}"
            if address == res.module_address
            else ""
        )
        for t in _fits(e, g, facet):
            found.append(_against(e, t, label(key), relation, atol, rtol, None, address, facet))
            break
    for (address, i, facet), a in by_key.items():
        downstream = {"resid_pre": "resid_mid", "resid_mid": "resid_post"}.get(facet)
        b = by_key.get((address, i, downstream)) if downstream else None
        if b is None or a.shape != b.shape:
            continue
        # the site itself, or its tensor under another module's name (a norm's input is the
        # block's resid_mid: a hook on a copy only the norm consumes misses the residual path)
        if (address, i, facet) != here and (ref is None or not _same(ref, a)):
            continue
        site = f"{label((address, i, facet))} - {label((address, i, downstream))}"
        found += [
            _against(
                e,
                t,
                site,
                "the gradient without the residual path: only what flows through the sublayer",
                atol,
                rtol,
                address=address,
                facet=facet,
            )
            for t in _fits(e, a - b, facet)
        ]
    # An exact match on another named site outranks a fit, a site the generation names one it
    # does not (one tensor can be two sites: the last block's output is the final norm's input);
    # then by error.
    named = set(names.values())
    found.sort(
        key=lambda c: (
            not c.matches,
            c.factor is not None,
            c.site.split(" - ")[0] not in named,
            c.error,
        )
    )
    best = found[0] if found and found[0].matches else None
    if best is None:
        return "no gradient of the trace explains it", tuple(found[:8])
    if best.site == "all zeros":
        return f"all zeros: {best.relation}", tuple(found[:8])
    if best.factor is not None or best.site == label(here):  # this site's gradient, transformed
        return f"the gradient at {best.site}, {best.relation}", tuple(found[:8])
    what = f": {best.relation}" if best.relation else ""
    return f"equals the gradient at {best.site}{what}", tuple(found[:8])
