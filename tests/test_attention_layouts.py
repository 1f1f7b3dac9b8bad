"""Attention facets in the layouts a kernel really ran, or refused: each test takes its ground
truth from outside TorchLens (eager `output_attentions`, forward hooks that clone, the projection
recomputed by hand).

- GQA single-token decode, where the query is packed into the kernel's query axis.
- A head axis that is not the query's heads, and softmax columns that cannot be told keys, are
  refused, not served.
- `result`'s status does not depend on `save=`.
- Query rows with no visible key are served as the zero weights the kernel used.
- Attention sinks (GPT-OSS): the key columns equal eager `attentions`.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers
from fixtures.seeded import IDS, hooked, seeded, seeded_gpt2

import torchlens as tl

# -- GQA single-token decode: the query packed into the kernel's query axis ------------------------


def _llama(impl: str = "sdpa") -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=32,
    )
    return seeded(transformers.LlamaForCausalLM, cfg, impl, "norm")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_gqa_packed_decode_serves_spec_layout_equal_to_eager_attentions(cache):
    model = _llama("sdpa")
    eager = copy.deepcopy(model)
    eager.config._attn_implementation = "eager"
    for mod in eager.modules():
        if hasattr(mod, "config"):
            mod.config._attn_implementation = "eager"
    ids = torch.tensor([[1, 5, 9, 3, 7, 2], [4, 4, 8, 6, 1, 3]])
    am = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    step = torch.tensor([[11], [12]])

    def new_cache():
        if cache == "dynamic":
            return transformers.DynamicCache(config=model.config)
        return transformers.StaticCache(config=model.config, max_cache_len=12)

    pre = dict(attention_mask=am) if cache == "dynamic" else {}
    kw = (
        dict(attention_mask=torch.cat([am, torch.ones(2, 1, dtype=am.dtype)], 1))
        if cache == "dynamic"
        else dict(cache_position=torch.tensor([6]))
    )
    ce, c, ch = new_cache(), new_cache(), new_cache()
    with torch.no_grad():
        eager(ids, cache=ce, use_cache=True, **pre)
        truth = eager(step, cache=ce, use_cache=True, output_attentions=True, **kw).attentions[0]
        model(ids, cache=c, use_cache=True, **pre)
        model(ids, cache=ch, use_cache=True, **pre)
    attn = "model.layers.0.self_attn"
    z_in, proj_out = hooked(model, attn + ".o_proj", step, cache=ch, use_cache=True, **kw)
    t = tl.trace(model, step, cache=c, use_cache=True, **kw)
    assert t.check() == {}
    fm = t.modules[attn].facets
    b, n_heads, d = 2, 4, 8
    assert fm["pattern"].shape == truth.shape == (b, n_heads, 1, truth.shape[-1])
    assert torch.allclose(fm["pattern"], truth, atol=1e-5)
    z = fm["z"]
    assert z.shape == (b, n_heads, 1, d) and fm.site("z").kind == "real"
    assert torch.equal(
        z.transpose(1, 2).reshape(b, 1, n_heads * d), z_in
    )  # o_proj's input, by hook
    w = model.model.layers[0].self_attn.o_proj.weight.detach()
    by_hand = torch.einsum("bthd,ohd->btho", z_in.view(b, 1, n_heads, d), w.view(-1, n_heads, d))
    assert torch.allclose(fm["result"], by_hand, atol=1e-6)
    assert torch.allclose(by_hand.sum(2), proj_out, atol=1e-5)
    assert fm["rot_q"].shape == (b, 1, n_heads, d)


class _RegroupedQuery(torch.nn.Module):
    """One decode token, its heads moved into the kernel's query axis by a transpose (not a
    reshape), against one shared key/value head: the kernel's z is [b, 1, heads, d]."""

    def __init__(self, d_model: int = 16, heads: int = 4):
        super().__init__()
        self.h, self.d = heads, d_model // heads
        self.q_proj = torch.nn.Linear(d_model, d_model)
        self.k_proj = torch.nn.Linear(d_model, self.d)
        self.v_proj = torch.nn.Linear(d_model, self.d)
        self.o_proj = torch.nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.h, self.d).transpose(1, 2)  # [b, h, 1, d]
        k = self.k_proj(x).view(b, t, 1, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, 1, self.d).transpose(1, 2)
        z = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k, v
        )  # [b, 1, h, d]
        return self.o_proj(z.reshape(b, t, self.h * self.d))


class _Block(torch.nn.Module):
    def __init__(self, attn: torch.nn.Module, d_model: int = 16):
        super().__init__()
        self.ln1, self.attn, self.ln2 = (
            torch.nn.LayerNorm(d_model),
            attn,
            torch.nn.LayerNorm(d_model),
        )
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(d_model, 32), torch.nn.GELU(), torch.nn.Linear(32, d_model)
        )

    def forward(self, x, **kw):
        x = x + self.attn(self.ln1(x), **kw)
        return x + self.mlp(self.ln2(x))


class _Net(torch.nn.Module):
    """Two pre-norm blocks around the given attention modules (found by TorchLens's structure rules)."""

    def __init__(self, make_attn):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(make_attn()), _Block(make_attn())])

    def forward(self, x, **kw):
        for b in self.blocks:
            x = b(x, **kw)
        return x


def test_head_axis_that_is_not_the_querys_heads_is_refused_not_served():
    torch.manual_seed(0)
    t = tl.trace(_Net(_RegroupedQuery).eval(), torch.randn(2, 1, 16))
    fm = t.modules["blocks.0.attn"].facets
    # The kernel's heads disagree with the query projection's split: one of them is misread
    # (here the kernel's regrouping; on CodeGen it was the split), so neither side is served.
    for name in ("scores", "pattern", "z", "q", "k", "v"):
        with pytest.raises(
            tl.FacetNotFound, match="are not the 4 heads x 1 positions found for the query"
        ):
            fm[name]
    assert "result" in fm.refused and "cannot tell which" in fm.refused["q"]


# -- result's status does not depend on save= -----------------------------------------------------


@pytest.mark.parametrize("save", ["all", ["result"], ["z", "result"]])
def test_result_under_dropout_is_checked_on_its_own_and_equals_the_projection_by_hand(save):
    model = seeded_gpt2("eager", attn_pdrop=0.5).train()
    attn = "transformer.h.0.attn"
    torch.manual_seed(1)
    z_in, proj_out = hooked(model, attn + ".c_proj", IDS)  # the post-dropout z the projection read
    torch.manual_seed(1)
    t = tl.trace(model, IDS, save=save)
    refused = t.check()
    assert (attn, 0, "result") not in refused
    b, n, h, d = 1, IDS.shape[1], 4, 8
    w = model.transformer.h[0].attn.c_proj.weight.detach()  # Conv1D: [in, out]
    by_hand = torch.einsum("bthd,hdo->btho", z_in.view(b, n, h, d), w.view(h, d, -1))
    result = t[attn + ":result"]
    assert torch.allclose(result, by_hand, atol=1e-6)
    assert torch.allclose(
        by_hand.sum(2) + model.transformer.h[0].attn.c_proj.bias.detach(), proj_out, atol=1e-5
    )
    if save != ["result"]:
        assert "dropout" in refused[(attn, 0, "z")]  # z's own check: pattern @ v is not z


# -- query rows with no visible key ----------------------------------------------------------------


class _SdpaAttn(torch.nn.Module):
    """Self-attention calling `scaled_dot_product_attention` with the mask it is given."""

    def __init__(self, d_model: int = 16, heads: int = 2):
        super().__init__()
        self.h, self.d = heads, d_model // heads
        self.qkv, self.o = torch.nn.Linear(d_model, 3 * d_model), torch.nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):
        b, t, e = x.shape
        q, k, v = (y.view(b, t, self.h, self.d).transpose(1, 2) for y in self.qkv(x).split(e, -1))
        z = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o(z.transpose(1, 2).reshape(b, t, e))


def _fully_masked(kind: str) -> torch.Tensor:
    """A [2, 1, 5, 5] mask that hides every key from query 2 of batch 1."""
    if kind == "bool":
        m = torch.ones(2, 1, 5, 5, dtype=torch.bool)
        m[1, :, 2, :] = False
        return m
    m = torch.zeros(2, 1, 5, 5)
    m[1, :, 2, :] = float("-inf")
    return m


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_query_row_is_served_as_the_zero_weights_the_kernel_used(kind):
    torch.manual_seed(0)
    net = _Net(_SdpaAttn).eval()
    x, mask = torch.randn(2, 5, 16), _fully_masked(kind)
    att = net.blocks[0].attn
    xin, _ = hooked(net, "blocks.0.attn", x, mask=mask)
    with (
        torch.no_grad()
    ):  # by hand: softmax over the visible keys, no weights where none is visible
        q, k, v = (y.view(2, 5, 2, 8).transpose(1, 2) for y in att.qkv(xin).split(16, -1))
        s = q @ k.transpose(-1, -2) / math.sqrt(8)
        s = s.masked_fill(~mask, float("-inf")) if kind == "bool" else s + mask
        p_true = torch.softmax(s, -1).nan_to_num(0.0)
    t = tl.trace(net, x, mask=mask)
    fm = t.modules["blocks.0.attn"].facets
    p = fm["pattern"]
    assert not p.isnan().any()
    assert torch.equal(p[1, :, 2], torch.zeros(2, 5))
    assert torch.allclose(p, p_true, atol=1e-6)
    assert torch.allclose(fm["z"], p_true @ v, atol=1e-6)


def test_a_fully_masked_row_is_checked_against_the_kernel_output_too():
    from torchlens._analysis.facets.rebuild import rebuild_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, 2, 5, 8).unbind(0)
    mask = _fully_masked("bool")[1:]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    _, p, err, tol = rebuild_attention((q, k, v), {"attn_mask": mask}, out)
    assert err <= tol and torch.equal(p[0, :, 2], torch.zeros(2, 5))
    planted = out.clone()
    planted[0, :, 2] = v[0, :, 0]  # all weight on key 0, which the mask hides
    _, _, err, tol = rebuild_attention((q, k, v), {"attn_mask": mask}, planted)
    assert err > tol  # that row is compared, not skipped


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mha_fully_masked_row_serves_what_its_output_proves(kind):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    net = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    with torch.no_grad():
        for mod in net.modules():
            if isinstance(mod, torch.nn.MultiheadAttention):
                mod.out_proj.bias.normal_()
    x = torch.randn(1, 4, 16)
    mask = torch.zeros(4, 4, dtype=torch.bool) if kind == "bool" else torch.zeros(4, 4)
    mask[1] = True if kind == "bool" else float("-inf")  # query 1 sees no key
    mha = net.layers[0].self_attn
    got = {}
    h = mha.register_forward_hook(
        lambda m, a, o: got.update(x=a[0].detach().clone(), out=o[0].detach().clone())
    )
    with torch.no_grad():
        net(x, mask=mask)
        h.remove()
        _, w_true = mha(
            got["x"],
            got["x"],
            got["x"],
            attn_mask=mask,
            need_weights=True,
            average_attn_weights=False,
        )
    t = tl.trace(net, x, mask=mask)
    assert t.check() == {}
    p = t.modules["layers.0.self_attn"].facets["pattern"]
    row = got["out"][0, 1]
    if torch.equal(row, mha.out_proj.bias.detach()):  # the op used no weights on that row
        assert torch.equal(p[0, :, 1], torch.zeros(2, 4))
    else:  # the op's softmax had no answer there, as need_weights shows
        assert row.isnan().all() and p[0, :, 1].isnan().all() and w_true[0, :, 1].isnan().all()
    keep = torch.tensor([0, 2, 3])
    assert torch.allclose(p[:, :, keep], w_true[:, :, keep], atol=1e-6)


# -- attention sinks (GPT-OSS) ---------------------------------------------------------------------


def test_attention_sinks_serve_the_key_columns_equal_to_eager_attentions():
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=64,
        max_position_embeddings=32,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    )
    cfg._attn_implementation = "eager"
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for mod in model.modules():
            if hasattr(mod, "sinks"):
                mod.sinks.normal_(0, 2.0)
        truth = model(IDS, output_attentions=True).attentions
    attn = "model.layers.1.self_attn"
    z_in, proj_out = hooked(model, attn + ".o_proj", IDS)
    t = tl.trace(model, IDS)
    assert t.check() == {}
    for layer in range(2):
        fm = t.modules[f"model.layers.{layer}.self_attn"].facets
        assert fm["pattern"].shape == truth[layer].shape == (1, 4, 6, 6)
        assert torch.allclose(fm["pattern"], truth[layer], atol=1e-6)
        assert fm["scores"].shape == (1, 4, 6, 6)
    fm = t.modules[attn].facets
    # scores: the key columns of the softmax input (shifted by the row's max, as the model does), so
    # score differences are log-ratios of the eager weights on the visible keys (key 0 is visible to all)
    s, p = fm["scores"].double(), truth[1].double()
    visible = torch.ones(6, 6, dtype=torch.bool).tril()
    diff = (s - s[..., :1]) - (p.log() - p[..., :1].log())
    assert float(diff[..., visible].abs().max()) < 1e-4
    assert torch.equal(fm["z"].transpose(1, 2).reshape(1, 6, 32), z_in)
    w = model.model.layers[1].self_attn.o_proj.weight.detach()
    assert torch.allclose(
        fm["result"],
        torch.einsum("bthd,ohd->btho", z_in.view(1, 6, 4, 8), w.view(32, 4, 8)),
        atol=1e-6,
    )


class _PaddedSoftmax(torch.nn.Module):
    """Eager attention whose softmax runs over one extra padded column, dropped before `@ v`: no
    `cat` names which columns are keys."""

    def __init__(self, d_model: int = 16, heads: int = 2):
        super().__init__()
        self.h, self.d = heads, d_model // heads
        self.qkv, self.o = torch.nn.Linear(d_model, 3 * d_model), torch.nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, e = x.shape
        q, k, v = (y.view(b, t, self.h, self.d).transpose(1, 2) for y in self.qkv(x).split(e, -1))
        s = torch.nn.functional.pad(q @ k.transpose(-1, -2) / math.sqrt(self.d), (1, 0))
        p = torch.softmax(s, -1)[..., 1:]
        return self.o((p @ v).transpose(1, 2).reshape(b, t, e))


def test_softmax_columns_that_cannot_be_told_keys_are_refused_not_served():
    torch.manual_seed(0)
    t = tl.trace(_Net(_PaddedSoftmax).eval(), torch.randn(1, 5, 16))
    fm = t.modules["blocks.0.attn"].facets
    for name in ("scores", "pattern"):
        with pytest.raises(tl.FacetNotFound, match="which columns are keys"):
            fm[name]


class _OneTensor:
    """The part of a `Graph` `rot_site` reads: one op output's meta and value."""

    def __init__(self, t):
        self.t = t

    def meta(self, ref):
        return tuple(self.t.shape), self.t.dtype

    def value(self, ref):
        return self.t


@pytest.mark.parametrize("apart", [False, True])
def test_rot_k_from_repeated_heads_is_served_only_when_they_are_copies(apart):
    """A kernel input with more heads than the keys (each key repeated for its group's query heads
    before RoPE) serves the first copy of each as `rot_k` only where the copies are equal: a model
    that made them differ after repeating has no one rotated key per key/value head."""
    from torchlens._analysis.facets.heads import rot_site
    from torchlens._core.records import Ref

    torch.manual_seed(0)
    keys = torch.randn(1, 2, 5, 8)  # [batch, kv heads, tokens, dim]
    repeated = keys.repeat_interleave(2, dim=1)  # 4 heads, group-major
    if apart:
        repeated = repeated * torch.tensor([1.0, 1.0, 1.0, 0.5]).view(1, 4, 1, 1)
    site = rot_site(_OneTensor(repeated), "rot_k", Ref(3, 0), (1, 5, 2, 8), ["mul"])
    if apart:
        assert site.kind == "refused" and "not copies of one tensor" in site.note
    else:
        assert site.kind == "real" and torch.equal(site.tensor, keys.transpose(1, 2))


def test_merged_batch_head_rows_are_served_as_batch_and_heads():
    """XGLM's eager attention runs softmax and pattern @ v on [batch * heads] rows: scores,
    pattern and z are served [batch, heads, ...], equal to HF's attentions and to the output
    projection's input; an edit of the pattern is given that view and lands in the model."""
    cfg = transformers.XGLMConfig(
        num_layers=2,
        d_model=32,
        attention_heads=4,
        ffn_dim=48,
        vocab_size=64,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.XGLMForCausalLM(cfg).eval()
    ids = torch.tensor([[5, 9, 12, 7, 30, 2, 8], [3, 4, 5, 6, 7, 8, 9]])
    seen = {}
    attn = model.model.layers[0].self_attn
    handle = attn.out_proj.register_forward_pre_hook(lambda m, a: seen.update(z=a[0].detach()))
    try:
        with torch.no_grad():
            hf = model(ids, output_attentions=True)
    finally:
        handle.remove()
    t = tl.trace(model, ids)
    facets = t.modules["model.layers.0.self_attn"].facets
    assert facets["pattern"].shape == (2, 4, 7, 7) and facets["scores"].shape == (2, 4, 7, 7)
    torch.testing.assert_close(facets["pattern"], hf.attentions[0], rtol=0, atol=0)
    z = facets["z"]  # head-major [batch, heads, query, d_head], checked as pattern @ v
    torch.testing.assert_close(z.transpose(1, 2).reshape(2, 7, 32), seen["z"], rtol=0, atol=0)
    key = ("model.layers.0.self_attn", "pattern")
    same = tl.trace(model, ids, edit={key: lambda p: p})
    torch.testing.assert_close(same.output.logits, hf.logits, rtol=0, atol=0)
    zeroed = tl.trace(model, ids, edit={key: lambda p: p * 0})
    assert not torch.equal(zeroed.output.logits, hf.logits)
    assert float(zeroed.modules["model.layers.0.self_attn"].facets["z"].abs().max()) == 0.0
