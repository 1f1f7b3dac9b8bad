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
