"""A relation check's verdict does not depend on the dtype the model ran in (issue 22, item 4).

`resid_mid` is served only when a relation the model fixes holds: resid_pre + the attention
branch = resid_mid = resid_post - the MLP branch. A check verifies something only if its
verdict is the verdict of the same relation computed exactly: so the expected verdict of every
block is taken from the same model run in float64, and the float32, bfloat16 and float16 runs
must agree with it. (Today the half-precision tolerance is 2e-2 times the output's scale, so
relations off by about 0.019 in float64 pass in bfloat16.)

Architectures (tiny seeded configs in `tests/_edge_models.py`):

- MBart and Pegasus decoder blocks (self-attention, cross-attention, fc1/fc2 in the block), and
  M2M-100 and Blenderbot (the same kind; no other test uses them).
- Granite (sublayer outputs times `residual_multiplier` before the add), and MiniCPM3 (the same
  kind: times `scale_depth / sqrt(n_layers)`; no other test uses it).

Ground truth for the values: a `resid_mid` that is served must be a residual tensor between the
attention and the MLP, recomputed in float64 from plain hooks on the block (its input) and its
attention modules (their outputs), with the model's own residual scale: block input + scale ×
self-attention output, or, in a decoder block, that plus the cross-attention output (the add that
feeds the MLP). The tolerance is the model's own roundings: one per add and per scaling, each at
most the dtype's epsilon times the magnitude rounded.
"""

from __future__ import annotations

import functools
import math

import _edge_models as em
import pytest
import torch

import torchlens as tl
from torchlens import testing

#: arch -> (block address patterns, the residual scale of a sublayer's output)
ARCHS = {
    "mbart": (("model.encoder.layers.{L}", "model.decoder.layers.{L}"), lambda cfg: 1.0),
    "pegasus": (("model.encoder.layers.{L}", "model.decoder.layers.{L}"), lambda cfg: 1.0),
    "m2m100": (("model.encoder.layers.{L}", "model.decoder.layers.{L}"), lambda cfg: 1.0),
    "blenderbot": (("model.encoder.layers.{L}", "model.decoder.layers.{L}"), lambda cfg: 1.0),
    "granite": (("model.layers.{L}",), lambda cfg: cfg.residual_multiplier),
    "minicpm3": (
        ("model.layers.{L}",),
        lambda cfg: cfg.scale_depth / math.sqrt(cfg.num_hidden_layers),
    ),
    # further cases of the same kinds, used by no other test: Marian (decoder with cross-attention),
    # GraniteMoE (residual_multiplier on an MoE block)
    "marian": (("model.encoder.layers.{L}", "model.decoder.layers.{L}"), lambda cfg: 1.0),
    "granitemoe": (("model.layers.{L}",), lambda cfg: cfg.residual_multiplier),
}
HALF = (torch.bfloat16, torch.float16)
ALL = (torch.float32,) + HALF
LAYERS = 2


def _blocks(arch: str) -> list[str]:
    return [p.format(L=i) for p in ARCHS[arch][0] for i in range(LAYERS)]


@functools.cache
def traced(arch: str, dtype: torch.dtype):
    model = em.build(arch, dtype)
    args, kwargs = em.inputs(arch, dtype)
    trace = tl.trace(model, *args, **kwargs, save="all")
    trace.check()
    return model, args, kwargs, trace


def verdicts(arch: str, dtype: torch.dtype) -> dict[str, str]:
    """block -> "served", "refused" or "absent" for its resid_mid."""
    trace = traced(arch, dtype)[3]
    out = {}
    for block in _blocks(arch):
        facets = trace.modules[block].calls[0].facets
        site = facets.sites.get("resid_mid")
        if site is not None and site.tensor is not None:
            out[block] = "served"
        elif "resid_mid" in facets.refused or site is not None:
            out[block] = "refused"
        else:
            out[block] = "absent"
    return out


@pytest.mark.parametrize("dtype", ALL, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_resid_mid_verdict_is_the_float64_verdict(arch, dtype):
    """Every block's resid_mid is served, refused or absent in `dtype` exactly as in float64."""
    exact, got = verdicts(arch, torch.float64), verdicts(arch, dtype)
    flips = {
        b: f"{exact[b]} in float64, {got[b]} in {str(dtype)[6:]}"
        for b in exact
        if got[b] != exact[b]
    }
    assert not flips, flips


@pytest.mark.parametrize("dtype", (torch.float64,) + ALL, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_served_resid_mid_is_a_residual_between_attention_and_mlp(arch, dtype):
    """Where resid_mid is served, it is block input + scale × self-attention output (or, in a
    decoder block, that plus the cross-attention output), from plain hooks, to the model's roundings."""
    model, args, kwargs, trace = traced(arch, dtype)
    scale = ARCHS[arch][1](model.config)
    blocks = _blocks(arch)
    attns = [f"{b}.self_attn" for b in blocks]
    cross = [
        f"{b}.encoder_attn" for b in blocks if f"{b}.encoder_attn" in dict(model.named_modules())
    ]
    ins = em.hooked_inputs(model, blocks, *args, **kwargs)
    outs = testing.hooked_outputs(model, attns + cross, *args, **kwargs)
    eps = torch.finfo(dtype).eps
    wrong = []
    for block in blocks:
        site = trace.modules[block].calls[0].facets.sites.get("resid_mid")
        if site is None or site.tensor is None:
            continue
        served = site.tensor.double()
        terms = [ins[block].double(), scale * outs[f"{block}.self_attn"].double()]
        options = [terms]
        if f"{block}.encoder_attn" in outs:
            options.append(terms + [outs[f"{block}.encoder_attn"].double()])
        ok = False
        for parts in options:
            truth = sum(parts)
            tol = eps * (truth.abs() + sum(p.abs() for p in parts)) + torch.finfo(dtype).tiny
            ok = ok or bool(((served - truth).abs() <= tol).all())
        if not ok:
            err = min(float((served - sum(p)).abs().max()) for p in options)
            wrong.append(
                f"{block}: served resid_mid is off every residual between attention and MLP by {err:.3g}"
            )
    assert not wrong, "\n".join(wrong)


#: arch -> the address of one RMSNorm that casts its input to float32 before normalizing (a
#: float64 model computes it in float32): Gemma-2 (in the families) and Gemma-3n (no other test).
NORMS = {
    "gemma2": "model.layers.0.input_layernorm",
    "gemma3n": "model.layers.0.input_layernorm",
    "olmo3": "model.layers.0.self_attn.q_norm",
}  # OLMo-3 (no other test): every RMSNorm casts to float32
NORM_FACETS = ("normalized", "scale", "inv_rms")


@functools.cache
def _norm_trace(arch: str, dtype: torch.dtype):
    model = testing.build(arch, dtype=dtype) if arch in testing.SUITE else em.build(arch, dtype)
    args, kwargs = (
        ((testing.token_ids(length=5),), {}) if arch in testing.SUITE else em.inputs(arch, dtype)
    )
    trace = tl.trace(model, *args, **kwargs, save="all")
    trace.check()
    return model, args, kwargs, trace


@pytest.mark.parametrize("arch", list(NORMS))
def test_norm_facets_verdict_does_not_depend_on_dtype(arch):
    """Every norm of the model serves the same norm facets in float64 as in float32, and the
    served `normalized` is input × rsqrt(mean(input²) + eps), recomputed in float64 from the
    norm's input seen by a plain pre-hook, to float32 precision (the norm casts to float32, so a
    float64 model computes it in float32: a tolerance taken from the output's dtype, 1e-10,
    refuses every norm facet there today)."""
    served = {}
    for dtype in (torch.float64, torch.float32):
        trace = _norm_trace(arch, dtype)[3]
        served[dtype] = {
            (a, c.index, f)
            for a, rec in trace.modules.items()
            for c in rec.calls
            for f in NORM_FACETS
            if c.facets.sites.get(f) is not None and c.facets.sites[f].tensor is not None
        }
    only32 = sorted(served[torch.float32] - served[torch.float64])
    only64 = sorted(served[torch.float64] - served[torch.float32])
    assert not only32 and not only64, (
        f"served in float32 only: {only32[:6]}; in float64 only: {only64[:6]}"
    )
    model, args, kwargs, trace = _norm_trace(arch, torch.float64)
    norm = NORMS[arch]
    x = em.hooked_inputs(model, [norm], *args, **kwargs)[norm].double()
    module = model.get_submodule(norm)
    eps = (
        module.eps if hasattr(module, "eps") else module.variance_epsilon
    )  # OLMo-3 names it variance_epsilon
    truth = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    got = trace.modules[norm].calls[0].facets.sites["normalized"].tensor.double()
    assert float((got - truth).abs().max()) <= 8 * torch.finfo(torch.float32).eps * float(
        truth.abs().max()
    )


def test_torchs_rms_norm_without_eps_is_checked_with_its_dtypes_eps():
    """`nn.RMSNorm(eps=None)` (torch's default) adds `finfo(dtype).eps` under the root: its
    `normalized` is served, equal to recomputation, not refused as not fitting an eps of 1e-5."""
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.RMSNorm(8)).to(dtype)
        x = torch.randn(2, 3, 8, dtype=dtype) * 1e-3  # small: the eps matters
        facets = tl.trace(model, x).modules["1"].facets
        with torch.no_grad():
            h = model[0](x)
            truth = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + torch.finfo(dtype).eps)
        assert "normalized" not in facets.refused, facets.refused
        assert torch.allclose(
            facets["normalized"], truth, rtol=1e-5 if dtype == torch.float32 else 1e-12
        )
