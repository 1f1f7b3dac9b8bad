"""`compare(trace, grads, of="grad")`: another engine's gradients checked site by site (issue 24, item 3).

The "engine" is plain PyTorch: tensor hooks (`Tensor.register_hook`) put by forward hooks on the
modules of an unfrozen copy of the model, then `loss.backward()`. Those gradients must pass; the
wrong ones below are the classes peers shipped, each made the way the peer made it, and each must
fail with an explanation that names what the tensor is:

- all zeros / None: a hook on a reshaped view the model never consumed (TransformerLens PR #1750);
- the gradient of the neighbouring site (before instead of after a norm);
- summed over heads;
- missing the residual branch;
- scaled by the loss's reduction (a mean instead of a sum).
"""

from __future__ import annotations

import functools

import pytest
import torch

import torchlens as tl
import torchlens.mechinterp as mi
from torchlens import testing


def loss_fn(out):
    logits = out.logits
    return logits[0, -1, 3] - logits[0, -1, 5]


@functools.cache
def setting():
    """(the trace with grads=, {module address: (d loss/d input, d loss/d output)} from tensor hooks)."""
    ids = testing.token_ids(1, 6)
    trace = tl.trace(testing.build("gpt2"), ids, save="all", grads=loss_fn)
    model = testing.build("gpt2")  # the same seeded weights, parameters trainable
    grads: dict[str, list] = {}
    handles = []
    for address, module in model.named_modules():

        def pre(m, args, address=address):
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if x is not None and x.requires_grad:
                x.register_hook(lambda g: grads.setdefault(address, [None, None]).__setitem__(0, g))

        def post(m, args, out, address=address):
            y = out[0] if isinstance(out, tuple) else out
            if isinstance(y, torch.Tensor) and y.requires_grad:
                y.register_hook(lambda g: grads.setdefault(address, [None, None]).__setitem__(1, g))

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    loss_fn(model(ids)).backward()
    for h in handles:
        h.remove()
    return trace, {a: (g[0], g[1]) for a, g in grads.items()}


def test_hooked_gradients_pass():
    trace, grads = setting()
    engine = {
        "blocks.0.hook_resid_pre": grads["transformer.h.0"][0],
        "blocks.0.hook_resid_post": grads["transformer.h.0"][1],
        "blocks.1.hook_attn_out": grads["transformer.h.1.attn"][1],
        "blocks.1.hook_mlp_out": grads["transformer.h.1.mlp"][1],
        "blocks.0.hook_resid_mid": grads["transformer.h.0.ln_2"][0],
    }
    report = mi.compare(trace, engine, generation="2.x", of="grad")
    assert report.ok, str(report)
    assert len(report) == 5


def _explained(report) -> str:
    (row,) = report
    assert not row.passed
    return row.explanation


def test_a_view_the_model_never_consumed_gives_none_or_zeros():
    trace, grads = setting()
    ref = grads["transformer.h.0.attn"][1]
    (none_row,) = mi.compare(trace, {"blocks.0.hook_attn_out": None}, generation="2.x", of="grad")
    assert not none_row.passed and "None" in none_row.hint
    zeros = mi.compare(
        trace, {"blocks.0.hook_attn_out": torch.zeros_like(ref)}, generation="2.x", of="grad"
    )
    assert _explained(zeros).startswith("all zeros")


def test_the_neighbouring_site_before_the_norm():
    """The engine hands the gradient after the MLP's residual add (resid_post) as the one before it
    (resid_mid), a hook one site downstream."""
    trace, grads = setting()
    wrong = grads["transformer.h.1"][1]  # d loss / d resid_post of block 1
    report = mi.compare(trace, {"blocks.1.hook_resid_mid": wrong}, generation="2.x", of="grad")
    assert "blocks.1.hook_resid_post" in _explained(report)


def test_summed_over_heads():
    trace, _ = setting()
    z = mi.resolve_alias(trace, "blocks.1.attn.hook_z", generation="2.x").grad  # [b, heads, pos, d]
    report = mi.compare(trace, {"blocks.1.attn.hook_z": z.sum(1)}, generation="2.x", of="grad")
    assert "summed over the heads" in _explained(report)


def test_missing_the_residual_branch():
    trace, grads = setting()
    pre, mid = grads["transformer.h.0"][0], grads["transformer.h.0.ln_2"][0]
    report = mi.compare(trace, {"blocks.0.hook_resid_pre": pre - mid}, generation="2.x", of="grad")
    assert "without the residual path" in _explained(report)


def test_scaled_by_the_losss_reduction():
    trace, grads = setting()
    g = grads["transformer.h.0"][1]
    report = mi.compare(trace, {"blocks.0.hook_resid_post": g / 6}, generation="2.x", of="grad")
    assert "1/6 of it" in _explained(report) and "mean over 6" in _explained(report)


@pytest.mark.parametrize(
    "kwargs,words",
    [
        (dict(of="grads"), "of='grads' is not accepted"),
        (dict(of="grad", tolerance="auto"), "with of='grad' pass atol/rtol"),
    ],
)
def test_bad_of_values_teach(kwargs, words):
    trace, grads = setting()
    with pytest.raises(mi.CompareSpecError, match=words):
        mi.compare(trace, {"blocks.0.hook_resid_post": grads["transformer.h.0"][1]}, **kwargs)


def test_a_trace_without_grads_says_how_to_take_one():
    trace = tl.trace(testing.build("gpt2"), testing.token_ids(1, 6))
    with pytest.raises(mi.CompareSpecError, match="grads=loss_fn"):
        mi.compare(trace, {"blocks.0.hook_resid_post": torch.zeros(1, 6, 32)}, of="grad")


def test_trace_grad_is_the_gradient_counterpart_of_trace_getitem():
    """`trace.grad(name)` reads the site `trace[name]` reads, and gives the tensor hooks' gradient."""
    trace, grads = setting()
    want = grads["transformer.h.0"][1]
    for name in ("blocks.0.hook_resid_post", "layers_output[0]", "transformer.h.0:resid_post"):
        assert trace.grad(name).shape == trace[name].shape, name
        assert torch.allclose(trace.grad(name), want, rtol=1e-5, atol=1e-7), name
    with pytest.raises(tl.LookupFailed, match="takes a name"):
        trace.grad(3)


def test_trace_grad_on_a_trace_without_grads_says_so():
    trace = tl.trace(testing.build("gpt2"), testing.token_ids(1, 6))
    with pytest.raises(tl.NoGradients):
        trace.grad("blocks.0.hook_resid_post")


def test_a_hook_on_a_copy_only_the_norm_consumes_misses_the_residual_path():
    """The TransformerLens 4.x bridge's backward hook at `blocks.L.ln2.hook_in` sits on the
    output of a hook point that only the norm consumes; the residual add uses the tensor before
    it. Made here the same way with plain PyTorch: a pre-hook hands ln_2 a copy of its input and
    a tensor hook on the copy takes its gradient, which is d loss / d resid_mid without what the
    residual path carries."""
    trace, _ = setting()
    model = testing.build("gpt2")
    got = {}

    def pre(module, args):
        copy = args[0].clone()
        copy.register_hook(lambda g: got.setdefault("g", g))
        return (copy, *args[1:])

    model.transformer.h[0].ln_2.register_forward_pre_hook(pre)
    loss_fn(model(testing.token_ids(1, 6))).backward()
    report = mi.compare(trace, {"blocks.0.ln2.hook_in": got["g"]}, generation="3.x", of="grad")
    explained = _explained(report)
    assert "without the residual path" in explained, explained
    # 3.x names resid_post by the block's hook_out
    assert "blocks.0.hook_resid_mid - blocks.0.hook_out" in explained, explained


def test_a_norm_folded_into_centered_weights_loses_the_mean_of_its_gradient():
    """TransformerLens's `fold_ln` folds a LayerNorm's weight into the layer that reads it and
    centers that layer's weights over the features: the forward is unchanged (the normalized
    vector has mean zero), but a hook on the normalized tensor then gets d loss / d normalized
    without its mean over the features. Made here with plain PyTorch: GPT-2's final norm written
    out, its output read by an unembedding with the weight folded in and centered, and a tensor
    hook on the normalized vector."""
    trace, _ = setting()
    model = testing.build("gpt2")
    ln, head = model.transformer.ln_f, model.lm_head
    folded = ln.weight[:, None] * head.weight.T  # [d_model, vocab]
    folded = folded - folded.mean(0, keepdim=True)
    bias = ln.bias @ head.weight.T
    got = {}

    def forward(x):
        mu = x.mean(-1, keepdim=True)
        normalized = (x - mu) / torch.sqrt(((x - mu) ** 2).mean(-1, keepdim=True) + ln.eps)
        normalized.register_hook(lambda g: got.setdefault("g", g))
        return normalized

    ln.forward = forward
    head.forward = lambda n: n @ folded + bias
    ids = testing.token_ids(1, 6)
    out = model(ids)
    with torch.no_grad():  # the folded model is the same function
        assert torch.allclose(out.logits, testing.build("gpt2")(ids).logits, atol=1e-5)
    loss_fn(out).backward()
    report = mi.compare(trace, {"ln_final.hook_normalized": got["g"]}, generation="2.x", of="grad")
    explained = _explained(report)
    assert "mean over the features removed" in explained, explained
