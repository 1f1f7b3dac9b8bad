"""Gradients of derived facets: d loss / d a tensor no op of the model produced, derived from the
gradients autograd gives where the model did run an op, and served only where a relation the
model fixes checks the derivation against autograd's own gradients.

- A norm's `normalized`, `inv_std` / `inv_rms` and `scale` (TransformerLens's `hook_normalized`
  and `hook_scale`). The norm's output is `normalized * gain + bias` (its value's check), so
  d loss / d normalized = d loss / d output ⊙ gain. With normalized = centred / scale,
  d loss / d scale = -Σ d loss / d normalized ⊙ normalized / scale over the normalized shape (the
  divisor as a node of its own, the centred input held: TransformerLens's graph), and inv =
  1 / scale gives d loss / d inv = -scale² · d loss / d scale. Checked: the normalization's
  backward of those gradients, computed in float64 from the norm's input (through normalized with
  the scale held, plus through the scale), equals autograd's gradient at the norm's input
  through the norm, which a second `torch.autograd.grad`, from the norm's output to its input,
  gives (the gradient at the input itself also holds the residual path around the norm).
- Attention's per-head `result` (z_h · W_O,h, whose sum over heads plus the bias is the output
  projection's output): d loss / d result_h = d loss / d that output, for every head (the sum's
  Jacobian). Checked: d loss / d result_h · W_O,hᵀ, head by head, equals autograd's gradient at
  z, which therefore has to be kept.

A plan (`norm_plan`, `result_plan`) names the gradient edges the derivation needs, which the one
backward of `_analysis.grads.backward` then asks for; once it ran, `norm_grads` and `result_grads`
take what the derivation computes from and return it as a `Deferred`: the derivation and its
check run on the first read of any of its gradients (a `_core.pending.Pending`, as derived facet
values do), not when the trace is taken. What must come from the forward's autograd graph, which
the trace does not hold on to, is taken at once: the norm's gradient at its input through the
norm (the second `torch.autograd.grad`). Either returns a str where the gradient cannot be served
whatever is computed later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from torchlens._analysis.facets.attention import _per_head_weight
from torchlens._analysis.facets.norm import affine_gain, norm_form, norm_precision
from torchlens._capture.edges import Edges
from torchlens._core import ops as _ops
from torchlens._core import roles as _roles
from torchlens._core.records import ModuleCall, OpRecord, Ref
from torchlens._core.sites import FacetSite

__all__ = [
    "NORM_DERIVED",
    "norm_plan",
    "norm_grads",
    "result_plan",
    "result_grads",
    "Plan",
    "Deferred",
]

#: the derived facets of a norm whose gradients are derived here
NORM_DERIVED = ("normalized", "inv_std", "inv_rms", "scale")

_NORM_CHECK = (
    "checked: the normalization's backward of it, in float64 from the norm's input, equals "
    "autograd's gradient at the norm's input through the norm"
)
_NORM_NOTES = {
    "normalized": "derived: d loss / d the norm's output ⊙ its gain; " + _NORM_CHECK,
    "scale": "derived: -Σ d loss / d normalized ⊙ normalized / scale (the divisor as a node of its "
    "own, the centred input held, as TransformerLens's hook_scale); " + _NORM_CHECK,
    "inv_std": "derived: -scale² · d loss / d scale; " + _NORM_CHECK,
    "inv_rms": "derived: -scale² · d loss / d scale; " + _NORM_CHECK,
}
_RESULT_NOTE = (
    "derived: d loss / d the output projection's output, for every head (the sum over heads' "
    "Jacobian); checked: it times W_O per head equals autograd's gradient at z"
)
_ZEROS = "zeros: the loss does not depend on {what} (not on any path to it); "


@dataclass
class Plan:
    """What one call's derivation needs: the sites it serves; `grad_of`, the (edge, tensor) of
    the output whose gradient the one backward takes (the norm's, or the output projection's);
    the module whose weights it reads; the call's ops (norms); `x`, the (edge, tensor) of the
    norm's input (norms); `z`, the site whose gradient checks the result (attention)."""

    sites: dict[str, FacetSite]
    grad_of: tuple[Any, Tensor]
    module: nn.Module
    ops: list[OpRecord]
    x: tuple[Any, Tensor] | None = None
    z: FacetSite | None = None


@dataclass
class Deferred:
    """A derivation of one call's gradients, run on first read: `fn(inputs)` computes from the
    tensors in `inputs` only and returns `(values, check error, refusal)`, the protocol of
    `_core.pending.Pending`, which runs it; `notes` is each served facet's note (known before it
    runs), by facet name."""

    fn: Any
    inputs: list
    notes: dict[str, str]


def _detached(t: Tensor | None) -> Tensor | None:
    """`t` without its autograd history (same memory and version counter), so a pending
    derivation does not hold the forward's graph alive."""
    return None if t is None else t.detach()


def _edge(ref: Any, alias: Any, edges: Edges) -> tuple[Any, Tensor] | None:
    """The (edge, tensor) the recorder kept for a call's input or output: the op output `ref`
    names, else the `alias` its hook kept; None when neither was kept with its edge."""
    found = edges.ops.get((ref.op, ref.slot)) if type(ref) is Ref else None
    if found is None and isinstance(alias, Tensor):
        edge = edges.alias(alias)
        found = None if edge is None else (edge, alias)
    return found


def norm_plan(
    call: ModuleCall,
    sites: dict[str, FacetSite],
    edges: Edges,
    ops: list[OpRecord],
    module: nn.Module | None,
    io: tuple[Any, Any] | None,
) -> Plan | str:
    """The plan of a norm call's derived gradients (`sites`), or why there is none; `io` is the
    input and output aliases the call's hooks kept (`_analysis.grads.backward`)."""
    x_alias, out_alias = io or (None, None)
    out, x = _edge(call.output_ref, out_alias, edges), _edge(call.input_ref, x_alias, edges)
    if module is None:
        return "the norm's module is not known to the trace, so its gain is not known"
    if out is None:
        return (
            "the norm's output was not kept with its gradient edge (or does not require grad), so "
            "d loss / d its output, which the derivation starts from, is not known"
        )
    if x is None:
        return (
            "the norm's input was not kept with its gradient edge (or does not require grad), so "
            "the derivation cannot be checked against autograd's gradient at it"
        )
    if x[1].shape != out[1].shape:
        return "the norm's input and output differ in shape"
    return Plan(sites, out, module, ops[call.first_op : call.end_op], x=x)


def norm_grads(plan: Plan, g_out: Tensor | None) -> Deferred | str:
    """The derived gradients of a norm call's sites from d loss / d its output (`g_out`, None where
    the loss does not depend on it), derived and checked on first read, or why they are not
    served. Autograd's gradient at the norm's input through the norm is taken now, while the
    forward's graph is there."""
    assert plan.x is not None
    (out_edge, out), (x_edge, x) = plan.grad_of, plan.x
    kind, eps, n_dims, groups = norm_form(plan.module, plan.ops, x.dtype)
    unused = g_out is None
    dx: Tensor | None = None
    if not unused:
        try:
            (got,) = torch.autograd.grad(
                [out_edge], [x_edge], [g_out], retain_graph=True, allow_unused=True
            )
        except RuntimeError as exc:
            return f"autograd's backward from the norm's output to its input failed: {exc}"
        if got is None:
            return (
                "the norm's output does not depend on its input in the autograd graph (its "
                "normalization is detached), so the derivation cannot be checked"
            )
        dx = got
    if kind == "group" and groups is None:
        return "the norm ran group_norm but has no num_groups"
    precision = norm_precision([x.dtype, *(d for op in plan.ops for d in op.dtypes), out.dtype])
    w, b = getattr(plan.module, "weight", None), getattr(plan.module, "bias", None)
    w = w.detach() if isinstance(w, Tensor) else None
    b = b.detach() if isinstance(b, Tensor) else None
    # what each served site needs to know of itself, without holding the site
    shapes = {name: (site.dtype, site.shape) for name, site in plan.sites.items()}

    def run(inputs: list) -> tuple:
        g, dx, x, out, w, b = inputs
        if g is None:
            g, dx = torch.zeros_like(out), torch.zeros_like(x)
        wide = torch.float64
        dims: tuple[int, ...]
        with torch.enable_grad():
            x64 = x.detach().to(wide, copy=True).requires_grad_(True)
            if kind == "group":
                xv, dims = x64.reshape(x64.shape[0], groups, -1), (-1,)
            else:
                xv, dims = x64, tuple(range(x64.dim() - n_dims, x64.dim()))
            centred = xv if kind == "rms" else xv - xv.mean(dims, keepdim=True)
            scale = (centred.pow(2).mean(dims, keepdim=True) + eps).sqrt()
            normalized = centred / scale.detach()  # the scale's own path is taken by g_scale
            n = normalized.detach().reshape(x.shape)
            gain, fit = affine_gain(n, out, w, b, kind)
            tol_fit = _ops.reconstruction_tolerance(precision) * max(1.0, float(out.abs().max()))
            if not fit <= tol_fit:
                return (
                    {},
                    None,
                    f"normalized * gain + bias differs from the norm's output by {fit:.3g} (> "
                    f"{tol_fit:.3g}), so the gain d loss / d its output is multiplied by is not known",
                )
            g_n = g.to(wide) if gain is None else g.to(wide) * gain.to(wide)
            g_nv = g_n.reshape(normalized.shape)
            g_scale = -(g_nv * normalized.detach()).sum(dims, keepdim=True) / scale.detach()
            (dx_pred,) = torch.autograd.grad([normalized, scale], [x64], [g_nv, g_scale])
        real = dx.to(wide)
        err = float((dx_pred - real).abs().max()) if real.numel() else 0.0
        tol = _ops.reconstruction_tolerance(precision) * max(
            float(real.abs().max()) if real.numel() else 0.0, 1e-30
        )
        if not err <= tol:
            return (
                {},
                err,
                f"derived as d loss / d output ⊙ gain, but the normalization's backward of it differs "
                f"from autograd's gradient at the norm's input through the norm by {err:.3g} (> "
                f"{tol:.3g}): the norm's backward is not that of (x - mean) / σ · gain + bias "
                "(detached statistics, a custom backward), so it is not served",
            )
        values = {
            "normalized": g_n,
            "scale": g_scale,
            "inv_std": -g_scale * scale.detach().pow(2),
            "inv_rms": -g_scale * scale.detach().pow(2),
        }
        return (
            {
                name: values[name].to(dtype).reshape(shape)
                for name, (dtype, shape) in shapes.items()
            },
            err,
            None,
        )

    zeros = _ZEROS.format(what="the norm's output") if unused else ""
    notes = {name: zeros + _NORM_NOTES[name] for name in plan.sites}
    return Deferred(run, [_detached(g_out), dx, _detached(x), _detached(out), w, b], notes)


def result_plan(
    call: ModuleCall,
    site: FacetSite,
    z: FacetSite | None,
    kids: list[ModuleCall],
    edges: Edges,
    modules: dict[str, nn.Module],
    io: dict[int, tuple[Any, Any]],
) -> Plan | str:
    """The plan of an attention call's per-head `result` gradient, or why there is none.

    The output projection is found as the value's rule finds it
    (`_analysis.facets.attention`): the first child called after z's op that has a weight."""
    if z is None or z.op is None:
        return "z, whose gradient checks the derivation, is not found in this call"
    proj = next(
        (k for k in kids if k.first_op > z.op and hasattr(modules.get(k.address), "weight")), None
    )
    if proj is None:
        return "no output projection with a weight is found after z"
    out = _edge(proj.output_ref, io.get(id(proj), (None, None))[1], edges)
    if out is None:
        return (
            "the output projection's output was not kept with its gradient edge (or does not "
            "require grad), so d loss / d its output is not known"
        )
    return Plan({"result": site}, out, modules[proj.address], [], z=z)


def result_grads(plan: Plan, g_out: Tensor | None, g_z: Any) -> Deferred | str:
    """The per-head `result` gradient from d loss / d the output projection's output (`g_out`,
    None where the loss does not depend on it), checked against autograd's gradient at z
    (`g_z`: what `_analysis.grads.backward` found for z's site) on first read, or why it is not
    served."""
    site, z = plan.sites["result"], plan.z
    assert z is not None
    if g_z is None:
        return (
            "the check needs autograd's gradient at z, which this trace did not keep: keep 'z' "
            "too (save=[..., 'z'])"
        )
    if isinstance(g_z, str):
        return f"the check needs autograd's gradient at z, which is not served: {g_z}"
    g_z = g_z[0]
    out = plan.grad_of[1]
    unused = g_out is None
    b, h, t, dh = z.shape
    if out.dim() != 3 or out.shape[:2] != (b, t) or tuple(g_z.shape) != (b, h, t, dh):
        return (
            f"the output projection's output {list(out.shape)} does not line up with z "
            f"{list(z.shape)} (batch, position), so the heads' gradients cannot be told"
        )
    layout = _roles.weight_layout(plan.module)
    weight = getattr(plan.module, "weight", None)
    if layout is None or not isinstance(weight, Tensor):
        return "the output projection's weight layout is not known"
    dtype, shape, z_dtype = site.dtype, site.shape, z.dtype

    def run(inputs: list) -> tuple:
        g, g_z, weight, out = inputs
        if g is None:
            g = torch.zeros_like(out)
        wide = torch.float64
        w3 = _per_head_weight(weight, layout, g.shape[-1], h, dh).to(wide)
        pred = torch.einsum("bto,ohd->bhtd", g.to(wide), w3)
        real = g_z.to(wide)
        err = float((pred - real).abs().max()) if real.numel() else 0.0
        tol = _ops.reconstruction_tolerance(z_dtype) * max(
            float(real.abs().max()) if real.numel() else 0.0, 1e-30
        )
        if not err <= tol:
            return (
                {},
                err,
                f"derived as d loss / d the output projection's output for every head, but that "
                f"times W_O per head differs from autograd's gradient at z by {err:.3g} (> "
                f"{tol:.3g}): z's gradient does not come from the output projection alone, so it "
                "is not served",
            )
        grad = g.unsqueeze(2).expand(b, t, h, g.shape[-1]).to(dtype).contiguous()
        return {"result": grad.reshape(shape)}, err, None

    zeros = _ZEROS.format(what="the output projection's output") if unused else ""
    # the output is held only for its shape and dtype where the loss does not depend on it
    inputs = [_detached(g_out), g_z, weight.detach(), None if not unused else _detached(out)]
    return Deferred(run, inputs, {"result": zeros + _RESULT_NOTE})
