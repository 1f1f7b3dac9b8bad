"""`compare(..., tolerance="auto")`: each site's tolerance from how far the trace's dtype is from
float64 there, measured on copies of the model rerun in float64 (and in the engine's dtype
where it is coarser)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from torchlens._core.errors import LookupFailed
from torchlens._trace import Trace
from torchlens._tracing import trace as run_trace
from torchlens.mechinterp._lineup import engine_tensor

#: `tolerance="auto"`: a site's atol is this many times the trace's largest deviation from float64 there.
AUTO_FACTOR = 4.0


def _coarser(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    if not b.is_floating_point:
        return a
    if not a.is_floating_point:
        return b
    return a if torch.finfo(a).eps >= torch.finfo(b).eps else b


def _cast_inputs(inputs: Any, dtype: torch.dtype) -> tuple[tuple, dict]:
    def cast(x):
        return x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() else x

    if isinstance(inputs, Mapping):
        return (), {k: cast(v) for k, v in inputs.items()}
    if isinstance(inputs, tuple):
        return tuple(cast(x) for x in inputs), {}
    return (cast(inputs),), {}


def _rerun(model: nn.Module, inputs: Any, dtype: torch.dtype, sites: set[tuple[str, str]]) -> Trace:
    twin = copy.deepcopy(model).to(dtype)
    args, kwargs = _cast_inputs(inputs, dtype)
    with torch.no_grad():
        return run_trace(
            twin, *args, save=lambda address, facet: (address, facet) in sites, **kwargs
        )


def auto_tolerances(trace: Trace, resolved, model: nn.Module, inputs: Any) -> dict[str, tuple]:
    """name -> (atol, rtol, dtype name, "") from the deviation of the trace's dtype from float64 at
    each site, or (None, None, None, why) where a rerun has no tensor for the site."""
    wanted: dict[str, tuple[str, str, torch.dtype, torch.dtype]] = {}
    for name, value, res in resolved:
        if not res.readable or res.module_address is None or res.facet is None:
            continue
        ref = res.tensor
        engine, _, _ = engine_tensor(value)
        if ref is None or not ref.is_floating_point():
            continue
        wanted[name] = (res.module_address, res.facet, ref.dtype, _coarser(ref.dtype, engine.dtype))
    if not wanted:
        return {}
    sites = {(a, f) for a, f, _, _ in wanted.values()}
    runs = {torch.float64: _rerun(model, inputs, torch.float64, sites)}
    for _, _, ref_dtype, coarse in wanted.values():
        if coarse != ref_dtype and coarse not in runs:
            runs[coarse] = _rerun(model, inputs, coarse, sites)
    out: dict[str, tuple] = {}
    for name, (address, facet, ref_dtype, coarse) in wanted.items():
        try:
            exact = runs[torch.float64].modules[address].facets[facet].double()
            near = (
                (trace if coarse == ref_dtype else runs[coarse])
                .modules[address]
                .facets[facet]
                .double()
            )
        except LookupFailed as exc:
            out[name] = (
                None,
                None,
                None,
                f"tolerance='auto' unavailable here, atol/rtol used: the rerun has no "
                f"tensor at {address}:{facet} ({exc})",
            )
            continue
        if near.shape != exact.shape:
            continue
        d = (near - exact).abs()
        finite = (
            torch.isfinite(exact)
            & torch.isfinite(near)
            & (exact.abs() < torch.finfo(torch.float32).max / 4)
        )
        dev = float(d[finite].max()) if bool(finite.any()) else 0.0
        out[name] = (AUTO_FACTOR * dev, torch.finfo(coarse).eps, str(coarse)[6:], "")
    return out
