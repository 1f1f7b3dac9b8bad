"""Diagnosis points the right way: exact matches first, no match with an infinite error (issue 22, item 5).

Each case hands `compare` a tensor a plain-PyTorch "engine" read in the wrong place, under the
name it meant to read, and checks the explanation `compare` gives:

- scores read before the causal mask, as `hook_attn_scores` (the trace's scores are masked with
  -inf): today the top candidate is "rounded to bfloat16 ... compare with tolerance='auto'"
  with error inf and `matches=True`, and the pre-mask op, at error 0, ranks second;
- v handed as `hook_k`: today "axes 1 and 2 swapped" of an op outranks the exact `hook_v`;
- the query after Qwen3's `q_norm`, before RoPE, as `hook_rot_q`: the site is found but the
  explanation never says "before RoPE".

Families: Qwen3, Phi-3, Mistral (`torchlens.testing.build`), and EXAONE-4 (QK-norm applied
head-major, then RoPE; no other test uses it), all float32 and eager.

Ground truth: the engines' tensors are computed outside TorchLens, from plain forward hooks on
the projections, the QK-norms and the rotary embedding, with the model's own
`apply_rotary_pos_emb` / `repeat_kv` and `scaling`; what each tensor is is known by construction.
"""

from __future__ import annotations

import functools
import importlib
import math

import _edge_models as em
import pytest
import torch

import torchlens as tl
import torchlens.mechinterp as mi
from torchlens import testing

IDS = testing.token_ids()
FAMILIES = ("qwen3", "phi3", "mistral", "exaone4", "helium")  # Helium: used by no other test


def _build(family: str) -> torch.nn.Module:
    return testing.build(family) if family in testing.SUITE else em.build(family)


@functools.cache
def traced(family: str):
    model = _build(family)
    return model, tl.trace(model, IDS, save="all")


def _hooks(model, specs) -> dict:
    saved, handles = {}, []
    try:
        for name, module in specs:
            handles.append(
                module.register_forward_hook(lambda m, a, o, name=name: saved.__setitem__(name, o))
            )
        with torch.no_grad():
            model(IDS)
    finally:
        for h in handles:
            h.remove()
    return saved


def _token_major(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, t, h, d] from a per-head tensor that is [b, t, h, d] or [b, h, t, d]."""
    return t if t.shape[2] == heads and t.shape[1] == IDS.shape[1] else t.transpose(1, 2)


def engine(model) -> dict[str, torch.Tensor]:
    """q (after any QK-norm, before RoPE), k, v per head (token-major), and the pre-mask scores."""
    attn = model.model.layers[0].self_attn
    cfg = model.config
    heads, kv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim
    specs = [("rope", model.model.rotary_emb)]
    specs += (
        [("qkv", attn.qkv_proj)]
        if hasattr(attn, "qkv_proj")
        else [("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj)]
    )
    if hasattr(attn, "q_norm"):
        specs += [("qn", attn.q_norm), ("kn", attn.k_norm)]
    s = _hooks(model, specs)
    b, t = IDS.shape
    if "qkv" in s:
        x = s["qkv"]
        q, k, v = (
            x[..., : heads * dh],
            x[..., heads * dh : (heads + kv) * dh],
            x[..., (heads + kv) * dh :],
        )
    else:
        q, k, v = s["q"], s["k"], s["v"]
    q, k, v = q.reshape(b, t, heads, dh), k.reshape(b, t, kv, dh), v.reshape(b, t, kv, dh)
    if "qn" in s:
        q, k = _token_major(s["qn"], heads), _token_major(s["kn"], kv)
    cos, sin = s["rope"]
    modeling = importlib.import_module(type(attn).__module__)
    rq, rk = modeling.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    rk = modeling.repeat_kv(rk, heads // kv)
    scores = (rq @ rk.transpose(2, 3)) * attn.scaling
    return {"q": q.detach(), "k": k.detach(), "v": v.detach(), "pre_mask_scores": scores.detach()}


def _row(family: str, name: str, tensor: torch.Tensor):
    (row,) = mi.compare(traced(family)[1], {name: tensor}, generation="2.x")
    return row


def _no_false_match(row) -> None:
    bad = [
        c
        for c in row.candidates
        if c.matches and not (math.isfinite(c.error) and math.isfinite(c.max_abs_error))
    ]
    assert not bad, f"candidates that match with a non-finite error: {bad}"


@pytest.mark.parametrize("family", FAMILIES)
def test_scores_before_the_mask_point_at_the_pre_mask_op(family):
    """The exact pre-mask op ranks first, the explanation speaks of the mask, and it does not
    advise a half-precision tolerance (the engine and the trace are float32 and agree exactly)."""
    model, trace = traced(family)
    row = _row(family, "blocks.0.attn.hook_attn_scores", engine(model)["pre_mask_scores"])
    assert not row.passed
    _no_false_match(row)
    top = row.candidates[0]
    assert top.matches and top.error <= 1e-6, row.candidates
    assert "mask" in row.explanation, row.explanation
    assert "bfloat16" not in row.explanation and "tolerance='auto'" not in row.explanation, (
        row.explanation
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_an_exact_named_site_outranks_a_layout_guess(family):
    """v handed as hook_k equals hook_v exactly: that is the explanation, not an axis swap of an op."""
    model, trace = traced(family)
    row = _row(family, "blocks.0.attn.hook_k", engine(model)["v"])
    assert not row.passed
    _no_false_match(row)
    assert row.candidates[0].site == "blocks.0.attn.hook_v", row.candidates
    assert row.explanation.startswith("equals blocks.0.attn.hook_v"), row.explanation


@pytest.mark.parametrize("family", ["qwen3", "exaone4"])
def test_query_before_rope_says_before_rope(family):
    """The query after the QK-norm, before RoPE, handed as hook_rot_q: the explanation says so."""
    model, trace = traced(family)
    row = _row(family, "blocks.0.attn.hook_rot_q", engine(model)["q"])
    assert not row.passed
    _no_false_match(row)
    assert row.candidates[0].matches and row.candidates[0].error <= 1e-6, row.candidates
    assert "before RoPE" in row.explanation, row.explanation
