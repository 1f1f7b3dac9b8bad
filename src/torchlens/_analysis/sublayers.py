"""The sublayers of one layer of a stack: its attention, cross-attention and MLP, from the data flow.

`fill_layer` is the rule `torchlens._analysis.structure.find` applies to every layer it found:

- The **attention** is found from an attention kernel (a softmax over a
  `[batch, heads, query, key]` tensor, or a fused attention op): it is the layer's child call
  that ran the kernel, or, when that child adds its own input back (a residual inside it, as in
  T5's `T5LayerSelfAttention` or BERT's `BertAttention`), its child that ran the kernel. Where
  several children ran a kernel, those whose kernel's queries are the layer's tokens are taken (a
  softmax over residual streams, DeepSeek-V4's hyper-connection, is no attention). A second
  attention whose keys do not come from the layer's input is the **cross-attention**.
- The **MLP** is a child call of a layer (found with the same descent through residual
  wrappers, T5's `T5LayerFF` -> `DenseReluDense`): not a norm, no kernel, at least two ops
  reading weights outside norms, and not a token mixer (no convolution over positions: a
  Mamba mixer, a short conv); it applies a nonlinearity and keeps its input's width. Where
  such a call reads what the layer's token mixer wrote, one beside the mixer (reading the
  mixer's input) is not the MLP; routed experts give way to a dense MLP beside them. The one
  call left is the MLP, whatever the layer's mixer (attention, SSM, conv, linear attention);
  none when no call, or several, are left (`_the_mlp`). Being the first or the last call to
  write into the residual makes no call the MLP.

Sublayers named with `roles=` win over these rules.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from torch import nn

from torchlens._analysis.graph import Graph
from torchlens._core import ops as _ops
from torchlens._core.records import ModuleCall, OpRecord, Ref

if TYPE_CHECKING:
    from torchlens._analysis.structure import Layer

__all__ = ["fill_layer"]


def _sublayer(flow: Graph, layer: ModuleCall, pick) -> list[ModuleCall]:
    """Calls under `layer` that `pick` accepts, descending through residual wrappers.

    A picked child that adds its own input back (a residual inside it) is replaced by its picked
    children, when it has any; so is one that only wraps a picked child returning the same output.
    """
    out: list[ModuleCall] = []
    todo = list(
        flow.kids.get(id(layer), [])
    )  # iterative: a recursive closure would make a reference cycle
    # id(call) -> pick(call): a child is asked again when its parent is descended through
    answers: dict[int, bool] = {}

    def picked(call: ModuleCall) -> bool:
        answer = answers.get(id(call))
        if answer is None:
            answer = answers[id(call)] = bool(pick(call))
        return answer

    while todo:
        node = todo.pop(0)
        if not picked(node):
            continue
        inner = [k for k in flow.kids.get(id(node), []) if picked(k)]
        if inner and flow.adds_own_input(node):
            todo[:0] = inner
            continue
        if (
            len(inner) == 1
            and type(node.output_ref) is Ref
            and inner[0].output_ref == node.output_ref
        ):
            todo.insert(
                0, inner[0]
            )  # a pure wrapper (GPT-Neo's attn around attn.attention): take the inner one
            continue
        out.append(node)
    return out


def _param_ops(flow: Graph, call: ModuleCall, roles: dict[str, str]) -> int:
    return sum(
        1
        for op in flow.ops[call.first_op : call.end_op]
        if roles.get(op.module) != "norm" and any(isinstance(r, str) for r in op.inputs)
    )


def _over_tokens(kernel: OpRecord, tokens: set[int] | None) -> bool:
    """Whether an attention kernel's queries are the layer's tokens: its query axis (the
    softmax's or the fused kernel's second to last) has the layer input's token count (`tokens`:
    the sizes the token axis may have, None where the input's shape does not tell). A softmax
    over something else of three or more dimensions (DeepSeek-V4's hyper-connection mixing its
    residual streams, a softmax over earlier blocks' outputs) is not the layer's attention. A
    fused attention kernel always is: where its heads and positions are mixed up, its facets are
    refused with that reason (`facets.heads.head_guard`)."""
    if tokens is None or kernel.name in _ops.FUSED_ATTENTION_OPS:
        return True  # a fused attention kernel is attention (its layout is checked with its facets)
    return len(kernel.shape) >= 2 and kernel.shape[-2] in tokens


def fill_layer(
    flow: Graph,
    layer: Layer,
    roles: dict[str, str],
    modules: dict[str, nn.Module],
    overrides: dict[str, str],
) -> None:
    below = flow.descendants(layer.call)
    named = {c.address: overrides[c.address] for c in below if c.address in overrides}
    if named:
        attns = [c for c in below if named.get(c.address) in ("attention", "cross_attention")]
    else:
        shape = flow.shape(layer.call.input_ref)
        # the token axis: [batch, tokens, d] or [tokens, batch, d] (sequence-first); with more
        # axes, [batch, tokens, streams, d] (DeepSeek-V4's hyper-connections)
        tokens = (
            None
            if shape is None or len(shape) < 3
            else {shape[0], shape[1]}
            if len(shape) == 3
            else {shape[1]}
        )
        attns = _sublayer(
            flow,
            layer.call,
            lambda c: (
                bool(flow.kernels(c)) or isinstance(modules.get(c.address), nn.MultiheadAttention)
            ),
        )
        # Of several, those whose kernel's queries are the tokens: a softmax over something else
        # (streams, earlier blocks' outputs) in a call beside the attention is not the attention.
        # One alone stays (a windowed attention's queries are its window's tokens: Swin).
        over = [
            c
            for c in attns
            if any(_over_tokens(k, tokens) for k in flow.kernels(c))
            or isinstance(modules.get(c.address), nn.MultiheadAttention)
        ]
        if over and len(over) < len(attns):
            attns = over
    # a picked call that holds an attention and an MLP after it is a block inside the block
    # (Zamba's shared transformer): its attention is the attention, its MLP is looked for too
    inner_blocks = []
    if not named:
        for i, a in enumerate(attns):
            kernel_kids = [k for k in flow.kids.get(id(a), []) if flow.kernels(k)]
            if len(kernel_kids) == 1 and any(
                k.first_op >= kernel_kids[0].end_op and _weighted(flow, k, roles)
                for k in flow.kids.get(id(a), [])
            ):
                inner_blocks.append(a)
                attns[i] = kernel_kids[0]
    for a in attns:
        if named.get(a.address) == "cross_attention" or (
            layer.attention is not None and _keys_outside(flow, layer.call, a)
        ):
            layer.cross_attention = layer.cross_attention or a
        elif layer.attention is None:
            layer.attention = a
    if named:
        mlps = [c for c in below if named.get(c.address) == "mlp"]
        layer.mlp = mlps[0] if mlps else None
        return
    weighted = [
        c
        for holder in [layer.call] + inner_blocks
        for c in _sublayer(flow, holder, lambda c: _weighted(flow, c, roles))
    ]
    layer.mlp = _the_mlp(flow, layer, sorted(weighted, key=lambda c: c.first_op), roles)


def _weighted(flow: Graph, call: ModuleCall, roles: dict[str, str]) -> bool:
    """A sublayer that could be an MLP: not a norm or embedding, no attention kernel, calls
    inside it, at least two ops reading weights outside norms."""
    return (
        roles.get(call.address) not in ("norm", "embedding")
        and not flow.kernels(call)
        and bool(flow.kids.get(id(call)))
        and _param_ops(flow, call, roles) >= 2
    )


def _the_mlp(
    flow: Graph, layer: Layer, weighted: list[ModuleCall], roles: dict[str, str]
) -> ModuleCall | None:
    """The layer's MLP among its weighted sublayer calls (`weighted`, in run order), or None.

    The **token mixers** of a layer are its attention calls and every weighted call that mixes
    positions (an op of `_core.ops.TOKEN_MIXING_OPS`: a Mamba mixer's conv and scan, a short
    conv). The MLP maps each position on its own, through a nonlinearity (`_nonlinear`), to as
    many values of the input's width (`_keeps_width`): a low-rank linear side block is no MLP,
    nor is a router. Where some such call reads what a token mixer wrote
    (the residual after the attention), one that runs beside the mixer instead, reading the
    mixer's input (Gemma-3n's LAuReL, an adapter in parallel with the attention), is not the MLP.
    Routed experts reading a sibling router's choice give way to a dense MLP beside them.
    The MLP is the one call left; with none or several, the layer has none (several: which one
    is the MLP cannot be told from the data flow; `roles=` can name it).
    """
    mixers = [c for c in (layer.attention, layer.cross_attention) if c is not None]
    mixers += [
        c
        for c in weighted
        if any(op.name in _ops.TOKEN_MIXING_OPS for op in flow.ops[c.first_op : c.end_op])
    ]
    mixing = {id(c) for c in mixers}
    mlps = [
        c
        for c in weighted
        if id(c) not in mixing and _nonlinear(flow, c, roles) and _keeps_width(flow, c)
    ]
    after = [c for c in mlps if any(flow.reaches(m.output_ref, c.input_ref) for m in mixers)]
    if after:
        mlps = after
    unrouted = [c for c in mlps if not _routed(flow, c, weighted)]
    if unrouted:
        mlps = unrouted
    return mlps[0] if len(mlps) == 1 else None


def _routed(flow: Graph, call: ModuleCall, siblings: list[ModuleCall]) -> bool:
    """Whether the call reads what a sibling sublayer computed, besides its input: a routing
    decision (Gemma-4's `experts` read `router`'s choice). Routed experts beside a dense MLP that
    reads the stream alone are not that MLP."""
    spans = [(c.first_op, c.end_op) for c in siblings if c is not call]
    return any(
        type(r) is Ref and r != call.input_ref and any(lo <= r.op < hi for lo, hi in spans)
        for op in flow.ops[call.first_op : call.end_op]
        for r in op.inputs
    )


def _keeps_width(flow: Graph, call: ModuleCall) -> bool:
    """Whether the call's output has its input's last dimension and number of values (Llama-4's
    MoE returns its input flattened to `[tokens, width]`)."""
    i, o = flow.shape(call.input_ref), flow.shape(call.output_ref)
    return (
        i is not None
        and o is not None
        and len(i) > 0
        and len(o) > 0
        and i[-1] == o[-1]
        and math.prod(i) == math.prod(o)
    )


def _nonlinear(flow: Graph, call: ModuleCall, roles: dict[str, str]) -> bool:
    """Whether the call applies a nonlinearity outside its norms: an activation op, or a product
    of two tensors both computed inside the call (a gate)."""
    for op in flow.ops[call.first_op : call.end_op]:
        if roles.get(op.module) == "norm":
            continue
        if op.name in _ops.ACTIVATION_OPS:
            return True
        if (
            op.name in _ops.MUL_OPS
            and sum(1 for r in op.inputs if type(r) is Ref and r.op >= call.first_op) >= 2
        ):
            return True
    return False


def _keys_outside(flow: Graph, layer: ModuleCall, attn: ModuleCall) -> bool:
    """Whether the attention's keys are not computed from the layer's input (cross-attention)."""
    kernel = next(iter(flow.kernels(attn)), None)
    if kernel is None or type(layer.input_ref) is not Ref:
        return False
    if kernel.name in _ops.FUSED_ATTENTION_OPS:
        return len(kernel.inputs) > 1 and not flow.reaches(layer.input_ref, kernel.inputs[1])
    r = (
        kernel.inputs[0] if kernel.inputs else None
    )  # eager: walk back from the scores to their matmul
    for _ in range(12):
        if type(r) is not Ref:
            return False
        op = flow.ops[r.op]
        if op.name in _ops.MATMUL_OPS:
            k = _ops.MATMUL_OPERANDS.get(op.name, (0, 1))[1]
            return k < len(op.inputs) and not flow.reaches(layer.input_ref, op.inputs[k])
        r = next((x for x in op.inputs if type(x) is Ref), None)
    return False
