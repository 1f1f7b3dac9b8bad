"""The model's output is the trace's alone until `Trace.output` is read (`_capture.output_copies`).

The trace's tensors on memory only the returned output shares (the logits) are not copied when
`trace` returns, but on the first read of `Trace.output` or of one of them; where anything else
holds the output (a hook, the model), they are copied when `trace` returns. Either way, no write
into the output changes what the trace serves. Ground truth: a forward hook that clones the
unembedding's output, and the model's plain forward.
"""

from __future__ import annotations

import copy
import pickle
import weakref

import pytest
import torch
from torch import nn

import torchlens
from torchlens import testing

IDS = testing.token_ids(2, 6)


def _truth(model, address: str = "lm_head") -> torch.Tensor:
    """The unembedding's output as a plain forward hook saw it (the logits)."""
    return testing.hooked_outputs(model, [address], IDS)[address]


def _logits_op(trace):
    return next(op for op in reversed(trace.ops) if op.module == "lm_head")


def _write(tensor: torch.Tensor, how: str) -> None:
    """Write into `tensor`'s memory, by a route with a version counter or one without."""
    if how == "in place":
        with torch.no_grad():
            tensor.add_(1.0)
    else:  # numpy: no version counter moves
        tensor.detach().numpy()[...] += 1.0


@pytest.fixture(scope="module")
def gpt2():
    return testing.build("gpt2")


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "autograd"])
def test_the_output_memory_is_not_copied_until_the_output_is_read(gpt2, grad):
    with torch.set_grad_enabled(grad):
        trace = torchlens.trace(gpt2, IDS, save="all")
    op = _logits_op(trace)
    # uncopied: the trace's alias still shares the output's memory
    assert trace._output_guards
    assert op._tensors[0].data_ptr() == trace._output.logits.data_ptr()
    out = trace.output  # the first read copies the trace's tensors first
    assert trace._output_guards is None
    assert op.tensor.data_ptr() != out.logits.data_ptr()


@pytest.mark.parametrize("how", ["in place", "numpy"])
@pytest.mark.parametrize("first", ["output", "facet", "op"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "autograd"])
def test_a_write_into_the_output_never_changes_the_trace(gpt2, grad, first, how):
    truth = _truth(gpt2)
    with torch.set_grad_enabled(grad):
        trace = torchlens.trace(gpt2, IDS, save="all")
    facets = trace.modules[""].facets
    read_first = {
        "output": lambda: trace.output,
        "facet": lambda: facets["logits"],
        "op": lambda: _logits_op(trace).tensor,
    }[first]()
    _write(trace.output.logits, how)
    assert torch.equal(facets["logits"], truth)
    assert torch.equal(_logits_op(trace).tensor, truth)
    assert torch.equal(trace.modules["lm_head"].facets["output"], truth)
    if first != "output":
        assert torch.equal(read_first, truth)  # what was served before the write is unchanged


def test_the_output_read_after_a_served_facet_was_written_is_the_models(gpt2):
    """The facet read first is a copy: writing into it changes neither the output nor the op."""
    truth = _truth(gpt2)
    trace = torchlens.trace(gpt2, IDS, save="all")
    served = trace.modules[""].facets["logits"]
    served.detach().numpy()[...] = 0.0
    assert torch.equal(trace.output.logits, truth)


@pytest.mark.parametrize("how", ["in place", "numpy"])
def test_an_output_a_hook_kept_is_copied_when_the_trace_returns(gpt2, how):
    truth = _truth(gpt2)
    kept = []
    handle = gpt2.register_forward_hook(lambda module, args, out: kept.append(out))
    try:
        trace = torchlens.trace(gpt2, IDS, save="all")
    finally:
        handle.remove()
    assert trace._output_guards is None  # not the trace's alone: copied as it returned
    _write(kept[0].logits, how)
    assert torch.equal(trace.modules[""].facets["logits"], truth)
    assert torch.equal(_logits_op(trace).tensor, truth)


class _KeepsView(nn.Module):
    """A model that keeps a view of the logits it returns (its last row), and one that keeps the
    output object itself."""

    def __init__(self, keep: str):
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.keep = keep
        self.kept = None

    def forward(self, x):
        y = self.body(x)
        out = {"logits": y}
        self.kept = y[-1] if self.keep == "view" else out
        return out


@pytest.mark.parametrize("keep", ["view", "object"])
def test_an_output_the_model_keeps_is_copied_when_the_trace_returns(keep):
    torch.manual_seed(0)
    model, x = _KeepsView(keep), torch.randn(3, 4)
    with torch.no_grad():
        truth = model.body(x).clone()
    trace = torchlens.trace(model, x, save="all")
    assert trace._output_guards is None
    kept = model.kept if keep == "view" else model.kept["logits"]
    kept.detach().numpy()[...] = 0.0
    assert torch.equal(trace.modules["body"].facets["output"], truth)


def test_hidden_states_in_the_output_wait_too_and_stay_the_models(gpt2):
    truth = testing.hooked_outputs(gpt2, ["transformer.h.0"], IDS)["transformer.h.0"]
    trace = torchlens.trace(gpt2, IDS, save="all", output_hidden_states=True)
    assert trace._output_guards  # the logits at least
    trace.output.hidden_states[1].detach().numpy()[...] = 0.0
    assert torch.equal(trace.modules["transformer.h.0"].facets["resid_post"], truth)


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "save"])
def test_copies_of_a_trace_with_its_output_unread_keep_the_models_values(gpt2, how, tmp_path):
    truth = _truth(gpt2)
    trace = torchlens.trace(gpt2, IDS, save="all")
    if how == "pickle":
        other = pickle.loads(pickle.dumps(trace))
    elif how == "deepcopy":
        other = copy.deepcopy(trace)
    else:
        trace.save(tmp_path / "t")
        other = torchlens.load(tmp_path / "t")
    for t in (other, trace):
        _write(t.output["logits"], "numpy")  # a loaded output is a dict
        assert torch.equal(t.modules[""].facets["logits"], truth)


def test_the_output_still_leads_back_through_the_model(gpt2):
    """With autograd on, the output the trace hands over is the model's, graph and all."""
    trace = torchlens.trace(gpt2, IDS, save="all")
    logits = trace.output.logits
    assert logits.grad_fn is not None
    logits.sum().backward()
    assert gpt2.lm_head.weight.grad is not None
    gpt2.zero_grad(set_to_none=True)


@pytest.mark.parametrize("what", ["logits", "output"])
def test_an_output_a_weak_reference_reaches_is_copied_when_the_trace_returns(what):
    """A weak reference (a cache keyed weakly by tensors) reaches the output without counting as a
    reference: the trace copies as it returns, so a write through it changes nothing served."""
    torch.manual_seed(0)

    class KeepsWeakly(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 8)
            self.ref = None

        def forward(self, x):
            out = _Out(logits=self.body(x))
            self.ref = weakref.ref(out["logits"] if what == "logits" else out)
            return out

    model, x = KeepsWeakly(), torch.randn(3, 4)
    with torch.no_grad():
        truth = model.body(x).clone()
    trace = torchlens.trace(model, x, save="all")
    assert trace._output_guards is None
    kept = model.ref() if what == "logits" else model.ref()["logits"]
    kept.detach().numpy()[...] = 0.0
    assert torch.equal(trace.modules["body"].facets["output"], truth)


class _Out(dict):
    """A dict output that can be referenced weakly (as a `ModelOutput` can)."""


def test_an_input_the_model_returns_is_copied_when_the_trace_returns():
    """A tensor in the output that is also the model's input is the caller's: copied at once."""

    class ReturnsItsInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 4)

        def forward(self, x):
            return {"x": x, "y": self.body(x)}

    torch.manual_seed(0)
    model, x = ReturnsItsInput(), torch.randn(2, 4)
    truth = x.clone()
    trace = torchlens.trace(model, x, save="all")
    x.add_(1.0)  # the caller's input, written after the trace
    assert torch.equal(trace.modules[""].facets["input"], truth)
    assert torch.equal(trace.ops[0].tensor, truth)


def test_an_output_whose_storage_is_referred_to_weakly_is_copied_when_the_trace_returns():
    """A weak reference to the logits' storage object reaches that memory with no reference count
    to show it: the trace copies as it returns, so a write through it changes nothing served."""
    torch.manual_seed(0)

    class KeepsStorageWeakly(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 8)
            self.ref = None

        def forward(self, x):
            y = self.body(x)
            self.ref = weakref.ref(y.untyped_storage())
            return {"logits": y}

    model, x = KeepsStorageWeakly(), torch.randn(3, 4)
    with torch.no_grad():
        truth = model.body(x).clone()
    trace = torchlens.trace(model, x, save="all")
    assert trace._output_guards is None
    torch.empty(0).set_(model.ref(), 0, (3, 8), (8, 1)).numpy()[...] = 0.0
    assert torch.equal(trace.modules["body"].facets["output"], truth)


def test_an_empty_tuple_in_the_output_does_not_force_the_copy(gpt2):
    """GPT-2 with `output_attentions` returns `cross_attentions=()`, the one empty tuple Python
    shares: it reaches no tensor, and the logits still wait for the first read."""
    trace = torchlens.trace(gpt2, IDS, save="all", output_attentions=True)
    assert trace._output_guards


def test_a_guard_stays_on_its_sites_until_the_copy_is_in_place(gpt2, monkeypatch):
    """Another thread that reads a facet while the first read of `output` copies must find the
    guard (and wait for the copy), never a site already disarmed and still on the output's memory:
    the sites and ops keep their guard until the copy has replaced their tensors."""
    from torchlens._capture import snapshot

    trace = torchlens.trace(gpt2, IDS, save="all")
    site = trace.modules[""].facets._sites["logits"]
    op = _logits_op(trace)
    seen = []
    real = snapshot._copy_group

    def copy_group(key, items):
        seen.append((site._guard is not None, op._guard is not None))
        return real(key, items)

    monkeypatch.setattr(snapshot, "_copy_group", copy_group)
    trace.output
    assert seen == [(True, True)]
    assert site._guard is None and op._guard is None
