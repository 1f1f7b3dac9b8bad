"""Block facets: `resid_pre`, `resid_mid` (checked against the residual sums) and `resid_post`."""

from __future__ import annotations


from torch import Tensor

from torchlens._analysis.graph import Graph
from torchlens._analysis.facets.common import held, io_ref, make_site, wide
from torchlens._analysis.facets.mlp import weighted
from torchlens._core import ops as _ops
from torchlens._core import roles as _roles
from torchlens._core.facet_spec import tokens_flattened
from torchlens._core.pending import Pending
from torchlens._core.records import ModuleCall, Ref
from torchlens._core.sites import FacetSite


# -- blocks ------------------------------------------------------------------------------------


def block_facets(g: Graph, call: ModuleCall, kids: list[ModuleCall]) -> dict[str, FacetSite]:
    sites = {}
    for name, which in (("resid_pre", "in"), ("resid_post", "out")):
        s = make_site(g, name, io_ref(g, call, which), note=f"block {which}put")
        if s:
            sites[name] = s
    attn = next((k for k in kids if k.role == "attention"), None)
    mlp = next((k for k in kids if k.role == "mlp"), None)
    if mlp is None and attn is not None:
        mlp = _split_mlp_norm(g, call, kids, attn)
    if attn is None or mlp is None or type(attn.output_ref) is not Ref or type(mlp.input_ref) is not Ref:
        return sites
    # Ops downstream of the attention output and upstream of the MLP input: the residual add.
    down = {attn.output_ref.op}
    for i in range(attn.end_op, mlp.first_op):
        if any(type(r) is Ref and r.op in down for r in g.ops[i].inputs):
            down.add(i)
    up = g.ancestors(mlp.input_ref, attn.end_op)
    adds = [
        i for i in down & set(up)
        if g.ops[i].name in _ops.ADD_OPS and g.ops[i].module == call.address and g.ops[i].call == call.index
    ]
    if adds:
        sites["resid_mid"] = make_site(g, "resid_mid", Ref(_pick_resid_mid(g, attn, adds), 0), note="residual add after attention")
        sites.update(_check_resid_mid(g, sites, kids, attn, mlp))
    return sites


def _split_mlp_norm(g: Graph, call: ModuleCall, kids: list[ModuleCall], attn: ModuleCall) -> ModuleCall | None:
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


def _check_resid_mid(
    g: Graph, sites: dict[str, FacetSite], kids: list[ModuleCall], attn: ModuleCall, mlp: ModuleCall
) -> dict[str, FacetSite]:
    """Refuse `resid_mid` unless resid_pre + the attention branch = resid_mid and resid_mid + the
    MLP branch = resid_post. A branch's output is its sublayer's output or that of a later
    sibling (a post-sublayer norm, a dropout), so Gemma-2's post-norms pass. The check is
    deferred to the first read (see `FacetSite`); only whether it can run is settled here."""
    mid, pre, post = (sites.get(n) for n in ("resid_mid", "resid_pre", "resid_post"))
    if mid is None or held(mid) is None:
        return {}
    if pre is None or post is None or held(pre) is None or held(post) is None:
        mid.tensor = None  # cannot be checked, so not served
        return {}
    attn_branch = [k for k in kids if attn.first_op <= k.first_op < mlp.first_op]
    mlp_branch = [k for k in kids if k.first_op >= mlp.first_op]
    branch_outs = [[g.value(io_ref(g, k, "out")) for k in branch] for branch in (attn_branch, mlp_branch)]
    inputs = [held(pre), held(mid), held(post), *branch_outs[0], *branch_outs[1]]
    n_attn, dtype = len(branch_outs[0]), mid.dtype

    def run(inputs: list) -> tuple:
        pre_t, mid_t, post_t = inputs[:3]
        m = wide(mid_t)
        tol = _ops.reconstruction_tolerance(dtype) * max(1.0, float(post_t.abs().max()))

        def best(base: Tensor, target: Tensor, outs: list) -> float:
            errors = [float("inf")]
            for v in outs:
                if v is not None and tokens_flattened(v.shape, target.shape):
                    v = v.reshape(target.shape)  # a branch run on flattened tokens (OPT's MLP)
                if v is not None and v.shape == target.shape:
                    errors.append(float((base + wide(v)).sub_(target).abs_().max()))
                    if errors[-1] <= tol:
                        break
            return min(errors)

        err = max(best(wide(pre_t), m, inputs[3 : 3 + n_attn]), best(m, wide(post_t), inputs[3 + n_attn :]))
        if not err <= tol:
            return {}, err, (f"resid_pre + attention branch = resid_mid = resid_post - MLP branch does not hold "
                             f"(off by {err:.3g} > {tol:.3g})")
        return {}, err, None

    Pending(run, inputs, [mid])
    return {}


