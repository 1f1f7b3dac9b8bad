"""Fixes for an adversarial review of lazy facets: each test takes its ground truth from outside
TorchLens (eager `output_attentions`, forward hooks that clone, recomputation by hand) and fails
against the code the review ran.

- A tensor written after the trace (e.g. in place into a served facet) is never what a lazily
  computed facet is computed from: the facet is refused with the reason.
- A pending check runs with autocast off, whatever the reader's context.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers

import torchlens as tl

IDS = torch.tensor([[1, 5, 9, 3, 7, 2]])


def _gpt2(impl: str = "sdpa", seed: int = 0, **kw) -> torch.nn.Module:
    """A 2-layer GPT-2 with norm gains away from 1 (and, with `initializer_range=0.5`, residuals
    much larger than the norm's eps, as in trained models)."""
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                  bos_token_id=0, eos_token_id=0, **kw)
    cfg._attn_implementation = impl
    m = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "ln" in n:
                p.add_(torch.randn_like(p) * 0.3)
    return m


def _hooked(model, address: str, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) of the module at `address` in a plain forward, cloned by a hook."""
    got = {}

    def hook(mod, i, o):
        got["in"], got["out"] = i[0].detach().clone(), (o[0] if isinstance(o, tuple) else o).detach().clone()

    h = dict(model.named_modules())[address].register_forward_hook(hook)
    with torch.no_grad():
        model(*args, **kwargs)
    h.remove()
    return got["in"], got["out"]


# -- writes after the trace ----------------------------------------------------------------------


def test_write_into_served_resid_pre_refuses_norm_stats_not_serves_halved_ones():
    model = _gpt2(initializer_range=0.5)
    x, _ = _hooked(model, "transformer.h.0.ln_1", IDS)
    true_inv = torch.rsqrt(x.double().var(-1, unbiased=False, keepdim=True) + model.config.layer_norm_epsilon)
    t = tl.trace(model, IDS)
    fm = t.modules["transformer.h.0.ln_1"].facets
    t["transformer.h.0:resid_pre"].mul_(2.0)  # the caller writes into a tensor it was served
    with pytest.raises(tl.FacetNotFound, match="written after the trace returned.*trace.check"):
        fm["inv_std"]
    assert "inv_std" in fm.refused and "scale" in fm.refused
    # The same read before the write serves the traced value.
    t2 = tl.trace(model, IDS)
    fm2 = t2.modules["transformer.h.0.ln_1"].facets
    inv = fm2["inv_std"]
    t2["transformer.h.0:resid_pre"].mul_(2.0)
    assert torch.allclose(inv.double(), true_inv, atol=1e-5)


def test_constant_shift_of_served_k_refuses_scores_instead_of_serving_shifted_ones():
    model = _gpt2(use_cache=False)
    t = tl.trace(model, IDS, use_cache=False)
    attn = "transformer.h.0.attn"
    q, k = t[attn + ":q"].clone(), t[attn + ":k"].clone()
    by_hand = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    t[attn + ":k"].add_(torch.randn(k.shape[-1]))  # shifts each score row by a constant: the pattern is unchanged
    fm = t.modules[attn].facets
    with pytest.raises(tl.FacetNotFound, match="written after the trace returned"):
        fm["scores"]
    assert "pattern" in fm.refused
    t2 = tl.trace(model, IDS, use_cache=False)
    assert torch.allclose(t2[attn + ":scores"].tril(), by_hand.tril(), atol=1e-5)


def test_zeroing_a_head_of_served_z_refuses_result_with_the_write_as_reason():
    model = _gpt2()
    t = tl.trace(model, IDS)
    attn = "transformer.h.0.attn"
    t[attn + ":z"][:, 1].zero_()
    fm = t.modules[attn].facets
    assert "written after the trace returned" in t.check()[(attn, 0, "result")]
    assert "dropout" not in fm.refused["result"]


def test_check_before_the_write_keeps_every_facet():
    model = _gpt2()
    t = tl.trace(model, IDS)
    assert t.check() == {}
    t["transformer.h.0:resid_pre"].mul_(2.0)
    t["transformer.h.0.attn:q"].zero_()
    assert t.check() == {}
    assert t.modules["transformer.h.0.ln_1"].facets["normalized"] is not None


# -- autocast ------------------------------------------------------------------------------------


def test_read_under_autocast_serves_what_a_read_outside_serves():
    model = _gpt2(initializer_range=0.5)
    attn = "transformer.h.0.attn"
    ref = tl.trace(model, IDS)
    want = {f: ref[f"{attn}:{f}"] for f in ("pattern", "result")}
    want["normalized"] = ref["transformer.h.0.ln_1:normalized"]
    t = tl.trace(model, IDS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = {f: t[f"{attn}:{f}"] for f in ("pattern", "result")}
        got["normalized"] = t["transformer.h.0.ln_1:normalized"]
    assert t.check() == {}
    for f, w in want.items():
        assert got[f].dtype == torch.float32
        assert torch.equal(got[f], w), f
