"""A decode step's sites against the full forward's, one `DecodeRow` each: the two tensors lined up
(the step's positions, and for scores and patterns the keys of dynamic, static and sliding-window
caches), their difference, and each site's tolerance from a float64 rerun."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from torchlens._core.errors import LookupFailed
from torchlens._core.facet_spec import BY_NAME
from torchlens._generation.decode_report import DecodeRow

if TYPE_CHECKING:
    from torchlens._trace import Trace

__all__ = ["AUTO_FACTOR", "align", "compare_sites", "diff"]

#: How far from the full forward a decode step may be, in units of the full forward's own distance
#: from float64 at the site: the factor `compare(tolerance="auto")` uses
#: (`mechinterp._auto_tolerance.AUTO_FACTOR`; a test keeps the two equal).
AUTO_FACTOR = 4
_MASKED = torch.finfo(torch.float32).min / 2


# -- lining a step's tensor up with the full forward's -------------------------------------------


def _axes(facet: str, dec: Tensor, ref: Tensor) -> tuple[int | None, int | None]:
    """(position axis, key axis) of a facet's tensor: from its row's axes, else (input, output,
    a module's own layout) axis 1 where the two differ only there."""
    spec = BY_NAME.get(facet)
    if spec is not None and spec.axes:
        pos = next((i for i, a in enumerate(spec.axes) if a in ("pos", "query")), None)
        key = next((i for i, a in enumerate(spec.axes) if a == "key"), None)
        return pos, key
    if dec.shape == ref.shape or dec.dim() != ref.dim() or dec.dim() < 2:
        return None, None
    same = all(a == b for i, (a, b) in enumerate(zip(dec.shape, ref.shape)) if i != 1)
    return (1, None) if same and dec.shape[1] <= ref.shape[1] else (None, None)


def diff(step: Tensor, full: Tensor, facet: str) -> Tensor:
    """|step - full| in float64, a masked score equal to a masked score whatever its fill."""
    e, r = step.double(), full.double()
    if facet == "scores":
        em, rm = e <= _MASKED, r <= _MASKED
        d = torch.where(em & rm, torch.zeros_like(e), (e - r).abs())
        d = torch.where(em == rm, d, torch.full_like(d, float("inf")))
        return d.nan_to_num(nan=float("inf"), posinf=float("inf"))
    return (e - r).abs().nan_to_num(nan=float("inf"), posinf=float("inf"))


def align(facet: str, dec: Tensor, ref: Tensor, new: int) -> tuple[Tensor, Tensor, str] | None:
    """The step's tensor and the full forward's, lined up element by element, and how; None when
    the shapes cannot be lined up.

    The full forward's positions are narrowed to the step's (its last ones). On the key axis of
    scores and patterns, the step's keys are the prefix's positions: all of them, the first ones
    (a static cache's buffer, longer than the prefix: its extra slots are compared against 0 for a
    pattern), or the last ones (a sliding-window cache: the prefix's older positions are compared
    against 0 for a pattern, and left out for scores, which the cache never computed). A step
    with fewer keys than the prefix is also lined up with the first ones (its own positions
    missing), whichever of the two is closer.
    """
    lined = _align_axes(facet, dec, ref, new)
    if lined is None and dec.dim() == ref.dim() and dec.shape != ref.shape:
        # another layout than the facet row's (T5's relative-position bias is [query, key]): the one
        # axis where the step is shorter holds the positions, the step's the last ones
        differ = [i for i in range(dec.dim()) if dec.shape[i] != ref.shape[i]]
        if len(differ) == 1 and dec.shape[differ[0]] < ref.shape[differ[0]]:
            i, n = differ[0], dec.shape[differ[0]]
            return dec, ref.narrow(i, ref.shape[i] - n, n), f"last {n} positions along axis {i}"
    return lined


def _align_axes(
    facet: str, dec: Tensor, ref: Tensor, new: int
) -> tuple[Tensor, Tensor, str] | None:
    pos, key = _axes(facet, dec, ref)
    if pos is None:
        return (dec, ref, "as is") if dec.shape == ref.shape else None
    n = dec.shape[pos]
    if n > ref.shape[pos]:
        return None
    ref = ref.narrow(pos, ref.shape[pos] - n, n)
    layout = f"last {n} positions"
    if key is None:
        return (dec, ref, layout) if dec.shape == ref.shape else None
    kd, kr = dec.shape[key], ref.shape[key]
    others = [i for i in range(dec.dim()) if i != key]
    if any(dec.shape[i] != ref.shape[i] for i in others):
        return None
    if kd == kr:
        return dec, ref, layout + f"; keys: the {kr} positions"
    if kd > kr:  # a static cache's buffer: slots past the prefix
        if facet == "pattern":
            pad = ref.new_zeros(ref.shape[:key] + (kd - kr,) + ref.shape[key + 1 :])
            return (
                dec,
                torch.cat([ref, pad], dim=key),
                layout + f"; keys: {kr} positions, then {kd - kr} empty slots (weight 0)",
            )
        return dec.narrow(key, 0, kr), ref, layout + f"; keys: the first {kr} of {kd} slots"
    # fewer keys than positions: a window's last ones, or (a cache read before its update) the first ones
    options = []
    for where, start in (("last", kr - kd), ("first", 0)):
        if facet == "pattern":
            full = dec.new_zeros(dec.shape[:key] + (kr,) + dec.shape[key + 1 :])
            full.narrow(key, start, kd).copy_(dec)
            pair = (full, ref)
        else:
            pair = (dec, ref.narrow(key, start, kd))
        err = diff(pair[0], pair[1], facet)
        options.append((float(err.max()) if err.numel() else 0.0, where, pair))
    options.sort(key=lambda o: o[0])
    _, where, (a, b) = options[0]
    return a, b, layout + f"; keys: the {where} {kd} of {kr} positions"


# -- tolerance ---------------------------------------------------------------------------------


def _tolerance(
    facet: str,
    full: Tensor,
    full64: Tensor | None,
    atol: float | None,
    rtol: float | None,
    auto: bool,
) -> tuple[float, float, str]:
    if not auto or full64 is None or not full.is_floating_point():
        return (1e-5 if atol is None else atol), (1e-4 if rtol is None else rtol), ""
    d = diff(full, full64, facet)
    finite = (
        torch.isfinite(d)
        & torch.isfinite(full64)
        & (full64.abs() < torch.finfo(torch.float32).max / 4)
    )
    dev = float(d[finite].max()) if bool(finite.any()) else 0.0
    return AUTO_FACTOR * dev, AUTO_FACTOR * torch.finfo(full.dtype).eps, ""


# -- comparing -------------------------------------------------------------------------------


def _site_name(call, facet: str) -> str:
    return f"{call.address or '<root>'}:{facet}" + (f" (call {call.index})" if call.index else "")


def _unmatched(
    step: int, name: str, call: Any, facet: str, dec: Tensor, ref_shape: tuple | None, why: str
) -> DecodeRow:
    """The failed row of a site the full forward cannot be compared at, with why."""
    return DecodeRow(
        step,
        name,
        call.address,
        call.index,
        facet,
        tuple(dec.shape),
        ref_shape,
        "",
        None,
        False,
        None,
        why,
    )


def compare_sites(
    step: int,
    step_trace: Trace,
    full: Trace,
    full64: Trace | None,
    sites,
    new: int,
    atol: float | None,
    rtol: float | None,
    auto: bool,
    tolerances: dict | None,
) -> list[DecodeRow]:
    rows = []
    for call, facet in sites:
        name = _site_name(call, facet)
        try:
            dec = step_trace.modules[call.address].calls[call.index].facets[facet]
        except LookupFailed:  # a pending check refused it on this read: the step does not serve it
            continue
        dec = dec.detach().cpu()
        try:
            ref = full.modules[call.address].calls[call.index].facets[facet].detach().cpu()
        except (LookupFailed, IndexError) as exc:
            rows.append(
                _unmatched(
                    step,
                    name,
                    call,
                    facet,
                    dec,
                    None,
                    f"the full forward has no tensor here ({exc})",
                )
            )
            continue
        lined = align(facet, dec, ref, new)
        if lined is None:
            why = f"the shapes do not line up (step {list(dec.shape)}, full forward {list(ref.shape)})"
            rows.append(_unmatched(step, name, call, facet, dec, tuple(ref.shape), why))
            continue
        a, b, layout = lined
        key = (call.address, call.index, facet)
        if tolerances is not None and key in tolerances:
            at, rt, hint = tolerances[key]
        else:
            b64 = None
            if full64 is not None:
                try:
                    r64 = (
                        full64.modules[call.address].calls[call.index].facets[facet].detach().cpu()
                    )
                    l64 = align(facet, dec, r64, new)
                    b64 = l64[1] if l64 is not None else None
                except (LookupFailed, IndexError):
                    b64 = None
            at, rt, hint = _tolerance(facet, b, b64, atol, rtol, auto)
            if tolerances is not None:
                tolerances[key] = (at, rt, hint)
        d = diff(a, b, facet)
        scale = b.double().abs().nan_to_num(posinf=0.0, neginf=0.0)
        if facet == "scores":
            scale = torch.where(b.double() <= _MASKED, torch.zeros_like(scale), scale)
        passed = (
            bool((d <= at + rt * scale).all()) if a.is_floating_point() else bool(torch.equal(a, b))
        )
        err = float(d.max()) if d.numel() else 0.0
        rows.append(
            DecodeRow(
                step,
                name,
                call.address,
                call.index,
                facet,
                tuple(dec.shape),
                tuple(ref.shape),
                layout,
                err,
                passed,
                (at, rt),
                hint,
            )
        )
    return rows
