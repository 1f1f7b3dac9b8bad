"""Facets are derived lazily: nothing expensive runs until a facet is read, and statuses stay honest.

A derived facet (a pattern rebuilt from a fused kernel, a per-head `result`, a norm's statistics)
and the expensive check of a real one (`z`, `resid_mid`) are computed and checked on first read,
then cached. These tests count the calls into the rebuild functions to show that reprs, summaries,
reports and mapping queries compute nothing; that a read computes only what it asks for; that a
check failing on first read refuses the facet as an eager refusal did; and that a pending facet is
computed from the forward that was traced, not from weights the caller changed afterwards (ground
truth: forward hooks and weights copied before the change).
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

import torchlens as tl
import torchlens.mechinterp as mi
from torchlens import testing
from torchlens._analysis.facets import (
    attention as _attention,  # internals: the functions whose calls are counted
)
from torchlens._analysis.facets import norm as _norm
from torchlens._analysis.facets import rebuild as _rebuild

IDS = testing.token_ids(2, 6)
COUNTED = (
    (_rebuild, "rebuild_attention"),
    (_rebuild, "rebuild_mha"),
    (_norm, "_normalize"),
    (_norm, "_affine_error"),
    (_attention, "_per_head_weight"),
)


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls into the functions that compute or check derived facets."""
    counts: collections.Counter = collections.Counter()
    for module, name in COUNTED:
        real = getattr(module, name)

        def counted(*a, _real=real, _name=name, **kw):
            counts[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(module, name, counted)
    return counts


def _attn(i: int) -> str:
    return f"transformer.h.{i}.attn"


def test_nothing_is_computed_until_read(calls):
    model = testing.build("gpt2", "sdpa")
    with torch.no_grad():
        t = tl.trace(model, IDS)
    assert sum(calls.values()) == 0, calls
    pending = t.pending
    assert pending > 0
    # Everything that only describes the trace computes nothing.
    text = [repr(t), t.summary(), t._repr_html_()]
    for rec in t.modules.values():
        for c in rec.calls:
            f = c.facets
            text += [repr(f), *(repr(s) for s in f.sites.values())]
            assert len(f) == len(list(f)) == len(f.keys())
            assert all(n in f for n in f)
    for generation in mi.GENERATIONS:
        report = mi.alias_report(t, generation=generation)
        text += [repr(report), report._repr_html_()]
    assert sum(calls.values()) == 0, calls
    assert t.pending == pending
    assert "check pending" in repr(t.modules[_attn(1)].facets.site("pattern"))
    assert f"{pending} facets are checked on first read" in t.summary()
    assert (
        "check pending" in t._repr_html_()
        and f"{pending} facets are checked on first read" in t._repr_html_()
    )
    # Reading one layer's pattern rebuilds that layer's kernel only (scores come with it).
    t.modules[_attn(1)].facets["pattern"]
    assert calls == {"rebuild_attention": 1}, calls
    assert t.modules[_attn(1)].facets.site("scores").checked
    assert not t.modules[_attn(0)].facets.site("pattern").checked
    t.modules[_attn(1)].facets["scores"]  # cached
    assert calls == {"rebuild_attention": 1}, calls
    assert t.pending == pending - 2


def test_a_read_pattern_equals_the_eager_models_and_is_computed_once():
    """The lazily rebuilt pattern against an eager-attention copy's own softmax output
    (`output_attentions`), and the same tensor object on a second read."""
    sdpa, eager = testing.build("gpt2", "sdpa"), testing.build("gpt2", "eager")
    eager.load_state_dict(sdpa.state_dict())
    with torch.no_grad():
        t = tl.trace(sdpa, IDS)
        want = eager(IDS, output_attentions=True).attentions
    for i, w in enumerate(want):
        got = t.modules[_attn(i)].facets["pattern"]
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6)
        assert t.modules[_attn(i)].facets["pattern"] is got


def test_statuses_say_when_a_check_has_not_run_and_resolve_alias_runs_it():
    model = testing.build("gpt2", "sdpa")
    with torch.no_grad():
        t = tl.trace(model, IDS)
    report = mi.alias_report(t, generation="2.x")
    rows = {r.query: r for r in report}
    assert rows["blocks.1.attn.hook_pattern"].status == "reconstructed_read_only"
    assert not rows["blocks.1.attn.hook_pattern"].checked
    assert "not computed or checked yet" in rows["blocks.1.attn.hook_pattern"].reason
    assert (
        rows["blocks.1.hook_resid_post"].checked
        and rows["blocks.1.hook_resid_post"].status == "real"
    )
    assert (
        not rows["blocks.1.hook_resid_mid"].checked
        and rows["blocks.1.hook_resid_mid"].status == "real"
    )
    assert "Not checked yet" in rows["blocks.1.hook_resid_mid"].reason
    assert not t.modules[_attn(1)].facets.site("pattern").checked  # the report computed nothing
    r = mi.resolve_alias(t, "blocks.1.attn.hook_pattern")
    assert r.checked and r.status == "reconstructed_read_only" and "not computed" not in r.reason
    assert t.modules[_attn(1)].facets.site("pattern").checked
    assert not t.modules[_attn(0)].facets.site("pattern").checked
    # once checked, the report says so too
    rows = {r.query: r for r in mi.alias_report(t, generation="2.x")}
    assert (
        rows["blocks.1.attn.hook_pattern"].checked
        and not rows["blocks.0.attn.hook_pattern"].checked
    )
    # a row's tensor is a read: it runs that site's check
    assert (
        rows["blocks.0.attn.hook_pattern"].tensor.shape
        == t.modules[_attn(0)].facets.site("pattern").shape
    )
    assert t.modules[_attn(0)].facets.site("pattern").checked


def _plant_bad_rebuild(monkeypatch):
    real = _rebuild.rebuild_attention
    monkeypatch.setattr(
        _rebuild, "rebuild_attention", lambda a, kw, out: real(a, {**kw, "scale": 0.01}, out)
    )


def test_a_check_that_fails_on_first_read_refuses_the_facet(monkeypatch):
    model = testing.build("gpt2", "sdpa")
    _plant_bad_rebuild(monkeypatch)
    with torch.no_grad():
        t = tl.trace(model, IDS)
    f = t.modules[_attn(0)].facets
    assert "pattern" in f and "pattern" in f.sites and not f.refused  # not checked yet
    row = next(
        r for r in mi.alias_report(t, generation="2.x") if r.query == "blocks.0.attn.hook_pattern"
    )
    assert row.status == "reconstructed_read_only" and not row.checked
    with pytest.raises(tl.FacetNotFound, match="the rebuild disagreed"):
        f["pattern"]
    assert set(f.refused) == {"scores", "pattern"}
    assert "pattern" not in f and "pattern" not in f.sites and "scores" not in f.sites
    with pytest.raises(tl.FacetNotFound, match="not served: the rebuild disagreed"):
        f["scores"]
    r = mi.resolve_alias(t, "blocks.1.attn.hook_pattern")  # runs layer 1's check: refused too
    assert r.status == "needs_capture" and "not served: the rebuild disagreed" in r.reason
    # iterating a map while its checks refuse sites is safe; items() leaves the refused out
    g = t.modules[_attn(1)].facets
    assert "scores" not in dict(g.items())


def test_trace_check_runs_every_pending_check(monkeypatch):
    model = testing.build("gpt2", "sdpa")
    with torch.no_grad():
        good = tl.trace(model, IDS)
    assert good.pending > 0
    assert good.check() == {}
    assert good.pending == 0
    for rec in good.modules.values():
        for c in rec.calls:
            for s in c.facets.sites.values():
                assert s.checked
                if s.read_only:
                    assert s.check_error is not None, (rec.address, s.name)
    _plant_bad_rebuild(monkeypatch)
    with torch.no_grad():
        bad = tl.trace(model, IDS)
    refused = bad.check()
    assert set(refused) == {
        (_attn(i), 0, n) for i in range(len(bad.blocks)) for n in ("scores", "pattern")
    }
    assert all("the rebuild disagreed" in why for why in refused.values())


def test_an_explained_refusal_keeps_its_words_when_the_check_fails_later(monkeypatch):
    model = testing.build("gpt2", "sdpa")
    _plant_bad_rebuild(monkeypatch)
    with torch.no_grad():
        t = tl.trace(model, IDS)
    f = t.modules[_attn(0)].facets
    f.explain_refusal("pattern", " (because of the plant)")
    f.explain_refusal("result", " (never shown: its check holds)")
    with pytest.raises(tl.FacetNotFound, match="because of the plant"):
        f["pattern"]
    assert f.refused["pattern"].endswith("(because of the plant)")
    assert "because" not in f.refused["scores"]
    f.explain_refusal("scores", " (added after)")
    assert f.refused["scores"].endswith("(added after)")
    f["result"]
    assert "result" not in f.refused


def test_a_pending_facet_shows_the_traced_forward_after_an_optimizer_step():
    """`result` and a LayerNorm's `normalized`, first read after an SGD step changed every weight,
    against values computed outside TorchLens: a pre-hook on the output projection (z with its
    heads merged) and on the norm (its input), and W_O copied before the step."""
    model = testing.build("gpt2", "eager")
    attn, norm = model.transformer.h[0].attn, model.transformer.h[0].ln_1
    seen = {}
    hooks = [
        attn.c_proj.register_forward_pre_hook(
            lambda m, a: seen.setdefault("z", a[0].detach().clone())
        ),
        norm.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0].detach().clone())),
    ]
    try:
        with torch.no_grad():
            t = tl.trace(model, IDS)
    finally:
        for h in hooks:
            h.remove()
    w_o = attn.c_proj.weight.detach().clone()  # Conv1D: [d_model in, d_model out]
    assert not t.modules[_attn(0)].facets.site("result").checked
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(IDS).logits.square().mean().backward()
    opt.step()
    assert not torch.equal(attn.c_proj.weight, w_o) and not torch.equal(
        norm.weight, torch.ones_like(norm.weight)
    )
    heads = t.modules[_attn(0)].facets.site("result").shape[2]
    b, n, d = seen["z"].shape
    per_head = seen["z"].view(b, n, heads, d // heads)
    want = torch.einsum("bthd,hdo->btho", per_head, w_o.view(heads, d // heads, -1))
    torch.testing.assert_close(t.modules[_attn(0)].facets["result"], want, rtol=1e-5, atol=1e-6)
    x = seen["x"]
    normalized = (x - x.mean(-1, keepdim=True)) / torch.sqrt(
        x.var(-1, unbiased=False, keepdim=True) + norm.eps
    )
    torch.testing.assert_close(
        t.modules["transformer.h.0.ln_1"].facets["normalized"], normalized, rtol=1e-5, atol=1e-5
    )


def test_reading_a_pending_facet_inside_another_trace_records_nothing_there():
    model = testing.build("gpt2", "sdpa")
    with torch.no_grad():
        clean = tl.trace(model, IDS)
    read = {}

    class Reader(nn.Module):
        def forward(self, x):
            read["pattern"] = clean.modules[_attn(0)].facets[
                "pattern"
            ]  # rebuilt here, inside `outer`
            return x * 2

    outer = tl.trace(Reader(), torch.ones(3))
    assert [op.name for op in outer.ops] == ["input", "mul"]
    assert read["pattern"].shape == clean.modules[_attn(0)].facets.site("pattern").shape


def test_a_saved_trace_has_no_pending_check(tmp_path):
    model = testing.build("gpt2", "sdpa")
    with torch.no_grad():
        t = tl.trace(model, IDS)
    assert t.pending > 0
    with pytest.warns(
        UserWarning, match=r"could not store 1 value.*DynamicCache"
    ):  # the KV cache is no tensor
        t.save(tmp_path / "t")
    assert t.pending == 0  # save ran every check
    back = tl.load(tmp_path / "t")
    assert back.pending == 0
    for i in range(len(t.blocks)):
        site = back.modules[_attn(i)].facets.site("pattern")
        assert (
            site.checked
            and site.check_error == t.modules[_attn(i)].facets.site("pattern").check_error
        )
        assert torch.equal(
            back.modules[_attn(i)].facets["pattern"], t.modules[_attn(i)].facets["pattern"]
        )


def test_a_facet_save_did_not_keep_is_never_computed(calls):
    model = testing.build("gpt2", "sdpa")
    with torch.no_grad():
        t = tl.trace(model, IDS, save=["resid_post"])
    assert t.pending == 0 and sum(calls.values()) == 0
    site = t.modules[_attn(0)].facets.site("pattern")
    assert not site.saved and site.check_error is None
    with pytest.raises(tl.FacetNotSaved):
        t.modules[_attn(0)].facets["pattern"]
    assert sum(calls.values()) == 0


def test_in_place_ops_are_flagged_mutated():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            y = self.lin(x)
            y.add_(1)
            return torch.relu(y)

    t = tl.trace(M(), torch.ones(2, 3))
    flags = {op.name: op.mutated for op in t.ops}
    assert flags["add_"] is True
    assert flags["linear"] is False and flags["relu"] is False


def test_a_pickled_trace_runs_its_pending_checks_first():
    import pickle

    model = testing.build("gpt2", "sdpa")
    with torch.no_grad():
        t = tl.trace(model, IDS, use_cache=False)
    assert t.pending > 0
    back = pickle.loads(pickle.dumps(t))
    assert back.pending == 0 and t.pending == 0
    for i in range(len(t.blocks)):
        assert torch.equal(
            back.modules[_attn(i)].facets["pattern"], t.modules[_attn(i)].facets["pattern"]
        )


def test_a_pending_pattern_is_rebuilt_from_the_keys_the_kernel_saw_after_the_cache_is_overwritten():
    """The kernel's keys and values are the KV cache's own tensors, which the caller holds in the
    output: zeroing them after the trace (a static-cache update writes in place) must not change
    a pattern first read afterwards. Ground truth: an eager-attention copy's softmax output."""
    sdpa, eager = testing.build("gpt2", "sdpa"), testing.build("gpt2", "eager")
    eager.load_state_dict(sdpa.state_dict())
    with torch.no_grad():
        t = tl.trace(sdpa, IDS, use_cache=True)
        want = eager(IDS, output_attentions=True).attentions
    assert not t.modules[_attn(0)].facets.site("pattern").checked
    cache = [x for layer in t.output.past_key_values.layers for x in (layer.keys, layer.values)]
    assert cache
    for x in cache:
        x.zero_()
    for i, w in enumerate(want):
        torch.testing.assert_close(t.modules[_attn(i)].facets["pattern"], w, rtol=1e-5, atol=1e-6)
