"""A sublayer's contribution to the residual is served wherever the block adds one (issue 22, item 4).

TransformerLens 2.x `blocks.L.hook_attn_out` / `blocks.L.hook_mlp_out` read "the attention's /
MLP's contribution to the residual": the tensor the block adds to the residual stream for that
sublayer. Where the model changes the sublayer's output on the way, that tensor is no module's
output, and TorchLens serves it as the sublayer's `contribution` facet (the add's operand, an op
output):

- Granite: `residual + out * residual_multiplier`, for both sublayers; GraniteSWA (its
  sliding-window variant, no other test uses it) the same.
- MiniCPM3: `residual + out * (scale_depth / sqrt(n_layers))`.
- Llama-4: `residual + feed_forward(x).view(residual.shape)`.
- HyperCLOVAX (no other test uses it): `residual + post_norm(out) * residual_multiplier`, so the
  contribution is the sandwich norm's output, scaled; the facet is the norm's.

Ground truth: plain forward hooks on the module whose output the block changes
(`testing.hooked_outputs`), with the model's own scale or reshape applied by hand from its config
(the same elementwise product of the same float32 values, so equal to one rounding).
"""

from __future__ import annotations

import functools
import math

import _edge_models as em
import pytest
import torch

import torchlens as tl
import torchlens.mechinterp as mi
from torchlens import testing

#: arch -> (sublayer -> the module under model.layers.N whose output the block changes, the
#: residual scale of that output)
ARCHS = {
    "granite": ({"attn": "self_attn", "mlp": "mlp"}, lambda cfg: cfg.residual_multiplier),
    "graniteswa": ({"attn": "self_attn", "mlp": "mlp"}, lambda cfg: cfg.residual_multiplier),
    "minicpm3": (
        {"attn": "self_attn", "mlp": "mlp"},
        lambda cfg: cfg.scale_depth / math.sqrt(cfg.num_hidden_layers),
    ),
    "llama4": ({"attn": "self_attn", "mlp": "feed_forward"}, lambda cfg: 1.0),
    "hyperclovax": (
        {"attn": "post_norm1", "mlp": "post_norm2"},
        lambda cfg: cfg.residual_multiplier,
    ),
}
CASES = [(a, s) for a in ARCHS for s in ("attn", "mlp")]
LAYERS = 2


@functools.cache
def traced(arch: str):
    model = em.build(arch)
    args, kwargs = em.inputs(arch)
    return model, args, kwargs, tl.trace(model, *args, **kwargs, save="all")


@pytest.mark.parametrize("arch,sub", CASES, ids=[f"{a}-{s}" for a, s in CASES])
def test_contribution_is_served_where_the_block_adds_it(arch, sub):
    model, args, kwargs, trace = traced(arch)
    modules, scale_of = ARCHS[arch]
    scale = scale_of(model.config)
    addrs = [f"model.layers.{i}.{modules[sub]}" for i in range(LAYERS)]
    blocks = [f"model.layers.{i}" for i in range(LAYERS)]
    outs = testing.hooked_outputs(model, addrs + blocks, *args, **kwargs)
    wrong = []
    for i, address in enumerate(addrs):
        out = outs[address]
        truth = (out.view(outs[blocks[i]].shape) * scale).double()
        name = f"blocks.{i}.hook_{sub}_out"
        r = mi.resolve_alias(trace, name, generation="2.x")
        if r.status != "real":
            wrong.append(f"{name} [{r.status}]: {r.reason}")
            continue
        got = r.tensor.double()
        tol = torch.finfo(torch.float32).eps * truth.abs()
        if got.shape != truth.shape or not bool(((got - truth).abs() <= tol).all()):
            wrong.append(
                f"{name} -> {r.module_address}:{r.facet} is not {scale:.3g} x {address}'s output"
            )
    assert not wrong, "\n".join(wrong)


def test_a_contribution_whose_check_fails_is_refused_never_the_unscaled_output():
    """A served tensor written in place after the trace makes the contribution's check refuse; the
    name is then refused, and is never answered with the sublayer's `output` (another tensor)."""
    model = em.build("granite")
    args, kwargs = em.inputs("granite")
    trace = tl.trace(model, *args, **kwargs, save="all")
    trace.modules["model.layers.0.self_attn"].facets["output"].mul_(2.0)
    r = mi.resolve_alias(trace, "blocks.0.hook_attn_out", generation="2.x")
    assert (r.status, r.module_address, r.facet) == (
        "refused",
        "model.layers.0.self_attn",
        "contribution",
    ), (r.status, r.facet, r.reason)
    assert "written after the trace returned" in r.reason


def test_where_the_block_adds_the_output_as_it_is_there_is_no_contribution_facet():
    """GPT-2 and Gemma-2 (a sandwich norm, no constant) add what the module returns: hook_attn_out
    reads the module's `output`, and no `contribution` facet is made beside it."""
    for family, module in (
        ("gpt2", "transformer.h.0.attn"),
        ("gemma2", "model.layers.0.post_attention_layernorm"),
    ):
        trace = tl.trace(testing.build(family), testing.token_ids(length=5), save="all")
        r = mi.resolve_alias(trace, "blocks.0.hook_attn_out", generation="2.x")
        assert (r.module_address, r.facet, r.status) == (module, "output", "real"), family
        assert not any("contribution" in rec.facets.sites for rec in trace.modules.values())


def test_the_contribution_is_found_whatever_save_keeps():
    """Where the facet is must not depend on save=: an edit's locating pass keeps nothing, and a
    selection keeps the block's input only sometimes. The values a selection keeps are those of
    save="all"."""
    model = em.build("granite")
    args, kwargs = em.inputs("granite")
    full = traced("granite")[3]
    for save in ("none", ["contribution"], ["resid_post"]):
        trace = tl.trace(model, *args, **kwargs, save=save)
        for i in range(LAYERS):
            for sub in ("self_attn", "mlp"):
                facets = trace.modules[f"model.layers.{i}.{sub}"].calls[0].facets
                assert "contribution" in facets.sites, (save, i, sub)
                if save == ["contribution"]:
                    want = full.modules[f"model.layers.{i}.{sub}"].facets["contribution"]
                    assert torch.equal(facets["contribution"], want), (i, sub)


@pytest.mark.parametrize("arch", ["granite", "llama4", "hyperclovax"])
def test_an_edit_of_the_contribution_is_the_edit_plain_hooks_make(arch):
    """Zeroing 2.x hook_attn_out / hook_mlp_out through edit= zeroes what the block adds, as a
    forward hook zeroing the module whose output the block changes (times any constant is 0)."""
    model = em.build(arch)
    args, kwargs = em.inputs(arch)
    modules = ARCHS[arch][0]
    for sub in ("attn", "mlp"):
        edited = tl.trace(
            model, *args, **kwargs, save="none", edit={f"blocks.0.hook_{sub}_out": torch.zeros_like}
        )
        target = model.get_submodule(f"model.layers.0.{modules[sub]}")
        hook = target.register_forward_hook(
            lambda m, a, out: (out[0] * 0, *out[1:]) if isinstance(out, tuple) else out * 0
        )
        try:
            with torch.no_grad():
                want = model(*args, **kwargs).logits
        finally:
            hook.remove()
        assert torch.equal(edited.output.logits.detach(), want), (arch, sub)
