"""`compare`: check tensors read from another engine against a TorchLens trace, name by name."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from torch import Tensor, nn

from torchlens._core import html
from torchlens._core.errors import LookupFailed, TorchLensError
from torchlens._core.facet_spec import KERNEL_REBUILT
from torchlens._naming.diagnose import Candidate, diagnose
from torchlens._naming.layouts import fitting
from torchlens._naming.resolver import resolve_alias
from torchlens._naming.results import AliasResolution
from torchlens._trace import Trace
from torchlens._tracing import trace as run_trace
from torchlens.mechinterp._grad_diagnosis import diagnose_grad

__all__ = [
    "compare",
    "Comparison",
    "ComparisonReport",
    "Candidate",
    "ToleranceError",
    "CompareSpecError",
    "AUTO_FACTOR",
]

#: `tolerance="auto"`: a site's atol is this many times the trace's largest deviation from float64 there.
AUTO_FACTOR = 4.0


class CompareSpecError(TorchLensError, ValueError):
    """`compare`'s `of=` is not `"value"` or `"grad"`, or `of="grad"` cannot be served: the trace
    was taken without `grads=`, or `tolerance="auto"` was asked with it."""


class ToleranceError(TorchLensError, ValueError):
    """`tolerance=` is not accepted, or `"auto"` lacks the model and inputs it reruns."""


@dataclass(frozen=True)
class Comparison:
    """One name's comparison.

    Attributes:
        name: the name as given.
        status: the name's resolution status, one of `torchlens.mechinterp.STATUSES` (`refused`
            when TorchLens found the site but does not serve it because its check failed; an
            `editable=True` row on a read-only site keeps `reconstructed_read_only` and fails,
            its hint saying why).
        module_address: the module of the TorchLens site (None when there is none).
        facet: the facet of the TorchLens site (None when there is none).
        engine_shape: the shape of the tensor as handed in.
        reference_shape: the shape of the tensor as TorchLens holds it.
        layout: the conversion applied to the TorchLens tensor to match the engine's layout.
        max_abs_error: the largest absolute difference after conversion (None if not compared).
        passed: whether the two agree within tolerance.
        hint: what to look at when they do not agree.
        explanation: for a failed row, what the engine's tensor equals in the trace, in one line
            and in the generation's own names (`"equals blocks.0.hook_resid_mid: the residual is
            included"`), or that it matches nothing, with the nearest candidates; `""` for a row
            that passed.
        candidates: the ranked [`Candidate`][torchlens.mechinterp.Candidate]s behind the
            explanation (site or op, relation, relative error); empty for a row that passed.
        tolerance: the `(atol, rtol)` the row was checked with (per site under
            `tolerance="auto"`).
    """

    name: str
    status: str
    module_address: str | None
    facet: str | None
    engine_shape: tuple[int, ...] | None
    reference_shape: tuple[int, ...] | None
    layout: str
    max_abs_error: float | None
    passed: bool
    hint: str = ""
    explanation: str = ""
    candidates: tuple[Candidate, ...] = ()
    tolerance: tuple[float, float] | None = None


class ComparisonReport(list):
    """The list `compare` returns; prints as a table."""

    @property
    def ok(self) -> bool:
        """True when every name was compared and agreed."""
        return all(c.passed for c in self)

    @property
    def mismatched(self) -> list[str]:
        """The names that did not pass (including names without a readable site)."""
        return [c.name for c in self if not c.passed]

    def __repr__(self) -> str:
        if not self:
            return "ComparisonReport([])"
        w = max(len(c.name) for c in self)
        s = max(len(c.status) for c in self)
        lines = [f"{'name'.ljust(w)}  ok   {'max |diff|':>10}  {'status'.ljust(s)}  site / hint"]
        for c in self:
            tail = _site(c) + (f" [{c.layout}]" if c.layout != "as is" else "")
            if c.hint:
                tail += f"  ({c.hint})"
            if c.explanation:
                tail += f"  => {c.explanation}"
            ok = "yes" if c.passed else "NO "
            lines.append(f"{c.name.ljust(w)}  {ok}  {_err(c):>10}  {c.status.ljust(s)}  {tail}")
        lines.append(f"({_summary(self)})")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = [
            [
                html.code(c.name),
                '<span style="color:#2e7d32">yes</span>'
                if c.passed
                else '<span style="color:#c62828">no</span>',
                html.esc(_err(c)) if c.max_abs_error is not None else "",
                html.esc(c.status),
                html.nowrap(html.code(_site(c)))
                + (f" <small>[{html.esc(c.layout)}]</small>" if c.layout != "as is" else ""),
                (f"<b>{html.esc(c.explanation)}</b><br/>" if c.explanation else "")
                + html.esc(c.hint),
            ]
            for c in self
        ]
        return html.table(
            ["name", "ok", "max |diff|", "status", "site", "hint"],
            rows,
            note=_summary(self) if self else "",
        )


def _site(c: Comparison) -> str:
    if c.module_address is None or c.facet is None or c.status == "structurally_absent":
        return "-"
    return f"{c.module_address or '<root>'}:{c.facet}"


def _err(c: Comparison) -> str:
    return "-" if c.max_abs_error is None else f"{c.max_abs_error:.3g}"


def _summary(report: ComparisonReport) -> str:
    failed = sum(not c.passed for c in report)
    return f"{len(report)} compared: {len(report) - failed} agree, {failed} do not"


def _layouts(
    ref: Tensor, engine_shape: tuple[int, ...], facet: str, broadcasts: bool = True
) -> list[tuple[str, Tensor]]:
    """The TorchLens tensor in each layout `compare` accepts (`_naming.layouts`) that gives the engine's shape."""
    return fitting(ref, tuple(engine_shape), facet, broadcasts=broadcasts)


def _closest(
    engine: Tensor, options: list[tuple[str, Tensor]], facet: str
) -> tuple[str, float, Tensor, Tensor]:
    """Of the layouts `options` (not empty), the one nearest the engine's tensor: its label, the
    largest difference, the converted tensor and the elementwise differences."""
    best: tuple[str, float, Tensor, Tensor] | None = None
    for label, t in options:
        err, d = _diff(engine, t, facet)
        if best is None or err < best[1]:
            best = (label, err, t, d)
    assert best is not None  # options is not empty
    return best


def _diff(engine: Tensor, ref: Tensor, facet: str) -> tuple[float, Tensor]:
    e, r = engine.float(), ref.float()
    if facet == "scores":  # a masked entry is masked whichever fill each side uses
        floor = torch.finfo(torch.float32).min / 2
        e_masked, r_masked = e <= floor, r <= floor
        same_mask = e_masked == r_masked
        d = torch.where(e_masked & r_masked, torch.zeros_like(e), (e - r).abs())
        d = torch.where(same_mask, d, torch.full_like(d, float("inf")))
    else:
        d = (e - r).abs()
    d = d.nan_to_num(nan=float("inf"))
    return (float(d.max()) if d.numel() else 0.0), d


def compare(
    trace: Trace,
    engine_values: Mapping[str, Any],
    generation: str | None = None,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    editable: bool = False,
    tolerance: str | None = None,
    model: nn.Module | None = None,
    inputs: Tensor | tuple | Mapping[str, Any] | None = None,
    explain: bool = True,
    of: str = "value",
) -> ComparisonReport:
    """Compare tensors read from another engine with the trace's tensors at the same names.

    With `of="grad"` the engine's tensors are gradients (what its backward hooks, or `.grad`
    after `retain_grad()`, gave), compared with the trace's d loss / d each site
    (`resolve_alias(trace, name).grad`; the trace must be taken with `grads=` and the same loss).
    A `None` gradient fails its row and says why an engine gets one; a failed row's explanation
    searches the trace's gradients (`mechinterp._grad_diagnosis`): all zeros, a constant multiple
    (a loss's mean instead of its sum), summed over heads, another site's gradient, a residual
    site's gradient without the residual path.

    Each name is resolved with [`resolve_alias`][torchlens.mechinterp.resolve_alias]. The
    TorchLens tensor is converted to the engine's layout when the shapes say how: a batch axis of
    1 dropped, heads flattened into the width, z moved from head-major to token-major, k/v
    repeated from kv heads to query heads. Both sides are compared in float32; a masked attention
    score counts as equal whether its fill is `-inf` or the dtype minimum.

    A row that fails is explained: the trace is searched for what the engine's tensor equals
    (every saved facet and op output under layout conversions, the neighbouring layers, the site
    before or after its norm or RoPE, with or without the residual, a scalar multiple, the sum of
    two sites, a rounding to bfloat16/float16, the other elements of a tuple the engine handed),
    and `Comparison.explanation` names the best match in the generation's own names.

    `tolerance="auto"` sets each site's tolerance from float64. A deep copy of `model` (never
    `model` itself) is run once in float64 on `inputs`, and, when an engine tensor is in a coarser
    dtype than the trace at a site (a bfloat16 engine against a float32 trace), once more in that
    dtype. Let `d` be the coarser of the two dtypes, `R_d` the site's tensor computed in `d` (the
    trace's own when `d` is the trace's dtype), `R64` the float64 one, `R` the trace's tensor and
    `eps` the machine epsilon of `d`. A row passes when, element by element,
    `|engine - R| <= AUTO_FACTOR * max|R_d - R64| + eps * |R|` (`AUTO_FACTOR` is 4): the engine
    may be up to four times as far from the trace as computing in `d` is from exact. Sites without
    a floating-point tensor (token ids), and sites a rerun does not serve (a derived facet whose
    check fails there), keep `atol`/`rtol`; the row's hint says so.

    Limits: the reruns must compute what the trace computed, so the model must be deterministic
    (eval mode, no sampling) and `inputs` must be the traced inputs. Ops a model runs in float32
    whatever its dtype (Gemma's RMSNorm casts to float32) stay float32 in the "float64" run, so
    the bound there is float32's. A kernel much less accurate than the model's own ops in the same
    dtype (an approximate fused kernel) can exceed the bound although its hook is right, and a
    wrong hook whose tensor differs from the right one by less than the dtype's noise (a residual
    of near-zero norm) passes.

    Args:
        trace: the reference [`Trace`][torchlens.Trace].
        engine_values: `{name: tensor}` as read from the engine (a tuple is taken at element 0,
            and the row says so).
        generation: resolve names in this generation only (default: any); explanations name
            sites in this generation (default: the generation each name was found in).
        atol: absolute tolerance, as in `torch.allclose`; loosen it for bf16/fp16 engines.
        rtol: relative tolerance, as in `torch.allclose`.
        editable: the engine's hooks will *write* these sites. A site TorchLens only
            reconstructed (read-only) is then refused instead of compared.
        tolerance: None (use `atol`/`rtol`) or `"auto"` (per site, from a float64 rerun; needs
            `model` and `inputs`; `atol`/`rtol` are then unused).
        model: the model the trace was taken of, for `tolerance="auto"`. It is deep-copied;
            the copy is cast and run, `model` is not touched.
        inputs: what the trace ran the model on, for `tolerance="auto"`: a tensor, a tuple of
            positional arguments, or a dict of keyword arguments.
        explain: search the trace to explain each failed row (default True). The search keeps a
            float32 copy of the trace's tensors of each shape it looks at, for as long as the
            trace lives; pass False to skip it.
        of: `"value"` (default): the engine's tensors are activations; `"grad"`: they are
            gradients of the loss the trace's `grads=` took.

    Returns:
        A [`ComparisonReport`][torchlens.mechinterp.ComparisonReport]: one row per name, in order;
        `.ok` and `.mismatched` summarize it. A name without a readable site is a failed row with
        the reason, never dropped.

    Raises:
        AliasError: a name is not in any table (or breaks its grammar).
        ToleranceError: `tolerance` is not None or `"auto"`, or `"auto"` lacks `model`/`inputs`.
        CompareSpecError: `of` is not `"value"` or `"grad"`; `of="grad"` on a trace taken without
            `grads=`, or with `tolerance="auto"`.
    """
    if of not in ("value", "grad"):
        raise CompareSpecError(
            f"of={of!r} is not accepted: pass 'value' (the engine's tensors are activations) or "
            "'grad' (they are gradients of the loss the trace's grads= took)."
        )
    if of == "grad":
        if tolerance is not None:
            raise CompareSpecError(
                "tolerance='auto' reruns the forward in float64 and has no gradient counterpart: "
                "with of='grad' pass atol/rtol."
            )
        if all(call.grads is None for rec in trace.modules.values() for call in rec.calls):
            raise CompareSpecError(
                "of='grad' compares with the trace's gradients, and this trace was taken without "
                "grads=: trace the model with tl.trace(model, *inputs, grads=loss_fn), loss_fn the "
                "same loss the engine's backward used."
            )
        return _compare_grads(trace, engine_values, generation, atol, rtol, explain)
    if tolerance not in (None, "auto"):
        raise ToleranceError(
            f"tolerance={tolerance!r} is not accepted: pass None (use atol/rtol) or 'auto' "
            "(per-site tolerances from a float64 rerun of a copy of model=)."
        )
    if tolerance == "auto" and (not isinstance(model, nn.Module) or inputs is None):
        raise ToleranceError(
            "tolerance='auto' reruns the model in float64: pass model= (the traced module; "
            "a deep copy is run) and inputs= (a tensor, a tuple of positional arguments or a "
            "dict of keyword arguments)."
        )
    report = ComparisonReport()
    resolved = [
        (name, value, resolve_alias(trace, name, generation=generation))
        for name, value in engine_values.items()
    ]
    tolerances = (
        _auto_tolerances(trace, resolved, model, inputs)
        if tolerance == "auto" and isinstance(model, nn.Module)
        else {}
    )
    for name, value, res in resolved:
        tol = tolerances.get(name, (atol, rtol, None, ""))
        if (
            tol[0] is None
        ):  # no float64 value at this site: the given atol/rtol, and the row says why
            tol = (atol, rtol, None, tol[3])
        report.append(_compare_one(trace, name, value, res, tol, editable, generation, explain))
    return report


def _compare_grads(
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
        report.append(_compare_grad(trace, name, value, res, generation, atol, rtol, explain))
    return report


def _compare_grad(
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
    engine, _, tuple_hint = _engine_tensor(value)
    hints = [tuple_hint] if tuple_hint else []

    def why() -> tuple:
        if not explain:
            return "", ()
        return diagnose_grad(trace, engine, res, ref, generation or res.generation, atol, rtol)

    options = _layouts(ref, engine.shape, res.facet or "")
    if not options:
        hints.append(
            f"shapes do not line up under any layout conversion (engine {list(engine.shape)}, "
            f"TorchLens {list(ref.shape)})"
        )
        return row(False, "; ".join(hints), tuple(engine.shape), tuple(ref.shape), why=why())
    label, err, t, d = _closest(engine, options, "")
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


def _engine_tensor(value: Any) -> tuple[Tensor, tuple, str]:
    """(element 0 as a CPU tensor, the other elements, hint) for what the engine handed."""
    rest: tuple = ()
    hint = ""
    if isinstance(value, (tuple, list)):
        hint = f"engine value is a {type(value).__name__} of {len(value)}: compared element 0"
        value, rest = value[0], tuple(value[1:])
    if not isinstance(value, Tensor):
        value = getattr(value, "value", value)  # proxies that wrap a saved value
    engine = torch.as_tensor(value) if not isinstance(value, Tensor) else value
    return engine.detach().cpu(), tuple(getattr(r, "value", r) for r in rest), hint


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


def _auto_tolerances(trace: Trace, resolved, model: nn.Module, inputs: Any) -> dict[str, tuple]:
    """name -> (atol, rtol, dtype name, "") from the deviation of the trace's dtype from float64 at
    each site, or (None, None, None, why) where a rerun has no tensor for the site."""
    wanted: dict[str, tuple[str, str, torch.dtype, torch.dtype]] = {}
    for name, value, res in resolved:
        if not res.readable or res.module_address is None or res.facet is None:
            continue
        ref = res.tensor
        engine, _, _ = _engine_tensor(value)
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


def _compare_one(
    trace, name, value, res: AliasResolution, tol, editable, generation, explain
) -> Comparison:
    atol, rtol, auto_dtype, auto_note = tol
    hints = [auto_note] if auto_note else []
    engine, rest, tuple_hint = _engine_tensor(value)
    if tuple_hint:
        hints.append(tuple_hint)

    def row(status, passed, hint, ref_shape=None, layout="as is", err=None):
        explanation, candidates = "", cast(tuple, ())
        if not passed and explain and engine.is_floating_point() and engine.numel() > 1:
            try:
                explanation, candidates = diagnose(
                    trace,
                    engine,
                    res.module_address if res.readable else None,
                    res.facet if res.readable else None,
                    generation or res.generation,
                    atol,
                    rtol,
                    rest,
                )
            except Exception as exc:  # the row's verdict stands; say why it has no explanation
                explanation = f"no explanation: the search failed ({type(exc).__name__}: {exc})"
        return Comparison(
            name,
            status,
            res.module_address,
            res.facet,
            tuple(engine.shape),
            ref_shape,
            layout,
            err,
            passed,
            "; ".join(hints + ([hint] if hint else [])),
            explanation,
            candidates,
            (atol, rtol),
        )

    if not res.readable:
        return row(
            res.status, False, f"no readable TorchLens site: {res.reason} {res.remedy}".strip()
        )
    if editable and res.status == "reconstructed_read_only":
        return row(
            res.status,
            False,
            "not compared: editable=True, and TorchLens only reconstructs this site "
            "(read-only): an engine writing it "
            "edits a tensor the eager model never materializes; trace with attn_implementation='eager'",
        )
    assert res.tensor is not None and res.facet is not None  # a readable resolution has both
    ref = res.tensor.detach().cpu()
    if engine.dtype != ref.dtype:
        hints.append(
            f"dtypes differ (engine {str(engine.dtype)[6:]}, TorchLens {str(ref.dtype)[6:]})"
        )
    options = _layouts(ref, engine.shape, res.facet)
    if not options:
        return row(
            res.status,
            False,
            f"shapes do not line up under any layout conversion "
            f"(engine {list(engine.shape)}, TorchLens {list(ref.shape)})",
            tuple(ref.shape),
        )
    label, err, t, d = _closest(engine, options, res.facet)
    scale = t.float().abs().nan_to_num(posinf=0.0, neginf=0.0)
    passed = bool((d <= atol + rtol * scale).all())
    hint = ""
    if not passed:
        hint = _mismatch_hint(trace, res, d, atol, rtol, scale, engine, t)
        if (
            auto_dtype is not None
        ):  # the precision is accounted for: keep only a hint about something else
            note = f"tolerance='auto' at {auto_dtype} precision: atol {atol:.2g}, rtol {rtol:.2g}"
            hint = note if hint.startswith("half-precision") else f"{note}; {hint}"
    return row(res.status, passed, hint, tuple(ref.shape), label, err)


def _equals_facet(trace, res: AliasResolution, facet: str, engine: Tensor, atol, rtol) -> bool:
    """Whether the engine tensor equals another facet of the same module (in some layout)."""
    try:
        # AliasResolution.tensor reads the call the alias names (a block object run for several layers)
        other = replace(res, facet=facet, trace=trace).tensor
    except Exception:  # the module has no such facet, or it was not kept
        return False
    if not isinstance(other, Tensor):
        return False
    other = other.detach().cpu()
    for _, t in _layouts(other, engine.shape, facet, broadcasts=False):
        err, d = _diff(engine, t, facet)
        if bool((d <= atol + rtol * t.float().abs().nan_to_num(posinf=0.0, neginf=0.0)).all()):
            return True
    return False


def _mismatch_hint(
    trace, res: AliasResolution, d: Tensor, atol, rtol, scale, engine: Tensor, ref: Tensor
) -> str:
    bad = d > atol + rtol * scale
    if res.facet == "normalized" and _equals_facet(trace, res, "output", engine, atol, rtol):
        return (
            "the engine's tensor is this norm's output, after the gain and bias: TransformerLens 2.x hooks "
            "hook_normalized there on an unfolded LayerNorm (fold_ln=False); TorchLens's normalized is the "
            "tensor before the gain, which a folded model (fold_ln=True) hooks"
        )
    if res.status == "reconstructed_read_only":
        if res.facet in KERNEL_REBUILT:
            return "TorchLens rebuilt this site from a fused kernel's inputs; compare an eager-attention copy to be sure"
        return (
            "TorchLens computed this site from recorded tensors; check the engine's convention for it"
            + (f" ({res.note})" if res.note else "")
        )
    if engine.dtype in (torch.bfloat16, torch.float16) or ref.dtype in (
        torch.bfloat16,
        torch.float16,
    ):
        return "half-precision run: loosen atol/rtol to the engine's precision"
    if bad.dim() >= 2 and ref.dim() >= 2:
        per_pos = bad.flatten(0, -2).any(-1) if bad.dim() > 2 else bad.any(-1)
        if 0 < int(per_pos.sum()) < per_pos.numel() // 2:
            return "only some positions differ: check padding and the attention mask on both sides"
    return "a different tensor: the engine's hook may sit before/after another op (dropout, norm, cast) or a fused kernel"
