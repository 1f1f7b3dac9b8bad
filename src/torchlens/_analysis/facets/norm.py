"""Norm facets: `normalized`, `inv_rms` / `inv_std` and `scale`, computed from the norm's input and
weights and checked against its output."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from torchlens._analysis.facets.common import held, io_ref, make_site, refused, wide
from torchlens._analysis.graph import Graph
from torchlens._core import ops as _ops
from torchlens._core import roles as _roles
from torchlens._core.pending import Pending
from torchlens._core.records import ModuleCall, OpRecord, Ref
from torchlens._core.sites import FacetSite

# -- norms -------------------------------------------------------------------------------------


def _norm_kind(module: nn.Module, ops: list[OpRecord]) -> str:
    """`"rms"`, `"std"` or `"group"`: what the norm divides by, from the ops it ran.

    A fused op names it (`rms_norm`, `layer_norm`, `group_norm`); a norm written out with
    `rsqrt` centres its input first (a subtraction) only when it is a LayerNorm, so T5's
    `T5LayerNorm`, which is an RMS norm, is found to be one.
    """
    names = {op.name for op in ops}
    if "group_norm" in names or isinstance(module, nn.GroupNorm):
        return "group"
    if "rms_norm" in names:
        return "rms"
    if "layer_norm" in names:
        return "std"
    if "rsqrt" in names:
        return "std" if names & _ops.SUB_OPS else "rms"
    return "rms" if _roles.is_rms_norm(module) else "std"


def _n_normalized(module: nn.Module) -> int:
    """How many trailing dimensions a LayerNorm/RMSNorm normalizes over: its `normalized_shape`
    (default: the last one)."""
    shape = getattr(module, "normalized_shape", None)
    return len(shape) if isinstance(shape, (tuple, list, torch.Size)) and shape else 1


def _normalize(
    x: Tensor, kind: str, eps: float, n_dims: int, groups: int | None
) -> tuple[Tensor, Tensor | None]:
    """The norm's input centred (unless RMS) and divided by its RMS/std over its last `n_dims`
    dimensions (over each of `groups` groups for GroupNorm), in float32; and the inverse divisor
    (None for GroupNorm, whose statistics are per group, not per position)."""
    xf = wide(x)
    if kind == "group":
        if groups is None:  # group_norm ran in a module that does not say its number of groups
            raise ValueError("the norm ran group_norm but has no num_groups")
        g = xf.reshape(xf.shape[0], groups, -1)
        g = g - g.mean(-1, keepdim=True)
        inv = torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
        return (g * inv).reshape(xf.shape), None
    dims = tuple(range(x.dim() - n_dims, x.dim()))
    centred = xf if kind == "rms" else xf - xf.mean(dims, keepdim=True)
    inv = torch.rsqrt(centred.pow(2).mean(dims, keepdim=True) + eps)
    return centred * inv, inv


def _affine_errors(
    normalized: Tensor, out: Tensor, w: Tensor | None, b: Tensor | None, kind: str, tol: float = 0.0
) -> list[tuple[Tensor | None, float]]:
    """`(gain, error)` for each gain a norm may apply: how far `normalized * gain + bias` is from
    the norm's output, in order, up to the first within `tol`.

    The gain is the module's weight `w`, or `1 + w` (Gemma's RMSNorm stores the offset), or
    None (1) without a weight; for GroupNorm it is shaped to broadcast over the channel axis.
    """
    n, o = wide(normalized), wide(out)
    shape = (-1,) + (1,) * (n.dim() - 2) if kind == "group" else None
    bias = 0 if b is None else (wide(b).view(shape) if shape else wide(b))
    gains = [None] if w is None else [wide(w), 1 + wide(w)]
    found: list[tuple[Tensor | None, float]] = []
    for gain in gains:
        gain = gain.view(shape) if shape and gain is not None else gain
        y = n + bias if gain is None else (n * gain).add_(bias)  # new tensors
        found.append((gain, float(y.sub_(o).abs_().max()) if o.numel() else 0.0))
        if found[-1][1] <= tol:
            break
    return found


def _affine_error(
    normalized: Tensor, out: Tensor, w: Tensor | None, b: Tensor | None, kind: str, tol: float = 0.0
) -> float:
    """How far `normalized * gain + bias` is from the norm's output, for the gain the model uses:
    the smallest error over the gains `_affine_errors` tries (the first within `tol`)."""
    return min(err for _, err in _affine_errors(normalized, out, w, b, kind, tol))


def affine_gain(
    normalized: Tensor, out: Tensor, w: Tensor | None, b: Tensor | None, kind: str
) -> tuple[Tensor | None, float]:
    """The gain the norm applies after normalizing, and how far `normalized * gain + bias` is from
    its output with it: the module's weight, `1 + weight` (Gemma) or None (no weight), whichever
    fits best, in float32 (float64 for float64 tensors), shaped to broadcast over `normalized`."""
    return min(_affine_errors(normalized, out, w, b, kind), key=lambda found: found[1])


def norm_form(
    module: nn.Module, ops: list[OpRecord], dtype: torch.dtype = torch.float32
) -> tuple[str, float, int, int | None]:
    """What a norm call computes: `(kind, eps, n_dims, groups)`: `"rms"`, `"std"` or `"group"`
    (what it divides by, from the ops it ran), the epsilon under its square root (the `finfo.eps`
    of its input's `dtype` for a norm that takes it from there), how many trailing dimensions it
    normalizes over, and its number of groups (GroupNorm, else None)."""
    eps = _roles.norm_eps(module)
    return (
        _norm_kind(module, ops),
        torch.finfo(dtype).eps if eps is None else eps,
        _n_normalized(module),
        getattr(module, "num_groups", None),
    )


def norm_precision(dtypes: list[torch.dtype]) -> torch.dtype:
    """The precision a norm computed in: the least precise floating dtype among its input's,
    its ops' outputs' and its output's `dtypes` (the last one when none is floating).

    A norm that casts to float32 (Gemma's RMSNorm) computes in float32 in a float64 model, and a
    tolerance taken from the float64 output would refuse it there while it passes in float32."""
    floats = [d for d in dtypes if d.is_floating_point]
    return max(floats, key=lambda d: torch.finfo(d).eps) if floats else dtypes[-1]


def _reads_a_sum(g: Graph, rsqrt: OpRecord) -> bool:
    """Whether `rsqrt`'s argument is a sum reduction plus at most an epsilon and casts (an L2
    norm's `rsqrt(sum(x^2) + eps)`), not a mean (`sum(x^2) / d` is one: a division on the way)."""
    ref = rsqrt.inputs[0] if rsqrt.inputs else None
    for _ in range(4):
        if type(ref) is not Ref:
            return False
        op = g.ops[ref.op]
        if op.name not in _ops.ADD_OPS and op.name not in _ops.CAST_OPS:
            return op.name == "sum"
        ref = next((r for r in op.inputs if type(r) is Ref), None)
    return False


def norm_facets(g: Graph, call: ModuleCall) -> dict[str, FacetSite]:
    """`normalized`, `inv_rms`/`inv_std` and `scale` of a norm call, each checked.

    The real ops (a `rsqrt` and the product with it) are taken where the norm is written out;
    otherwise (a fused `layer_norm`, `rms_norm`, `group_norm`) they are computed from the input
    over the normalized shape. Either way the facets are served only if `normalized * gain + bias`
    equals the norm's output within the dtype's tolerance; else they are refused with the error.
    What is computed, and the check, run on first read of any of them (see `FacetSite`).
    GroupNorm has `normalized` only (its statistics are per group).
    """
    module = g.modules[call.address]
    x_ref, out_ref = io_ref(g, call, "in"), io_ref(g, call, "out")
    xm, om = g.meta(x_ref), g.meta(out_ref)
    if xm is None or om is None or xm[0] != om[0]:
        return {}
    ops = g.ops[call.first_op : call.end_op]
    kind, eps, n_dims, groups = norm_form(module, ops, xm[1])
    inv_name = "inv_rms" if kind == "rms" else "inv_std"
    names = ("normalized",) if kind == "group" else ("normalized", inv_name, "scale")
    rsqrt = next((op for op in ops if op.name == "rsqrt"), None) if kind != "group" else None
    if rsqrt is not None and _reads_a_sum(g, rsqrt):
        # x * rsqrt(sum(x^2) + eps): an L2 normalization (Dory's q_norm and k_norm), whose
        # divisor is no RMS or standard deviation, the statistics these facets are defined by
        return refused(
            names,
            "the norm divides by its input's L2 norm (its rsqrt reads a sum, not a mean): the norm facets "
            "are defined by the RMS or the standard deviation, which this module never computes",
        )
    sites: dict[str, FacetSite] = {}
    if rsqrt is not None:
        sites[inv_name] = make_site(g, inv_name, Ref(rsqrt.index, 0), note="the norm's rsqrt op")
        mul = next(
            (c for c in g.consumers.get(rsqrt.index, []) if g.ops[c].name in _ops.MUL_OPS), None
        )
        if mul is not None:
            n_ref = g.follow(Ref(mul, 0), _ops.CAST_OPS)
            sites["normalized"] = make_site(
                g, "normalized", n_ref, note="input times the rsqrt, before the gain"
            )
    x, out = g.value(x_ref), g.value(out_ref)
    compute = any(sites.get(n) is None for n in names[:2])
    if compute:
        note = "computed from the norm's input over its normalized shape (the norm ran as one fused op)"
        dims = range(len(xm[0]) - n_dims, len(xm[0]))
        stat_shape = tuple(1 if i in dims else d for i, d in enumerate(xm[0]))
        sites["normalized"] = FacetSite("normalized", "computed", xm[0], xm[1], note=note)
        if kind != "group":
            # `_normalize` computes it as `wide` does: float64 stays float64, the rest float32
            wide_dtype = torch.float64 if xm[1] == torch.float64 else torch.float32
            sites[inv_name] = FacetSite(inv_name, "computed", stat_shape, wide_dtype, note=note)
    if kind != "group":
        inv_site = sites[inv_name]
        sites["scale"] = FacetSite(
            "scale", "computed", inv_site.shape, inv_site.dtype, note=f"1 / {inv_name}"
        )
    if (x if compute else held(sites["normalized"])) is None:
        # Nothing is served, so nothing needs checking; a written-out norm whose product was not
        # kept still serves its rsqrt, and the scale from it.
        inv = None if compute or kind == "group" else held(sites[inv_name])
        if inv is not None:
            with torch.no_grad():
                sites["scale"].tensor = torch.reciprocal(inv)
        return sites
    if out is None:  # cannot be checked, so not served; a save= that keeps the norm serves it
        for site in sites.values():
            site.tensor = None
        return sites
    w, b = getattr(module, "weight", None), getattr(module, "bias", None)
    w = w.detach() if isinstance(w, Tensor) else None
    b = b.detach() if isinstance(b, Tensor) else None
    precision = norm_precision([xm[1], *(d for op in ops for d in op.dtypes), om[1]])
    inputs = [
        x if compute else None,
        out,
        w,
        b,
        None if compute or kind == "group" else held(sites[inv_name]),
        None if compute else held(sites["normalized"]),
    ]

    def run(inputs: list) -> tuple:
        x, out, w, b, inv, normalized = inputs
        values: dict[str, Tensor] = {}
        if compute:
            normalized, inv = _normalize(x, kind, eps, n_dims, groups)
            values["normalized"] = normalized = normalized.to(x.dtype)
            if kind != "group":
                assert inv is not None  # `_normalize` returns the inverse divisor but for "group"
                values[inv_name] = inv
        if kind != "group":
            values["scale"] = torch.reciprocal(inv)
        tol = _ops.reconstruction_tolerance(precision) * max(1.0, float(out.abs().max()))
        err = _affine_error(normalized, out, w, b, kind, tol)
        if not err <= tol:
            return (
                {},
                err,
                f"normalized * gain + bias differs from the norm's output by {err:.3g} (> {tol:.3g})",
            )
        return values, err, None

    Pending(run, inputs, list(sites.values()))
    return sites
