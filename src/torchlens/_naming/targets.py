"""Targets: which module of a trace a table row reads, found from roles and data flow.

A row of a naming table says *what* it reads (`target="ln2"`, `facet="scale"`); this module
says *where* that is in a given trace. Each target is found from module roles and from which
module's output feeds which module's input, so the same row reads the right module on GPT-2
(`transformer.h.0.ln_2`), Llama (`model.layers.0.post_attention_layernorm`) or Gemma-2
(`model.layers.0.pre_feedforward_layernorm`). Layers, sublayers, embeddings, final norm and
unembedding come from the trace's structure (`torchlens._analysis.structure`), so
a layer index counts the calls of the language-model stack's blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchlens._analysis.graph import adds_own_input
from torchlens._analysis.structure import Layer, Structure, from_model_input
from torchlens._core.errors import TorchLensError
from torchlens._core.facet_spec import absent_reason
from torchlens._core.ops import (
    ACTIVATION_OPS,
    ADD_OPS,
    CAST_OPS,
    FUSED_ATTENTION_OPS,
    PASS_THROUGH_OPS,
    RESHAPE_OPS,
    SCALE_OPS,
    SOFTMAX_OPS,
)
from torchlens._core.records import ModuleCall, Ref
from torchlens._core.roles import ROLES, WEIGHT_LAYOUT

if TYPE_CHECKING:
    from torchlens._trace import Trace

# Finders take (trace, layer) and return the ModuleCall the target names, or None.


def _st(trace: Trace) -> Structure:
    """The trace's structure (`trace()` always finds one; a finder never runs on a trace without it)."""
    if trace.structure is None:
        raise TorchLensError(
            "this trace has no structure (its records are incomplete); trace the model again."
        )
    return trace.structure


def _layer(trace: Trace, layer):
    """The LM stack's layer `layer`, or `layer` itself when `find_call` already picked one of another stack."""
    return layer if isinstance(layer, Layer) else _st(trace).layers[layer]


def stack_of_kind(trace: Trace, kind: str):
    """The one stack of that kind (`"encoder"` / `"decoder"`), or None."""
    stacks = (
        [s for s in trace.structure.stacks.values() if s.kind == kind] if trace.structure else []
    )
    return stacks[0] if len(stacks) == 1 else None


def _kids(trace: Trace, call: ModuleCall) -> list[ModuleCall]:
    return _st(trace).children.get(id(call), [])


def _below(trace: Trace, call: ModuleCall) -> list[ModuleCall]:
    """Every call made inside `call`, in the order they started."""
    out, todo = [], list(_kids(trace, call))
    while todo:
        c = todo.pop(0)
        out.append(c)
        todo.extend(_kids(trace, c))
    return sorted(out, key=lambda c: c.first_op)


def _sublayer(trace: Trace, layer: int, which: str) -> ModuleCall | None:
    return getattr(_layer(trace, layer), which)


def _norm_where(
    trace: Trace, layer: int, match: Callable[[ModuleCall, ModuleCall], bool], which: str
):
    sub = _sublayer(trace, layer, which)
    if sub is None:
        return None
    inside = {id(c) for c in _below(trace, sub)}
    for norm in _below(trace, _layer(trace, layer).call):
        if norm.role == "norm" and id(norm) not in inside and match(norm, sub):
            return norm
    return None


def _feeds(n: ModuleCall, s: ModuleCall) -> bool:
    return type(n.output_ref) is Ref and n.output_ref == s.input_ref


def _follows(n: ModuleCall, s: ModuleCall) -> bool:
    return type(s.output_ref) is Ref and n.input_ref == s.output_ref


def _sandwich_norm(trace: Trace, layer: int, which: str) -> ModuleCall | None:
    """The norm applied to the sublayer's output, when that norm's output is the sublayer's
    contribution: added (as it is, or times a constant: HyperCLOVAX) to the stream the sublayer
    read (Gemma-2, OLMo-2). A norm that reads the
    sublayer's output after the sublayer added the stream itself (BLOOM's attention returns the
    residual sum, and `post_attention_layernorm` is the MLP's input norm) normalizes the stream,
    not a contribution, and is no post-sublayer norm."""
    norm = _norm_where(trace, layer, _follows, which)
    if _added_to_residual(trace, layer, norm, _sublayer(trace, layer, which)) is None:
        return None
    return norm


def _added_to_residual(
    trace: Trace, layer: int, sub: ModuleCall | None, reads: ModuleCall | None = None
) -> str | None:
    """Whether the call's output is a summand of what the layer adds to its residual stream:
    `"as_is"`, `"changed"` (the model reshapes it, or multiplies it by a constant, on the way:
    Llama-4, Granite, MiniCPM3), or None (it is not).

    Followed through casts, dropout and other sums (GPT-J adds attention and MLP outputs first),
    the output must meet an add whose other operand is the stream the sublayer read (a tensor its
    input, `reads`'s, by default `sub`'s own, is computed from), or a sum holding it. That is what makes the output the
    sublayer's contribution to the residual stream; BERT's self-attention returns the merged
    heads, and its output projection lies outside it. A sum that then goes through a norm is no
    contribution (Gemma-4 normalizes its MLP's and its experts' normed outputs once more before
    the add).
    """
    if sub is None or type(sub.output_ref) is not Ref:
        return None
    block = _layer(trace, layer).call
    reads = reads or sub
    refs, changed = {sub.output_ref}, set()
    for op in trace.ops[sub.end_op : block.end_op]:
        hit = [r for r in op.inputs if r in refs]
        if not hit:
            continue
        out = Ref(op.index, 0)
        if op.name in ADD_OPS:
            if any(_holds_stream(trace, r, reads.input_ref) for r in op.inputs if r not in refs):
                return "changed" if any(r in changed for r in hit) else "as_is"
            refs.add(out)
        elif (
            op.name in PASS_THROUGH_OPS and op.inputs[0] in refs
        ):  # (`y.type_as(x)` passes y on, not x)
            refs.add(out)
            if op.inputs[0] in changed:
                changed.add(out)
        elif op.name in SCALE_OPS | RESHAPE_OPS and len(op.inputs) == 1 and op.inputs[0] in refs:
            # a product with a Python number, or a view: the only tensor argument is ours
            refs.add(out)
            changed.add(out)
    return None


def _has_facet(call: ModuleCall | None, facet: str) -> bool:
    facets = call.facets if call is not None else None
    return facets is not None and (facet in facets.sites or facet in facets.refused)


def _holds_stream(trace: Trace, ref, read, depth: int = 4) -> bool:
    """Whether `ref` is the residual stream the tensor `read` was computed from, or a sum (through
    casts) one of whose terms is (a block adding a side branch and its MLP in one expression,
    `x + side(h) + mlp(h)`)."""
    if _computed_from(trace, ref, read):
        return True
    op = trace.ops[ref.op] if type(ref) is Ref else None
    if depth == 0 or op is None or op.name not in ADD_OPS | PASS_THROUGH_OPS or not op.inputs:
        return False
    terms = op.inputs if op.name in ADD_OPS else op.inputs[:1]
    return any(_holds_stream(trace, r, read, depth - 1) for r in terms if type(r) is Ref)


def _computed_from(trace: Trace, src, dst) -> bool:
    """Whether the tensor `dst` is computed from the tensor `src` (or is it)."""
    if type(src) is not Ref or type(dst) is not Ref:
        return False
    seen, todo = set(), [dst]
    while todo:
        r = todo.pop()
        if type(r) is not Ref or r.op < src.op or r.op in seen:
            continue
        if r.op == src.op:
            return r.slot == src.slot
        seen.add(r.op)
        todo.extend(trace.ops[r.op].inputs)
    return False


def _contribution(which: str) -> Callable[[Trace, int], ModuleCall | None]:
    def find(trace: Trace, layer: int) -> ModuleCall | None:
        """The sublayer, where its output is what the layer adds to the stream, or the model changes
        it on the way and TorchLens found the changed tensor: its `contribution` facet (served
        or refused), which the names of the contribution read first."""
        sub = _sublayer(trace, layer, which)
        how = _added_to_residual(trace, layer, sub)
        if how == "changed" and not _has_facet(sub, "contribution"):
            return None
        return sub if how is not None else None

    return find


def _token_embed(trace: Trace) -> ModuleCall | None:
    return _st(trace).token_embed


def _outside_layers(trace: Trace, role: str) -> list[ModuleCall]:
    inside = {
        id(c)
        for s in _st(trace).stacks.values()
        for layer in s.layers
        for c in [layer.call] + _below(trace, layer.call)
    }
    return [
        c
        for rec in trace.modules.values()
        for c in rec.calls
        if c.role == role and id(c) not in inside
    ]


def _pos_embed(trace: Trace) -> ModuleCall | None:
    """The one embedding outside the layers, other than the token embedding, whose indices are positions.

    With several (BERT also embeds token types), the one whose saved indices count 0, 1, 2, ...;
    none when that cannot be told.
    """
    token = _token_embed(trace)
    others = [
        c
        for c in _outside_layers(trace, "embedding")
        if (token is None or c.address != token.address)
        and not from_model_input(trace.ops, c.input_ref)
    ]
    if (
        len(others) <= 1
    ):  # (a lookup of model input ids, T5's decoder embedding, is no position embedding)
        return others[0] if others else None
    for c in others:
        site = c.facets.sites.get("indices") if c.facets else None
        t = site.tensor if site is not None else None
        if t is not None and t.numel() and t.shape[-1] > 1 and bool((t.diff(dim=-1) == 1).all()):
            return c
    return None


def _attn_o(trace: Trace, layer: int) -> ModuleCall | None:
    """The attention's output projection: a weighted module inside it that runs after its kernel."""
    attn = _sublayer(trace, layer, "attention")
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
        for c in _below(trace, attn)
        if c.class_name in WEIGHT_LAYOUT and kernel is not None and c.first_op > kernel
    ]
    return weighted[-1] if weighted else None


#: The facet only a gated MLP has (its row in `torchlens._core.facet_spec` says why others lack it).
_GATED_BY = "pre_linear"


def _mlp_gated(trace: Trace, layer: int) -> ModuleCall | None:
    """The layer's MLP when it is gated (it has a linear branch), else None."""
    mlp = _sublayer(trace, layer, "mlp")
    if mlp is None or mlp.facets is None or _GATED_BY not in mlp.facets.sites:
        return None
    return mlp


def _or_raw(norm_target: str, which: str) -> Callable[[Trace, int], ModuleCall | None]:
    """The norm applied to the sublayer's output when that norm's output is what the layer adds
    to the residual stream (a sandwich norm; or that output times a constant, with the norm's
    `contribution` facet found), else the sublayer itself when its output is."""

    def find(trace: Trace, layer: int) -> ModuleCall | None:
        norm = TARGETS[norm_target].find(trace, layer)
        how = _added_to_residual(trace, layer, norm, _sublayer(trace, layer, which))
        if how == "as_is" or (how == "changed" and _has_facet(norm, "contribution")):
            return norm
        if how == "changed":  # the changed norm output is the contribution, and it was not found
            return None
        return _contribution(which)(trace, layer)

    return find


# -- post-LN encoder blocks (BERT): norms after the residual adds, an MLP split over two modules --


def _weighted_below(trace: Trace, call: ModuleCall) -> list[ModuleCall]:
    return [
        c for c in _below(trace, call) if c.class_name in WEIGHT_LAYOUT and not _below(trace, c)
    ]


def _post_ln(trace: Trace, layer: int, which: int) -> ModuleCall | None:
    """A post-LN block's norms, outside its attention: `0` after the attention, `-1` the last.

    Only for a block whose output is its last norm's output (post-LN), and only when there are
    exactly two such norms, so a pre-LN block never gets them.
    """
    lay = _layer(trace, layer)
    attn = lay.attention
    if attn is None:
        return None
    inside = {id(c) for c in _below(trace, attn)} | {id(attn)}
    norms = [
        c
        for c in _below(trace, lay.call)
        if c.role == "norm" and id(c) not in inside and c.first_op > attn.end_op
    ]
    if (
        len(norms) != 2
        or type(norms[-1].output_ref) is not Ref
        or norms[-1].output_ref != lay.call.output_ref
    ):
        return None
    return norms[which]


def _split_mlp(trace: Trace, layer: int, which: int) -> ModuleCall | None:
    """The two weighted layers of an MLP held by no module of its own, between a post-LN block's two norms."""
    ln1, ln2 = _post_ln(trace, layer, 0), _post_ln(trace, layer, -1)
    if ln1 is None or ln2 is None or _layer(trace, layer).mlp is not None:
        return None
    lins = [
        c
        for c in _weighted_below(trace, _layer(trace, layer).call)
        if ln1.end_op <= c.first_op < ln2.first_op
    ]
    return lins[which] if len(lins) == 2 else None


def _pre_ln_split(trace: Trace, layer: int) -> tuple[ModuleCall, ModuleCall, ModuleCall] | None:
    """(norm, up, down) of a pre-LN block whose MLP is held by no module of its own (OPT's and
    fairseq-style layers: `final_layer_norm`, `fc1`, `fc2` are children of the block): exactly two
    weighted layers run after the attention, the first reads a norm's output directly, and the
    block's output is not a norm's (which would make it post-LN)."""
    lay = _layer(trace, layer)
    if lay.mlp is not None or lay.attention is None or _post_ln(trace, layer, -1) is not None:
        return None
    end = max(c.end_op for c in (lay.attention, lay.cross_attention) if c is not None)
    lins = [c for c in _weighted_below(trace, lay.call) if c.first_op >= end]
    if len(lins) != 2 or type(lins[0].input_ref) is not Ref or type(lins[0].output_ref) is not Ref:
        return None
    norm = next(
        (
            c
            for c in _below(trace, lay.call)
            if c.role == "norm" and c.first_op >= end and c.output_ref == lins[0].input_ref
        ),
        None,
    )
    # The up projection's output goes straight into an activation (a module, or an activation op),
    # so that it is the activation's input (`hook_pre`).
    up = lins[0].output_ref
    activated = any(
        c.input_ref == up and c.role != "norm" and c.class_name not in WEIGHT_LAYOUT
        for c in _below(trace, lay.call)
    ) or any(
        op.name in ACTIVATION_OPS and op.inputs and op.inputs[0] == up
        for op in trace.ops[lins[0].end_op : lins[1].first_op]
    )
    return None if norm is None or not activated else (norm, lins[0], lins[1])


def _pre_ln_mlp(which: int) -> Callable[[Trace, int], ModuleCall | None]:
    def find(trace: Trace, layer: int) -> ModuleCall | None:
        split = _pre_ln_split(trace, layer)
        return None if split is None else split[which]

    return find


def _attn_out_proj(trace: Trace, layer: int) -> ModuleCall | None:
    """The output projection that reads the attention's output, when it sits outside the attention (BERT)."""
    lay = _layer(trace, layer)
    attn = lay.attention
    if attn is None or type(attn.output_ref) is not Ref:
        return None
    return next(
        (c for c in _weighted_below(trace, lay.call) if c.input_ref == attn.output_ref), None
    )


def _post_ln_block(trace: Trace, layer: int) -> ModuleCall | None:
    return _layer(trace, layer).call if _post_ln(trace, layer, -1) is not None else None


def _scaled_embed_block(trace: Trace) -> ModuleCall | None:
    """The first block, when what it reads is the token embedding module's output scaled by a
    constant outside that module (Gemma's sqrt(d_model) in the model's forward) and nothing else:
    then that input is the embedding as it enters the residual stream. None where the module
    itself scales (its output is that tensor) or where anything else (a position embedding) is
    added on the way."""
    structure = trace.structure
    token = structure.token_embed if structure is not None else None
    if (
        structure is None
        or token is None
        or not structure.layers
        or type(token.output_ref) is not Ref
    ):
        return None
    first = structure.layers[0].call
    ref, scaled = first.input_ref, False
    while type(ref) is Ref and ref != token.output_ref:
        op = trace.ops[ref.op]
        tensors = [r for r in op.inputs if type(r) is Ref]
        if op.name in CAST_OPS and len(tensors) == 1:
            ref = tensors[0]
            continue
        if op.name not in SCALE_OPS or not tensors:
            return None
        others = [r for r in op.inputs if r is not tensors[0]]
        if any(type(r) is Ref and math.prod(trace.ops[r.op].shapes[r.slot]) != 1 for r in others):
            return None  # a product with a tensor of values, not a constant
        ref, scaled = tensors[0], True
    return first if ref == token.output_ref and scaled else None


def _embed_norm(trace: Trace) -> ModuleCall | None:
    """The norm outside the layers whose output is the first block's input (BERT's
    `embeddings.LayerNorm`, over the sum of the embeddings)."""
    if trace.structure is None or not trace.structure.layers:
        return None
    ref = trace.structure.layers[0].call.input_ref
    for _ in range(
        4
    ):  # through the embedding's dropout (eval or not, the norm's output is what it passes on)
        if type(ref) is not Ref:
            return None
        op = trace.ops[ref.op]
        if op.name not in PASS_THROUGH_OPS or not op.inputs:
            break
        ref = op.inputs[0]
    return next((c for c in _outside_layers(trace, "norm") if c.output_ref == ref), None)


def _type_embed(trace: Trace) -> ModuleCall | None:
    """The one embedding outside the layers that is neither the token nor the position embedding."""
    token, pos = _token_embed(trace), _pos_embed(trace)
    if pos is None:
        return None
    others = [
        c
        for c in _outside_layers(trace, "embedding")
        if c is not pos and (token is None or c.address != token.address)
    ]
    return others[0] if len(others) == 1 else None


def _residual_wrapper(which: str) -> Callable[[Trace, int], ModuleCall | None]:
    """The call between the block and its sublayer that adds the residual (T5's T5LayerSelfAttention)."""

    def find(trace: Trace, layer: int) -> ModuleCall | None:
        lay = _layer(trace, layer)
        c = getattr(lay, which)
        while c is not None and c.parent is not None and c.parent is not lay.call:
            c = c.parent
            if adds_own_input(trace.ops, c):
                return c
        return None

    return find


def _root(trace: Trace, layer: int) -> ModuleCall | None:
    return trace.modules[""].calls[0] if trace.modules[""].calls else None


@dataclass(frozen=True)
class Target:
    """What a naming row's `target` names: one kind of module a trace may have.

    Attributes:
        name: the key a row uses (`"ln2"`, `"attn_o"`).
        find: `find(trace, layer) -> ModuleCall | None`: the call in that trace (`layer` is a layer
            index of the language-model stack, or a `Layer` of another stack; ignored when not
            `per_layer`).
        per_layer: whether there is one per layer (a sublayer, a norm in the block) or one per
            model (an embedding, the final norm).
        roles: the roles the module it finds can have: a row may read only facets of those
            roles, or the `input`/`output` every module has.
        absent: why a trace may have none.
    """

    name: str
    find: Callable
    per_layer: bool
    roles: tuple[str, ...]
    absent: str


def check_targets(rows: tuple[Target, ...]) -> dict[str, Target]:
    """The rows by name, once each is checked: a unique name, and roles TorchLens has.

    Raises:
        TorchLensError: a name appears twice, or a row names a role `_core.roles.ROLES` lacks.
    """
    by_name: dict[str, Target] = {}
    for t in rows:
        if t.name in by_name:
            raise TorchLensError(f"two targets are named {t.name!r}")
        bad = [r for r in t.roles if r not in ROLES]
        if not t.roles or bad:
            raise TorchLensError(
                f"target {t.name!r} names roles {list(t.roles)}; each must be one of {', '.join(ROLES)}"
            )
        by_name[t.name] = t
    return by_name


#: target name -> its `Target` row, checked on import.
TARGETS: dict[str, Target] = check_targets(
    (
        Target(
            name="block",
            find=lambda t, i: _layer(t, i).call,
            per_layer=True,
            roles=("block",),
            absent="no block",
        ),
        Target(
            name="attention",
            find=lambda t, i: _sublayer(t, i, "attention"),
            per_layer=True,
            roles=("attention",),
            absent="the block has no attention sublayer",
        ),
        Target(
            name="cross_attention",
            find=lambda t, i: _sublayer(t, i, "cross_attention"),
            per_layer=True,
            roles=("attention",),
            absent="the block has no cross-attention sublayer",
        ),
        Target(
            name="mlp",
            find=lambda t, i: _sublayer(t, i, "mlp"),
            per_layer=True,
            roles=("mlp",),
            absent="the block has no MLP sublayer: no single module of it maps each position through a nonlinearity "
            "after its token mixer (none does, or several do, such as a dense and a shared MLP side by side)",
        ),
        Target(
            name="ln1",
            find=lambda t, i: _norm_where(t, i, _feeds, "attention"),
            per_layer=True,
            roles=("norm",),
            absent="no norm feeds the attention input (the block normalizes after its sublayers)",
        ),
        Target(
            name="ln2",
            find=lambda t, i: _norm_where(t, i, _feeds, "mlp") or _pre_ln_mlp(0)(t, i),
            per_layer=True,
            roles=("norm",),
            absent="no norm feeds the MLP input (the block normalizes after its sublayers)",
        ),
        Target(
            name="attn_post_norm",
            find=lambda t, i: _sandwich_norm(t, i, "attention"),
            per_layer=True,
            roles=("norm",),
            absent="no norm is applied to the attention output before it joins the residual stream (no sandwich norm)",
        ),
        Target(
            name="mlp_post_norm",
            find=lambda t, i: _sandwich_norm(t, i, "mlp"),
            per_layer=True,
            roles=("norm",),
            absent="no norm is applied to the MLP output before it joins the residual stream (no sandwich norm)",
        ),
        Target(
            name="attn_out_final",
            find=_or_raw("attn_post_norm", "attention"),
            per_layer=True,
            roles=("norm", "attention"),
            absent="no attention sublayer whose output is added to the residual stream",
        ),
        Target(
            name="mlp_out_final",
            find=_or_raw("mlp_post_norm", "mlp"),
            per_layer=True,
            roles=("norm", "mlp"),
            absent="no MLP sublayer whose output is added to the residual stream",
        ),
        Target(
            name="attn_o",
            find=_attn_o,
            per_layer=True,
            roles=("other",),
            absent="the attention has no output projection module",
        ),
        Target(
            name="mlp_gated",
            find=_mlp_gated,
            per_layer=True,
            roles=("mlp",),
            absent=absent_reason(_GATED_BY),
        ),
        Target(
            name="token_embed",
            find=lambda t, i: _token_embed(t),
            per_layer=False,
            roles=("embedding",),
            absent="no embedding module read the model's input ids",
        ),
        Target(
            name="pos_embed",
            find=lambda t, i: _pos_embed(t),
            per_layer=False,
            roles=("embedding",),
            absent="no learned position embedding module ran (positions are rotary or absent), or it cannot be "
            "told from the other embeddings",
        ),
        Target(
            name="final_norm",
            find=lambda t, i: t.structure.final_norm,
            per_layer=False,
            roles=("norm",),
            absent="no norm runs between the last block and the unembedding",
        ),
        Target(
            name="unembed",
            find=lambda t, i: t.structure.unembed,
            per_layer=False,
            roles=("unembed",),
            absent="the model has no unembedding (lm_head) module",
        ),
        Target(
            name="post_ln1",
            find=lambda t, i: _post_ln(t, i, 0),
            per_layer=True,
            roles=("norm",),
            absent="the block is not post-LN (no norm after the attention's residual add)",
        ),
        Target(
            name="post_ln2",
            find=lambda t, i: _post_ln(t, i, -1),
            per_layer=True,
            roles=("norm",),
            absent="the block is not post-LN (its output is not a norm's output)",
        ),
        Target(
            name="post_ln_block",
            find=_post_ln_block,
            per_layer=True,
            roles=("block",),
            absent="the block is not post-LN (its output is not a norm's output)",
        ),
        Target(
            name="attn_out_proj",
            find=_attn_out_proj,
            per_layer=True,
            roles=("other",),
            absent="no output projection reads the attention's output outside it",
        ),
        Target(
            name="split_mlp_in",
            find=lambda t, i: _split_mlp(t, i, 0),
            per_layer=True,
            roles=("other",),
            absent="no MLP split over two modules between the block's two norms",
        ),
        Target(
            name="split_mlp_out",
            find=lambda t, i: _split_mlp(t, i, -1),
            per_layer=True,
            roles=("other",),
            absent="no MLP split over two modules between the block's two norms",
        ),
        Target(
            name="pre_ln_mlp_in",
            find=_pre_ln_mlp(1),
            per_layer=True,
            roles=("other",),
            absent="the block is not pre-LN with an MLP held by no module of its own (a norm, then two "
            "weighted layers, all children of the block)",
        ),
        Target(
            name="pre_ln_mlp_out",
            find=_pre_ln_mlp(2),
            per_layer=True,
            roles=("other",),
            absent="the block is not pre-LN with an MLP held by no module of its own",
        ),
        Target(
            name="type_embed",
            find=lambda t, i: _type_embed(t),
            per_layer=False,
            roles=("embedding",),
            absent="no token-type embedding module ran",
        ),
        Target(
            name="embed_norm",
            find=lambda t, i: _embed_norm(t),
            per_layer=False,
            roles=("norm",),
            absent="no norm outside the layers feeds the first block",
        ),
        Target(
            name="scaled_embed_block",
            find=lambda t, i: _scaled_embed_block(t),
            per_layer=False,
            roles=("block",),
            absent="the first block does not read the token embedding scaled outside its module",
        ),
        Target(
            name="ln_cross",
            find=lambda t, i: _norm_where(t, i, _feeds, "cross_attention"),
            per_layer=True,
            roles=("norm",),
            absent="no norm feeds the cross-attention input",
        ),
        Target(
            name="first_block",
            find=lambda t, i: _layer(t, 0).call if t.structure.layers else None,
            per_layer=False,
            roles=("block",),
            absent="no block ran",
        ),
        Target(
            name="attn_residual",
            find=_residual_wrapper("attention"),
            per_layer=True,
            roles=("other",),
            absent="no module between the block and its attention adds the residual",
        ),
        Target(
            name="cross_residual",
            find=_residual_wrapper("cross_attention"),
            per_layer=True,
            roles=("other",),
            absent="no module between the block and its cross-attention adds the residual",
        ),
        Target(name="root", find=_root, per_layer=False, roles=("root",), absent=""),
    )
)


def find_call(
    trace: Trace, target: str, layer: int | None, stack: str | None = None
) -> tuple[ModuleCall | None, str]:
    """The module call `target` names in `trace` at `layer` of the language-model stack (or of the
    stack of kind `stack`), or None and the reason."""
    row = TARGETS[target]
    finder, why = row.find, row.absent
    if stack is not None:
        st = stack_of_kind(trace, stack)
        if st is None:
            return None, f"the model has no single {stack} stack"
        if layer is not None:
            layer = st.layers[layer]
        if (
            target == "final_norm"
        ):  # the stack's own, by `_analysis.structure`'s one final-norm rule
            return st.final_norm, "no norm reads the last layer's output"
    elif target == "final_norm" and (trace.structure is None or trace.structure.lm_stack is None):
        return None, (
            "TorchLens found no language-model stack of layers in this trace, so no norm is the one "
            "between the last block and the unembedding"
        )
    return finder(trace, layer), why


def find(trace: Trace, target: str, layer: int | None) -> tuple[str | None, str]:
    """The module address `target` names in `trace` at `layer`, or None and the reason."""
    call, why = find_call(trace, target, layer)
    return (call.address if call is not None else None), why
