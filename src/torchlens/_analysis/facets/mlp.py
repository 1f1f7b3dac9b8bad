"""MLP facets: `pre`, `pre_linear`, `act`, `gated_out`, `post`, `down_out`."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from torchlens._analysis.facets.common import io_ref, make_site
from torchlens._analysis.graph import Graph
from torchlens._core import ops as _ops
from torchlens._core import roles as _roles
from torchlens._core.records import ModuleCall, Ref
from torchlens._core.sites import FacetSite

# -- MLP ---------------------------------------------------------------------------------------


def weighted(g: Graph, call: ModuleCall) -> bool:
    return (
        isinstance(getattr(g.modules[call.address], "weight", None), Tensor)
        and _roles.weight_layout(g.modules[call.address]) is not None
    )


def mlp_facets(g: Graph, call: ModuleCall, kids: list[ModuleCall]) -> dict[str, FacetSite]:
    linears = [k for k in kids if weighted(g, k)]
    if len(linears) < 2:
        return {}
    down = linears[-1]
    post_ref, sites = io_ref(g, down, "in"), {}
    sites["post"] = make_site(g, "post", post_ref, note="input of the down projection")
    sites["down_out"] = make_site(
        g, "down_out", io_ref(g, down, "out"), note="down projection output"
    )
    linear_outs = {k.output_ref for k in linears if type(k.output_ref) is Ref}

    def is_linear_branch(ref: Any) -> bool:
        for _ in range(4):
            if ref in linear_outs:
                return True
            op = g.op(ref)
            if op is None or op.name not in _ops.SLICE_OPS:
                return False
            ref = op.inputs[0]
        return False

    def back(ref: Any) -> Any:
        """Back from `ref` over what sits between the activation (or the gating product) and
        the down projection: dropout and casts (T5), a norm child (Kosmos-2's `ffn_layernorm`,
        BitNet's `ffn_sub_norm`). In training mode the down projection reads the dropped-out
        tensor (`post`), not the activation's output (`act`)."""
        for _ in range(4):
            ref = g.source(ref, _ops.PASS_THROUGH_OPS)
            norm = next(
                (k for k in kids if k.output_ref == ref and _roles.is_norm(g.modules[k.address])),
                None,
            )
            if norm is None or type(norm.input_ref) is not Ref:
                break
            ref = norm.input_ref
        return ref

    def activation_module(ref: Any) -> ModuleCall | None:
        return next(
            (
                k
                for k in kids
                if k.output_ref == ref
                and not weighted(g, k)
                and not _roles.is_norm(g.modules[k.address])
            ),
            None,
        )

    def activation_input(ref: Any) -> Any:
        """The input of the activation that produced `ref` (an activation module's, or a
        functional activation op's); None when `ref` is not an activation's output."""
        module = activation_module(ref)
        if module is not None:
            return io_ref(g, module, "in")
        op = g.op(ref)
        return (
            op.inputs[0]
            if op is not None and op.name in _ops.ACTIVATION_OPS and op.inputs
            else None
        )

    core = back(post_ref)
    act_ref, gated = core, False
    prod = g.op(core)
    # An activation module's output is the activation even where its last op is a product
    # (CLIP's QuickGELU: x * sigmoid(1.702 x)); only a bare product can be the gate.
    if (
        activation_module(core) is None
        and prod is not None
        and prod.name in _ops.MUL_OPS
        and len(prod.inputs) == 2
    ):
        a, b = prod.inputs
        if is_linear_branch(a) != is_linear_branch(b):
            lin, other = (a, b) if is_linear_branch(a) else (b, a)
            act_ref, gated = g.source(other, _ops.PASS_THROUGH_OPS), True
            sites["pre_linear"] = make_site(
                g, "pre_linear", lin, note="linear branch of the gated MLP"
            )
            if act_ref == other:  # nothing between act and the product: it is act(pre) * pre_linear
                sites["gated_out"] = make_site(g, "gated_out", core, note="act(pre) * pre_linear")
    # `act` only where it is an activation of the up projection: a scale, an in-place write or
    # anything else in between would otherwise be served under its name.
    pre_ref = activation_input(act_ref)
    if pre_ref is not None and is_linear_branch(pre_ref):
        sites["act"] = make_site(g, "act", act_ref, note="activation output")
        sites["pre"] = make_site(g, "pre", pre_ref, note="input of the activation")
    else:  # not known to be an activation of the up projection, so not known to be gated either
        sites.pop("gated_out", None)
        sites.pop("pre_linear", None)
        m, op = g.meta(act_ref), g.op(act_ref)
        if m is not None and op is not None:
            sites["act"] = FacetSite(
                "act",
                "refused",
                m[0],
                m[1],
                note=(
                    f"what reaches the down projection{' through the gating product' if gated else ''} comes from "
                    f"op #{op.index} {op.name}, not from an activation of the up projection, so no tensor of this MLP "
                    "is known to be act(pre)"
                ),
            )
    return {k: v for k, v in sites.items() if v is not None}
