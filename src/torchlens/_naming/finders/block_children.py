"""The per-layer targets that are the block's own children, held by no sublayer module: a post-LN
block's two norms after its residual adds and the block itself (BERT), the two weighted layers
of an MLP held by no module of its own (BERT's between those norms, OPT's after a pre-LN norm),
and an output projection that reads the attention's output outside it (BERT)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from torchlens._core.ops import ACTIVATION_OPS
from torchlens._core.records import ModuleCall, Ref
from torchlens._core.roles import WEIGHT_LAYOUT
from torchlens._naming.finders.calls import calls_below, layer_of, weighted_leaves

if TYPE_CHECKING:
    from torchlens._trace import Trace


def post_ln(trace: Trace, layer: int, which: int) -> ModuleCall | None:
    """A post-LN block's norms, outside its attention: `0` after the attention, `-1` the last.

    Only for a block whose output is its last norm's output (post-LN), and only when there are
    exactly two such norms, so a pre-LN block never gets them.
    """
    lay = layer_of(trace, layer)
    attn = lay.attention
    if attn is None:
        return None
    inside = {id(c) for c in calls_below(trace, attn)} | {id(attn)}
    norms = [
        c
        for c in calls_below(trace, lay.call)
        if c.role == "norm" and id(c) not in inside and c.first_op > attn.end_op
    ]
    if (
        len(norms) != 2
        or type(norms[-1].output_ref) is not Ref
        or norms[-1].output_ref != lay.call.output_ref
    ):
        return None
    return norms[which]


def post_ln_of(trace: Trace, layer: int, which: int) -> ModuleCall | None:
    """A post-LN block's norm after its sublayer number `which` (0: the attention, 1: the
    cross-attention, 2: the MLP), in the order they run: for a block whose output is its last
    norm's output, with exactly one norm outside its sublayers after each of its three sublayers
    (BART's decoder layer, whose MLP may be held by no module); None otherwise (a pre-LN block,
    T5's)."""
    lay = layer_of(trace, layer)
    if lay.attention is None or lay.cross_attention is None:
        return None
    # the MLP may be held by no module of its own (BART's fc1 and fc2 are the layer's)
    subs = [s for s in (lay.attention, lay.cross_attention, lay.mlp) if s is not None]
    inside = {id(c) for s in subs for c in [s, *calls_below(trace, s)]}
    norms = [c for c in calls_below(trace, lay.call) if c.role == "norm" and id(c) not in inside]
    if (
        len(norms) != 3
        or type(norms[-1].output_ref) is not Ref
        or norms[-1].output_ref != lay.call.output_ref
        or not all(s.end_op <= n.first_op for s, n in zip(subs, norms))
    ):
        return None
    return norms[which]


def split_mlp(trace: Trace, layer: int, which: int) -> ModuleCall | None:
    """The two weighted layers of an MLP held by no module of its own, between a post-LN block's two norms."""
    ln1, ln2 = post_ln(trace, layer, 0), post_ln(trace, layer, -1)
    if ln1 is None or ln2 is None or layer_of(trace, layer).mlp is not None:
        return None
    lins = [
        c
        for c in weighted_leaves(trace, layer_of(trace, layer).call)
        if ln1.end_op <= c.first_op < ln2.first_op
    ]
    return lins[which] if len(lins) == 2 else None


def _pre_ln_split(trace: Trace, layer: int) -> tuple[ModuleCall, ModuleCall, ModuleCall] | None:
    """(norm, up, down) of a pre-LN block whose MLP is held by no module of its own (OPT's and
    fairseq-style layers: `final_layer_norm`, `fc1`, `fc2` are children of the block): exactly two
    weighted layers run after the attention, the first reads a norm's output directly, and the
    block's output is not a norm's (which would make it post-LN)."""
    lay = layer_of(trace, layer)
    if lay.mlp is not None or lay.attention is None or post_ln(trace, layer, -1) is not None:
        return None
    end = max(c.end_op for c in (lay.attention, lay.cross_attention) if c is not None)
    lins = [c for c in weighted_leaves(trace, lay.call) if c.first_op >= end]
    if len(lins) != 2 or type(lins[0].input_ref) is not Ref or type(lins[0].output_ref) is not Ref:
        return None
    norm = next(
        (
            c
            for c in calls_below(trace, lay.call)
            if c.role == "norm" and c.first_op >= end and c.output_ref == lins[0].input_ref
        ),
        None,
    )
    # The up projection's output goes straight into an activation (a module, or an activation op),
    # so that it is the activation's input (`hook_pre`).
    up = lins[0].output_ref
    activated = any(
        c.input_ref == up and c.role != "norm" and c.class_name not in WEIGHT_LAYOUT
        for c in calls_below(trace, lay.call)
    ) or any(
        op.name in ACTIVATION_OPS and op.inputs and op.inputs[0] == up
        for op in trace.ops[lins[0].end_op : lins[1].first_op]
    )
    return None if norm is None or not activated else (norm, lins[0], lins[1])


def pre_ln_mlp(which: int) -> Callable[[Trace, int], ModuleCall | None]:
    def find(trace: Trace, layer: int) -> ModuleCall | None:
        split = _pre_ln_split(trace, layer)
        return None if split is None else split[which]

    return find


def attn_out_proj(trace: Trace, layer: int) -> ModuleCall | None:
    """The output projection that reads the attention's output, when it sits outside the attention (BERT)."""
    lay = layer_of(trace, layer)
    attn = lay.attention
    if attn is None or type(attn.output_ref) is not Ref:
        return None
    return next(
        (c for c in weighted_leaves(trace, lay.call) if c.input_ref == attn.output_ref), None
    )


def post_ln_block(trace: Trace, layer: int) -> ModuleCall | None:
    return layer_of(trace, layer).call if post_ln(trace, layer, -1) is not None else None
