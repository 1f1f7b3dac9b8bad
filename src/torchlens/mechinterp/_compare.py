"""`compare`: check tensors read from another engine against a TorchLens trace, name by name.

The arguments are checked here; the rows are made by `_value_rows` (activations) and
`_grad_rows` (gradients), `tolerance="auto"` by `_auto_tolerance`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from torchlens._core.errors import TorchLensError, bad_tolerance
from torchlens._naming.resolver import need_trace, resolve_alias
from torchlens._trace import Trace
from torchlens.mechinterp._auto_tolerance import auto_tolerances
from torchlens.mechinterp._comparison import ComparisonReport
from torchlens.mechinterp._grad_rows import grad_rows
from torchlens.mechinterp._value_rows import value_row

__all__ = ["compare", "ToleranceError", "CompareSpecError"]


class CompareSpecError(TorchLensError, ValueError):
    """`compare`'s `of=` is not `"value"` or `"grad"`, or `of="grad"` cannot be served: the trace
    was taken without `grads=`, or `tolerance="auto"` was asked with it."""


class ToleranceError(TorchLensError, ValueError):
    """`tolerance=` is not accepted, or `"auto"` lacks the model and inputs it reruns."""


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
    repeated from kv heads to query heads. Where the engine's shape fits two layouts that read the
    values differently (as many heads as positions), a match passes only under the token-major
    layout the naming generations use; a match under the head-major one alone (a forgotten
    transpose) fails, and its hint says so. Both sides are compared in float32; a masked attention
    score counts as equal whether its fill is `-inf` or its own dtype's minimum (float16's too).

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
        ToleranceError: `tolerance` is not None or `"auto"`, or `"auto"` lacks `model`/`inputs`;
            `model`/`inputs` given without `"auto"`; `atol`/`rtol` not a number of zero or more.
        TorchLensError: `trace` is not a `Trace`.
        CompareSpecError: `of` is not `"value"` or `"grad"`; `of="grad"` on a trace taken without
            `grads=`, or with `tolerance="auto"`.
    """
    need_trace(trace, "compare")
    for name, value in (("atol", atol), ("rtol", rtol)):
        why = bad_tolerance(name, value)
        if why:
            raise ToleranceError(f"{why}.")
    if tolerance != "auto" and (model is not None or inputs is not None):
        raise ToleranceError(
            "model= and inputs= are read only with tolerance='auto' (a float64 rerun of a copy of "
            "the model sets each site's tolerance); pass tolerance='auto' with them, or leave them "
            "out to compare with atol/rtol."
        )
    if not isinstance(engine_values, Mapping):
        raise CompareSpecError(
            f"compare takes a dict from names to the engine's tensors ({{'blocks.0.hook_resid_post': t}}), got a "
            f"{type(engine_values).__name__}"
            + (": pass dict(pairs)" if isinstance(engine_values, (list, tuple)) else "")
            + "."
        )
    if not engine_values:
        raise CompareSpecError(
            "compare was given no names ({}), so there is nothing to compare; pass "
            "{'blocks.0.hook_resid_post': tensor, ...} with what the engine read."
        )
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
        return grad_rows(trace, engine_values, generation, atol, rtol, explain)
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
        auto_tolerances(trace, resolved, model, inputs)
        if tolerance == "auto" and isinstance(model, nn.Module)
        else {}
    )
    for name, value, res in resolved:
        tol = tolerances.get(name, (atol, rtol, None, ""))
        if (
            tol[0] is None
        ):  # no float64 value at this site: the given atol/rtol, and the row says why
            tol = (atol, rtol, None, tol[3])
        report.append(value_row(trace, name, value, res, tol, editable, generation, explain))
    return report
