"""An attention facet is served where the model computes it, or its absence is given a true reason (issue 22, item 4).

Today, when the facet code cannot find q/k/v/z in an attention it says nothing, and the resolver
falls back on the facet row's generic text: "the module does not compute it", and for rot_q /
rot_k "nothing transforms the queries/keys between the projection and the kernel (no RoPE)".
Both are false on these models:

- DeepSeek-V3 and MiniCPM3 (multi-head latent attention; MiniCPM3 is used by no other test):
  k is `cat(k_nope, k_rope)` and v a slice of `kv_b_proj`; k's RoPE part is rotated.
- GPT-BigCode (multi-query): q, k, v are slices of one fused `c_attn`.
- ModernBERT: q, k, v are one `Wqkv` viewed as [batch, pos, 3, heads, d_head]; q and k get RoPE.
- DeBERTa-v2: v is `value_proj` per head; z is `bmm(pattern, v)` over merged batch*heads.

The rule: each (model, facet) below is either served with the value the model computed, or
absent/refused with a reason that the model does not contradict: never "does not compute it"
(the model computes it: the test recomputes it from the projection's output), never "no RoPE"
where the model's rotary embedding ran and rotated it.

Ground truth: plain forward hooks on the projections (`torchlens.testing.hooked_outputs`), with
the model's own slicing (from its source) applied by hand. For rotated facets, properties
RoPE fixes: at position 0 it is the identity, and it keeps each head vector's norm.
"""

from __future__ import annotations

import functools

import _edge_models as em
import pytest
import torch

import torchlens as tl
import torchlens.mechinterp as mi
from torchlens import testing

FALSE_REASONS = {
    "q": ("does not compute it",),
    "k": ("does not compute it",),
    "v": ("does not compute it",),
    "z": ("does not compute it",),
    "rot_q": ("no RoPE", "does not compute it"),
    "rot_k": ("no RoPE", "does not compute it"),
}


@functools.cache
def traced(arch: str):
    model = em.build(arch)
    args, kwargs = em.inputs(arch)
    return model, args, kwargs, tl.trace(model, *args, **kwargs, save="all")


def _out(arch: str, address: str) -> torch.Tensor:
    model, args, kwargs, _ = traced(arch)
    return testing.hooked_outputs(model, [address], *args, **kwargs)[address]


def _mla(arch: str) -> dict[str, torch.Tensor]:
    """DeepSeek-V3 / MiniCPM3: k (before RoPE) = cat(k_nope per head, the shared k_rope), v, token-major."""
    model = traced(arch)[0]
    cfg = model.config
    a = "model.layers.0.self_attn"
    compressed = _out(arch, f"{a}.kv_a_proj_with_mqa")
    b, t, _ = compressed.shape
    kv = _out(arch, f"{a}.kv_b_proj").view(b, t, -1, cfg.qk_nope_head_dim + cfg.v_head_dim)
    heads = kv.shape[2]
    k_nope, v = kv[..., : cfg.qk_nope_head_dim], kv[..., cfg.qk_nope_head_dim :]
    k_rope = (
        compressed[..., cfg.kv_lora_rank :]
        .view(b, t, 1, cfg.qk_rope_head_dim)
        .expand(b, t, heads, -1)
    )
    return {"k": torch.cat([k_nope, k_rope], -1), "v": v, "k_nope": k_nope, "k_rope": k_rope}


def _bigcode(arch: str) -> dict[str, torch.Tensor]:
    """GPT-BigCode multi-query: c_attn = [q (heads * d_head) | k (d_head) | v (d_head)]."""
    model = traced(arch)[0]
    out = _out(arch, "transformer.h.0.attn.c_attn")
    b, t, _ = out.shape
    d, dh = model.config.n_embd, model.config.n_embd // model.config.n_head
    return {
        "q": out[..., :d].view(b, t, -1, dh),
        "k": out[..., d : d + dh].view(b, t, 1, dh),
        "v": out[..., d + dh :].view(b, t, 1, dh),
    }


def _modernbert(arch: str) -> dict[str, torch.Tensor]:
    """ModernBERT: Wqkv viewed [batch, pos, 3, heads, d_head], unbound on the 3."""
    model = traced(arch)[0]
    out = _out(arch, "model.layers.0.attn.Wqkv")
    b, t, _ = out.shape
    q, k, v = out.view(b, t, 3, model.config.num_attention_heads, -1).unbind(2)
    return {"q": q, "k": k, "v": v}


def _deberta(arch: str) -> dict[str, torch.Tensor]:
    """DeBERTa-v2: v = value_proj per head; z = the attention's merged context, per head."""
    model = traced(arch)[0]
    a = "deberta.encoder.layer.0.attention.self"
    h = model.config.num_attention_heads
    v = _out(arch, f"{a}.value_proj")
    z = _out(arch, a)
    b, t, _ = v.shape
    return {"v": v.view(b, t, h, -1), "z": z.view(b, t, h, -1)}


#: arch -> (generation, attention address, ground truth, rotary module (None: no RoPE), facets)
CASES = {
    "deepseek_v3": (
        "3.x",
        "model.layers.0.self_attn",
        _mla,
        "model.rotary_emb",
        ("k", "v", "rot_k"),
    ),
    "minicpm3": ("3.x", "model.layers.0.self_attn", _mla, "model.rotary_emb", ("k", "v", "rot_k")),
    "gpt_bigcode": ("3.x", "transformer.h.0.attn", _bigcode, None, ("q", "k", "v")),
    "modernbert": (
        "3.x",
        "model.layers.0.attn",
        _modernbert,
        "model.rotary_emb",
        ("q", "k", "v", "rot_q"),
    ),
    "deberta_v2": ("3.x", "deberta.encoder.layer.0.attention.self", _deberta, None, ("v", "z")),
    # DeepSeek-V2 (no other test): the same multi-head latent attention as DeepSeek-V3
    "deepseek_v2": (
        "3.x",
        "model.layers.0.self_attn",
        _mla,
        "model.rotary_emb",
        ("k", "v", "rot_k"),
    ),
}
PARAMS = [(arch, facet) for arch, case in CASES.items() for facet in case[4]]


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal to float32 rounding, token-major or head-major (axes 1 and 2 swapped)."""
    tol = 8 * torch.finfo(torch.float32).eps * float(want.abs().max())
    for g in (got, got.transpose(1, 2) if got.dim() == 4 else got):
        if g.shape == want.shape and bool(((g.double() - want.double()).abs() <= tol).all()):
            return True
    return False


def _token_major(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t if t.shape == like.shape else t.transpose(1, 2)


@pytest.mark.parametrize("arch,facet", PARAMS, ids=[f"{a}-{f}" for a, f in PARAMS])
def test_facet_is_served_right_or_absent_for_a_true_reason(arch, facet):
    generation, attn, truth_of, rotary, _ = CASES[arch]
    model, args, kwargs, trace = traced(arch)
    truth = truth_of(arch)
    if rotary is not None:  # the model's rotary embedding ran: a "no RoPE" reason would be false
        assert rotary in dict(model.named_modules())
        assert testing.hooked_outputs(model, [rotary], *args, **kwargs)
    r = mi.resolve_alias(trace, f"blocks.0.attn.hook_{facet}", generation=generation)
    if r.status in ("real", "reconstructed_read_only"):
        assert r.module_address == attn, r
        got = r.tensor
        if facet in truth:
            assert _close(got, truth[facet]), (
                f"{facet} served as {r.status} is not the model's {facet}"
            )
        else:  # rot_q / rot_k: RoPE of the unrotated tensor (identity at position 0, norm kept)
            base = truth[facet[4:]] if facet[4:] in truth else truth["k"]
            got = _token_major(got, base)
            assert got.shape == base.shape, (got.shape, base.shape)
            assert _close(got[:, :1], base[:, :1]), f"{facet} at position 0 is not {facet[4:]}"
            assert _close(got.norm(dim=-1), base.norm(dim=-1)), (
                f"{facet} does not keep the head norms of {facet[4:]}"
            )
            assert not _close(got, base), f"{facet} is served unrotated"
        return
    assert r.status in ("structurally_absent", "refused", "ambiguous"), r
    lies = [p for p in FALSE_REASONS[facet] if p in r.reason]
    assert not lies, (
        f"{arch} {facet} [{r.status}]: the reason says {lies}, which the model contradicts: {r.reason}"
    )
    assert r.reason.strip(), "an absent facet must say why"
