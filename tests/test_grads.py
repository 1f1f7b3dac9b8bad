"""`trace(..., grads=loss_fn)`: every served gradient checked against ground truth from outside
TorchLens.

Ground truth:

- tensor hooks (`Tensor.register_hook`) put by plain forward pre-hooks and forward hooks on every
  module's first input and output tensor, in a separate forward of an unfrozen copy of the model
  (same seeded weights), then `loss.backward()`;
- tensor hooks on the outputs of the ops a facet names (the softmax of an eager attention, a
  projection's output viewed per head), put by a small `TorchFunctionMode` of this file;
- float64 central finite differences of the loss on sampled elements, the element perturbed by a
  forward hook or by that mode.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
import transformers
from torch.overrides import TorchFunctionMode

import torchlens as tl
from torchlens import testing

FAMILIES = [
    ("gpt2", "eager"),
    ("gpt2", "sdpa"),
    ("llama", "eager"),
    ("llama", "sdpa"),
    ("gemma2", "eager"),
    ("bert", "eager"),
    ("bert", "sdpa"),
]


def build(family: str, impl: str, dtype=torch.float32):
    if family == "bert":
        cfg = transformers.BertConfig(
            vocab_size=testing.VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
        )
        return testing.from_config(cfg, transformers.BertForMaskedLM, impl, dtype)
    return testing.build(family, impl, dtype)


def loss_fn(out):
    """A logit difference at the last position, as attribution work takes it."""
    logits = out.logits
    return logits[0, -1, 3] - logits[0, -1, 5] + 0.1 * logits[0, 2].logsumexp(-1)


def _first(x):
    """The first tensor, depth first, of a module's arguments or output."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        for v in x:
            t = _first(v)
            if t is not None:
                return t
    return None


def hook_grads(model, ids, loss=loss_fn):
    """(address, "input"/"output") -> [d loss / d that tensor, per call] from tensor hooks put by
    plain module hooks; None where the hook never fired (the loss does not depend on it)."""
    got: dict = {}
    handles = []

    def watch(key, t):
        slot = [None]
        got.setdefault(key, []).append(slot)
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(lambda g: slot.__setitem__(0, g.detach().clone()))

    for addr, mod in model.named_modules():
        handles.append(
            mod.register_forward_pre_hook(
                lambda m, a, k, addr=addr: watch((addr, "input"), _first((a, k))), with_kwargs=True
            )
        )
        handles.append(
            mod.register_forward_hook(lambda m, a, o, addr=addr: watch((addr, "output"), _first(o)))
        )
    try:
        with torch.enable_grad():
            out = model(ids)
            loss(out).backward()
    finally:
        for h in handles:
            h.remove()
    return {k: [s[0] for s in v] for k, v in got.items()}


class _Ops(TorchFunctionMode):
    """Test-side: calls `on(name, n, output) -> output` for the n-th call of each op in `names`."""

    def __init__(self, names, on):
        super().__init__()
        self.names, self.on, self.n = names, on, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if name in self.names:
            n = self.n.get(name, 0)
            self.n[name] = n + 1
            out = self.on(name, n, out)
        return out


def _close(a, b, dtype):
    scale = max(float(b.abs().max()), 1e-30)
    tol = (1e-5 if dtype == torch.float32 else 2e-2) * scale
    return float((a.float() - b.float()).abs().max()) <= tol


@pytest.mark.parametrize("family,impl", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_io_grads_match_tensor_hooks(family, impl, dtype):
    """Every module call's `input` and `output` gradient equals a tensor hook's on that tensor;
    block `resid_pre`/`resid_post` equal the block's input/output gradients. The traced model is
    frozen and the caller under no_grad; the ground truth model is an unfrozen copy."""
    if dtype == torch.bfloat16 and impl == "sdpa" and family != "llama":
        pytest.skip("bfloat16 is checked on one sdpa family (llama); the rest in eager")
    ids = testing.token_ids(1, 7)
    truth = hook_grads(build(family, impl, dtype), ids)
    model = build(family, impl, dtype).requires_grad_(False)
    with torch.no_grad():
        t = tl.trace(model, ids, grads=loss_fn)
    compared = 0
    for addr, rec in t.modules.items():
        for i, call in enumerate(rec.calls):
            for facet, side in (
                ("input", "input"),
                ("output", "output"),
                ("resid_pre", "input"),
                ("resid_post", "output"),
            ):
                if facet not in call.grads.sites:
                    continue
                if facet.startswith("resid") and rec.role != "block":
                    continue
                want = truth[(addr, side)][i]
                got = call.grads[facet]
                assert (
                    got.shape == call.facets[facet].shape and got.dtype == call.facets[facet].dtype
                )
                if want is None:
                    assert not got.any(), (addr, facet)
                else:
                    assert _close(got, want, dtype), (
                        addr,
                        facet,
                        float((got.float() - want.float()).abs().max()),
                    )
                compared += 1
    assert compared >= 20
    assert all(p.grad is None and not p.requires_grad for p in model.parameters())
    out = t.output.logits
    assert out.grad_fn is None  # the caller was under no_grad: no graph handed back


def _op_truth(family, impl, ids):
    """Gradients of op-level sites from tensor hooks put by the test's own function mode: each
    softmax output (eager attention's pattern) and, per layer, the MLP activation."""
    model = build(family, impl)
    pats: list = []

    def on(name, n, out):
        slot = [None]
        pats.append(slot)
        out.register_hook(lambda g: slot.__setitem__(0, g.clone()))
        return out

    with torch.enable_grad(), _Ops({"softmax"}, on):
        out = model(ids)
    loss_fn(out).backward()
    return [s[0] for s in pats]


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2", "bert"])
def test_pattern_grads_match_softmax_hooks_eager(family):
    ids = testing.token_ids(1, 7)
    want = _op_truth(family, "eager", ids)
    t = tl.trace(build(family, "eager").requires_grad_(False), ids, grads=loss_fn)
    attns = [a for a, r in t.modules.items() if r.role == "attention"]
    assert len(attns) == len(want) == 2
    for a, w in zip(attns, want):
        got = t.modules[a].grads["pattern"]
        assert torch.allclose(got, w, rtol=1e-5, atol=1e-7 * float(w.abs().max()))


def _fd(model, ids, perturb, eps=1e-6):
    """Central difference of the loss when `perturb(delta)` installs a perturbation of one element."""
    vals = []
    for d in (eps, -eps):
        undo = perturb(d)
        try:
            with torch.no_grad():
                vals.append(float(loss_fn(model(ids))))
        finally:
            undo()
    return (vals[0] - vals[1]) / (2 * eps)


def _module_perturb(mod, index, side="output"):
    def perturb(d):
        if side == "output":

            def hook(m, a, o):
                t = o[0] if isinstance(o, tuple) else o
                t = t.clone()
                t[index] += d
                return (t,) + tuple(o[1:]) if isinstance(o, tuple) else t

            h = mod.register_forward_hook(hook)
        else:

            def hook(m, a):
                t = a[0].clone()
                t[index] += d
                return (t,) + tuple(a[1:])

            h = mod.register_forward_pre_hook(hook)
        return h.remove

    return perturb


def _softmax_perturb(model, layer, index):
    def perturb(d):
        def on(name, n, out):
            if n == layer:
                out = out.clone()
                out[index] += d
            return out

        mode = _Ops({"softmax"}, on)
        mode.__enter__()
        return lambda: mode.__exit__(None, None, None)

    return perturb


# (family, facet, where the perturbation goes: ("module", address, side, index-mapper) or softmax)
_FD_SITES = {
    "gpt2": [
        ("transformer.h.0", "resid_post", ("module", "transformer.h.0", "output")),
        ("transformer.h.1", "resid_pre", ("module", "transformer.h.1", "input")),
        ("transformer.h.0.mlp", "act", ("module", "transformer.h.0.mlp.act", "output")),
        ("transformer.h.0.mlp", "pre", ("module", "transformer.h.0.mlp.act", "input")),
        ("transformer.h.0.attn", "pattern", ("softmax", 0)),
        ("transformer.h.1.attn", "q", ("qkv", "transformer.h.1.attn.c_attn", 0)),
        ("transformer.h.1.attn", "v", ("qkv", "transformer.h.1.attn.c_attn", 2)),
        ("transformer.h.0.attn", "output", ("module", "transformer.h.0.attn", "output")),
    ],
    "llama": [
        ("model.layers.0", "resid_post", ("module", "model.layers.0", "output")),
        ("model.layers.1.mlp", "act", ("module", "model.layers.1.mlp.act_fn", "output")),
        ("model.layers.1.mlp", "pre_linear", ("module", "model.layers.1.mlp.up_proj", "output")),
        ("model.layers.0.self_attn", "q", ("proj", "model.layers.0.self_attn.q_proj")),
        ("model.layers.1.self_attn", "k", ("proj", "model.layers.1.self_attn.k_proj")),
        ("model.layers.1.self_attn", "pattern", ("softmax", 1)),
        ("model.norm", "input", ("module", "model.norm", "input")),
    ],
}


#: (step, tolerance) of the central difference. GPT-2 in float64 is float64 throughout: a tiny
#: step. Llama's RMSNorm computes in float32 whatever the model's dtype, so its loss carries
#: float32 rounding (~1e-7 relative): a step of 1e-3 keeps that noise near 1e-7 / 1e-3 and the
#: truncation error (step squared times the third derivative) near 1e-6.
_FD_STEP = {"gpt2": (1e-6, 1e-6), "llama": (1e-3, 2e-5)}


@pytest.mark.parametrize("family", list(_FD_SITES))
def test_grads_match_float64_finite_differences(family):
    """Sampled elements of one site of each facet kind, in float64: TorchLens's gradient equals
    the central difference of the loss with that element perturbed in a plain forward."""
    step, tol = _FD_STEP[family]
    ids = testing.token_ids(1, 7)
    model = build(family, "eager", torch.float64)
    t = tl.trace(model, ids, grads=loss_fn)
    gen = torch.Generator().manual_seed(0)
    for addr, facet, where in _FD_SITES[family]:
        g = t.modules[addr].grads[facet]
        for _ in range(3):
            idx = tuple(int(torch.randint(n, (1,), generator=gen)) for n in g.shape)
            if where[0] == "module":
                perturb = _module_perturb(model.get_submodule(where[1]), idx, where[2])
            elif where[0] == "softmax":
                perturb = _softmax_perturb(model, where[1], idx)
            else:  # a projection's output viewed per head: [b, t, h, d] -> the flat feature h * d + i
                b, tok, h, i = idx
                d_head = g.shape[-1]
                col = h * d_head + i + (where[2] * g.shape[-2] * d_head if where[0] == "qkv" else 0)
                perturb = _module_perturb(model.get_submodule(where[1]), (b, tok, col))
            fd = _fd(model, ids, perturb, step)
            assert abs(fd - float(g[idx])) <= tol * max(1.0, abs(fd)), (
                addr,
                facet,
                idx,
                fd,
                float(g[idx]),
            )


def test_real_facets_of_every_kind_are_served():
    """Which facets have gradients (the derived per-head result's is derived and checked:
    `tests/test_derived_grads.py`), and why the others do not (token ids, a misspelling)."""
    t = tl.trace(build("llama", "eager"), testing.token_ids(1, 7), grads=loss_fn)
    attn = t.modules["model.layers.0.self_attn"].grads
    assert set(attn) == {
        "input",
        "q",
        "k",
        "v",
        "rot_q",
        "rot_k",
        "scores",
        "pattern",
        "z",
        "result",
        "output",
    }
    assert {n for n, s in attn.sites.items() if s.kind != "real"} == {"result"}
    with pytest.raises(tl.GradNotFound, match="int64"):
        t.modules["model.embed_tokens"].grads["indices"]
    with pytest.raises(tl.GradNotFound, match="no facet 'patern'.*pattern"):
        attn["patern"]


def test_unused_site_gets_zeros_and_says_so():
    """A site the loss does not depend on: gradient zeros (a tensor hook never fires there)."""

    def first_layer_only(out):
        return out.hidden_states[1][0, 0].sum()

    model = build("gpt2", "eager")
    t = tl.trace(model, testing.token_ids(1, 7), grads=first_layer_only, output_hidden_states=True)
    g = t.modules["transformer.h.1"].grads
    assert not g["resid_post"].any()
    assert "does not depend" in g.site("resid_post").note
    assert t.modules["transformer.h.0"].grads["resid_post"][0, 0].eq(1).all()


def test_save_selection_keeps_gradients_of_what_it_keeps():
    ids = testing.token_ids(1, 7)
    full = tl.trace(build("gpt2", "eager"), ids, grads=loss_fn)
    t = tl.trace(build("gpt2", "eager"), ids, save=["resid_post"], grads=loss_fn)
    for layer in ("transformer.h.0", "transformer.h.1"):
        assert torch.equal(
            t.modules[layer].grads["resid_post"], full.modules[layer].grads["resid_post"]
        )
    with pytest.raises(tl.GradNotSaved, match="save="):
        t.modules["transformer.h.0"].grads["resid_pre"]


def test_alias_grad_reads_the_same_site():
    from torchlens import mechinterp as mi

    t = tl.trace(build("gpt2", "eager"), testing.token_ids(1, 7), grads=loss_fn)
    r = mi.resolve_alias(t, "blocks.1.hook_resid_post", generation="2.x")
    assert r.grad is t.modules["transformer.h.1"].grads["resid_post"]


def test_no_grads_trace_says_how():
    t = tl.trace(build("gpt2", "eager"), testing.token_ids(1, 7))
    with pytest.raises(tl.NoGradients, match="grads=loss_fn"):
        _ = t.modules["transformer.h.0"].grads


def test_frozen_params_restored_and_no_param_grad_written():
    model = build("gpt2", "eager")
    model.transformer.h[0].requires_grad_(False)
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    t = tl.trace(model, testing.token_ids(1, 7), grads=loss_fn)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before
    assert all(p.grad is None for p in model.parameters())
    assert t.modules["transformer.h.0"].grads["resid_post"].abs().sum() > 0


def _installed(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda out: out.logits, r"shape \[1, 7, 64\].*scalar"),
        (lambda out: 3.0, "not a tensor"),
        (lambda out: out.missing_attribute, "raised AttributeError"),
        (lambda out: out.logits.detach().sum(), "does not depend on anything differentiable"),
        (lambda out: out.logits.argmax(), "has no gradient"),
        ("not callable", "takes a function"),
    ],
)
def test_bad_loss_is_a_torchlens_error_and_leaves_nothing(bad, match):
    model = build("gpt2", "eager").requires_grad_(False)
    with pytest.raises(tl.GradientError, match=match):
        tl.trace(model, testing.token_ids(1, 7), grads=bad)
    assert _installed(model) == 0
    assert torch._C._len_torch_function_stack() == 0
    assert not any(p.requires_grad for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())


def test_a_loss_that_writes_into_the_output_through_data_leaves_the_saved_output_as_computed():
    """The loss function runs inside `trace`, after the forward: a write it makes into the
    model's output through `.data` (no version counter moves) is seen as the forward's writes are,
    so the unembedding's saved output is still what a plain forward hook cloned, with no warning;
    the caller's output holds the written values."""
    model = build("gpt2", "eager").requires_grad_(False)
    seen = {}
    handle = model.lm_head.register_forward_hook(
        lambda m, a, out: seen.update(out=out.detach().clone())
    )

    def doubling(out):
        out.logits.data.mul_(2.0)
        return out.logits[0, -1].max()

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t = tl.trace(model, testing.token_ids(1, 7), grads=doubling)
    finally:
        handle.remove()
    assert not [w for w in caught if "torchlens" in str(w.message)]
    assert torch.equal(t.modules["lm_head"].facets["output"], seen["out"])
    assert torch.equal(t.output.logits, 2.0 * seen["out"])
    assert torch._C._len_torch_function_stack() == 0


def test_inference_mode_refused_with_reason():
    model = build("gpt2", "eager")
    with torch.inference_mode(), pytest.raises(tl.GradientError, match="inference_mode.*no_grad"):
        tl.trace(model, testing.token_ids(1, 7), grads=loss_fn)
    assert _installed(model) == 0


def test_no_differentiable_path():
    """A model with no parameter and an integer input: nothing to differentiate."""

    class Count(torch.nn.Module):
        def forward(self, x):
            return (x * 2).float().sum()

    with pytest.raises(tl.GradientError, match="does not depend on anything differentiable"):
        tl.trace(Count(), torch.arange(4), grads=lambda out: out)


def test_graph_not_kept_alive_under_no_grad():
    """Under no_grad the trace holds no autograd graph once it returns (the edges are dropped)."""
    import weakref

    model = build("gpt2", "eager").requires_grad_(False)
    with torch.no_grad():
        t = tl.trace(model, testing.token_ids(1, 7), grads=loss_fn)
    ops = [op.tensors[0] for op in t.ops if op.tensors and op.tensors[0] is not None]
    assert all(x.grad_fn is None for x in ops)
    ref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_sdpa_pattern_and_scores_grads_derived_and_checked(family):
    """Under SDPA the pattern and scores are rebuilt (not in the autograd graph): their gradients
    are derived (dZ·Vᵀ per head, then the softmax's VJP) and served with the check; ground truth is
    the eager model's softmax output and input, hooked by the test's own function mode."""
    ids = testing.token_ids(1, 7)
    want_p = _op_truth(family, "eager", ids)
    model = build("bert" if family == "bert" else family, "eager")
    scores: list = []

    def on(name, n, out):
        return out

    # scores: the softmax input of the eager run, through a hook on the softmax's argument
    class _In(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") == "softmax":
                x = args[0]
                slot = [None]
                scores.append(slot)
                x.register_hook(lambda g: slot.__setitem__(0, g.clone()))
            return func(*args, **(kwargs or {}))

    with torch.enable_grad(), _In():
        out = model(ids)
    loss_fn(out).backward()
    t = tl.trace(build(family, "sdpa").requires_grad_(False), ids, grads=loss_fn)
    attns = [a for a, r in t.modules.items() if r.role == "attention"]
    for a, wp, ws in zip(attns, want_p, scores):
        g = t.modules[a].grads
        assert g.site("pattern").kind == "computed" and "checked" in g.site("pattern").note
        assert torch.allclose(g["pattern"], wp, rtol=1e-4, atol=1e-5 * float(wp.abs().max()))
        assert torch.allclose(g["scores"], ws[0], rtol=1e-4, atol=1e-5 * float(ws[0].abs().max()))


@pytest.mark.parametrize("store", ["cpu", "dir"])
def test_store_and_save_load_carry_grads(store, tmp_path):
    ids = testing.token_ids(1, 7)
    ref = tl.trace(build("llama", "sdpa"), ids, grads=loss_fn)
    t = tl.trace(
        build("llama", "sdpa"),
        ids,
        grads=loss_fn,
        store="cpu" if store == "cpu" else tmp_path / "st",
    )
    t.save(tmp_path / "t.tl")
    u = tl.load(tmp_path / "t.tl")
    n = 0
    for addr, rec in ref.modules.items():
        for i, call in enumerate(rec.calls):
            for facet in call.grads.sites:
                want = call.grads[facet]
                for other in (t, u):
                    got = other.modules[addr].calls[i].grads[facet]
                    assert torch.equal(got, want), (addr, facet)
                n += 1
            assert set(call.grads.refused) == set(u.modules[addr].calls[i].grads.refused)
    assert n > 50
    assert u.modules["model.layers.0.self_attn"].grads.site("pattern").kind == "computed"


def test_edit_gives_the_gradient_of_the_edited_forward():
    """edit= with grads=: the gradients are those of the edited forward (ground truth: a forward
    hook replacing the block output, with a tensor hook on the replacement and on the next block's
    input)."""
    ids = testing.token_ids(1, 7)
    model = build("gpt2", "eager")
    seen = {}

    def replace(m, a, o):
        t = o[0] if isinstance(o, tuple) else o
        new = t * 0.5
        new.register_hook(lambda g: seen.__setitem__("resid_post", g.clone()))
        return (new,) + tuple(o[1:]) if isinstance(o, tuple) else new

    def pre(m, a):
        a[0].register_hook(lambda g: seen.__setitem__("next", g.clone()))

    h1 = model.transformer.h[0].register_forward_hook(replace)
    h2 = model.transformer.h[1].register_forward_pre_hook(pre)
    try:
        loss_fn(model(ids)).backward()
    finally:
        h1.remove()
        h2.remove()
    t = tl.trace(
        build("gpt2", "eager").requires_grad_(False),
        ids,
        grads=loss_fn,
        edit={"transformer.h.0:resid_post": lambda x: x * 0.5},
    )
    assert torch.allclose(
        t.modules["transformer.h.0"].grads["resid_post"], seen["resid_post"], rtol=1e-5, atol=1e-7
    )
    assert torch.allclose(
        t.modules["transformer.h.1"].grads["resid_pre"], seen["next"], rtol=1e-5, atol=1e-7
    )


@pytest.mark.parametrize("value", ["tensor", "zeros_like"])
def test_a_constant_edit_names_itself_where_it_cuts_the_gradient(value):
    """An edit whose tensor has no autograd history (a given tensor, `torch.zeros_like(x)`)
    cuts autograd's path: the edited site and what is computed from it alone have no gradient,
    and their refusal names the edit. Upstream of it, the loss no longer depends on the block:
    its input's gradient is zeros (ground truth: a plain forward hook making the same edit,
    under which the block's input gets no gradient at all)."""
    ids = testing.token_ids(1, 7)
    model = build("gpt2", "eager").requires_grad_(False)
    const = torch.randn(1, 7, model.config.n_embd, generator=torch.Generator().manual_seed(3))
    edit = const if value == "tensor" else torch.zeros_like
    key = "transformer.h.0:resid_post"
    t = tl.trace(model, ids, grads=loss_fn, edit={key: edit})
    for address, facet in (("transformer.h.0", "resid_post"), ("transformer.h.1", "resid_pre")):
        with pytest.raises(tl.GradNotFound, match=f"edit=.{{1,2}}{key}"):
            t.modules[address].grads[facet]
    plain = build("gpt2", "eager")
    inputs = {}

    def leaf(m, a):
        inputs["x"] = a[0].detach().requires_grad_()
        return (inputs["x"],) + tuple(a[1:])

    def replace(m, a, o):
        t = o[0] if isinstance(o, tuple) else o
        new = const if value == "tensor" else torch.zeros_like(t)
        return (new,) + tuple(o[1:]) if isinstance(o, tuple) else new

    h1 = plain.transformer.h[0].register_forward_pre_hook(leaf)
    h2 = plain.transformer.h[0].register_forward_hook(replace)
    try:
        loss = loss_fn(plain(ids))
    finally:
        h1.remove()
        h2.remove()
    assert torch.autograd.grad(loss, inputs["x"], allow_unused=True) == (None,)
    assert torch.count_nonzero(t.modules["transformer.h.0"].grads["resid_pre"]) == 0


# -- where the graph starts: frozen parameters stay frozen, the first activations require grad ---


def _embedding_leaves(model):
    """Forward hooks making each `nn.Embedding`'s output an autograd leaf (a plain forward's way
    of taking gradients down to the embeddings with frozen weights); returns the handles."""
    return [
        m.register_forward_hook(lambda mod, a, out: out.detach().requires_grad_())
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding)
    ]


def test_parameters_stay_frozen_during_the_traced_forward():
    """A frozen model's parameters do not require grad while the traced forward runs (seen by the
    test's own pre-hooks), yet every block's input and output does, as the embeddings' outputs do."""
    model = build("gpt2", "eager").requires_grad_(False)
    seen: list = []
    handles = [
        m.register_forward_pre_hook(
            lambda mod, a: seen.extend(p.requires_grad for p in mod.parameters(recurse=False))
        )
        for m in model.modules()
    ]
    flows: list = []
    for m in [model.transformer.wte, model.transformer.wpe, *model.transformer.h]:
        handles.append(
            m.register_forward_hook(lambda mod, a, out: flows.append(_first(out).requires_grad))
        )
    try:
        with torch.no_grad():
            t = tl.trace(model, testing.token_ids(1, 7), grads=loss_fn)
    finally:
        for h in handles:
            h.remove()
    assert len(seen) >= len(list(model.parameters()))  # each seen (the tied one twice)
    assert not any(seen)
    assert flows == [True] * 4
    assert t.modules["transformer.h.0"].grads["resid_pre"].abs().sum() > 0


@pytest.mark.parametrize("family,impl", [("gpt2", "eager"), ("llama", "sdpa")])
def test_forward_saves_what_a_plain_forward_from_the_embeddings_saves(family, impl):
    """The traced forward saves for backward exactly the tensors (shape, dtype) a plain forward
    saves whose embeddings' outputs are the autograd leaves (weights frozen): no linear's input is
    saved for a weight gradient that nobody asks for. Seen by `saved_tensors_hooks` while the root
    module runs (not the loss)."""
    ids = testing.token_ids(1, 7)

    def saved(model, run):
        got: list = []
        on = [False]

        def pack(x):
            if on[0]:
                got.append((tuple(x.shape), x.dtype))
            return x

        hs = [
            model.register_forward_pre_hook(lambda m, a: on.__setitem__(0, True)),
            model.register_forward_hook(lambda m, a, o: on.__setitem__(0, False)),
        ]
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
                run()
        finally:
            for h in hs:
                h.remove()
        return sorted(got, key=repr)

    plain = build(family, impl).requires_grad_(False)
    leaves = _embedding_leaves(plain)
    try:
        with torch.enable_grad():
            want = saved(plain, lambda: loss_fn(plain(ids)).backward())
    finally:
        for h in leaves:
            h.remove()
    model = build(family, impl).requires_grad_(False)
    got = saved(model, lambda: tl.trace(model, ids, save=["resid_post"], grads=loss_fn))
    assert want and got == want


def test_first_activation_written_in_place():
    """A model that writes its embedding's output in place runs under grads= as it does plainly
    (the output it gets requires grad but is no leaf), and the gradients are the ones the weights
    give: loss = Σ W (2·e) + b, so d loss / d e = 2·Σ_rows W at every position."""

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, ids):
            x = self.emb(ids)
            x.mul_(2.0)
            return self.lin(x)

    torch.manual_seed(0)
    model = Scaled().requires_grad_(False)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        plain = model(ids)
        t = tl.trace(model, ids, grads=lambda out: out.sum())
    assert torch.equal(t.output, plain)
    want = (2.0 * model.lin.weight.sum(0)).expand(1, 3, 4)
    assert torch.allclose(t.modules["emb"].grads["output"], want, rtol=1e-6, atol=0)
    assert torch.allclose(
        t.modules["lin"].grads["input"], model.lin.weight.sum(0).expand(1, 3, 4), rtol=1e-6, atol=0
    )
    assert not any(p.requires_grad or p.grad is not None for p in model.parameters())


class _LearnedPositions(torch.nn.Module):
    """A module whose output is computed from its parameter alone (no input on its path)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 4))

    def forward(self, n: int):
        return self.weight[:n] * 1.0


class _WithPositions(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.pos = _LearnedPositions()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, ids):
        return self.lin(self.emb(ids) + self.pos(ids.shape[1]))


def test_tensor_of_frozen_parameters_alone_is_refused_with_the_reason():
    """A site computed from frozen parameters alone is on no autograd graph: its gradient is
    refused saying why and how to get it; with that parameter unfrozen it is served, equal to a
    tensor hook's. Every site on the input's path keeps its gradient (tensor hooks, unfrozen copy)."""
    torch.manual_seed(0)
    model = _WithPositions()
    ids = torch.tensor([[1, 2, 3, 4]])
    truth: dict = {}

    def watch(name):
        def hook(m, a, o):
            o.register_hook(lambda g: truth.__setitem__(name, g.clone()))

        return hook

    hs = [getattr(model, n).register_forward_hook(watch(n)) for n in ("emb", "pos", "lin")]
    (model(ids) ** 2).sum().backward()
    for h in hs:
        h.remove()
    model.zero_grad(set_to_none=True)

    def loss(out):
        return (out**2).sum()

    model.requires_grad_(False)
    t = tl.trace(model, ids, grads=loss)
    with pytest.raises(tl.GradNotFound, match="frozen parameters alone.*requires_grad_"):
        t.modules["pos"].grads["output"]
    assert torch.allclose(t.modules["emb"].grads["output"], truth["emb"], rtol=1e-6, atol=0)
    assert torch.allclose(t.modules["lin"].grads["output"], truth["lin"], rtol=1e-6, atol=0)
    model.pos.requires_grad_(True)
    u = tl.trace(model, ids, grads=loss)
    assert torch.allclose(u.modules["pos"].grads["output"], truth["pos"], rtol=1e-6, atol=0)
    assert model.pos.weight.grad is None and not model.emb.weight.requires_grad


def test_image_input_grads_match_tensor_hooks():
    """A frozen ViT on pixel values (no embedding lookup: the patch convolution reads the input
    with its weight): every module input and output gradient equals a tensor hook's on an
    unfrozen copy."""

    def logit_diff(out):
        return out.logits[0, 1] - out.logits[0, 2]

    (pixels,), _ = testing.inputs("vit")
    truth = hook_grads(testing.build("vit"), pixels, logit_diff)
    with torch.no_grad():
        t = tl.trace(testing.build("vit").requires_grad_(False), pixels, grads=logit_diff)
    compared = 0
    for addr, rec in t.modules.items():
        for i, call in enumerate(rec.calls):
            for facet in ("input", "output"):
                want = truth[(addr, facet)][i]
                if want is None or facet not in call.grads.sites:
                    continue
                assert _close(call.grads[facet], want, torch.float32), (addr, facet)
                compared += 1
    assert compared >= 20


@pytest.mark.parametrize("family,impl", [("gpt2", "sdpa"), ("llama", "sdpa"), ("gpt2", "eager")])
def test_padding_mask_is_not_made_to_require_grad(family, impl):
    """With a padded attention mask, the mask reaches attention not requiring grad (it reads no
    parameter), as it does with the weights unfrozen, and the logits are bit-identical to the
    model's plain forward. The test's own function mode, outside the trace's, sees every op."""
    ids = testing.token_ids(1, 7)
    mask = torch.ones(1, 7, dtype=torch.long)
    mask[0, :2] = 0
    masks: list = []

    class _Masks(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            if name == "scaled_dot_product_attention":
                m = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
                masks.append(m is not None and m.requires_grad)
            if name in ("__add__", "add") and len(args) == 2:  # eager: scores + mask
                b = args[1]
                if isinstance(b, torch.Tensor) and b.dim() == 4 and b.shape[1] == 1:
                    masks.append(b.requires_grad)
            return func(*args, **kwargs)

    model = build(family, impl).requires_grad_(False)
    with torch.no_grad():
        plain = model(ids, attention_mask=mask).logits
        with _Masks():
            t = tl.trace(model, ids, attention_mask=mask, grads=loss_fn)
    assert masks and not any(masks)
    assert torch.equal(t.output.logits, plain)
    assert (
        t.modules[next(a for a, r in t.modules.items() if r.role == "block")]
        .grads["resid_post"]
        .abs()
        .sum()
        > 0
    )


class _KeepRotatedKeys(torch.overrides.TorchFunctionMode):
    """A plain forward's tensor hook on layer 0's rotated keys: the second RoPE `add` whose output
    has the broadcast key's shape (the first rotates the queries)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.seen, self.grad = shape, 0, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") == "add" and isinstance(out, torch.Tensor):
            if tuple(out.shape) == self.shape and out.requires_grad:
                self.seen += 1
                if self.seen == 2:
                    out.register_hook(lambda g: setattr(self, "grad", g))
        return out


def test_a_key_broadcast_before_rope_gets_the_sum_of_its_copies_gradients():
    """Falcon's new layout broadcasts each key/value group to its query heads before RoPE, so the
    rotated key exists only as copies; `rot_k` serves the group's key (the first copy), and its
    gradient is d loss / d that key: the sum over the copies (it was the first copy's alone, off
    by up to 100%). Ground truth: a tensor hook on the model's broadcast rotated keys."""
    model = testing.build("falcon_new_layout", dtype=torch.float64)
    ids = testing.token_ids(1, 7)

    def loss(out):
        return out.logits[0, -1, 3] - out.logits[0, -1, 5]

    trace = tl.trace(model.requires_grad_(False), ids, grads=loss)
    site = "transformer.h.0.self_attention"
    served = trace.modules[site].grads["rot_k"]  # [1, 7, kv, d]
    kv, d = served.shape[2], served.shape[3]
    heads = model.config.num_attention_heads
    keep = _KeepRotatedKeys((1, heads, 7, d))
    model.requires_grad_(True)
    try:
        with keep:
            loss(model(ids)).backward()
    finally:
        model.requires_grad_(False)
        model.zero_grad(set_to_none=True)
    truth = keep.grad.unflatten(1, (kv, heads // kv)).sum(2).transpose(1, 2)
    assert torch.allclose(served, truth, rtol=1e-10, atol=1e-14)
    assert "sum" in trace.modules[site].grads.site("rot_k").note


class _ReverseGrad(torch.autograd.Function):
    """The usual gradient reversal layer: its forward returns a view of its input."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -g


class _Reversed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.b(_ReverseGrad.apply(torch.tanh(self.a(x))))


def test_a_custom_function_returning_a_view_traces_with_grads():
    """The view a custom `autograd.Function` makes in its forward (under no_grad) has no gradient
    edge of its own; `trace(grads=)` raised torch's bare AssertionError there. The sites on either
    side of the Function get autograd's gradients, the reversal included. Ground truth: tensor
    hooks in a plain forward."""
    torch.manual_seed(0)
    model, x = _Reversed(), torch.randn(2, 4)
    model.requires_grad_(False)
    trace = tl.trace(model, x, grads=lambda out: out.sum())
    seen = {}

    def keep(name):
        def hook(module, args, out):
            out.register_hook(lambda g: seen.__setitem__(name, g))

        return hook

    model.requires_grad_(True)
    handles = [model.a.register_forward_hook(keep("a")), model.b.register_forward_hook(keep("b"))]
    try:
        model(x).sum().backward()
    finally:
        for h in handles:
            h.remove()
        model.requires_grad_(False)
        model.zero_grad(set_to_none=True)
    assert torch.allclose(trace.modules["a"].grads["output"], seen["a"])
    assert torch.allclose(trace.modules["b"].grads["output"], seen["b"])


class _RoundThrough(torch.autograd.Function):
    """A straight-through estimator: rounds forward, passes the gradient through unchanged."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


class _Quantize(torch.nn.Module):
    def forward(self, x):
        return _RoundThrough.apply(x)


class _Quantized(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.q, self.b = torch.nn.Linear(4, 4), _Quantize(), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.q(self.a(x)))


def test_a_tensor_made_inside_a_custom_function_is_refused_for_that_reason():
    """The output of a custom `autograd.Function`'s forward is computed with autograd off, so
    autograd has no gradient at the op that made it: it is refused, saying so (it said nothing it
    is computed from requires grad, which is false), and the gradient at its input, through the
    Function's backward, equals a tensor hook's."""
    torch.manual_seed(0)
    model, x = _Quantized(), torch.randn(2, 4)
    model.requires_grad_(False)
    trace = tl.trace(model, x, grads=lambda out: out.square().sum())
    grads = trace.modules["q"].grads
    assert "autograd was off" in grads.refused["output"]
    seen = {}

    def keep(module, args, out):
        out.register_hook(lambda g: seen.__setitem__("a", g))

    model.requires_grad_(True)
    handle = model.a.register_forward_hook(keep)
    try:
        model(x).square().sum().backward()
    finally:
        handle.remove()
        model.requires_grad_(False)
        model.zero_grad(set_to_none=True)
    assert torch.allclose(trace.modules["a"].grads["output"], seen["a"])
