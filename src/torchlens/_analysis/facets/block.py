"""Block facets: `resid_pre`, `resid_mid` (checked against the residual sums) and `resid_post`."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torchlens._analysis.facets.common import held, io_ref, make_site, wide
from torchlens._analysis.facets.mlp import weighted
from torchlens._analysis.graph import Graph
from torchlens._core import ops as _ops
from torchlens._core import roles as _roles
from torchlens._core.facet_spec import tokens_flattened
from torchlens._core.pending import Pending
from torchlens._core.records import ModuleCall, Ref
from torchlens._core.sites import FacetSite

# -- blocks ------------------------------------------------------------------------------------


def block_facets(
    g: Graph,
    call: ModuleCall,
    kids: list[ModuleCall],
    side: dict[int, dict[str, FacetSite]] | None = None,
) -> dict[str, FacetSite]:
    """The block call's facets; where `side` is given, the `contribution` facets of its attention
    and MLP calls go there too, by `id` of the call (see `_contributions`)."""
    sites = {}
    for name, which in (("resid_pre", "in"), ("resid_post", "out")):
        s = make_site(g, name, io_ref(g, call, which), note=f"block {which}put")
        if s:
            sites[name] = s
    attn = next((k for k in kids if k.role == "attention"), None)
    mlp = next((k for k in kids if k.role == "mlp"), None)
    if mlp is None and attn is not None:
        mlp = _split_mlp_norm(g, call, kids, attn)
    if (
        attn is None
        or mlp is None
        or type(attn.output_ref) is not Ref
        or type(mlp.input_ref) is not Ref
    ):
        return sites
    # Ops downstream of the attention output and upstream of the MLP input: the residual add.
    down = {attn.output_ref.op}
    for i in range(attn.end_op, mlp.first_op):
        if any(type(r) is Ref and r.op in down for r in g.ops[i].inputs):
            down.add(i)
    up = g.ancestors(mlp.input_ref, attn.end_op)
    adds = [
        i
        for i in down & set(up)
        if g.ops[i].name in _ops.ADD_OPS
        and g.ops[i].module == call.address
        and g.ops[i].call == call.index
    ]
    if adds:
        sites["resid_mid"] = make_site(
            g,
            "resid_mid",
            Ref(_pick_resid_mid(g, attn, adds), 0),
            note="residual add after attention",
        )
        sites.update(_check_resid_mid(g, call, sites, kids, attn, mlp))
        if side is not None:
            for sub, site in _contributions(g, call, sites, kids, attn, mlp):
                side.setdefault(id(sub), {})["contribution"] = site
    return sites


def _contributions(
    g: Graph,
    call: ModuleCall,
    sites: dict[str, FacetSite],
    kids: list[ModuleCall],
    attn: ModuleCall,
    mlp: ModuleCall,
) -> list[tuple[ModuleCall, FacetSite]]:
    """The tensor each residual add of the block takes from its attention or its MLP, where the
    model changes the sublayer's output on the way (a product with a constant: Granite's
    `residual_multiplier`, MiniCPM3's `scale_depth / sqrt(n_layers)`; a reshape: Llama-4's
    `.view(residual.shape)`), so the sublayer's `output` is not what the stream receives.

    Only where the side is one add (resid_pre + one operand = resid_mid, resid_mid + one operand
    = resid_post) and the operand comes from the attention or MLP call itself, or from the norm
    applied to its output (a sandwich norm, then the constant: HyperCLOVAX); the facet is then
    that call's. Each site is the
    add's operand, an op output, checked (on first read) to be the sublayer's output reshaped
    or times one constant, and served only while `resid_mid`'s check holds.
    """
    mid = sites.get("resid_mid")
    if mid is None or mid.op is None:
        return []
    outs = {io_ref(g, k, "out"): k for k in kids if type(io_ref(g, k, "out")) is Ref}
    mid_ref = Ref(mid.op, 0)
    found = []
    # The call's own refs, not the tensors its hooks kept: where the facet is must not depend on
    # what save= holds (the block's input is an op outside it, kept only by some selections).
    for start, end, lo, hi in (
        (call.input_ref, mid_ref, attn.first_op, mlp.first_op),
        (mid_ref, call.output_ref, mlp.first_op, call.end_op),
    ):
        if type(start) is not Ref or type(end) is not Ref:
            continue
        chain = _add_chain(g, call, end, start, list(outs.values()))
        if chain is None or len(chain) != 1:
            continue
        operand, output, _ = chain[0]
        sub = outs.get(output)
        # the sublayer itself, or the norm applied to its output (HyperCLOVAX scales its post-norms')
        if (
            not _changed_on_the_way(g, operand, output)
            or sub is None
            or sub.role not in ("attention", "mlp", "norm")
            or not lo <= sub.first_op < hi
        ):
            continue
        site = make_site(g, "contribution", operand, note="what the residual add takes from it")
        if site is None:
            continue
        # The site is there whatever save= keeps (an edit's locating pass keeps nothing); its
        # tensor is served only with its check, which needs the sublayer's output too.
        if site.tensor is not None:
            if g.value(output) is None:
                site.tensor = None
            else:
                Pending(_proportional, [site.tensor, g.value(output)], [site], after=(mid,))
        found.append((sub, site))
    return found


def _changed_on_the_way(g: Graph, operand: Any, output: Any) -> bool:
    """Whether a product with a constant or a reshape lies between the sublayer output and the
    add's operand (`_contribution`'s walk): dropout and casts alone leave the output as it is."""
    ref = operand
    while type(ref) is Ref and ref != output:
        op = g.op(ref)
        if op is None or not op.inputs:
            return False
        if op.name in _ops.SCALE_OPS | _ops.RESHAPE_OPS:
            return True
        ref = op.inputs[0]
    return False


def _proportional(inputs: list) -> tuple:
    """`inputs` = (the operand, the sublayer output): the operand must be the output, reshaped,
    times one constant, to the roundings of one product in the operand's dtype."""
    operand, output = inputs
    if operand.numel() != output.numel():
        return {}, None, "it holds a different number of values than the sublayer's output"
    a = operand.reshape(output.shape).double()
    b = output.double()
    scale = float((a * b).sum() / (b * b).sum()) if bool((b != 0).any()) else 1.0
    tol = torch.finfo(operand.dtype).eps * (b.abs() * abs(scale)) + torch.finfo(operand.dtype).tiny
    err = float(((a - scale * b).abs() - tol).max()) if a.numel() else 0.0
    if err > 0:
        return (
            {},
            err,
            (
                f"it is not the sublayer's output times one constant (off by {err:.3g} beyond one rounding)"
            ),
        )
    return {}, 0.0, None


def _split_mlp_norm(
    g: Graph, call: ModuleCall, kids: list[ModuleCall], attn: ModuleCall
) -> ModuleCall | None:
    """Where the block holds its MLP's layers itself (OPT: `final_layer_norm`, `fc1`, `fc2`), the
    norm child whose output the first weighted layer after the attention reads: the MLP branch
    starts there, so `resid_mid` is the residual add before it. None for a post-LN block (its
    output is a norm's), where the residual carried on is that norm's output."""
    after = [k for k in kids if k.first_op >= attn.end_op]
    lins = [k for k in after if weighted(g, k)]
    if not lins or type(lins[0].input_ref) is not Ref:
        return None
    norms = [k for k in after if _roles.is_norm(g.modules[k.address])]
    if any(type(k.output_ref) is Ref and k.output_ref == call.output_ref for k in norms):
        return None
    return next((k for k in norms if k.output_ref == lins[0].input_ref), None)


def _pick_resid_mid(g: Graph, attn: ModuleCall, adds: list[int]) -> int:
    """The residual add after attention: the last add fed by the attention and feeding the MLP."""
    return max(adds)


def _contribution(g: Graph, ref: Any, outs: dict[Ref, ModuleCall]) -> tuple[Ref, bool] | None:
    """The sublayer output that add operand `ref` carries, and whether a constant scales it.

    Walks back over what the model may do to a sublayer's output before the residual add without
    changing which values it adds: dropout and casts, a reshape (Llama-4's `.view(residual.shape)`)
    and a product with a Python number (Granite's `* residual_multiplier`, MiniCPM3's
    `* scale_depth / sqrt(n_layers)`: a scale op whose only tensor argument is that output).
    None when `ref` does not lead to the output of one of `outs` that way.
    """
    scaled = False
    for _ in range(6):
        if type(ref) is not Ref:
            return None
        if ref in outs:
            return ref, scaled
        op = g.op(ref)
        if op is None or not op.inputs or type(op.inputs[0]) is not Ref:
            return None
        if op.name in _ops.SCALE_OPS and len(op.inputs) == 1:
            scaled = True
        elif op.name not in _ops.PASS_THROUGH_OPS | _ops.RESHAPE_OPS or len(op.inputs) != 1:
            return None
        ref = op.inputs[0]
    return None


def _add_chain(
    g: Graph, call: ModuleCall, end: Any, start: Any, kids: list[ModuleCall]
) -> list | None:
    """The residual adds from `start` to `end` in this block call, as `(add operand, sublayer
    output, scaled)` per add: `end = start + Σ operand`, each operand a sublayer output of `kids`
    (see `_contribution`). None where `end` is not reached from `start` by such adds alone."""
    outs = {io_ref(g, k, "out"): k for k in kids if type(io_ref(g, k, "out")) is Ref}
    terms: list[tuple[Any, ...]] = []
    ref = end
    for _ in range(8):
        if ref == start:
            return terms if terms else None
        op = g.op(ref)
        if (
            op is None
            or op.name not in _ops.ADD_OPS
            or op.module != call.address
            or op.call != call.index
            or len(op.inputs) != 2
            or any(type(r) is not Ref for r in op.inputs)
        ):
            return None
        for res, con in (op.inputs, op.inputs[::-1]):
            # A cast to the dtype a tensor already has returns the tensor itself, recorded as an op
            # (inside the next norm): the residual operand is then that op's output.
            res = g.source(res, _ops.CAST_OPS)
            found = _contribution(g, con, outs)
            if found is not None and (
                res == start or ((res_op := g.op(res)) is not None and res_op.name in _ops.ADD_OPS)
            ):
                terms.append((con, *found))
                ref = res
                break
        else:
            return None
    return None


def _check_resid_mid(
    g: Graph,
    call: ModuleCall,
    sites: dict[str, FacetSite],
    kids: list[ModuleCall],
    attn: ModuleCall,
    mlp: ModuleCall,
) -> dict[str, FacetSite]:
    """Refuse `resid_mid` unless resid_pre + the attention branch = resid_mid and resid_mid + the
    MLP branch = resid_post. The check is deferred to the first read (see `FacetSite`); only
    whether it can run is settled here.

    Where the data flow shows each side as a chain of residual adds (`_add_chain`), the relation
    is that chain: resid_mid = resid_pre + the sum of what it adds (a decoder block adds its
    self-attention's and its cross-attention's outputs), each added operand a sublayer output,
    or one times a constant (Granite, MiniCPM3: the constant is fitted and the operand checked
    to be that multiple). Otherwise a branch's output is its sublayer's output or that of a later
    sibling (a post-sublayer norm, a dropout), so Gemma-2's post-norms pass.

    The tolerance is the model's own roundings, element by element: one rounding of the result
    per add (and per scaling), at most the dtype's epsilon times the magnitudes added. It is
    not taken from the output's scale, so a relation off by more than the roundings is refused
    in every dtype alike (a bfloat16 tolerance of 2e-2 times the output's scale passed relations
    that float64 refuses).
    """
    mid, pre, post = (sites.get(n) for n in ("resid_mid", "resid_pre", "resid_post"))
    if mid is None or held(mid) is None:
        return {}
    if pre is None or post is None or held(pre) is None or held(post) is None:
        mid.tensor = None  # cannot be checked, so not served
        return {}
    attn_branch = [k for k in kids if attn.first_op <= k.first_op < mlp.first_op]
    mlp_branch = [k for k in kids if k.first_op >= mlp.first_op]
    mid_ref = Ref(mid.op, 0) if mid.op is not None else None
    sides: list[
        tuple[str, list[Any]]
    ] = []  # per side: ("chain", [(operand, output, scaled)]) or ("any", [branch outputs])
    # The call's own refs, not the aliases its hooks kept (as `_contributions` reads them): which
    # relation is checked must not depend on what save= holds (the block's input is an op outside
    # it, kept only by some selections: Granite's scaled chain was checked as a plain branch).
    for start, end, branch in (
        (call.input_ref, mid_ref, attn_branch),
        (mid_ref, call.output_ref, mlp_branch),
    ):
        chain = (
            None
            if type(end) is not Ref or type(start) is not Ref
            else _add_chain(g, call, end, start, branch)
        )
        if chain is not None:
            terms = [(g.value(c), g.value(v), scaled) for c, v, scaled in chain]
            if all(v is not None and (c is not None or not scaled) for c, v, scaled in terms):
                sides.append(("chain", terms))
                continue
        sides.append(("any", [g.value(io_ref(g, k, "out")) for k in branch]))
    inputs: list[Tensor | None] = [held(pre), held(mid), held(post)]
    layout: list[tuple[str, int, int, list[Any] | None]] = []
    for kind, items in sides:
        flat = [t for item in items for t in (item[:2] if kind == "chain" else (item,))]
        layout.append(
            (kind, len(inputs), len(flat), [item[2] for item in items] if kind == "chain" else None)
        )
        inputs.extend(flat)

    def run(inputs: list) -> tuple:
        pre_t, mid_t, post_t = inputs[:3]
        worst, why = 0.0, None
        for (kind, at, n, scaled), base, target, label in zip(
            layout,
            (pre_t, mid_t),
            (mid_t, post_t),
            ("resid_pre + attention branch = resid_mid", "resid_mid + MLP branch = resid_post"),
        ):
            part = inputs[at : at + n]
            if kind == "chain":
                assert scaled is not None  # a chain side's layout carries its `scaled` flags
                err, bad = _chain_error(base, target, part, scaled)
            else:
                err, bad = _branch_error(base, target, part)
            worst = max(worst, err)
            if bad is not None and why is None:
                why = f"{label} does not hold: {bad}"
        return {}, worst, why

    Pending(run, inputs, [mid])
    return {}


def _rounding(dtype, *terms: Tensor) -> Tensor:
    """Per element, how far a sum of `terms` rounded in `dtype` can be from the exact sum: one
    rounding per add (each at most epsilon times the magnitudes added), twice over, plus the
    dtype's smallest normal number (a subnormal result)."""
    info = torch.finfo(dtype if dtype.is_floating_point else torch.float32)
    mag = wide(terms[0]).abs()  # every caller sums one term or more
    for t in terms[1:]:
        mag = mag + wide(t).abs()
    return mag.mul_(2 * info.eps * max(1, len(terms) - 1)).add_(info.tiny)


def _excess(diff: Tensor, tol: Tensor) -> tuple[float, float]:
    """The largest |diff| and the largest |diff| - tol (positive: the relation fails there)."""
    diff = diff.abs()
    m = float(diff.max()) if diff.numel() else 0.0
    over = float((diff - tol).max()) if diff.numel() else -1.0
    return (float("inf") if m != m else m), (float("inf") if over != over else over)


def _chain_error(
    base: Tensor, target: Tensor, part: list, scaled: list
) -> tuple[float, str | None]:
    """`target = base + Σ operands` to the roundings, and each operand its sublayer output (times
    the fitted constant where a constant scales it)."""
    operands = []
    for j, is_scaled in enumerate(scaled):
        c, v = part[2 * j], part[2 * j + 1]
        if c is None:  # not kept: unscaled, so the operand is the output itself
            c = v
        if c.numel() != v.numel():
            return float(
                "inf"
            ), f"an added operand has {c.numel()} values and its sublayer output {v.numel()}"
        v = v.reshape(c.shape)
        if is_scaled:
            v64, c64 = v.double(), c.double()
            s = float(
                (c64 * v64).sum() / (v64 * v64).sum().clamp_min(torch.finfo(torch.float64).tiny)
            )
            err, over = _excess(
                c64 - s * v64,
                _rounding(c.dtype, c) + torch.finfo(torch.float64).eps * (s * v64).abs(),
            )
            if over > 0:
                return (
                    err,
                    f"an added operand is not {s:.4g} times its sublayer's output (off by {err:.3g})",
                )
        else:
            err, over = _excess(wide(c) - wide(v).to(wide(c).dtype), _rounding(c.dtype, c))
            if over > 0:
                return err, f"an added operand is not its sublayer's output (off by {err:.3g})"
        operands.append(c)
    total = wide(base).clone()
    for c in operands:
        total = total + wide(c)
    if total.shape != target.shape:
        return float("inf"), f"the sum has shape {tuple(total.shape)}, not {tuple(target.shape)}"
    err, over = _excess(total - wide(target), _rounding(target.dtype, base, *operands))
    if over > 0:
        return err, f"off by {err:.3g}, more than the {len(operands)} add(s) can round"
    return err, None


def _branch_error(base: Tensor, target: Tensor, outs: list) -> tuple[float, str | None]:
    """`target = base + one branch output` (a sublayer's, or a later sibling's) to the roundings."""
    errors = [float("inf")]
    for v in outs:
        if v is not None and tokens_flattened(v.shape, target.shape):
            v = v.reshape(target.shape)  # a branch run on flattened tokens (OPT's MLP)
        if v is not None and v.shape == target.shape:
            err, over = _excess(
                wide(base) + wide(v) - wide(target), _rounding(target.dtype, base, v)
            )
            errors.append(err)
            if over <= 0:
                return err, None
    return min(
        errors
    ), f"no branch output makes it hold (off by {min(errors):.3g}, more than one add can round)"
