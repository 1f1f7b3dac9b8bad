"""Value fidelity: every site holds the tensor the model used there, and a trace never changes.

Ground truth always comes from outside TorchLens: plain forward hooks and pre-hooks that clone
what the caller received (registered after any hook that edits), a plain forward of the same
model, or recomputation from the inputs and weights.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import _models
import torchlens
from torchlens import TorchLensError

IDS = _models.token_ids(2, 6)

#: family -> (blocks ModuleList attribute path, the block's first norm attribute)
_LAYOUT = {
    "gpt2": ("transformer.h", "ln_1"),
    "llama": ("model.layers", "input_layernorm"),
    "gpt_neox_sequential": ("gpt_neox.layers", "input_layernorm"),
}


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


class Ground:
    """Plain hooks that clone module outputs as the caller received them and module inputs as
    the module received them. Registered last, so they see every earlier hook's edits."""

    def __init__(self, model: nn.Module, addresses):
        self.out, self.inp, self.handles = {}, {}, []
        for a in addresses:
            m = model.get_submodule(a)
            self.handles.append(m.register_forward_hook(self._post(a)))
            self.handles.append(m.register_forward_pre_hook(self._pre(a), with_kwargs=True))

    def _post(self, a):
        def hook(module, args, out):
            self.out[a] = _first(out).detach().clone()
        return hook

    def _pre(self, a):
        def hook(module, args, kwargs):
            x = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
            self.inp[a] = x.detach().clone()
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


class Edit(nn.Module):
    """Runs `inner`, then writes into its output in place in one of the common ways."""

    def __init__(self, inner: nn.Module, how: str):
        super().__init__()
        self.inner, self.how = inner, how

    def forward(self, x):
        y = self.inner(x)
        if self.how == "setitem":
            y[..., :2] += 1
        elif self.how == "view":
            y.view(-1).add_(1)
        elif self.how == "out":
            torch.mul(y, 2.0, out=y)
        return y


def _ablate(module, args, out):
    _first(out)[:, 2] = 0  # the usual zero-ablation hook: edits the tensor the caller receives


@pytest.mark.parametrize("family", list(_LAYOUT))
@pytest.mark.parametrize("how", ["hook", "setitem", "view", "out"])
def test_in_place_edits_after_return_are_what_the_caller_received(family, how):
    model = _models.build(family)
    stack, norm = _LAYOUT[family]
    b0, b1 = f"{stack}.0", f"{stack}.1"
    if how == "hook":
        edited = b0
        handle = model.get_submodule(b0).register_forward_hook(_ablate)
    else:
        edited = f"{b0}.mlp"
        block = model.get_submodule(b0)
        block.mlp = Edit(block.mlp, how)
        handle = None
    watched = [b0, b1, f"{b1}.{norm}", edited] + ([f"{edited}.inner"] if how != "hook" else [])
    ground = Ground(model, watched)
    with torch.no_grad():
        ref = model(IDS, output_hidden_states=True)
    ground.remove()
    with torch.no_grad():
        tr = torchlens.trace(model, IDS)
    if handle is not None:
        handle.remove()
    facets = lambda a: tr.modules[a].facets  # noqa: E731
    # The edit really changed something: the edited output differs from what the inner op returned.
    if how != "hook":
        assert not torch.equal(ground.out[edited], ground.out[f"{edited}.inner"])
        assert torch.equal(facets(f"{edited}.inner")["output"], ground.out[f"{edited}.inner"])
    assert torch.equal(facets(edited)["output"], ground.out[edited])
    assert torch.equal(facets(b0)["output"], ground.out[b0])
    assert torch.equal(facets(b0)["resid_post"], ground.out[b0])
    assert torch.equal(facets(b0)["resid_post"], ref.hidden_states[1])
    assert torch.equal(facets(b1)["resid_pre"], ground.inp[b1])
    assert torch.equal(facets(f"{b1}.{norm}")["input"], ground.inp[f"{b1}.{norm}"])
    assert torch.equal(tr.output.logits, ref.logits)
    assert torch.equal(facets("")["logits"], ref.logits)
    for op in tr.ops:
        if op.name == "written_in_place":
            assert op.mutated and op.tensor is not None


def test_module_input_is_as_received_when_the_module_writes_into_it():
    class Writes(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            x.mul_(2)  # writes into its own input
            return self.lin(x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a = nn.Linear(4, 4)
            self.b = Writes()

        def forward(self, x):
            h = self.a(x)
            return self.b(h) + h  # h was doubled by b

    net = Net()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    ground = Ground(net, ["a", "b", "b.lin"])
    with torch.no_grad():
        ref = net(x)
    ground.remove()
    with torch.no_grad():
        tr = torchlens.trace(net, x)
        a_out = net.a(x)
    assert torch.equal(tr.modules["b"].facets["input"], ground.inp["b"])
    assert torch.equal(tr.modules["b"].facets["input"], a_out)  # before the write
    assert torch.equal(tr.modules["b.lin"].facets["input"], a_out * 2)  # after it
    assert torch.equal(tr.modules["a"].facets["output"], a_out)  # as the op returned it
    assert torch.equal(tr.output, ref)


# ----------------------------------------------------------------------------------------------
# A returned trace does not change
# ----------------------------------------------------------------------------------------------


def _facet_values(tr):
    return {
        (a, i, n): s.tensor.clone()
        for a, rec in tr.modules.items()
        for i, c in enumerate(rec.calls)
        for n, s in c.facets.sites.items()
        if s.tensor is not None
    }


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_trace_unchanged_by_later_writes_to_inputs_weights_and_outputs(family):
    model = _models.build(family)
    ids = IDS.clone()
    stack = _LAYOUT[family][0]
    blocks = [f"{stack}.{i}" for i in range(2)]
    ground = Ground(model, blocks)
    with torch.no_grad():
        ref = model(ids, use_cache=True)
    ground.remove()
    with torch.no_grad():
        tr = torchlens.trace(model, ids, use_cache=True)
    before = _facet_values(tr)
    ops_before = [tuple(t.clone() if t is not None else None for t in op.tensors) for op in tr.ops]
    # The caller corrupts the prompt in place, takes an optimizer step, edits the returned logits.
    ids[:, 1] = 5
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    model(ids).logits.sum().backward()
    opt.step()
    with torch.no_grad():
        for b in model.buffers():
            if b.is_floating_point():
                b.add_(1)
    tr.output.logits.zero_()
    after = _facet_values(tr)
    assert after.keys() == before.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, changed[:5]
    for op, saved in zip(tr.ops, ops_before):
        for t, s in zip(op.tensors, saved):
            assert (t is None) == (s is None) and (t is None or torch.equal(t, s)), op
    # And the values are the model's, from outside TorchLens.
    assert torch.equal(tr.modules[""].facets["logits"], ref.logits)
    assert torch.equal(tr.modules[""].facets["input"], IDS)
    for b in blocks:
        assert torch.equal(tr.modules[b].facets["output"], ground.out[b])


def test_snapshot_copies_only_what_the_caller_can_reach():
    """The snapshot copies the aliases of inputs, weights and outputs, not every saved tensor."""
    from torchlens.capture import Recorder

    copied = []
    real = Recorder.snapshot

    def spy(self, model, reachable):
        n = real(self, model, reachable)
        copied.append(n)
        return n

    model = _models.gpt2()
    Recorder.snapshot = spy
    try:
        with torch.no_grad():
            tr = torchlens.trace(model, IDS, use_cache=False)
    finally:
        Recorder.snapshot = real
    saved = sum(t.numel() * t.element_size() for op in tr.ops for t in op.tensors if t is not None)
    logits = tr.output.logits
    ids_bytes = IDS.numel() * IDS.element_size()
    # At least the logits and the ids (both still held by the caller) were copied ...
    assert copied[0] >= logits.numel() * logits.element_size() + ids_bytes
    # ... and far from everything that was saved.
    assert copied[0] < saved / 2


# ----------------------------------------------------------------------------------------------
# save= containers
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "save", [["model.layers"], ["model.layers", "model.layers.0"], ["model.layers.1", "model.layers"], "model.layers"]
)
def test_save_a_container_keeps_all_its_children(save):
    model = _models.llama()
    addresses = ["model.layers.0", "model.layers.1", "model.layers.0.self_attn", "model.layers.1.mlp"]
    ground = Ground(model, addresses)
    with torch.no_grad():
        model(IDS)
    ground.remove()
    with torch.no_grad():
        tr = torchlens.trace(model, IDS, save=save)
    for a in addresses:
        assert torch.equal(tr.modules[a].facets["output"], ground.out[a]), a
    assert "resid_post" in tr.modules["model.layers.1"].facets
    assert "pattern" in tr.modules["model.layers.0.self_attn"].facets
    assert "logits" not in tr.modules[""].facets  # outside the selection
    assert "output" not in tr.modules["model.embed_tokens"].facets


@pytest.mark.parametrize("save", ["", [""], ["model.layers.0", ""]])
def test_save_empty_string_is_refused_with_what_to_pass(save):
    with pytest.raises(torchlens.errors.SaveSpecError) as info:
        torchlens.trace(_models.llama(), IDS, save=save)
    msg = str(info.value)
    assert "save='all'" in msg and "'model.layers'" in msg
    assert isinstance(info.value, TorchLensError)
