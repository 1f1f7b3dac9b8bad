"""A module beside a block's MLP is never served as the MLP (issue 22, item 3).

The rule under test: every name that reads "the MLP" (nnterp `mlps_input`/`mlps_output`,
TransformerLens 4.x `blocks.L.mlp.hook_in`/`hook_out`, 2.x `blocks.L.mlp.hook_post`,
interp-engine `mlp_in`/`mlp_out`/`mlp_act`) reads the module that is the block's MLP in the
model's source, and the MLP's contribution (2.x `blocks.L.hook_mlp_out`) is what the block adds
to the residual for it; or the name is honestly absent (`structurally_absent` / `ambiguous`).
It never reads a side module: a low-rank side block, an adapter, a token mixer, an expert block.

Designs (built in `tests/_edge_models.py`):

- Gemma-3n: LAuReL (`laurel`, a low-rank side block on the attention's input) runs before the
  attention; the MLP is `mlp`, its contribution `post_feedforward_layernorm`'s output.
- Falcon-H1: a Mamba-2 mixer (`mamba`) runs in parallel with the attention; the MLP is
  `feed_forward`, whose output is added to the residual.
- Gemma-4 with its MoE block (no other test uses it): a dense `mlp` with an expert block
  (`experts`) beside it; the block adds `post_feedforward_layernorm(norm1(mlp) + norm2(experts))`.
- Three custom blocks: a low-rank side block run before the MLP on the MLP's own input; an
  adapter with an activation (an MLP's shape) beside the attention; a token-mixing conv branch
  beside the MLP. Each has its side module at `layers.N.side` and its MLP at `layers.N.mlp`.

Further designs of the same kind (no other test uses them):

- Granite-MoE-shared: an MoE block (`block_sparse_moe`) with a dense `shared_mlp` beside it on the
  same normed input; the block adds their sum. Neither module alone is the MLP or its contribution.
- BLOOM: the attention adds the residual inside its own module, so neither its output nor the norm
  reading it is the attention's contribution (`self_attention.dense`'s output is).

Ground truth: plain forward hooks (`torchlens.testing.hooked_outputs`,
`_edge_models.hooked_inputs`) on the modules named in `TRUTH`, from the model's source. The
hooks run the same kernels on the same bytes as the trace, so served values must be equal.
"""

from __future__ import annotations

import functools

import _edge_models as em
import pytest
import torch

import torchlens as tl
import torchlens.mechinterp as mi
from torchlens import testing

_CUSTOM = dict(block="layers.{L}", mlp="mlp", down="mlp.down_proj", contribution="mlp", side="side")
#: design -> where its blocks are, and (relative to a block) its MLP, the MLP's down projection,
#: the module whose output the block adds to the residual as the MLP's contribution, and the side module.
TRUTH = {
    "gemma3n": dict(
        block="model.layers.{L}",
        mlp="mlp",
        down="mlp.down_proj",
        contribution="post_feedforward_layernorm",
        side="laurel",
    ),
    "falcon_h1": dict(
        block="model.layers.{L}",
        mlp="feed_forward",
        down="feed_forward.down_proj",
        contribution="feed_forward",
        side="mamba",
    ),
    "gemma4": dict(
        block="model.layers.{L}",
        mlp="mlp",
        down="mlp.down_proj",
        contribution="post_feedforward_layernorm",
        side="experts",
    ),
    **{name: _CUSTOM for name in em.CUSTOM},
}
DESIGNS = list(TRUTH)

#: (generation, name, what it reads on the MLP: "input", "output" or "post" = the down projection's input)
MLP_NAMES = [
    ("nnterp", "mlps_input[{L}]", "input"),
    ("nnterp", "mlps_output[{L}]", "output"),
    ("4.x", "blocks.{L}.mlp.hook_in", "input"),
    ("4.x", "blocks.{L}.mlp.hook_out", "output"),
    ("2.x", "blocks.{L}.mlp.hook_post", "post"),
    ("interp-engine", "mlp_in.{L}", "input"),
    ("interp-engine", "mlp_out.{L}", "output"),
    ("interp-engine", "mlp_act.{L}", "post"),
]
SERVED = ("real", "reconstructed_read_only")
ABSENT = ("structurally_absent", "ambiguous")
LAYERS = 2


@functools.cache
def traced(design: str):
    """(model, args, kwargs, trace), cached: tests must not modify them."""
    model = em.build(design)
    args, kwargs = em.inputs(design)
    return model, args, kwargs, tl.trace(model, *args, **kwargs, save="all")


def _addr(design: str, layer: int, part: str) -> str:
    return f"{TRUTH[design]['block'].format(L=layer)}.{TRUTH[design][part]}"


@pytest.mark.parametrize("design", DESIGNS)
def test_the_designs_are_what_the_docstring_says(design):
    """The side module of the design runs, and differs from its MLP (else the tests below prove nothing)."""
    model = em.build(design)
    args, kwargs = em.inputs(design)
    want = [_addr(design, 0, "mlp"), _addr(design, 0, "side")]
    out = testing.hooked_outputs(model, want, *args, **kwargs)
    assert set(out) == set(want), design
    mlp, side = out[want[0]], out[want[1]]
    assert mlp.shape != side.shape or not torch.allclose(mlp, side), design


@pytest.mark.parametrize("design", DESIGNS)
def test_mlp_names_read_the_mlp_or_are_absent(design):
    """Each MLP name, at each layer, serves the MLP module's input / output / down-projection
    input (equal to what plain hooks on that module saw), or is absent; never the side module."""
    model, args, kwargs, trace = traced(design)
    mlps = [_addr(design, i, "mlp") for i in range(LAYERS)]
    downs = [_addr(design, i, "down") for i in range(LAYERS)]
    outputs = testing.hooked_outputs(model, mlps, *args, **kwargs)
    ins = em.hooked_inputs(model, mlps + downs, *args, **kwargs)
    wrong = []
    for layer in range(LAYERS):
        truth = {
            "input": ins[mlps[layer]],
            "output": outputs[mlps[layer]],
            "post": ins[downs[layer]],
        }
        side = _addr(design, layer, "side")
        for generation, pattern, reads in MLP_NAMES:
            name = pattern.format(L=layer)
            r = mi.resolve_alias(trace, name, generation=generation)
            if r.status in ABSENT:
                continue
            where = f"{generation} {name} -> {r.module_address}:{r.facet} [{r.status}]"
            if r.module_address is not None and (
                r.module_address == side or r.module_address.startswith(side + ".")
            ):
                wrong.append(f"{where}: the side module")
                continue
            assert r.status in SERVED, where
            got, want = r.tensor, truth[reads]
            if got is None or got.shape != want.shape or not torch.equal(got, want):
                err = (
                    (got.double() - want.double()).norm() / want.double().norm()
                    if got is not None and got.shape == want.shape
                    else "shape " + str(None if got is None else tuple(got.shape))
                )
                wrong.append(f"{where}: not the MLP's {reads} (relative error {err})")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("design", DESIGNS)
def test_mlp_contribution_is_what_the_block_adds(design):
    """2.x `blocks.L.hook_mlp_out` ("MLP's contribution to the residual") serves the tensor the
    block adds to the residual for its MLP (the output of `TRUTH[design]['contribution']`, by
    plain hooks), or is absent."""
    model, args, kwargs, trace = traced(design)
    adds = [_addr(design, i, "contribution") for i in range(LAYERS)]
    truth = testing.hooked_outputs(model, adds, *args, **kwargs)
    wrong = []
    for layer in range(LAYERS):
        r = mi.resolve_alias(trace, f"blocks.{layer}.hook_mlp_out", generation="2.x")
        if r.status in ABSENT:
            continue
        got, want = r.tensor, truth[adds[layer]]
        if got is None or got.shape != want.shape or not torch.equal(got, want):
            wrong.append(
                f"blocks.{layer}.hook_mlp_out -> {r.module_address}:{r.facet} [{r.status}] is not "
                f"{adds[layer]}'s output"
            )
    assert not wrong, "\n".join(wrong)


def test_two_mlps_side_by_side_are_not_served_as_one():
    """Granite-MoE-shared adds `block_sparse_moe(h) + shared_mlp(h)` to the residual (times
    `residual_multiplier`, 1 here): an MLP output or contribution name serves that sum (by plain
    hooks on both modules) or is absent, never one of the two."""
    design = "granitemoeshared"
    model, args, kwargs, trace = traced(design)
    assert model.config.residual_multiplier == 1.0
    parts = [
        f"model.layers.{i}.{m}" for i in range(LAYERS) for m in ("block_sparse_moe", "shared_mlp")
    ]
    out = testing.hooked_outputs(model, parts, *args, **kwargs)
    wrong = []
    for layer in range(LAYERS):
        want = (
            out[f"model.layers.{layer}.block_sparse_moe"] + out[f"model.layers.{layer}.shared_mlp"]
        )
        for generation, name in (
            ("2.x", f"blocks.{layer}.hook_mlp_out"),
            ("nnterp", f"mlps_output[{layer}]"),
            ("4.x", f"blocks.{layer}.mlp.hook_out"),
            ("interp-engine", f"mlp_out.{layer}"),
        ):
            r = mi.resolve_alias(trace, name, generation=generation)
            if r.status in ABSENT:
                continue
            if (
                r.tensor is None
                or r.tensor.shape != want.shape
                or not torch.allclose(r.tensor, want, atol=1e-6)
            ):
                wrong.append(
                    f"{generation} {name} -> {r.module_address}:{r.facet} [{r.status}] is not what the "
                    "block adds for its MLP"
                )
    assert not wrong, "\n".join(wrong)


def test_attention_contribution_excludes_the_residual_it_adds_itself():
    """BLOOM's attention returns `residual + dense(z)`: 2.x `blocks.L.hook_attn_out` ("attention's
    contribution to the residual") serves `self_attention.dense`'s output (plain hooks) or is absent."""
    design = "bloom"
    model, args, kwargs, trace = traced(design)
    dense = [f"transformer.h.{i}.self_attention.dense" for i in range(LAYERS)]
    out = testing.hooked_outputs(model, dense, *args, **kwargs)
    wrong = []
    for layer in range(LAYERS):
        r = mi.resolve_alias(trace, f"blocks.{layer}.hook_attn_out", generation="2.x")
        if r.status in ABSENT:
            continue
        want = out[dense[layer]]
        if r.tensor is None or r.tensor.shape != want.shape or not torch.equal(r.tensor, want):
            wrong.append(
                f"blocks.{layer}.hook_attn_out -> {r.module_address}:{r.facet} [{r.status}]"
            )
    assert not wrong, "\n".join(wrong)


class _RoutedAttention(torch.nn.Module):
    """Attention whose call first takes a router's softmax over 2 experts per token (JetMoe's
    mixture of attention heads), then the attention's own softmax over keys."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads, self.d_head = heads, d // heads
        self.router = torch.nn.Linear(d, 2)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.o = torch.nn.Linear(d, d)
        self.seen: dict = {}

    def forward(self, x):
        b, t, d = x.shape
        gate = torch.softmax(self.router(x), dim=-1)
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (y.view(b, t, self.heads, self.d_head).transpose(1, 2) for y in (q, k, v))
        pattern = torch.softmax(q @ k.transpose(-1, -2) / self.d_head**0.5, dim=-1)
        self.seen["pattern"] = pattern.detach()
        z = (pattern @ v).transpose(1, 2).reshape(b, t, d)
        return self.o(z) * gate[..., :1]


class _RoutedBlock(torch.nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.attn = _RoutedAttention(d)

    def forward(self, x):
        return x + self.attn(self.ln(x))


def test_a_routers_softmax_in_the_attention_is_not_served_as_its_pattern():
    torch.manual_seed(0)
    model = torch.nn.Sequential(_RoutedBlock(), _RoutedBlock()).eval()
    x = torch.randn(1, 5, 16)
    t = tl.trace(model, x, roles={"*.attn": "attention"})
    for i in range(2):
        facets = t.modules[f"{i}.attn"].facets
        assert facets.sites["pattern"].kind == "real"
        torch.testing.assert_close(facets["pattern"], model[i].attn.seen["pattern"], rtol=0, atol=0)


class _StreamMixer(torch.nn.Module):
    """A hyper-connection: a softmax over residual streams ([batch, tokens, streams, streams]),
    of three or more dimensions like an attention kernel's, but not over the tokens."""

    def __init__(self, d=16, streams=4):
        super().__init__()
        self.w = torch.nn.Linear(d, streams)

    def forward(self, x):  # x: [batch, tokens, streams, d]
        logits = self.w(x).mean(dim=2)  # [batch, tokens, streams]
        mix = torch.softmax(logits[..., :, None] * logits[..., None, :], dim=-1)
        return (mix @ x).mean(dim=2)


class _StreamBlock(torch.nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.hc = _StreamMixer(d)
        self.attn = _RoutedAttention(d)

    def forward(self, x):  # [batch, tokens, streams, d] -> the same
        return x + self.attn(self.hc(x))[:, :, None, :]


def test_a_softmax_over_streams_is_not_the_layers_attention():
    """The layer's attention is the call whose kernel's queries are the tokens (DeepSeek-V4's
    hyper-connection mixes streams with a 4-dimensional softmax first)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_StreamBlock(), _StreamBlock()).eval()
    t = tl.trace(model, torch.randn(1, 5, 4, 16))
    assert t.blocks == ["0", "1"]
    for i in range(2):
        assert t.modules[f"{i}.hc"].role != "attention"
        assert t.modules[f"{i}.attn"].role == "attention"
        torch.testing.assert_close(
            t.modules[f"{i}.attn"].facets["pattern"], model[i].attn.seen["pattern"], rtol=0, atol=0
        )


class _SumNorm(torch.nn.Module):
    """`x * rsqrt(sum(x^2) + eps) * w`, an L2 normalization (Dory's q_norm), or with `mean`, the
    same written as an RMS norm dividing the sum by the width."""

    def __init__(self, d=16, mean=False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(d) + 0.5)
        self.eps, self.mean = 1e-6, mean

    def forward(self, x):
        s = x.pow(2).sum(-1, keepdim=True)
        if self.mean:
            s = s / x.shape[-1]
        return x * torch.rsqrt(s + self.eps) * self.weight


@pytest.mark.parametrize("mean", [False, True])
def test_an_l2_normalization_serves_no_rms_statistics(mean):
    torch.manual_seed(0)
    model = torch.nn.Sequential(_SumNorm(mean=mean), torch.nn.Linear(16, 16)).eval()
    x = torch.randn(2, 3, 16)
    t = tl.trace(model, x, roles={"0": "norm"})
    facets = t.modules["0"].facets
    if not mean:
        with pytest.raises(tl.FacetNotFound, match="L2 norm"):
            facets["inv_rms"]
    else:  # the RMS, written out with a sum: served, and it is 1 / RMS
        expected = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        torch.testing.assert_close(facets["inv_rms"], expected, rtol=1e-6, atol=0)


class _TwoValueAttention(_RoutedAttention):
    """One softmax whose pattern multiplies two value halves, combined after (DiffLlama's eager
    differential attention): the pattern is the attention's, no one product is its z."""

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k = (y.view(b, t, self.heads, self.d_head).transpose(1, 2) for y in (q, k))
        v1, v2 = (
            y.reshape(b, t, self.heads, self.d_head // 2).transpose(1, 2) for y in v.chunk(2, -1)
        )
        pattern = torch.softmax(q @ k.transpose(-1, -2) / self.d_head**0.5, dim=-1)
        self.seen["pattern"] = pattern.detach()
        z = torch.cat([pattern @ v1, 0.5 * (pattern @ v2)], dim=-1)
        return self.o(z.transpose(1, 2).reshape(b, t, d))


def test_a_pattern_multiplying_two_value_tensors_has_no_z():
    torch.manual_seed(0)
    block = _RoutedBlock()
    block.attn = _TwoValueAttention()
    model = torch.nn.Sequential(block).eval()
    t = tl.trace(model, torch.randn(1, 5, 16), roles={"*.attn": "attention"})
    facets = t.modules["0.attn"].facets
    torch.testing.assert_close(facets["pattern"], block.attn.seen["pattern"], rtol=0, atol=0)
    with pytest.raises(tl.FacetNotFound, match="more than one value tensor"):
        facets["z"]


class _LowRankOutAttention(_RoutedAttention):
    """An attention whose output path is two projections (`o_a` to a narrow width, then `o_b`
    back), as DeepSeek-V4's grouped `o_a_proj`/`o_b_proj`: the first projection after z is not
    the map from the heads to the attention's output that `result` splits per head."""

    def __init__(self, d=16, heads=2, rank=4):
        super().__init__(d, heads)
        self.o_a, self.o_b = torch.nn.Linear(d, rank), torch.nn.Linear(rank, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (y.view(b, t, self.heads, self.d_head).transpose(1, 2) for y in (q, k, v))
        pattern = torch.softmax(q @ k.transpose(-1, -2) / self.d_head**0.5, dim=-1)
        z = pattern @ v
        self.seen["z"] = z.detach()
        return self.o_b(self.o_a(z.transpose(1, 2).reshape(b, t, d)))


@pytest.mark.parametrize("low_rank", [True, False])
def test_result_is_served_only_where_one_projection_maps_the_heads_to_the_output(low_rank):
    torch.manual_seed(0)
    block = _RoutedBlock()
    block.attn = _LowRankOutAttention() if low_rank else _RoutedAttention()
    model = torch.nn.Sequential(block).eval()
    x = torch.randn(1, 5, 16)
    t = tl.trace(model, x, roles={"*.attn": "attention"})
    facets = t.modules["0.attn"].facets
    if low_rank:
        torch.testing.assert_close(facets["z"], block.attn.seen["z"], rtol=0, atol=0)
        with pytest.raises(tl.FacetNotFound, match="not one map from all 2 heads' z"):
            facets["result"]
        return
    # one output projection: the heads' contributions, recomputed from its weight, sum to its output
    seen = {}
    block.attn.o.register_forward_hook(lambda m, a, o: seen.update(x=a[0], y=o))
    model(x)
    w = block.attn.o.weight.view(16, 2, 8)
    expected = torch.einsum("bthd,ohd->btho", seen["x"].view(1, 5, 2, 8), w)
    torch.testing.assert_close(facets["result"], expected)
    torch.testing.assert_close(facets["result"].sum(2) + block.attn.o.bias, seen["y"])
