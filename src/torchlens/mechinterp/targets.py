"""Targets: which module of a trace a table row reads, found from roles and data flow.

A row of a naming table says *what* it reads (`target="ln2"`, `facet="scale"`); this module
says *where* that is in a given trace. Each target is found from module roles and from which
module's output feeds which module's input, so the same row reads the right module on GPT-2
(`transformer.h.0.ln_2`), Llama (`model.layers.0.post_attention_layernorm`) or Gemma-2
(`model.layers.0.pre_feedforward_layernorm`).
"""

from __future__ import annotations

from collections.abc import Callable

from ..families import PASS_THROUGH_OPS, RESHAPE_OPS, WEIGHT_LAYOUT
from ..records import ModuleCall, ModuleRecord, Ref, Trace


def _first(rec: ModuleRecord) -> ModuleCall | None:
    return rec.calls[0] if rec.calls else None


def _children(trace: Trace, parent: str, role: str | None = None) -> list[ModuleRecord]:
    """Direct children of `parent` that ran, in the order they first ran."""
    depth = parent.count(".") + 1 if parent else 0
    prefix = parent + "." if parent else ""
    kids = [
        r for a, r in trace.modules.items()
        if a.startswith(prefix) and a.count(".") == depth and r.calls and (role is None or r.role == role)
    ]
    return sorted(kids, key=lambda r: r.calls[0].first_op)


def _sublayer(trace: Trace, layer: int, role: str) -> ModuleRecord | None:
    kids = _children(trace, trace.blocks[layer], role)
    return kids[0] if kids else None


def _norm_where(trace: Trace, layer: int, match: Callable[[ModuleCall, ModuleCall], bool], role: str) -> str | None:
    sub = _sublayer(trace, layer, role)
    if sub is None:
        return None
    s = _first(sub)
    for norm in _children(trace, trace.blocks[layer], "norm"):
        n = _first(norm)
        if n is not None and s is not None and match(n, s):
            return norm.address
    return None


def _feeds(n: ModuleCall, s: ModuleCall) -> bool:
    return type(n._out_ref) is Ref and n._out_ref == s._in_ref


def _follows(n: ModuleCall, s: ModuleCall) -> bool:
    return type(s._out_ref) is Ref and n._in_ref == s._out_ref


def _outside_blocks(trace: Trace, role: str) -> list[ModuleRecord]:
    recs = [
        r for a, r in trace.modules.items()
        if r.role == role and r.calls and not any(a == b or a.startswith(b + ".") for b in trace.blocks)
    ]
    return sorted(recs, key=lambda r: r.calls[0].first_op)


def _from_model_input(trace: Trace, ref) -> bool:
    """Whether `ref` is a model input, possibly reshaped (`input_ids.view(...)`), not computed."""
    for _ in range(8):
        if type(ref) is not Ref:
            return False
        op = trace.ops[ref.op]
        if op.name == "input":
            return True
        if op.name not in RESHAPE_OPS | PASS_THROUGH_OPS | {"__getitem__", "long", "int"} or not op.inputs:
            return False
        ref = op.inputs[0]
    return False


def _token_embed(trace: Trace) -> str | None:
    for rec in _outside_blocks(trace, "embedding"):
        if _from_model_input(trace, _first(rec)._in_ref):
            return rec.address
    return None


def _pos_embed(trace: Trace) -> str | None:
    token = _token_embed(trace)
    others = [r.address for r in _outside_blocks(trace, "embedding") if r.address != token]
    return others[0] if others else None


def _final_norm(trace: Trace) -> str | None:
    unembed = _outside_blocks(trace, "unembed")
    norms = _outside_blocks(trace, "norm")
    if unembed:
        start = unembed[0].calls[0].first_op
        norms = [n for n in norms if n.calls[0].end_op <= start]
    return norms[-1].address if norms else None


def _sub(role: str) -> Callable[[Trace, int], str | None]:
    def find(trace: Trace, layer: int) -> str | None:
        rec = _sublayer(trace, layer, role)
        return rec.address if rec else None

    return find


def _attn_o(trace: Trace, layer: int) -> str | None:
    attn = _sublayer(trace, layer, "attention")
    if attn is None:
        return None
    weighted = [r for r in _children(trace, attn.address) if r.class_name in WEIGHT_LAYOUT]
    return weighted[-1].address if weighted else None


def _mlp_gated(trace: Trace, layer: int) -> str | None:
    mlp = _sublayer(trace, layer, "mlp")
    if mlp is None or not mlp.calls or "pre_linear" not in mlp.calls[0].facets.sites:
        return None
    return mlp.address


def _or_raw(norm_target: str, role: str) -> Callable[[Trace, int], str | None]:
    def find(trace: Trace, layer: int) -> str | None:
        return TARGETS[norm_target][0](trace, layer) or _sub(role)(trace, layer)

    return find


#: target name -> (finder(trace, layer) -> address or None, per_layer, why it can be missing)
TARGETS: dict[str, tuple[Callable, bool, str]] = {
    "block": (lambda t, i: t.blocks[i], True, "no decoder block"),
    "attention": (_sub("attention"), True, "the block has no attention sublayer"),
    "mlp": (_sub("mlp"), True, "the block has no MLP sublayer"),
    "ln1": (lambda t, i: _norm_where(t, i, _feeds, "attention"), True,
            "no norm feeds the attention input (the block normalizes after its sublayers)"),
    "ln2": (lambda t, i: _norm_where(t, i, _feeds, "mlp"), True,
            "no norm feeds the MLP input (the block normalizes after its sublayers)"),
    "attn_post_norm": (lambda t, i: _norm_where(t, i, _follows, "attention"), True,
                       "no norm is applied to the attention output (no sandwich norm)"),
    "mlp_post_norm": (lambda t, i: _norm_where(t, i, _follows, "mlp"), True,
                      "no norm is applied to the MLP output (no sandwich norm)"),
    "attn_out_final": (_or_raw("attn_post_norm", "attention"), True, "the block has no attention sublayer"),
    "mlp_out_final": (_or_raw("mlp_post_norm", "mlp"), True, "the block has no MLP sublayer"),
    "attn_o": (_attn_o, True, "the attention has no output projection module"),
    "mlp_gated": (_mlp_gated, True, "the MLP is not gated (one input projection, no linear branch)"),
    "token_embed": (lambda t, i: _token_embed(t), False, "no embedding module read the model's input ids"),
    "pos_embed": (lambda t, i: _pos_embed(t), False,
                  "no learned position embedding module ran (positions are rotary or absent)"),
    "final_norm": (lambda t, i: _final_norm(t), False, "no norm runs between the last block and the unembedding"),
    "unembed": (lambda t, i: next((r.address for r in _outside_blocks(t, "unembed")), None), False,
                "the model has no unembedding (lm_head) module"),
    "root": (lambda t, i: "", False, ""),
}


def find(trace: Trace, target: str, layer: int | None) -> tuple[str | None, str]:
    """The module address `target` names in `trace` at `layer`, or None and the reason."""
    finder, _, why = TARGETS[target]
    return finder(trace, layer), why
