"""Derived gradients are computed on first read: a trace taken with `grads=` holds what a norm's
`normalized` / `scale` / `inv_std`, attention's per-head `result` and a fused kernel's rebuilt
`pattern` / `scores` gradients are derived from, and derives and checks them when one is first
read, as derived facet values are.

Ground truth from outside TorchLens: the norms written out with `retain_grad()` and the per-head
results formed by a forward hook on the output projection (`tests/test_derived_grads.py`), the
softmax output of an eager-attention run hooked by a tensor hook (`tests/test_grads.py`).

- Until read, every derived gradient is pending (`GradMap.pending`, the site's `checked` and its
  repr say so) and has no check error; a read derives its group and serves the ground truth.
- A write after the trace into a tensor a pending derivation computes from (a real gradient the
  trace served, such as z's) refuses the derived gradient with the reason instead of serving
  one derived from the written values; weights written after the trace change nothing.
- A store keeps them pending and serves the same values; a save derives them first, and a
  refusal found then is in the file.
"""

from __future__ import annotations

import pytest
import torch
from test_derived_grads import _close, per_head_results, write_out_norms
from test_grads import _op_truth, build, loss_fn
from torch import nn

import torchlens as tl
from torchlens import testing

IDS = testing.token_ids(1, 7)

#: the derived gradients of GPT-2 under SDPA, by the role of the call that serves them
DERIVED = {"norm": {"normalized", "inv_std", "scale"}, "attention": {"pattern", "scores", "result"}}


def _gpt2_trace(**kwargs) -> tl.Trace:
    with torch.no_grad():
        return tl.trace(build("gpt2", "sdpa").requires_grad_(False), IDS, grads=loss_fn, **kwargs)


def _truth() -> tuple[dict, dict, list]:
    """d loss / d each norm's `normalized`, each layer's per-head result (a written-out SDPA GPT-2),
    and each layer's softmax output (the eager-attention GPT-2 with the same weights)."""
    plain = build("gpt2", "sdpa")
    norms, results = write_out_norms(plain), per_head_results(plain, "gpt2")
    loss_fn(plain(IDS)).backward()
    return norms, results, _op_truth("gpt2", "eager", IDS)


def _attns(t: tl.Trace) -> list[str]:
    return [a for a, r in t.modules.items() if r.role == "attention"]


def test_derived_grads_are_pending_until_first_read():
    t = _gpt2_trace()
    norms, results, patterns = _truth()
    calls = [(a, r.role) for a, r in t.modules.items() if r.role in DERIVED]
    assert len(calls) == 7  # 2 x (ln_1, attn, ln_2) + ln_f
    for addr, role in calls:
        g = t.modules[addr].grads
        assert set(g.pending) == DERIVED[role], addr
        for name in DERIVED[role]:
            site = g.site(name)
            assert site.kind == "computed" and not site.checked and site.check_error is None
            assert site.saved and name in g  # pending, not missing
            assert "check pending" in repr(site)
        assert "check pending" in repr(g)
    attn0 = t.modules[_attns(t)[0]].grads
    got = attn0["pattern"]  # derives its group: pattern and scores, not result
    assert attn0.pending == ["result"]
    assert attn0.site("scores").check_error == attn0.site("pattern").check_error is not None
    want = patterns[0]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    for layer, addr in enumerate(_attns(t)):
        assert _close(t.modules[addr].grads["result"], results[layer].grad, torch.float32)
    ln = t.modules["transformer.h.1.ln_2"].grads
    assert _close(
        ln["normalized"], norms["transformer.h.1.ln_2"][0]["normalized"].grad, torch.float32
    )
    assert ln.pending == [] and ln.site("inv_std").check_error is not None


def test_a_write_into_a_served_gradient_refuses_what_is_derived_from_it():
    """z's gradient (served as a real gradient) is what the result's check and the pattern's
    derivation read; the norm's output gradient is what its `normalized` is derived from."""
    norms, results, _ = _truth()
    t = _gpt2_trace()
    attn = t.modules["transformer.h.0.attn"].grads
    attn["z"].mul_(2.0)  # the caller writes into a gradient it was served
    for name in ("result", "pattern", "scores"):
        with pytest.raises(tl.GradNotFound, match="written after the trace returned"):
            attn[name]
        assert name in attn.refused
    ln = t.modules["transformer.ln_f"].grads
    ln["output"].zero_()
    with pytest.raises(tl.GradNotFound, match="written after the trace returned"):
        ln["normalized"]
    assert {"normalized", "inv_std", "scale"} <= set(ln.refused)
    # untouched calls still serve the ground truth
    other = t.modules["transformer.h.1.attn"].grads
    assert _close(other["result"], results[1].grad, torch.float32)
    # the same reads before the writes serve the ground truth, and the writes change nothing then
    t = _gpt2_trace()
    attn, ln = t.modules["transformer.h.0.attn"].grads, t.modules["transformer.ln_f"].grads
    result, normalized = attn["result"], ln["normalized"]
    attn["z"].mul_(2.0)
    ln["output"].zero_()
    assert _close(result, results[0].grad, torch.float32)
    assert _close(normalized, norms["transformer.ln_f"][0]["normalized"].grad, torch.float32)
    assert torch.equal(attn["result"], result) and torch.equal(ln["normalized"], normalized)


def test_weights_written_after_the_trace_change_no_derived_gradient():
    """An optimizer-style write into the model's weights after the trace: the pending derivations
    read the weights as the forward used them (W_O for the result's check, the gain for
    `normalized`)."""
    norms, results, _ = _truth()
    model = build("gpt2", "sdpa").requires_grad_(False)
    with torch.no_grad():
        t = tl.trace(model, IDS, grads=loss_fn)
        for p in model.parameters():
            p.mul_(-3.0)
    for layer, addr in enumerate(_attns(t)):
        assert _close(t.modules[addr].grads["result"], results[layer].grad, torch.float32)
    for addr, calls in norms.items():
        got = t.modules[addr].grads["normalized"]
        assert _close(got, calls[0]["normalized"].grad, torch.float32), addr


@pytest.mark.parametrize("store", ["cpu", "dir"])
def test_a_store_keeps_them_pending_and_serves_the_same(store, tmp_path):
    norms, results, patterns = _truth()
    t = _gpt2_trace(store="cpu" if store == "cpu" else tmp_path / "st")
    plain = _gpt2_trace()
    for addr, rec in t.modules.items():
        if rec.role in DERIVED:
            assert set(rec.grads.pending) == DERIVED[rec.role], addr
            for name in DERIVED[rec.role]:  # the same bits as the trace held in memory
                assert torch.equal(rec.grads[name], plain.modules[addr].grads[name]), (addr, name)
    for layer, addr in enumerate(_attns(t)):
        assert _close(t.modules[addr].grads["result"], results[layer].grad, torch.float32)
        want = patterns[layer]
        got = t.modules[addr].grads["pattern"]
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    got = t.modules["transformer.h.0.ln_1"].grads["normalized"]
    assert _close(got, norms["transformer.h.0.ln_1"][0]["normalized"].grad, torch.float32)


def test_save_derives_them_first_and_keeps_a_refusal(tmp_path):
    """A trace saved before any derived gradient is read: the file holds the derived gradients
    (equal to the ground truth) and the refusal a failed check gives (a LayerNorm whose backward
    is straight-through), with its reason; the loaded trace has nothing pending."""
    norms, results, _ = _truth()
    model = build("gpt2", "sdpa").requires_grad_(False)
    ln = model.transformer.h[0].ln_1

    def forward(x):
        y = nn.functional.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)
        return x + (y - x).detach()

    ln.forward = forward
    with torch.no_grad():
        t = tl.trace(model, IDS, grads=loss_fn)
    assert t.modules["transformer.h.0.ln_1"].grads.pending  # refused only once derived
    t.save(tmp_path / "t.tl")
    assert all(not c.grads.pending for r in t.modules.values() for c in r.calls if c.grads)
    u = tl.load(tmp_path / "t.tl")
    g = u.modules["transformer.h.0.ln_1"].grads
    assert set(g.refused) >= {"normalized", "inv_std", "scale"} and not g.pending
    assert "through the norm" in g.refused["normalized"]
    with pytest.raises(tl.GradNotFound, match="not served"):
        g["normalized"]
    for layer, addr in enumerate(_attns(u)):  # the norm's backward does not feed W_O's check
        assert _close(u.modules[addr].grads["result"], results[layer].grad, torch.float32)
    got = u.modules["transformer.h.1.ln_1"].grads["normalized"]
    assert _close(got, norms["transformer.h.1.ln_1"][0]["normalized"].grad, torch.float32)


def test_trace_check_runs_the_pending_gradients_too_and_reports_their_refusals():
    """`Trace.check()` leaves no site pending, gradients included, and names a gradient whose
    derivation its check refused (a write into the tensor it is derived from, after the trace)."""
    model = testing.build("gpt2")
    ids = torch.tensor([[1, 2, 3, 4]])
    t = tl.trace(model, ids, grads=lambda out: out.logits[0, -1].logsumexp(-1))
    waiting = sum(len(c.grads.pending) for r in t.modules.values() for c in r.calls if c.grads)
    assert waiting > 0 and t.pending >= waiting
    norm = next(a for a in t.by_role("norm"))
    fresh = tl.trace(model, ids, grads=lambda out: out.logits[0, -1].logsumexp(-1))
    t.modules[norm].grads["output"].mul_(2.0)  # a write into a gradient the derivation reads
    refused = t.check()
    assert t.pending == 0
    gradient_keys = [k for k in refused if k[2].endswith(" (gradient)")]
    assert (norm, 0, "normalized (gradient)") in gradient_keys
    assert "written after the trace returned" in refused[(norm, 0, "normalized (gradient)")]
    assert all(k[2] not in ("input (gradient)", "indices (gradient)") for k in gradient_keys)
    assert fresh.check() == {} and fresh.pending == 0
