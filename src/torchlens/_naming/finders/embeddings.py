"""The targets one per model, around the embeddings: the token, position and token-type
embeddings, the norm over their sum (BERT), the norm over the token embedding alone (BLOOM), and
the first block when what it reads is the token embedding scaled outside its module (Gemma)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from torchlens._analysis.structure import from_model_input
from torchlens._core.ops import ADD_OPS, CAST_OPS, PASS_THROUGH_OPS, SCALE_OPS
from torchlens._core.records import ModuleCall, Ref
from torchlens._naming.finders.calls import outside_layers, structure_of

if TYPE_CHECKING:
    from torchlens._trace import Trace


def token_embed(trace: Trace) -> ModuleCall | None:
    return structure_of(trace).token_embed


def pos_embed(trace: Trace) -> ModuleCall | None:
    """The one embedding outside the layers, other than the token embedding, whose indices are positions.

    With several (BERT also embeds token types), the one whose saved indices count 0, 1, 2, ...;
    none when that cannot be told.
    """
    token = token_embed(trace)
    others = [
        c
        for c in outside_layers(trace, "embedding")
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


def scaled_embed_block(trace: Trace) -> ModuleCall | None:
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


def embed_norm(trace: Trace) -> ModuleCall | None:
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
    return next((c for c in outside_layers(trace, "norm") if c.output_ref == ref), None)


def type_embed(trace: Trace) -> ModuleCall | None:
    """The one embedding outside the layers that is neither the token nor the position embedding."""
    token, pos = token_embed(trace), pos_embed(trace)
    if pos is None:
        return None
    others = [
        c
        for c in outside_layers(trace, "embedding")
        if c is not pos and (token is None or c.address != token.address)
    ]
    return others[0] if len(others) == 1 else None


def embed_ln(trace: Trace, alone: bool) -> ModuleCall | None:
    """The norm outside the layers over the token embedding: the first to run, before every
    stack's first layer, whose input is computed from the token embedding's output by casts,
    dropout, scaling and additions (of position and token-type embeddings: BERT's
    `embeddings.LayerNorm`, BART's encoder `layernorm_embedding`, not its decoder's, which reads
    the decoder's lookup); with `alone`, by casts and dropout only (BLOOM's
    `word_embeddings_layernorm` over the lookup itself)."""
    token = token_embed(trace)
    if token is None or type(token.output_ref) is not Ref:
        return None
    # before every stack's first layer: the final norm also reads the embedding, through the layers
    firsts = [s.layers[0].call.first_op for s in structure_of(trace).stacks.values() if s.layers]
    start = min(firsts, default=len(trace.ops))
    through = (
        PASS_THROUGH_OPS | CAST_OPS if alone else PASS_THROUGH_OPS | CAST_OPS | SCALE_OPS | ADD_OPS
    )
    for norm in sorted(outside_layers(trace, "norm"), key=lambda c: c.first_op):
        if norm.end_op > start:
            continue
        todo, seen = [norm.input_ref], 0
        while todo and seen < 16:
            ref = todo.pop()
            seen += 1
            if ref == token.output_ref:
                return norm
            if type(ref) is not Ref:
                continue
            op = trace.ops[ref.op]
            if op.name in through:
                todo.extend(
                    r for r in (op.inputs if not alone else op.inputs[:1]) if type(r) is Ref
                )
    return None


def embedded(trace: Trace, alone: bool) -> ModuleCall | None:
    """The module whose output is the token embedding as the model passes it on: the embedding
    norm over it (`embed_ln`, `alone` as there) where there is one, else the token embedding."""
    return embed_ln(trace, alone) or token_embed(trace)
