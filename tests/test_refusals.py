"""Rebuilt facets when the rebuilt op's arguments are written in place after it ran, and the
status a facet refused by its check gets.

The kernel arguments TorchLens keeps for a rebuild (`OpRecord.extra`) are aliases: a write the
capture sees is preceded by a copy, so the rebuild reads what the kernel read; a write it cannot
see refuses the rebuild with that reason. Ground truth comes from outside TorchLens:
`nn.MultiheadAttention`'s own attention weights on an unmodified copy of its input, or the
softmax written out by hand from the projection weights.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchlens
import torchlens.mechinterp as mi

E, H, T = 16, 4, 5


class _MhaBlock(nn.Module):
    """A post-norm block whose residual add writes the attention's query/key/value in place."""

    def __init__(self, inplace: bool):
        super().__init__()
        self.inplace = inplace
        self.self_attn = nn.MultiheadAttention(E, H, batch_first=True)
        self.norm1 = nn.LayerNorm(E)
        self.mlp = nn.Sequential(nn.Linear(E, 32), nn.ReLU(), nn.Linear(32, E))
        self.norm2 = nn.LayerNorm(E)

    def forward(self, x):
        a = self.self_attn(x, x, x, need_weights=False)[0]
        if self.inplace:
            x += a  # x was the query, key and value of the op that just ran
        else:
            x = x + a
        x = self.norm1(x)
        return self.norm2(x + self.mlp(x))


class _MhaNet(nn.Module):
    def __init__(self, inplace: bool = True):
        super().__init__()
        self.layers = nn.ModuleList([_MhaBlock(inplace), _MhaBlock(inplace)])

    def forward(self, x):
        x = x * 1.0  # the blocks write into a tensor of the forward, not the caller's input
        for layer in self.layers:
            x = layer(x)
        return x


def _mha_truth(net: _MhaNet, x: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's per-head attention weights, from the module itself (need_weights=True) run
    on a copy of the input it got, taken by a plain forward pre-hook."""
    inputs = []
    handles = [
        layer.self_attn.register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach().clone()))
        for layer in net.layers
    ]
    with torch.no_grad():
        net(x.clone())
        weights = [
            layer.self_attn(i, i, i, need_weights=True, average_attn_weights=False)[1]
            for layer, i in zip(net.layers, inputs)
        ]
    for h in handles:
        h.remove()
    return weights


@pytest.mark.parametrize("store", [None, "dir"])
def test_mha_whose_input_the_residual_add_writes_in_place_serves_its_pattern(store, tmp_path):
    torch.manual_seed(0)
    net = _MhaNet().eval()
    x = torch.randn(2, T, E)
    truth = _mha_truth(net, x)
    tr = torchlens.trace(net, x, store=str(tmp_path / "store") if store else None)
    for n, w in enumerate(truth):
        fm = tr.modules[f"layers.{n}.self_attn"].facets
        torch.testing.assert_close(fm["pattern"], w, rtol=1e-5, atol=1e-6)
        assert not fm.refused
    with torch.no_grad():  # the first layer's query projection, by hand from its input
        layer = net.layers[0].self_attn
        q = F.linear(x, layer.in_proj_weight[:E], layer.in_proj_bias[:E]).view(2, T, H, E // H)
    torch.testing.assert_close(
        tr.modules["layers.0.self_attn"].facets["q"], q, rtol=1e-5, atol=1e-6
    )


class _SdpaAttn(nn.Module):
    """Attention through the fused kernel; `after` writes q and k in place once it ran."""

    def __init__(self, after: str):
        super().__init__()
        self.after = after
        self.q, self.k, self.v, self.o = (nn.Linear(E, E) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, H, E // H).transpose(1, 2) for p in (self.q, self.k, self.v))
        z = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.after == "seen":
            q.mul_(0)
            k.add_(1)
        elif self.after == "unseen":
            with torch._C.DisableTorchFunction():  # the capture does not see these writes
                q.mul_(0)
                k.add_(1)
        return self.o(z.transpose(1, 2).reshape(b, t, E))


class _SdpaBlock(nn.Module):
    def __init__(self, after: str):
        super().__init__()
        self.ln1 = nn.LayerNorm(E)
        self.attn = _SdpaAttn(after)
        self.ln2 = nn.LayerNorm(E)
        self.mlp = nn.Sequential(nn.Linear(E, 32), nn.GELU(), nn.Linear(32, E))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _SdpaNet(nn.Module):
    def __init__(self, after: str):
        super().__init__()
        self.blocks = nn.ModuleList([_SdpaBlock(after), _SdpaBlock(after)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _sdpa_truth(net: _SdpaNet, x: torch.Tensor) -> torch.Tensor:
    """Block 0's causal pattern, softmax(q k^T / sqrt(d)) written out from its q and k weights and
    the attention's input (a plain pre-hook)."""
    got = {}
    h = net.blocks[0].attn.register_forward_pre_hook(
        lambda m, a: got.update(x=a[0].detach().clone())
    )
    with torch.no_grad():
        net(x)
        h.remove()
        b, t, _ = got["x"].shape
        attn = net.blocks[0].attn
        q, k = (p(got["x"]).view(b, t, H, E // H).transpose(1, 2) for p in (attn.q, attn.k))
        s = q @ k.transpose(-1, -2) / math.sqrt(E // H)
        s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        return torch.softmax(s, -1)


def test_fused_kernel_whose_q_and_k_are_written_after_it_ran_serves_the_pattern_it_used():
    torch.manual_seed(0)
    net = _SdpaNet("seen").eval()
    x = torch.randn(2, T, E)
    truth = _sdpa_truth(net, x)
    tr = torchlens.trace(net, x)
    fm = tr.modules["blocks.0.attn"].facets
    torch.testing.assert_close(fm["pattern"], truth, rtol=1e-5, atol=1e-6)
    assert not fm.refused


def test_unseen_write_to_a_kept_kernel_argument_marks_it_stale_before_facets_are_derived(
    monkeypatch,
):
    """The capture's half of the refusal: `Recorder.check_versions` finds the moved version
    counter of the kept query and marks the kernel's arguments stale (with the reason) before
    `derive` reads them; a write the capture saw leaves them as the kernel read them."""
    import torchlens._assemble as assemble

    seen = {}
    derive = assemble.derive

    def spy(ops, *args, **kwargs):
        seen["stale"] = [op.extra.get("stale") for op in ops if op.extra is not None]
        return derive(ops, *args, **kwargs)

    monkeypatch.setattr(assemble, "derive", spy)
    torch.manual_seed(0)
    x = torch.randn(2, T, E)
    torchlens.trace(_SdpaNet("seen").eval(), x)
    assert seen["stale"] == [None, None]
    with pytest.warns(UserWarning, match="could not see"):
        torchlens.trace(_SdpaNet("unseen").eval(), x)
    assert len(seen["stale"]) == 2
    for reason in seen["stale"]:
        assert (
            "tensor argument 0 of scaled_dot_product_attention" in reason
            and "could not see" in reason
        )


def test_unseen_write_to_a_kept_kernel_argument_refuses_with_the_reason():
    torch.manual_seed(0)
    net = _SdpaNet("unseen").eval()
    x = torch.randn(2, T, E)
    with pytest.warns(UserWarning, match="written in place by code the capture could not see"):
        tr = torchlens.trace(net, x)
    fm = tr.modules["blocks.0.attn"].facets
    with pytest.raises(torchlens.FacetNotFound, match="could not see") as info:
        fm["pattern"]
    assert "the rebuild disagreed" not in str(info.value)
    assert "could not see" in fm.refused["scores"]


# ----------------------------------------------------------------------------------------------
# The status of a facet whose check failed: `refused`, not `structurally_absent`
# ----------------------------------------------------------------------------------------------


def _gpt2(impl: str, attn_pdrop: float = 0.0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=4,
        vocab_size=64,
        n_positions=16,
        initializer_range=0.5,
        attn_pdrop=attn_pdrop,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
    )
    config._attn_implementation = impl
    return transformers.GPT2LMHeadModel(config)


IDS = torch.tensor([[1, 5, 9, 3, 7, 2]])
ATTN = "transformer.h.0.attn"


@pytest.fixture(scope="module")
def dropout_gpt2():
    """Eager GPT-2 in training mode with attention dropout: dropout runs between the softmax and
    `pattern @ v`, so z's check fails."""
    return _gpt2("eager", attn_pdrop=0.5).train()


def test_the_refused_site_exists_in_the_model(dropout_gpt2):
    """Ground truth for the status: the module computes z (the merged heads reach c_proj, read by
    a plain pre-hook), so the name has a site and `structurally_absent` would be false."""
    got = {}
    h = dropout_gpt2.get_submodule(ATTN).c_proj.register_forward_pre_hook(
        lambda m, a: got.update(z=a[0])
    )
    with torch.no_grad():
        dropout_gpt2(IDS)
    h.remove()
    assert got["z"].shape == (1, IDS.shape[1], 32)  # 4 heads x 8, merged
    tr = torchlens.trace(dropout_gpt2, IDS)
    r = mi.resolve_alias(tr, "blocks.0.attn.hook_z")
    assert r.status != "structurally_absent"


def test_facet_refused_by_its_check_resolves_refused_with_the_reason(dropout_gpt2):
    tr = torchlens.trace(dropout_gpt2, IDS)
    r = mi.resolve_alias(tr, "blocks.0.attn.hook_z")
    assert (r.status, r.module_address, r.facet, r.checked) == ("refused", ATTN, "z", True), r
    assert "z is not served: pattern @ v differs from z" in r.reason
    assert "model.eval()" in r.remedy
    assert not r.readable
    with pytest.raises(torchlens.FacetNotFound, match="not served"):
        r.tensor
    assert "refused" in mi.STATUSES and "not served" in mi.STATUSES["refused"]


def test_alias_report_says_refused_once_the_check_ran_and_pending_before(dropout_gpt2):
    tr = torchlens.trace(dropout_gpt2, IDS)
    before = {r.query: r for r in mi.alias_report(tr, generation="2.x")}["blocks.0.attn.hook_z"]
    assert before.status == "real" and before.checked is False  # alias_report computes nothing
    tr.check()
    report = mi.alias_report(tr, generation="2.x")
    rows = {r.query: r for r in report}
    assert rows["blocks.0.attn.hook_z"].status == "refused" and rows["blocks.0.attn.hook_z"].checked
    line = next(x for x in repr(report).splitlines() if x.startswith("blocks.0.attn.hook_z "))
    assert f"{ATTN}:z" in line and "pattern @ v differs" in line, line
    assert (
        report.counts()["refused"] == sum(r.status == "refused" for r in report) >= 2
    )  # both layers
    html = report._repr_html_()
    assert '<span style="color:#ad1457">refused</span>' in html


def test_compare_reports_a_refused_site_as_refused(dropout_gpt2):
    tr = torchlens.trace(dropout_gpt2, IDS)
    c = mi.compare(
        tr, {"blocks.0.attn.hook_z": torch.zeros(1, 6, 4, 8)}, generation="2.x", explain=False
    )
    (row,) = c
    assert (row.status, row.passed, row.module_address, row.facet) == (
        "refused",
        False,
        ATTN,
        "z",
    ), row
    assert "pattern @ v differs" in row.hint and "model.eval()" in row.hint
    assert f"{ATTN}:z" in repr(c)


def test_compare_editable_on_a_rebuilt_site_keeps_its_resolution_status():
    model = _gpt2("sdpa").eval()
    tr = torchlens.trace(model, IDS)
    pattern = tr.modules[ATTN].facets["pattern"]
    (row,) = mi.compare(
        tr, {"blocks.0.attn.hook_pattern": pattern.clone()}, generation="2.x", editable=True
    )
    assert row.status == "reconstructed_read_only" and not row.passed
    assert "editable=True" in row.hint and "read-only" in row.hint


def test_mha_facets_refused_under_dropout_are_refused_not_needs_capture():
    """nn.MultiheadAttention runs as one op in any capture: no eager-attention capture serves its
    pattern, so a refused pattern there is `refused`, not `needs_capture` with that remedy."""
    torch.manual_seed(0)
    net = _MhaNet(inplace=False)
    for layer in net.layers:
        layer.self_attn.dropout = 0.5
    tr = torchlens.trace(net.train(), torch.randn(2, T, E))
    for name in ("blocks.0.attn.hook_pattern", "blocks.0.attn.hook_z", "blocks.0.attn.hook_q"):
        r = mi.resolve_alias(tr, name)
        assert (r.status, r.module_address) == ("refused", "layers.0.self_attn"), r
        assert "dropout in training mode" in r.reason and "attn_implementation" not in r.remedy
