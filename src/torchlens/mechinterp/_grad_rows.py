"""`compare(..., of="grad")`'s rows: each engine gradient against the trace's gradient at the
name's site, in the nearest accepted layout; a failed row is explained by
`mechinterp._grad_diagnosis`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchlens._core.errors import LookupFailed
from torchlens._naming.resolver import resolve_alias
from torchlens._naming.results import AliasResolution
from torchlens._trace import Trace
from torchlens.mechinterp._comparison import Comparison, ComparisonReport
from torchlens.mechinterp._grad_diagnosis import diagnose_grad
from torchlens.mechinterp._lineup import closest, engine_tensor, layouts


def grad_rows(
    trace: Trace,
    engine_values: Mapping[str, Any],
    generation: str | None,
    atol: float,
    rtol: float,
    explain: bool,
) -> ComparisonReport:
    """`compare(..., of="grad")`: each engine gradient against `resolve_alias(...).grad`."""
    report = ComparisonReport()
    for name, value in engine_values.items():
        res = resolve_alias(trace, name, generation=generation)
        report.append(_grad_row(trace, name, value, res, generation, atol, rtol, explain))
    return report


def _grad_row(
    trace: Trace,
    name: str,
    value: Any,
    res: AliasResolution,
    generation: str | None,
    atol: float,
    rtol: float,
    explain: bool,
) -> Comparison:
    def row(passed, hint, engine_shape=(), ref_shape=None, layout="as is", err=None, why=("", ())):
        return Comparison(
            name,
            res.status,
            res.module_address,
            res.facet,
            engine_shape,
            ref_shape,
            layout,
            err,
            passed,
            hint,
            why[0],
            why[1],
            (atol, rtol),
        )

    if not res.readable:
        return row(False, f"no readable TorchLens site: {res.reason} {res.remedy}".strip())
    try:
        ref = res.grad.detach().cpu()
    except LookupFailed as exc:  # refused, not saved: the row says which
        return row(False, f"TorchLens has no gradient here: {exc}")
    if value is None:
        return row(
            False,
            "the engine's gradient is None: its hook held a tensor no gradient reached, such as a "
            "reshaped view the model never consumed (retain_grad() on it stays None), or a hook "
            "that never ran in the backward",
            ref_shape=tuple(ref.shape),
        )
    try:
        engine, _, tuple_hint = engine_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        return row(
            False,
            f"the engine's gradient is not a tensor ({type(value).__name__}: {exc}): compare takes a tensor, "
            "or a tuple or list whose element 0 is one, per name",
            ref_shape=tuple(ref.shape),
        )
    hints = [tuple_hint] if tuple_hint else []

    def why() -> tuple:
        if not explain:
            return "", ()
        return diagnose_grad(trace, engine, res, ref, generation or res.generation, atol, rtol)

    options = layouts(ref, engine.shape, res.facet or "")
    if not options:
        hints.append(
            f"shapes do not line up under any layout conversion (engine {list(engine.shape)}, "
            f"TorchLens {list(ref.shape)})"
        )
        return row(False, "; ".join(hints), tuple(engine.shape), tuple(ref.shape), why=why())
    label, err, t, d = closest(engine, options, "")
    passed = bool((d <= atol + rtol * t.float().abs()).all())
    return row(
        passed,
        "; ".join(hints),
        tuple(engine.shape),
        tuple(ref.shape),
        label,
        err,
        ("", ()) if passed else why(),
    )
