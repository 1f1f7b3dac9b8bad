"""`trace(..., grads=loss_fn)` on derived facets: a norm's `normalized`, `inv_std` and `scale` (on
a norm that runs as one fused op), an RMSNorm's `scale`, and attention's per-head `result`. Their
gradients are derived and checked on first read (`tests/test_lazy_grads.py`); every one served
here is checked against ground truth from outside TorchLens, and planted models whose backward
breaks the relation are refused.

Ground truth:

- an unfrozen copy of the model (same seeded weights) whose norm modules' `forward` is replaced,
  on that copy only, by the normalization written out with `retain_grad()` on the centred input's
  divisor `scale`, its inverse and `normalized`, then the gain (and bias) as the module applies it;
  for `result`, a forward hook on the output projection that splits its input by head, forms
  `result_h = z_h @ W_O,h` with `retain_grad()` and returns their sum plus the bias;
- float64 central finite differences of the loss on sampled elements, the element perturbed in
  those same written-out forwards.
"""

from __future__ import annotations

import pytest
import torch
from test_grads import build as grads_build
from test_grads import loss_fn
from torch import nn

import torchlens as tl
from torchlens import testing

IDS = testing.token_ids(1, 7)

#: family -> (the computed norm facets whose gradients are served, the output projection's
#: address by layer, its weight layout)
FAMILIES = {
    "gpt2": ({"normalized", "inv_std", "scale"}, "transformer.h.{}.attn.c_proj", "in_out"),
    "llama": ({"scale"}, "model.layers.{}.self_attn.o_proj", "out_in"),
    "gemma2": ({"scale"}, "model.layers.{}.self_attn.o_proj", "out_in"),
    "bert": ({"normalized", "inv_std", "scale"}, None, None),
}


def build(family: str, dtype=torch.float32, impl: str = "eager") -> nn.Module:
    """The family's tiny seeded model (BERT as a masked LM), as the gradient tests build it."""
    return grads_build(family, impl, dtype)


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, scale: float = 0.0) -> bool:
    """Equal within the dtype's rounding of `b`'s largest entry, or of `scale` where larger (the
    sum of the magnitudes a reduced gradient adds up: its rounding is relative to them)."""
    scale = max(float(b.abs().max()), scale, 1e-30)
    tol = (1e-5 if dtype == torch.float32 else 3e-2) * scale
    return float((a.double() - b.double()).abs().max()) <= tol


def _summands(record: dict, name: str) -> float:
    """For the scale and its inverse of a written-out norm call: the largest sum of the
    magnitudes their gradient adds up, Σ |d loss / d normalized · centred| (times inv² for the
    scale); 0 for `normalized`."""
    if name == "normalized":
        return 0.0
    mags = (record["normalized"].grad * record["centred"]).abs().sum(-1, keepdim=True)
    if name == "scale":
        mags = mags * record["inv_std"].detach() ** 2
    return float(mags.max())


# -- ground truth: written-out norms and a per-head output projection ---------------------------


def _norm_kind(mod: nn.Module) -> str | None:
    if isinstance(mod, nn.LayerNorm):
        return "layer"
    return {"LlamaRMSNorm": "llama", "Gemma2RMSNorm": "gemma"}.get(type(mod).__name__)


def write_out_norms(model: nn.Module, perturb: dict | None = None) -> dict[str, list[dict]]:
    """Replace the forward of every norm of `model` (this instance only) by the normalization
    written out, keeping `scale`, `inv` and `normalized` with `retain_grad()`: address -> one dict
    per call. `perturb` maps (address, "normalized" or "scale") to (index, delta) to add there."""
    seen: dict[str, list[dict]] = {}
    perturb = perturb if perturb is not None else {}
    for addr, mod in model.named_modules():
        kind = _norm_kind(mod)
        if kind is None:
            continue

        def forward(x, mod=mod, kind=kind, addr=addr):
            xf = x.to(torch.promote_types(x.dtype, torch.float32))
            eps = mod.eps if kind != "llama" else mod.variance_epsilon
            centred = xf - xf.mean(-1, keepdim=True) if kind == "layer" else xf
            scale = (centred.pow(2).mean(-1, keepdim=True) + eps).sqrt()
            if (addr, "scale") in perturb:
                idx, d = perturb[addr, "scale"]
                scale = scale.clone()
                scale[idx] += d
            scale.retain_grad()
            inv = 1 / scale
            inv.retain_grad()
            normalized = centred * inv
            if (addr, "normalized") in perturb:
                idx, d = perturb[addr, "normalized"]
                normalized = normalized.clone()
                normalized[idx] += d
            normalized.retain_grad()
            seen.setdefault(addr, []).append(
                {
                    "scale": scale,
                    "inv_std": inv,
                    "inv_rms": inv,
                    "normalized": normalized,
                    "centred": centred.detach(),
                }
            )
            if kind == "layer":
                return (normalized * mod.weight + mod.bias).to(x.dtype)
            if kind == "llama":
                return mod.weight * normalized.to(x.dtype)
            return (normalized * (1.0 + mod.weight.float())).to(x.dtype)

        mod.forward = forward
    return seen


def per_head_results(model: nn.Module, family: str, perturb: dict | None = None) -> dict:
    """A forward hook on each output projection of `model` returning the sum over heads of
    `z_h @ W_O,h` (kept with `retain_grad()`) plus the bias: layer -> the per-head results
    `[b, t, h, d_out]`. `perturb` maps a layer to (index, delta) to add to its result."""
    _, proj, layout = FAMILIES[family]
    cfg = model.config
    heads = cfg.num_attention_heads
    seen: dict[int, torch.Tensor] = {}
    perturb = perturb if perturb is not None else {}
    for layer in range(cfg.num_hidden_layers):
        mod = model.get_submodule(proj.format(layer))

        def hook(m, args, out, layer=layer):
            z = args[0]
            d_in = z.shape[-1]
            zh = z.unflatten(-1, (heads, d_in // heads))
            w = m.weight
            w3 = (
                w.view(w.shape[0], heads, -1)
                if layout == "out_in"
                else w.view(heads, -1, w.shape[-1]).permute(2, 0, 1)
            )
            result = torch.einsum("bthd,ohd->btho", zh, w3)
            if layer in perturb:
                idx, d = perturb[layer]
                result = result.clone()
                result[idx] += d
            result.retain_grad()
            seen[layer] = result
            total = result.sum(2)
            return total if m.bias is None else total + m.bias

        mod.register_forward_hook(hook)
    return seen


# -- served and equal to the ground truth --------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_norm_grads_equal_the_written_out_norm(family, dtype):
    """Every norm call's derived gradients are served, kind 'computed' with the check's error, and
    equal d loss / d the written-out norm's `normalized`, `scale` and its inverse."""
    served, _, _ = FAMILIES[family]
    with torch.no_grad():
        t = tl.trace(build(family, dtype).requires_grad_(False), IDS, grads=loss_fn)
    plain = build(family, dtype)
    seen = write_out_norms(plain)
    loss_fn(plain(IDS)).backward()
    norms = [a for a, r in t.modules.items() if r.role == "norm"]
    assert norms and set(norms) == set(seen)
    for addr in norms:
        for i, call in enumerate(t.modules[addr].calls):
            derived = {n for n, s in call.grads.sites.items() if s.kind == "computed"}
            assert derived == served, (addr, derived, call.grads.refused)
            assert set(call.grads.pending) == derived  # derived and checked on first read
            for name in derived:
                site = call.grads.site(name)
                assert "checked" in site.note
                got, want = call.grads[name], seen[addr][i][name].grad
                assert site.checked and site.check_error is not None
                assert got.shape == want.shape and got.dtype == call.facets.site(name).dtype
                assert _close(got, want, dtype, _summands(seen[addr][i], name)), (addr, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2"])
def test_result_grads_equal_a_per_head_output_projection(family, dtype):
    """Each attention call's per-head `result` gradient equals d loss / d `z_h @ W_O,h` formed by
    a forward hook on the output projection, head by head; it reads by other libraries' names."""
    with torch.no_grad():
        t = tl.trace(build(family, dtype).requires_grad_(False), IDS, grads=loss_fn)
    plain = build(family, dtype)
    seen = per_head_results(plain, family)
    loss_fn(plain(IDS)).backward()
    attns = [a for a, r in t.modules.items() if r.role == "attention"]
    assert len(attns) == len(seen) == 2
    for layer, addr in enumerate(attns):
        grads = t.modules[addr].grads
        site = grads.site("result")
        assert site.kind == "computed" and grads.pending == ["result"]
        assert _close(grads["result"], seen[layer].grad, dtype), addr
        assert site.check_error is not None and grads.pending == []
    by_name = t.grad("blocks.1.attn.hook_result")
    assert torch.equal(by_name, t.modules[attns[1]].grads["result"])


def test_by_other_libraries_names():
    """TransformerLens's hook_normalized and hook_scale, by `trace.grad` and `resolve_alias`."""
    import torchlens.mechinterp as mi

    t = tl.trace(build("gpt2"), IDS, grads=loss_fn)
    plain = build("gpt2")
    seen = write_out_norms(plain)
    loss_fn(plain(IDS)).backward()
    got = t.grad("blocks.0.ln1.hook_normalized")
    assert _close(got, seen["transformer.h.0.ln_1"][0]["normalized"].grad, torch.float32)
    scale = mi.resolve_alias(t, "ln_final.hook_scale").grad
    assert _close(scale, seen["transformer.ln_f"][0]["scale"].grad, torch.float32)


#: (family, address, facet, where to perturb: ("norm", what) or ("result", layer)), with the
#: central difference's step and tolerance. GPT-2 and BERT in float64 compute in float64
#: throughout, so a tiny step; the RMSNorm families compute parts in float32 whatever the
#: model's dtype, whose rounding a central difference cannot resolve at a small step, so their
#: derived gradients are checked against the written-out norms above instead.
_FD = [
    ("gpt2", "transformer.h.0.ln_1", "normalized", ("norm", "normalized"), 1e-6, 1e-6),
    ("gpt2", "transformer.ln_f", "scale", ("norm", "scale"), 1e-6, 1e-6),
    ("gpt2", "transformer.h.1.ln_2", "inv_std", ("norm", "inv"), 1e-6, 1e-6),
    ("gpt2", "transformer.h.1.attn", "result", ("result", 1), 1e-6, 1e-6),
    (
        "bert",
        "bert.encoder.layer.0.output.LayerNorm",
        "normalized",
        ("norm", "normalized"),
        1e-6,
        1e-6,
    ),
    ("bert", "bert.embeddings.LayerNorm", "scale", ("norm", "scale"), 1e-6, 1e-6),
]


@pytest.mark.parametrize("family,addr,facet,where,step,tol", _FD)
def test_derived_grads_equal_float64_finite_differences(family, addr, facet, where, step, tol):
    """Sampled elements, in float64: the served gradient equals the central difference of the
    loss with that element perturbed in the written-out forward (for `inv_std`, the scale is
    perturbed by the step's image under 1 / scale and the chain rule's factor applied)."""
    t = tl.trace(build(family, torch.float64), IDS, grads=loss_fn)
    g = t.modules[addr].grads[facet]
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        idx = tuple(int(torch.randint(n, (1,), generator=gen)) for n in g.shape)
        vals = []
        for d in (step, -step):
            model = build(family, torch.float64)
            if where[0] == "norm" and where[1] != "inv":
                write_out_norms(model, {(addr, where[1]): (idx, d)})
            elif where[0] == "norm":
                write_out_norms(model, {(addr, "scale"): (idx, d)})
            else:
                per_head_results(model, family, {where[1]: (idx, d)})
            vals.append(float(loss_fn(model(IDS)).detach()))  # autograd on: the retain_grad()s
        fd = (vals[0] - vals[1]) / (2 * step)
        if where[1] == "inv":  # d loss / d inv = d loss / d scale · d scale / d inv = -scale² · ...
            scale = t.modules[addr].facets["scale"][idx]
            fd = -(float(scale) ** 2) * fd
        assert abs(fd - float(g[idx])) <= tol * max(1.0, abs(fd)), (addr, facet, idx, fd, g[idx])


# -- refused where the relation does not hold ----------------------------------------------------


def test_straight_through_norm_refuses_with_the_reason():
    """A LayerNorm whose value is the normalization but whose backward passes the gradient
    straight through (x + (layer_norm(x) - x).detach()): its values are served, its derived
    gradients are refused, and the refusal says which relation failed."""
    model = build("gpt2").requires_grad_(False)
    ln = model.transformer.h[0].ln_1

    def forward(x):
        y = nn.functional.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)
        return x + (y - x).detach()

    ln.forward = forward
    t = tl.trace(model, IDS, grads=loss_fn)
    call = t.modules["transformer.h.0.ln_1"]
    assert call.facets["normalized"].shape == (1, 7, 32)  # the value's relation holds
    for name in ("normalized", "inv_std", "scale"):
        with pytest.raises(tl.GradNotFound) as err:
            call.grads[name]
        text = str(err.value)
        assert "transformer.h.0.ln_1" in text and name in text
        assert "autograd's gradient at the norm's input through the norm" in text
        assert "not served" in text
    other = t.modules["transformer.h.1.ln_1"].grads
    assert other.site("normalized").kind == "computed"  # the untouched norms are served


def test_detached_statistics_refuse_the_norms_gradients():
    """An RMSNorm written out with its statistics detached (rsqrt(...).detach()): the value
    relation holds and the values are served, but the norm's backward is not the
    normalization's, so the derived `normalized`, `inv_rms` and `scale` gradients fail their
    check and are refused, saying why; the model's other norms are served."""
    model = build("llama").requires_grad_(False)
    norm = model.model.layers[0].input_layernorm

    def forward(x):
        inv = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).detach()
        return norm.weight * (x * inv)

    norm.forward = forward
    t = tl.trace(model, IDS, grads=loss_fn)
    call = t.modules["model.layers.0.input_layernorm"]
    for name in ("normalized", "inv_rms", "scale"):
        assert call.facets[name] is not None
        with pytest.raises(tl.GradNotFound, match="detached statistics"):
            call.grads[name]
    assert t.modules["model.layers.1.input_layernorm"].grads.site("scale").kind == "computed"


def test_z_read_elsewhere_refuses_result():
    """z also feeds the attention output directly (a hook adds it): the result's value relation
    holds (the output projection is untouched), but autograd's gradient at z is no longer W_O
    times d loss / d the projection's output, so the result gradient is refused."""
    model = build("gpt2").requires_grad_(False)
    attn = model.transformer.h[1].attn
    kept = {}
    attn.c_proj.register_forward_pre_hook(lambda m, a: kept.__setitem__("z", a[0]))

    def add_z(m, a, out):
        return (out[0] + 0.5 * kept["z"],) + tuple(out[1:])

    attn.register_forward_hook(add_z)
    t = tl.trace(model, IDS, grads=loss_fn)
    assert t.modules["transformer.h.1.attn"].facets["result"].shape == (1, 7, 2, 32)
    with pytest.raises(tl.GradNotFound, match="does not come from the output projection alone"):
        t.modules["transformer.h.1.attn"].grads["result"]
    assert t.modules["transformer.h.0.attn"].grads.site("result").kind == "computed"


def test_wrong_gain_refuses_value_and_gradient():
    """A norm whose output is not normalized * gain + bias (its weight doubled in the forward):
    the value is refused, and so is the gradient, saying which relation failed."""
    model = build("gpt2").requires_grad_(False)
    ln = model.transformer.ln_f

    def forward(x):
        return nn.functional.layer_norm(x, ln.normalized_shape, 2 * ln.weight, ln.bias, ln.eps)

    ln.forward = forward
    t = tl.trace(model, IDS, grads=loss_fn)
    with pytest.raises(tl.FacetNotFound, match="normalized \\* gain \\+ bias differs"):
        t.modules["transformer.ln_f"].facets["normalized"]
    with pytest.raises(tl.GradNotFound, match="normalized \\* gain \\+ bias differs"):
        t.modules["transformer.ln_f"].grads["normalized"]


def test_result_without_z_kept_says_to_keep_it():
    """save=['result'] keeps no z, whose gradient the check needs: refused, naming the remedy;
    save=['result', 'z'] serves it."""
    t = tl.trace(build("gpt2"), IDS, grads=loss_fn, save=["result"])
    with pytest.raises(tl.GradNotFound, match="keep 'z' too"):
        t.modules["transformer.h.0.attn"].grads["result"]
    t = tl.trace(build("gpt2"), IDS, grads=loss_fn, save=["result", "z"])
    assert t.modules["transformer.h.0.attn"].grads["result"].shape == (1, 7, 2, 32)
    t = tl.trace(build("gpt2"), IDS, grads=loss_fn, save=["scale"])
    assert t.modules["transformer.h.0.ln_1"].grads["scale"].shape == (1, 7, 1)


def test_group_norm_normalized_grad_equals_the_written_out_norm():
    """A GroupNorm (per-group statistics, a per-channel gain): `normalized`'s gradient is served
    and equals d loss / d the written-out group normalization's output."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.norm, self.out = nn.Linear(8, 12), nn.GroupNorm(3, 12), nn.Linear(12, 4)
            with torch.no_grad():
                self.norm.weight.uniform_(0.5, 2.0)
                self.norm.bias.uniform_(-1.0, 1.0)

        def forward(self, x):
            return self.out(torch.tanh(self.norm(self.inp(x))))

    torch.manual_seed(0)
    model, x = Net(), torch.randn(5, 8)

    def loss(out):
        return (out**2).sum()

    t = tl.trace(model, x, grads=loss)
    got = t.modules["norm"].grads["normalized"]
    seen = {}

    def written_out(h):
        grouped = h.reshape(5, 3, -1)
        centred = grouped - grouped.mean(-1, keepdim=True)
        scale = (centred.pow(2).mean(-1, keepdim=True) + model.norm.eps).sqrt()
        normalized = (centred / scale).reshape(5, 12)
        normalized.retain_grad()
        seen["normalized"] = normalized
        return normalized * model.norm.weight + model.norm.bias

    model.norm.forward = written_out
    loss(model(x)).backward()
    assert _close(got, seen["normalized"].grad, torch.float32)
