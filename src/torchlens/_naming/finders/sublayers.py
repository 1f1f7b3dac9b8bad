"""The per-layer targets around a block's sublayers: the norms that feed or follow them, the
sandwich norms, what each sublayer's output becomes in the residual stream, the attention's
output projection, the gated MLP, and the call that adds a sublayer's residual (T5)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from torchlens._analysis.graph import adds_own_input
from torchlens._core.ops import FUSED_ATTENTION_OPS, SOFTMAX_OPS
from torchlens._core.records import ModuleCall, Ref
from torchlens._core.roles import WEIGHT_LAYOUT
from torchlens._naming.finders.calls import calls_below, layer_of, sublayer
from torchlens._naming.finders.residual import added_to_residual, contribution, has_facet

if TYPE_CHECKING:
    from torchlens._trace import Trace


def norm_where(
    trace: Trace, layer: int, match: Callable[[ModuleCall, ModuleCall], bool], which: str
):
    """The first norm in the layer, outside its sublayer `which`, for which `match(norm, sublayer)` holds."""
    sub = sublayer(trace, layer, which)
    if sub is None:
        return None
    inside = {id(c) for c in calls_below(trace, sub)}
    for norm in calls_below(trace, layer_of(trace, layer).call):
        if norm.role == "norm" and id(norm) not in inside and match(norm, sub):
            return norm
    return None


def feeds(n: ModuleCall, s: ModuleCall) -> bool:
    """Whether `n`'s output is `s`'s input."""
    return type(n.output_ref) is Ref and n.output_ref == s.input_ref


def follows(n: ModuleCall, s: ModuleCall) -> bool:
    """Whether `n`'s input is `s`'s output."""
    return type(s.output_ref) is Ref and n.input_ref == s.output_ref


def sandwich_norm(trace: Trace, layer: int, which: str) -> ModuleCall | None:
    """The norm applied to the sublayer's output, when that norm's output is the sublayer's
    contribution: added (as it is, or times a constant: HyperCLOVAX) to the stream the sublayer
    read (Gemma-2, OLMo-2). A norm that reads the
    sublayer's output after the sublayer added the stream itself (BLOOM's attention returns the
    residual sum, and `post_attention_layernorm` is the MLP's input norm) normalizes the stream,
    not a contribution, and is no post-sublayer norm."""
    norm = norm_where(trace, layer, follows, which)
    if added_to_residual(trace, layer, norm, sublayer(trace, layer, which)) is None:
        return None
    return norm


def out_final(which: str) -> Callable[[Trace, int], ModuleCall | None]:
    """The norm applied to the sublayer's output when that norm's output is what the layer adds
    to the residual stream (a sandwich norm; or that output times a constant, with the norm's
    `contribution` facet found), else the sublayer itself when its output is."""

    def find(trace: Trace, layer: int) -> ModuleCall | None:
        norm = sandwich_norm(trace, layer, which)
        how = added_to_residual(trace, layer, norm, sublayer(trace, layer, which))
        if how == "as_is" or (how == "changed" and has_facet(norm, "contribution")):
            return norm
        if how == "changed":  # the changed norm output is the contribution, and it was not found
            return None
        return contribution(which)(trace, layer)

    return find


def attn_o(trace: Trace, layer: int) -> ModuleCall | None:
    """The attention's output projection: a weighted module inside it that runs after its kernel."""
    attn = sublayer(trace, layer, "attention")
    if attn is None:
        return None
    kernel = next(
        (
            op.index
            for op in trace.ops[attn.first_op : attn.end_op]
            if op.name in SOFTMAX_OPS | FUSED_ATTENTION_OPS
        ),
        None,
    )
    weighted = [
        c
        for c in calls_below(trace, attn)
        if c.class_name in WEIGHT_LAYOUT and kernel is not None and c.first_op > kernel
    ]
    return weighted[-1] if weighted else None


#: The facet only a gated MLP has (its row in `torchlens._core.facet_spec` says why others lack it).
GATED_BY = "pre_linear"


def mlp_gated(trace: Trace, layer: int) -> ModuleCall | None:
    """The layer's MLP when it is gated (it has a linear branch), else None."""
    mlp = sublayer(trace, layer, "mlp")
    if mlp is None or mlp.facets is None or GATED_BY not in mlp.facets.sites:
        return None
    return mlp


def residual_wrapper(which: str) -> Callable[[Trace, int], ModuleCall | None]:
    """The call between the block and its sublayer that adds the residual (T5's T5LayerSelfAttention)."""

    def find(trace: Trace, layer: int) -> ModuleCall | None:
        lay = layer_of(trace, layer)
        c = getattr(lay, which)
        while c is not None and c.parent is not None and c.parent is not lay.call:
            c = c.parent
            if adds_own_input(trace.ops, c):
                return c
        return None

    return find
