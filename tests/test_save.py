"""`save=` end to end: what capture holds for a selection, "kept nothing" before the forward,
aliases of shared modules, and values against ground truth from outside TorchLens.

Ground truth is `output_hidden_states` and plain forward hooks (`testing.hooked_outputs`). Some
tests read what capture held before the trace was assembled: that is an internal of TorchLens
(`torchlens._tracing.assemble` receives the recorder), and those tests say so.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchlens as tl
from torchlens import SaveSpecError, testing

IDS = testing.token_ids(length=6)


def _held_during_capture(monkeypatch, model, *args, **kwargs):
    """(trace, {op index: op name} of the ops holding an output when the forward ended).

    Internal: wraps `torchlens._tracing.assemble`, which receives the recorder after the forward.
    """
    import torchlens._tracing as tracing

    held = {}
    real = tracing.assemble

    def spy(rec, *rest):
        held.update({op.index: op.name for op in rec.ops if any(t is not None for t in op.tensors)})
        held["aliases"] = sum(c._in is not None or c._out is not None for c in rec.calls)
        return real(rec, *rest)

    monkeypatch.setattr(tracing, "assemble", spy)
    tr = tl.trace(model, *args, **kwargs)
    aliases = held.pop("aliases")
    return tr, held, aliases


def test_resid_post_holds_only_the_block_outputs(monkeypatch):
    """save=["resid_post"] holds one tensor per block during capture (the block output, as the
    output of the op that produced it), not the ops inside the blocks; the values are the
    model's own hidden states."""
    model = testing.build("gpt2")
    with torch.no_grad():
        hidden = model(IDS, output_hidden_states=True).hidden_states
    tr, held, _ = _held_during_capture(monkeypatch, model, IDS, save=["resid_post"])
    assert len(tr.blocks) == 2
    producers = {tr.modules[b].calls[0].output_ref.op for b in tr.blocks}
    assert set(held) == producers, held
    # GPT-2 applies ln_f to the last hidden state it returns; the others are the block outputs.
    torch.testing.assert_close(
        tr.modules[tr.blocks[0]].facets["resid_post"], hidden[1], rtol=0, atol=0
    )
    seen = testing.hooked_outputs(model, tr.blocks, IDS)
    for b in tr.blocks:
        torch.testing.assert_close(tr.modules[b].facets["resid_post"], seen[b], rtol=0, atol=0)
    assert all(t is None for op in tr.ops for t in op.tensors)  # nothing kept but the facets


def test_logits_holds_only_the_unembedding_output(monkeypatch):
    """save=["logits"] used to retain the whole forward (the root holds every op); it holds the
    unembedding's output only."""
    model = testing.build("gpt2")
    with torch.no_grad():
        logits = model(IDS).logits
    tr, held, aliases = _held_during_capture(monkeypatch, model, IDS, save=["logits"])
    unembed = tr.structure.unembed
    assert set(held) == {unembed.output_ref.op}, held
    assert aliases <= 1  # at most the model input, which no op produced
    torch.testing.assert_close(tr.modules[""].facets["logits"], logits, rtol=0, atol=0)


def test_logits_after_a_softcap_is_the_model_output(monkeypatch):
    """Gemma-2 softcaps after lm_head: `logits` is the root's output, held through the root hook."""
    model = testing.build("gemma2")
    with torch.no_grad():
        logits = model(IDS).logits
    tr, held, _ = _held_during_capture(monkeypatch, model, IDS, save=["logits"])
    assert len(held) == 2, held  # lm_head's output and the softcapped model output
    torch.testing.assert_close(tr.modules[""].facets["logits"], logits, rtol=0, atol=0)
    assert not torch.equal(
        tr.modules[""].facets["logits"], testing.hooked_outputs(model, ["lm_head"], IDS)["lm_head"]
    )


def test_a_block_address_still_holds_its_ops(monkeypatch):
    """A module address keeps the ops inside it, as before: every op of the block holds."""
    model = testing.build("gpt2")
    tr, held, _ = _held_during_capture(monkeypatch, model, IDS, save=["transformer.h.1"])
    call = tr.modules["transformer.h.1"].calls[0]
    inside = {op.index for op in tr.ops[call.first_op : call.end_op]}
    assert set(held) == inside
    assert all(any(t is not None for t in tr.ops[i].tensors) for i in inside)


class _Counting(nn.Module):
    """Linear, ReLU and an empty container; counts its forwards."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.act = nn.ReLU()
        self.unused = nn.ModuleList()
        self.runs = 0

    def forward(self, x):
        self.runs += 1
        return self.act(self.lin(x))


@pytest.mark.parametrize(
    "save",
    [["pattern"], "resid_post", ["logits"], ["final_norm_input"], ["unused"], ["unused", "q"]],
)
def test_kept_nothing_is_raised_before_the_forward(save):
    model = _Counting()
    with pytest.raises(SaveSpecError) as info:
        tl.trace(model, torch.ones(1, 3), save=save)
    msg = str(info.value)
    assert "kept nothing" in msg and "the forward was not run" in msg, msg
    assert "Facets that exist here: input, output" in msg, msg
    assert model.runs == 0
    tl.trace(model, torch.ones(1, 3), save=["lin"])  # a module that runs is kept as before
    assert model.runs == 1


def test_kept_nothing_after_the_forward_where_only_it_can_tell():
    """GPT-2 has attention, but no RoPE: rot_q can only be found missing by running it."""
    with pytest.raises(SaveSpecError, match="kept nothing in this forward") as info:
        tl.trace(testing.build("gpt2"), IDS, save=["rot_q"])
    assert "pattern" in str(info.value)  # lists what exists


class _Shared(nn.Module):
    """One block reached under two addresses (`first` and `second` are the same module)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.second = self.first
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.second(self.first(x)))


def test_an_alias_address_selects_the_shared_module():
    model = _Shared()
    x = torch.randn(2, 4)
    seen = []
    h = model.first.register_forward_hook(lambda m, a, o: seen.append(o.detach().clone()))
    with torch.no_grad():
        model(x)
    h.remove()
    tr = tl.trace(model, x, save=["second"])
    assert tr.save_spec.addresses == frozenset({"first"})
    calls = tr.modules["first"].calls
    assert len(calls) == 2
    for call, out in zip(calls, seen):
        torch.testing.assert_close(call.facets["output"], out, rtol=0, atol=0)
    assert "output" not in tr.modules["head"].facets


class _Blocks(nn.Module):
    """Two chained blocks; after the stack, the model writes the last block's output in place.

    Each block runs an in-place op of its own after producing its output, so the op that
    produced the output has been scanned for copy-on-write before the hook holds it."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x) + x
            torch.zeros(1).add_(1)  # an unrelated in-place write
            return y

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([self.Block(), self.Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        x.mul_(3)  # overwrites what the last block returned
        return x


def test_a_held_block_output_stays_the_value_the_block_returned():
    torch.manual_seed(0)
    model = _Blocks()
    x = torch.randn(2, 3, 4)
    seen = {}
    handles = [
        m.register_forward_hook(lambda m, a, o, n=n: seen.__setitem__(n, o.detach().clone()))
        for n, m in model.layers.named_children()
    ]
    with torch.no_grad():
        model(x.clone())
    for h in handles:
        h.remove()
    tr = tl.trace(model, x.clone(), save=["resid_post"])
    assert tr.blocks == ["layers.0", "layers.1"]
    for i in ("0", "1"):
        torch.testing.assert_close(
            tr.modules[f"layers.{i}"].facets["resid_post"], seen[i], rtol=0, atol=0
        )


# -- roles guessed before the forward (from an adversarial sweep of save= over 110 models) -------


def _truth_by_hooks(model, args, kwargs, addresses):
    """What plain forward hooks saw as each module's output."""
    return testing.hooked_outputs(model, addresses, *args, **kwargs)


@pytest.mark.parametrize("facets", [["q"], ["pattern", "z"], ["q", "k", "v", "z"]])
def test_a_decoder_layers_two_attentions_of_one_class_keep_their_facets(facets):
    """BART's decoder layer holds self_attn and encoder_attn, of one class: guessed as two blocks
    before the forward, their ops were not kept, and every decoder attention facet of a save= list
    was silently "not saved" (28 to 30 sites per seq2seq model). Each is now kept, equal to
    save='all' bit for bit, whose z is the output projection's input a plain hook sees."""
    model = testing.build("bart")
    args, kwargs = testing.inputs("bart")
    full = tl.trace(model, *args, **kwargs)
    some = tl.trace(model, *args, **kwargs, save=facets)
    attentions = [
        a
        for a in full.modules
        if a.startswith("model.decoder.layers.") and a.endswith(("self_attn", "encoder_attn"))
    ]
    assert len(attentions) >= 2
    for a in attentions:
        for f in facets:
            want, got = full.modules[a].calls[0].facets, some.modules[a].calls[0].facets
            assert got.sites[f].saved, (a, f)
            assert torch.equal(got[f], want[f]), (a, f)
    seen = {}
    handles = [
        model.get_submodule(a + ".out_proj").register_forward_pre_hook(
            lambda m, x, a=a: seen.setdefault(a, x[0].detach().clone())
        )
        for a in attentions
    ]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    for a in attentions:
        z = full.modules[a].calls[0].facets["z"]  # [batch, heads, pos, d_head]
        torch.testing.assert_close(z.transpose(1, 2).flatten(2), seen[a], rtol=0, atol=0)


@pytest.mark.parametrize("save", [["pre"], ["act", "resid_post"], ["final_norm_input"]])
def test_t5s_mlp_and_final_norm_facets_are_kept_by_a_save_list(save):
    """T5's MLP is `DenseReluDense` under a `layer` list, and its encoder and decoder are two
    stacks of one class: guessed as an "other" module and as two blocks, so save=['pre'] raised
    "kept nothing" while naming pre among the facets that exist, and final_norm_input likewise.
    Ground truth: plain hooks on the MLP's first projection and on the final norms."""
    model = testing.build("t5")
    args, kwargs = testing.inputs("t5")
    t = tl.trace(model, *args, **kwargs, save=save)
    full = tl.trace(model, *args, **kwargs)
    for rec in full.modules.values():
        for c, call in enumerate(rec.calls):
            if call.facets is None:
                continue
            for f in save:
                if f in call.facets.sites and call.facets.sites[f].saved:
                    got = t.modules[rec.address].calls[c].facets
                    assert got.sites[f].saved, (rec.address, f)
                    assert torch.equal(got[f], call.facets[f]), (rec.address, f)
    if "pre" in save:
        mlp = "encoder.block.0.layer.1.DenseReluDense"
        wi = _truth_by_hooks(model, args, kwargs, [mlp + ".wi"])[mlp + ".wi"]
        torch.testing.assert_close(t.modules[mlp].facets["pre"], wi, rtol=0, atol=0)


def test_a_selected_facet_capture_did_not_keep_is_refused_with_the_remedy():
    """Zamba's shared transformer block's MLP is guessed as "other" before the forward: a save=
    list cannot keep its act. The site says so and names the remedy (it was silently "not
    saved"); the remedy keeps it, equal to save='all'."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    import _edge_models as em

    model = em.build("zamba")
    args, kwargs = em.inputs("zamba")
    mlp = "model.layers.2.shared_transf.feed_forward"
    t = tl.trace(model, *args, **kwargs, save=["act", "resid_post"])
    with pytest.raises(
        tl.FacetNotFound, match=r"roles=\{'model.layers.2.shared_transf.feed_forward': 'mlp'\}"
    ):
        t.modules[mlp].calls[0].facets["act"]
    with pytest.raises(SaveSpecError, match="did not keep its tensor"):
        tl.trace(model, *args, **kwargs, save=["act"])
    fixed = tl.trace(model, *args, **kwargs, save=["act"], roles={mlp: "mlp"})
    full = tl.trace(model, *args, **kwargs)
    assert torch.equal(
        fixed.modules[mlp].calls[0].facets["act"], full.modules[mlp].calls[0].facets["act"]
    )


def test_a_save_list_naming_a_facet_no_module_has_raises_also_beside_others():
    """save=['inv_rms'] on GPT-2 (LayerNorms: inv_std) raised; beside another facet it was ignored."""
    model = testing.build("gpt2")
    for save in (["inv_rms"], ["resid_post", "inv_rms"], ["resid_post", "rot_q", "pre_linear"]):
        with pytest.raises(SaveSpecError) as info:
            tl.trace(model, IDS, save=save)
        missing = [f for f in save if f != "resid_post"]
        assert all(repr(f) in str(info.value) for f in missing), str(info.value)
    kept = tl.trace(model, IDS, save=["resid_post", "inv_std"])
    assert kept.modules["transformer.h.0.ln_1"].facets.sites["inv_std"].saved


@pytest.mark.parametrize("arch", ["granite", "minicpm3"])
def test_resid_mid_of_a_scaled_branch_is_served_by_a_save_list_as_by_all(arch):
    """Granite and MiniCPM3 scale each sublayer's output before the residual add. Under a save=
    list the block's input is not kept as an op output, and the check then took the scaled chain
    for a plain branch and refused resid_mid (off by 0.0237 on Granite); under save='all' it was
    served. Ground truth: the input of the MLP's norm, from a plain pre-hook."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    import _edge_models as em

    model = em.build(arch)
    args, kwargs = em.inputs(arch)
    block = "model.layers.0"
    seen = {}
    norm = model.get_submodule(block + ".post_attention_layernorm")
    handle = norm.register_forward_pre_hook(lambda m, a: seen.setdefault("mid", a[0].detach()))
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        handle.remove()
    for save in ("all", ["resid_mid"], ["resid_mid", "contribution"]):
        t = tl.trace(model, *args, **kwargs, save=save)
        torch.testing.assert_close(
            t.modules[block].facets["resid_mid"], seen["mid"], rtol=0, atol=0
        )
