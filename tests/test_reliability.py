"""Reliability of the capture core: errors, nesting, grad modes, threads, odd models, memory.

Every test states what must hold whatever the model does:

- a forward that raises reaches the caller unchanged (same object), with a note naming the op
  and module, and nothing TorchLens installed is left behind;
- traces nest, run under `no_grad` / `inference_mode`, keep autograd intact, and run from
  several threads at once, each recording only its own thread;
- models of unusual shape (a module called twice, dict / ModelOutput / nested / non-tensor
  outputs, keyword-only inputs, in-place ops, factory ops, compiled parts, half precision, no
  submodules) trace correctly, or are refused with a `TorchLensError`;
- bad `save=` values, facet names and module addresses raise errors that suggest close matches;
- a trace holds no reference cycle, does not keep the model alive, and repeated traces of a
  GPT-2-small-shaped model do not grow the process.

Ground truth comes from plain forwards and plain PyTorch hooks, never from TorchLens. The models
are tiny random-init ones (`torchlens.testing`), except the GPT-2-small-shaped memory model.

Tests internals: `torchlens._core.ops`'s op-classification cache (that it stays bounded), and
`torchlens._core.holdings.trace_holdings` (every tensor a trace holds, read without running a
check or resolving a guard).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import pickle
import threading
import warnings
import weakref

import pytest
import torch
from torch import Tensor, nn

import torchlens
from torchlens import (
    AmbiguousModuleCall,
    CaptureError,
    FacetNotFound,
    ModuleNotFoundInTrace,
    Ref,
    SaveSpecError,
    TorchLensError,
    testing,
)
from torchlens._capture import collector

_module_mod = torch.nn.modules.module
_GLOBAL_HOOK_DICTS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
    "_global_forward_hooks_always_called",
    "_global_forward_hooks_with_kwargs",
)
_MODULE_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_hooks",
    "_backward_pre_hooks",
)


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def hook_state(model: nn.Module) -> list[tuple]:
    """Every hook dict of every module, by key (a user's own hooks count too)."""
    return [
        (addr, name, tuple(getattr(m, name, {})))
        for addr, m in model.named_modules(remove_duplicate=False)
        for name in _MODULE_HOOK_DICTS
    ]


def assert_nothing_left(model: nn.Module | None = None, before: list | None = None) -> None:
    """No hook, global hook or torch function mode of TorchLens remains, and Python's garbage
    collector is on again (a trace pauses it, `_capture.collector`)."""
    assert gc.isenabled() and not collector._DEPTHS
    assert torch._C._len_torch_function_stack() == 0
    assert not torch._C._is_torch_function_mode_enabled()
    for name in _GLOBAL_HOOK_DICTS:
        assert not getattr(_module_mod, name, {}), name
    if model is not None:
        state = hook_state(model)
        if before is None:
            assert all(not keys for _, _, keys in state), [s for s in state if s[2]]
        else:
            assert state == before


def op_rows(tr: torchlens.Trace) -> list[tuple]:
    return [(op.name, op.module, op.call, op.inputs, op.shapes) for op in tr.ops]


def assert_same_trace(a: torchlens.Trace, b: torchlens.Trace) -> None:
    """Same ops (names, modules, data flow, shapes) and equal saved tensors."""
    assert op_rows(a) == op_rows(b)
    for x, y in zip(a.ops, b.ops):
        for s, t in zip(x.tensors, y.tensors):
            assert (s is None) == (t is None)
            if s is not None:
                assert torch.equal(s, t), x
    assert {k: len(r.calls) for k, r in a.modules.items()} == {
        k: len(r.calls) for k, r in b.modules.items()
    }


def hooked_io(model: nn.Module, *args, **kwargs) -> tuple[object, dict[str, list[tuple]]]:
    """A plain forward with plain PyTorch hooks: per module address, (input, output) per call."""
    seen: dict[str, list[tuple]] = {}
    handles = []

    def hook(addr):
        def post(m, a, kw, out):
            first = a[0] if a else next(iter(kw.values()))
            seen.setdefault(addr, []).append((first.detach().clone(), out.detach().clone()))

        return post

    for addr, m in model.named_modules():
        handles.append(m.register_forward_hook(hook(addr), with_kwargs=True))
    try:
        with torch.no_grad():
            out = model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return out, seen


@functools.cache
def gpt2():
    return testing.build("gpt2")


@functools.cache
def llama():
    return testing.build("llama")


IDS = testing.token_ids(1, 6)


@functools.cache
def gpt2_logits() -> Tensor:
    with torch.no_grad():
        return gpt2()(IDS).logits


# ----------------------------------------------------------------------------------------------
# A forward that raises
# ----------------------------------------------------------------------------------------------


class _Boom(Exception):
    pass


class _Stage(nn.Module):
    """A linear, then whatever failure the test switches on."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fail: str | None = None
        self.exc: BaseException | None = None

    def forward(self, x):
        y = self.lin(x) * 2
        if self.fail == "raise":
            raise self.exc
        if self.fail == "op":
            y = y @ torch.ones(5, 5)  # shape mismatch: the op itself raises
        if self.fail == "caught_then_raise":
            try:
                y @ torch.ones(5, 5)
            except RuntimeError:
                pass
            raise self.exc
        return y.relu()


class _Flaky(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(3, 4)
        self.stages = nn.Sequential(_Stage(), _Stage())
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.stages(self.embed(x)))


@pytest.mark.parametrize(
    "fail,exc,where,what",
    [
        # ops: #0 input, #1 embed linear, #2-#4 stages.0 (linear, mul, relu), #5-#6 stages.1
        ("raise", _Boom("boom"), "<root> > stages > stages.1", "after op #6 (mul)"),
        ("raise", ValueError("bad"), "<root> > stages > stages.1", "after op #6 (mul)"),
        ("raise", KeyboardInterrupt(), "<root> > stages > stages.1", "after op #6 (mul)"),
        ("op", None, "<root> > stages > stages.1", "during op #8 (matmul)"),  # #7 is torch.ones
        # the matmul failed and was caught; the later raise is not blamed on it
        ("caught_then_raise", _Boom("later"), "<root> > stages > stages.1", "after op #7 (ones)"),
    ],
    ids=["custom", "ValueError", "KeyboardInterrupt", "op-raises", "caught-op-failure-then-raise"],
)
def test_forward_raises_original_exception_with_note_and_nothing_left(fail, exc, where, what):
    model = _Flaky().eval()
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before_out = model(x)
    before_hooks = hook_state(model)
    stage = model.stages[1]
    stage.fail, stage.exc = fail, exc
    with pytest.raises(BaseException) as info:
        torchlens.trace(model, x)
    if exc is not None:
        assert info.value is exc  # the very object the model raised, type unchanged
    else:
        assert type(info.value) is RuntimeError
    notes = [n for n in getattr(info.value, "__notes__", []) if n.startswith("torchlens:")]
    assert len(notes) == 1, notes
    assert f"in module {where}" in notes[0] and what in notes[0], notes[0]
    assert_nothing_left(model, before_hooks)
    # the model runs plainly, and traces, exactly as before
    stage.fail = None
    with torch.no_grad():
        assert torch.equal(model(x), before_out)
    assert torch.equal(torchlens.trace(model, x).output, before_out)
    assert_nothing_left(model, before_hooks)


def test_hf_forward_raises_keeps_user_hooks_and_model_intact():
    model = gpt2()
    user = model.transformer.h[0].register_forward_hook(lambda m, a, o: None)
    try:
        before = hook_state(model)
        with pytest.raises(IndexError) as info:
            torchlens.trace(model, torch.full((1, 3), 10_000))  # out of vocabulary
        assert any(
            "(embedding) in module <root> > transformer > transformer.wte" in n
            for n in info.value.__notes__
        )
        assert_nothing_left(model, before)
    finally:
        user.remove()
    assert_nothing_left(model)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, gpt2_logits())


# ----------------------------------------------------------------------------------------------
# Nested traces
# ----------------------------------------------------------------------------------------------


class _TracesItsChild(nn.Module):
    """Its forward traces its own submodule (nested) or calls it plainly (reference)."""

    def __init__(self, nested: bool):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(3, 3)
        self.b = nn.Sequential(nn.Linear(3, 3), nn.GELU(), nn.LayerNorm(3))
        self.nested = nested
        self.inner: torchlens.Trace | None = None

    def forward(self, x):
        y = self.a(x)
        if self.nested:
            self.inner = torchlens.trace(self.b, y)
            y = self.inner.output
        else:
            y = self.b(y)
        return y.relu()


def test_trace_inside_a_module_forward():
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(1))
    nested, plain = _TracesItsChild(True), _TracesItsChild(False)
    outer = torchlens.trace(nested, x)
    reference = torchlens.trace(plain, x)
    # the outer trace saw the model's ops, and none of the inner recorder's bookkeeping
    assert_same_trace(outer, reference)
    assert "detach" not in [op.name for op in outer.ops]
    # the inner trace is the trace of the submodule on the same input
    with torch.no_grad():
        y = plain.a(x)
    assert_same_trace(nested.inner, torchlens.trace(plain.b, y))
    assert torch.equal(outer.output, reference.output)
    assert_nothing_left(nested)


class _TracesAnotherModel(nn.Module):
    def __init__(self, nested: bool):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(testing.VOCAB, 2)
        self.nested = nested
        self.inner: torchlens.Trace | None = None

    def forward(self, ids):
        if self.nested:
            self.inner = torchlens.trace(gpt2(), ids, save=["resid_post"])
            logits = self.inner.output.logits
        else:
            logits = gpt2()(ids).logits
        return self.proj(logits)


def test_trace_of_another_model_while_an_outer_trace_runs():
    gpt2()  # built before the traces: its building ops are no part of either forward
    nested, plain = _TracesAnotherModel(True), _TracesAnotherModel(False)
    outer = torchlens.trace(nested, IDS)
    reference = torchlens.trace(plain, IDS)
    assert_same_trace(outer, reference)  # the facet derivation of the inner trace is not in it
    alone = torchlens.trace(gpt2(), IDS, save=["resid_post"])
    assert op_rows(nested.inner) == op_rows(alone)
    for block in alone.blocks:
        assert torch.equal(
            nested.inner.modules[block].facets["resid_post"],
            alone.modules[block].facets["resid_post"],
        )
    assert torch.equal(nested.inner.output.logits, gpt2_logits())
    assert_nothing_left(gpt2())


class _TracesWithGrads(nn.Module):
    """A frozen GPT-2 run by a `grads=` trace of its own (`nested`), or plainly."""

    def __init__(self, nested: bool):
        super().__init__()
        self.model = testing.build("gpt2").requires_grad_(False)
        self.nested = nested
        self.inner: torchlens.Trace | None = None

    def forward(self, ids):
        if not self.nested:  # the loss's ops run in the forward either way: they are user code
            out = self.model(ids)
            _last_logsumexp(out)
            return out.logits
        self.inner = torchlens.trace(self.model, ids, save=["resid_post"], grads=_last_logsumexp)
        return self.inner.output.logits


def _last_logsumexp(out) -> Tensor:
    return out.logits[0, -1].logsumexp(-1)


def test_outer_trace_follows_the_data_flow_through_an_inner_grads_trace():
    """An inner `grads=` trace hands the model an autograd leaf's alias of the embeddings'
    outputs (frozen weights stay frozen); the outer trace reads that alias as the embedding op's
    output, so its data flow is the plain forward's, op for op."""
    nested, plain = _TracesWithGrads(True), _TracesWithGrads(False)
    outer = torchlens.trace(nested, IDS)
    reference = torchlens.trace(plain, IDS)
    assert_same_trace(outer, reference)
    embeddings = [i for i, op in enumerate(outer.ops) if op.name == "embedding"]
    assert len(embeddings) == 2  # token and position embeddings
    for i in embeddings:  # each is read by a later op of the forward, as without the inner trace
        assert any(Ref(i, 0) in op.inputs for op in outer.ops[i + 1 :]), outer.ops[i]
    assert (
        nested.inner is not None
        and nested.inner.modules["transformer.h.0"].grads["resid_post"] is not None
    )
    assert_nothing_left(nested)


# ----------------------------------------------------------------------------------------------
# Grad modes and autograd
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode", [torch.no_grad, torch.inference_mode, torch.enable_grad], ids=lambda m: m.__name__
)
def test_trace_under_grad_modes(mode):
    reference = torchlens.trace(gpt2(), IDS)
    with mode():
        tr = torchlens.trace(gpt2(), IDS)
    assert torch.equal(tr.output.logits, gpt2_logits())
    assert_same_trace(tr, reference)
    for block in tr.blocks:
        assert torch.equal(
            tr.modules[block].facets["resid_post"], reference.modules[block].facets["resid_post"]
        )
    assert_nothing_left(gpt2())


def test_inference_mode_inside_the_forward_with_in_place_write():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            with torch.inference_mode():
                y = self.lin(x)
                y.relu_()
            return y + 1

    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    m = M()
    with torch.no_grad():
        lin_out = m.lin(x)
    assert (lin_out < 0).any()
    tr = torchlens.trace(m, x)
    assert torch.equal(tr.modules["lin"].facets["output"], lin_out)  # saved before the relu_
    assert torch.equal(tr.output, lin_out.relu() + 1)


class _InPlaceMLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4)

    def forward(self, x):
        h = self.up(x)
        h = h * 1.5
        h.add_(0.25)
        h.relu_()
        return self.down(h)


@pytest.mark.parametrize("which", ["gpt2", "inplace"])
def test_requires_grad_inputs_gradients_flow_and_saved_tensors_detached(which):
    if which == "gpt2":
        model = testing.build("gpt2")
        inp = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(0))
        call = lambda m, e: m(inputs_embeds=e).logits
        run = lambda m, e: torchlens.trace(m, inputs_embeds=e)
        out_of = lambda tr: tr.output.logits
    else:
        model = _InPlaceMLP()
        inp = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
        call = lambda m, e: m(e)
        run = lambda m, e: torchlens.trace(m, e)
        out_of = lambda tr: tr.output
    weight = torch.randn_like(call(model, inp).detach())

    def grads(out, e):
        (out * weight).sum().backward()
        g = {n: p.grad.clone() for n, p in model.named_parameters()}
        g["<input>"] = e.grad.clone()
        model.zero_grad(set_to_none=True)
        return g

    e = inp.clone().requires_grad_(True)
    plain = grads(call(model, e), e)
    e = inp.clone().requires_grad_(True)
    tr = run(model, e)
    out = out_of(tr)
    assert out.requires_grad and out.grad_fn is not None
    traced = grads(out, e)
    assert plain.keys() == traced.keys()
    for name in plain:
        assert torch.equal(plain[name], traced[name]), name
    saved = [t for op in tr.ops for t in op.tensors if t is not None]
    saved += [
        s.tensor
        for r in tr.modules.values()
        for c in r.calls
        for s in c.facets.sites.values()
        if s.tensor is not None
    ]
    assert saved and all(not t.requires_grad and t.grad_fn is None for t in saved)
    assert_nothing_left(model)


# ----------------------------------------------------------------------------------------------
# Threads
# ----------------------------------------------------------------------------------------------


def _in_threads(jobs, meet_at):
    """Run each `(model, ids)` job's trace in its own thread; all meet inside their forward.

    A forward pre-hook on each job's `meet_at` module waits on a barrier, so every thread is in
    the middle of its forward (its recorder's hooks and mode installed) while the others run.
    """
    barrier = threading.Barrier(len(jobs), timeout=30)
    results: list = [None] * len(jobs)

    def meet(module, args):
        barrier.wait()

    handles = [
        model.get_submodule(meet_at[id(model)]).register_forward_pre_hook(meet)
        for model in {id(m): m for m, _ in jobs}.values()
    ]

    def work(i, model, ids):
        try:
            results[i] = torchlens.trace(model, ids)
        except BaseException as e:  # reported below
            results[i] = e
            barrier.abort()

    threads = [threading.Thread(target=work, args=(i, m, ids)) for i, (m, ids) in enumerate(jobs)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        for h in handles:
            h.remove()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def test_two_threads_two_models():
    g, l = gpt2(), llama()  # noqa: E741  # g(pt2) and l(lama), beside ids_g and ids_l
    ids_g, ids_l = testing.token_ids(1, 6, seed=1), testing.token_ids(2, 5, seed=2)
    ref_g, ref_l = torchlens.trace(g, ids_g), torchlens.trace(l, ids_l)
    tr_g, tr_l = _in_threads(
        [(g, ids_g), (l, ids_l)], {id(g): "transformer.h.1", id(l): "model.layers.1"}
    )
    assert_same_trace(tr_g, ref_g)
    assert_same_trace(tr_l, ref_l)
    assert_nothing_left(g)
    assert_nothing_left(l)


def test_two_threads_same_model():
    g = gpt2()
    ids_a, ids_b = testing.token_ids(1, 6, seed=3), testing.token_ids(1, 4, seed=4)
    ref_a, ref_b = torchlens.trace(g, ids_a), torchlens.trace(g, ids_b)
    tr_a, tr_b = _in_threads([(g, ids_a), (g, ids_b)], {id(g): "transformer.h.1"})
    # each trace holds its own thread's ops only: one call per module, its own input's values
    assert_same_trace(tr_a, ref_a)
    assert_same_trace(tr_b, ref_b)
    assert all(len(r.calls) <= 1 for r in tr_a.modules.values())
    assert_nothing_left(g)


@pytest.mark.parametrize("hook", ["pre", "post"])
def test_plain_forward_in_another_thread_while_a_trace_removes_its_hooks(hook):
    """`Module._call_impl` lists a module's hooks, then asks per hook whether it takes kwargs. A
    plain forward in thread B that listed the trace's hooks just before thread A's trace removed
    them must still run (the recorder's hooks are called without kwargs then)."""
    b_listed, a_done = threading.Event(), threading.Event()
    state: dict = {}

    class Wait(nn.Module):
        def forward(self, x):
            if threading.current_thread() is threading.main_thread() and "b" not in state:
                state["b"] = threading.Thread(target=plain_forward)
                state["b"].start()
                assert b_listed.wait(30)
            return x + 1

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.wait = Wait()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(self.wait(x))

    model = M()

    def plain_forward():
        try:
            with torch.no_grad():
                state["out"] = model(torch.ones(1, 3))
        except BaseException as e:
            state["error"] = e
            b_listed.set()

    def block_b(*_):  # a user's hook, registered before the trace's: runs first in the list
        if threading.current_thread() is state.get("b") and not a_done.is_set():
            b_listed.set()
            assert a_done.wait(30)

    user = (
        model.register_forward_pre_hook(block_b)
        if hook == "pre"
        else model.register_forward_hook(block_b)
    )
    try:
        tr = torchlens.trace(model, torch.ones(1, 3))
        a_done.set()
        state["b"].join(30)
    finally:
        a_done.set()
        user.remove()
    assert "error" not in state, state["error"]
    with torch.no_grad():
        assert torch.equal(state["out"], model(torch.ones(1, 3)))
    assert [(op.name, op.module) for op in tr.ops] == [
        ("input", ""),
        ("add", "wait"),
        ("linear", "lin"),
    ]
    assert_nothing_left(model)


# ----------------------------------------------------------------------------------------------
# Models of unusual shape
# ----------------------------------------------------------------------------------------------


class _Shared(nn.Module):
    """One linear registered under two names and called twice (tied weights)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 4)
        self.second = self.first

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def test_module_called_twice():
    model = _Shared()
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    out, seen = hooked_io(model, x)
    tr = torchlens.trace(model, x)
    assert torch.equal(tr.output, out)
    rec = tr.modules["first"]
    assert tr.modules["second"] is rec and rec.aliases == ("second",)
    assert [c.index for c in rec.calls] == [0, 1]
    for address in ("first", "second"):
        with pytest.raises(AmbiguousModuleCall) as info:
            tr.modules[address].facets
        msg = str(info.value)
        assert "ran 2 times" in msg and ".calls[i].facets" in msg and "0..1" in msg, msg
        assert isinstance(info.value, TorchLensError) and isinstance(info.value, KeyError)
    for call, (inp, outp) in zip(rec.calls, seen["first"]):
        assert torch.equal(call.facets["input"], inp)
        assert torch.equal(call.facets["output"], outp)
    # the shared weight is one parameter: both linear ops read it under its one name
    assert [op.inputs[1] for op in tr.ops if op.name == "linear"] == [
        "first.weight",
        "first.weight",
    ]


class _Returns(nn.Module):
    """Returns whatever `make(a, b)` builds from two tensors; keeps the object it returned."""

    def __init__(self, make):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)
        self.make = make
        self.returned = None

    def forward(self, x):
        a = self.lin(x)
        b = a * 2
        self.returned = self.make(a, b)
        return self.returned


def _model_output(a, b):
    from transformers.modeling_outputs import BaseModelOutputWithPast

    return BaseModelOutputWithPast(last_hidden_state=b, hidden_states=(a, b))


_OUTPUTS = {
    "tensor": (lambda a, b: b, "b"),
    "dict": (lambda a, b: {"n": 3, "x": b, "y": a}, "b"),
    "model_output": (_model_output, "b"),
    "tuple_none_first": (lambda a, b: (None, b, a), "b"),
    "nested_tuple": (lambda a, b: (("label", (b, 2)), a), "b"),
    "list_of_dicts": (lambda a, b: [{"k": "v"}, {"t": a}, b], "a"),
    "str": (lambda a, b: "no tensor here", None),
    "int": (lambda a, b: 7, None),
    "none": (lambda a, b: None, None),
}


@pytest.mark.parametrize("kind", list(_OUTPUTS))
def test_model_outputs_of_any_structure(kind):
    make, first = _OUTPUTS[kind]
    model = _Returns(make)
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    tr = torchlens.trace(model, x)
    assert tr.output is model.returned  # the model's own object, not a copy
    with torch.no_grad():
        a = model.lin(x)
    root = tr.modules[""].facets
    if first is None:
        assert "output" not in root.sites
        with pytest.raises(FacetNotFound):
            root["output"]
    else:
        assert torch.equal(root["output"], {"a": a, "b": a * 2}[first])
    assert_nothing_left(model)


def test_hf_model_output_and_keyword_only_inputs():
    model = gpt2()
    tr = torchlens.trace(model, input_ids=IDS)
    assert type(tr.output).__name__ == "CausalLMOutputWithCrossAttentions"
    assert torch.equal(tr.output.logits, gpt2_logits())
    root = tr.modules[""].facets
    assert torch.equal(root["input"], IDS)  # the first tensor keyword argument
    assert torch.equal(root["output"], gpt2_logits())  # first tensor of the ModelOutput
    assert tr.ops[0].name == "input" and tr.ops[0].inputs == ()
    assert_same_trace(tr, torchlens.trace(model, IDS))


def test_keyword_only_forward():
    class KwOnly(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(3, 3)

        def forward(self, *, x, scale=2.0, bias):
            return self.lin(x) * scale + bias

    model = KwOnly()
    x, bias = torch.ones(2, 3), torch.full((3,), 0.5)
    tr = torchlens.trace(model, x=x, bias=bias, scale=3.0)
    with torch.no_grad():
        assert torch.equal(tr.output, model(x=x, bias=bias, scale=3.0))
    assert [op.name for op in tr.ops[:2]] == ["input", "input"]
    assert torch.equal(tr.modules[""].facets["input"], x)


class _InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        y.relu_()
        y.add_(1.0)
        y.mul_(3.0)
        return y


def test_in_place_ops_keep_earlier_saved_values():
    model = _InPlace()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lin_out = model.lin(x)
    assert (lin_out < 0).any()
    tr = torchlens.trace(model, x)
    by_name = {op.name: op for op in tr.ops}
    assert torch.equal(by_name["linear"].tensor, lin_out)
    assert torch.equal(by_name["relu_"].tensor, lin_out.relu())
    assert torch.equal(by_name["add_"].tensor, lin_out.relu() + 1)
    assert torch.equal(by_name["mul_"].tensor, (lin_out.relu() + 1) * 3)
    assert [op.mutated for op in tr.ops] == [False, False, True, True, True]
    assert torch.equal(tr.modules["lin"].facets["output"], lin_out)
    assert torch.equal(tr.output, (lin_out.relu() + 1) * 3)


def test_factory_ops_are_recorded_without_inputs():
    class Positions(nn.Module):
        def forward(self, x):
            pos = torch.arange(x.shape[-1])
            return x + pos + torch.zeros(x.shape) + torch.ones_like(x)

    class NoInputs(nn.Module):
        def forward(self):
            return torch.arange(4.0) * 2

    tr = torchlens.trace(Positions(), torch.zeros(2, 3))
    ops = {op.name: op for op in tr.ops}
    assert ops["arange"].inputs == () and ops["zeros"].inputs == ()
    assert ops["ones_like"].inputs == (Ref(0, 0),)
    assert torch.equal(ops["arange"].tensor, torch.arange(3))
    tr = torchlens.trace(NoInputs())
    assert [(op.name, op.inputs) for op in tr.ops] == [("arange", ()), ("mul", (Ref(0, 0),))]
    assert torch.equal(tr.output, torch.arange(4.0) * 2)
    assert torch.equal(tr.modules[""].facets["output"], tr.output)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_half_precision(family, dtype):
    model = testing.build(family, "eager", dtype)
    with torch.no_grad():
        ref = model(IDS).logits
    tr = torchlens.trace(model, IDS)
    assert torch.equal(tr.output.logits, ref)
    assert ref.dtype == dtype
    block = tr.blocks[0]
    assert tr.modules[block].facets["resid_post"].dtype == dtype
    linear = [op for op in tr.ops if op.name == "linear"]
    assert linear and all(op.dtype == dtype and op.tensor.dtype == dtype for op in linear)
    assert_nothing_left(model)


def test_model_without_submodules():
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.full((3, 3), 0.5))

        def forward(self, x):
            return torch.softmax(x @ self.w, dim=-1).sum(-1)

    model = Bare()
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    tr = torchlens.trace(model, x)
    assert list(tr.modules) == [""]
    assert [op.name for op in tr.ops] == ["input", "matmul", "softmax", "sum"]
    assert tr.ops[1].inputs == (Ref(0, 0), "w")
    with torch.no_grad():
        assert torch.equal(tr.output, model(x))
    assert torch.equal(tr.modules[""].facets["output"], tr.output)


@pytest.mark.parametrize("store", [None, "cpu", "directory"])
def test_tensors_without_a_storage_of_their_own_are_kept_and_copied(store, tmp_path):
    # A sparse tensor has no storage to tell liveness or writes by: it is kept, and copied when the
    # trace returns (so a later write into the returned one leaves the trace as it was).
    class Sparse(nn.Module):
        def forward(self, x):
            s = (x * 1).to_sparse()
            return s.to_dense() + 1, s

    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    tr = torchlens.trace(Sparse(), x, store=str(tmp_path) if store == "directory" else store)
    assert [op.name for op in tr.ops] == ["input", "mul", "to_sparse", "to_dense", "add"]
    kept = tr.ops[2].tensor
    assert kept.layout == torch.sparse_coo and torch.equal(kept.to_dense(), x)
    assert torch.equal(tr.ops[-1].tensor, x + 1)
    tr.output[1].mul_(0)  # the caller writes into the sparse tensor the model returned
    assert torch.equal(tr.ops[2].tensor.to_dense(), x)


def test_a_wrapper_subclass_input_is_traced():
    # A wrapper subclass keeps its data in the tensors it wraps: its own storage has no data pointer.
    from torch.testing._internal.two_tensor import TwoTensor

    model = nn.Linear(4, 4)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    tr = torchlens.trace(model, TwoTensor(x, x * 2))
    assert [op.name for op in tr.ops] == ["input", "linear"]
    out = tr.ops[-1].tensor
    assert type(out).__name__ == "TwoTensor"
    with torch.no_grad():
        assert torch.equal(out.a, model(x)) and torch.equal(out.b, model(x * 2))


@pytest.mark.parametrize("store", [None, "directory"])
@pytest.mark.parametrize("how", ["mul_", "data"])
def test_a_wrapper_subclass_written_in_place_keeps_what_each_op_returned(how, store, tmp_path):
    # A wrapper subclass's memory is its inner tensors': a write into it (also through `.data`,
    # whose version counter is its own) first copies what the trace kept there.
    from torch.testing._internal.two_tensor import TwoTensor

    class Writes(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.lin2 = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x):
            h = self.lin(x)
            (h.data if how == "data" else h).mul_(0)
            return self.lin2(h)

    model = Writes()
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        first = model.lin(x)
    tr = torchlens.trace(model, TwoTensor(x, x * 2), store=str(tmp_path) if store else None)
    linear = tr.ops[1]
    assert linear.name == "linear" and torch.equal(linear.tensor.a, first)  # as the op returned it
    assert torch.equal(tr.modules["lin"].facets["output"].a, first)
    assert bool((tr.modules["lin2"].facets["input"].a == 0).all())  # what lin2 received
    source = tr.ops[tr.modules["lin2"].calls[0].input_ref.op]
    assert source.name == (
        "written_in_place" if how == "data" else "mul_"
    )  # what lin2 read comes from the write
    with pytest.warns(UserWarning, match="TwoTensor"):
        tr.save(
            tmp_path / "saved"
        )  # a wrapper subclass is left out of the file, with a note, not a crash
    assert any("TwoTensor" in note for note in torchlens.load(tmp_path / "saved").load_notes)


def test_a_directory_store_keeps_copying_a_wrapper_subclass_it_leaves_in_memory(tmp_path):
    # The store cannot write a wrapper subclass, so it stays in memory; a write into it in a later
    # block (seen by the mode) must still copy it first, after the store wrote block 0's plain tensors.
    from torch.testing._internal.two_tensor import TwoTensor

    class B0(nn.Module):
        def forward(self, x):
            self.plain = torch.ones(2) * 3  # a plain tensor the store writes when block 0 ends
            return x * 2

    class B1(nn.Module):
        def forward(self, y):
            y.add_(1)
            return y * 3

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.b0, self.b1 = B0(), B1()

        def forward(self, x):
            return self.b1(self.b0(x))

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no write goes unseen here
        tr = torchlens.trace(
            M(),
            TwoTensor(torch.ones(3), torch.ones(3) * 5),
            store=str(tmp_path),
            roles={"b0": "block", "b1": "block"},
        )
    out = tr.modules["b0"].facets["output"]
    assert torch.equal(out.a, torch.full((3,), 2.0)) and torch.equal(out.b, torch.full((3,), 10.0))
    assert torch.equal(tr.output.a, torch.full((3,), 9.0))


@pytest.mark.parametrize("source", ["model input", "op output"])
def test_a_kept_module_input_written_where_the_mode_cannot_see_is_not_served(source):
    class Inner(nn.Module):
        def forward(self, x):
            y = x * 2
            with torch._C.DisableTorchFunction():  # hidden from the mode
                x.mul_(0)
            return y

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            return self.inner(x if source == "model input" else x + 0)  # an op's output, not kept

    x = torch.arange(1.0, 7.0).reshape(2, 3)
    with pytest.warns(UserWarning, match="inner input"):
        tr = torchlens.trace(Outer(), x, save=["inner"])  # the input is kept as a hook alias
    facets = tr.modules["inner"].facets
    assert "input" not in facets  # not served with the zeros written later
    assert torch.equal(tr.output, torch.arange(1.0, 7.0).reshape(2, 3) * 2)
    # Asking for it says why: a refusal naming the write, not "not saved, trace with save=".
    assert "written in place after the trace kept it" in facets.refused["input"]
    with pytest.raises(
        torchlens.FacetNotFound, match="not served: the input tensor of 'inner' was written"
    ):
        facets["input"]
    assert "output" in facets  # the output was not written


@pytest.mark.parametrize(
    "not_a_module",
    [lambda x: x * 2, torch.ones(2), nn.Linear, "model", None],
    ids=["function", "tensor", "module-class", "str", "None"],
)
def test_non_module_is_refused(not_a_module):
    with pytest.raises(TorchLensError) as info:
        torchlens.trace(not_a_module, torch.ones(1, 2))
    assert "needs a torch.nn.Module" in str(info.value)
    assert_nothing_left()


# ----------------------------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------------------------


class _CountingBackend:
    """A torch.compile backend that counts compilations and runs of its compiled graphs."""

    def __init__(self):
        self.compiled = 0
        self.runs = 0

    def __call__(self, gm, example_inputs):
        self.compiled += 1

        def run(*args):
            self.runs += 1
            return gm(*args)

        return run


class _Sub(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return torch.relu(self.lin(x)) * 2


def _scaled_sin(x):
    return torch.sin(x) * 3 + 1


class _WithCompiled(nn.Module):
    """pre -> (a compiled `_Sub`, or a compiled function) -> post; `kind="eager"` / `"eager_fn"`
    are the same model with nothing compiled. Seeded: every kind has the same weights."""

    def __init__(self, kind, backend=None):
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(3, 3)
        if kind == "wrapper":
            self.sub = torch.compile(_Sub(), backend=backend)
        elif kind == "fullgraph":
            self.sub = torch.compile(_Sub(), backend=backend, fullgraph=True)
        else:
            self.sub = _Sub()
            if kind == "in_place":
                self.sub.compile(backend=backend)
        self.fn = {
            "function": torch.compile(_scaled_sin, backend=backend),
            "eager_fn": _scaled_sin,
        }.get(kind)
        self.post = nn.Linear(3, 3)

    def forward(self, x):
        h = self.pre(x)
        h = self.fn(h) if self.fn is not None else self.sub(h)
        return self.post(h)


@pytest.mark.parametrize("kind", ["wrapper", "fullgraph", "in_place", "function", "root"])
def test_compiled_parts_run_eagerly_while_tracing(kind):
    """TorchLens runs compiled code eagerly while it traces (`set_stance('force_eager')`): every
    op of a compiled submodule or function is recorded, the compiled graph does not run during
    the trace, and afterwards it runs again without recompiling. (Without that, dynamo met the
    recorder's hooks: graph breaks and a recompile per trace, or `Unsupported` under fullgraph.)"""
    backend = _CountingBackend()
    if kind == "root":
        model = torch.compile(_WithCompiled("eager"), backend=backend)
    else:
        model = _WithCompiled(kind, backend)
    eager = _WithCompiled("eager_fn" if kind == "function" else "eager")
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        compiled_out = model(x)
    assert backend.compiled >= 1 and backend.runs >= 1
    compiled, runs = backend.compiled, backend.runs
    with torch.no_grad():
        tr = torchlens.trace(model, x)
        ref = torchlens.trace(eager, x)
    assert (backend.compiled, backend.runs) == (
        compiled,
        runs,
    )  # nothing compiled, nothing run compiled
    assert [(op.name, op.module.replace("._orig_mod", "")) for op in tr.ops] == [
        (op.name, op.module) for op in ref.ops
    ]
    assert (
        "sin" in [op.name for op in tr.ops]
        if kind == "function"
        else "relu" in [op.name for op in tr.ops]
    )
    assert torch.equal(tr.output, ref.output)
    torch.testing.assert_close(tr.output, compiled_out)
    if kind == "root":  # the wrapper is traced as the eager model: its addresses, its class
        assert tr.model_class == "_WithCompiled" and list(tr.modules) == list(ref.modules)
    with torch.no_grad():
        model(x)
    assert (backend.compiled, backend.runs) == (
        compiled,
        runs + 1,
    )  # runs compiled again, no recompile
    assert_nothing_left(model)


def test_compiled_stance_restored_after_a_raising_and_a_nested_trace():
    backend = _CountingBackend()
    model = _WithCompiled("wrapper", backend)
    x = torch.ones(1, 3)
    model(x)
    runs = backend.runs

    class Outer(nn.Module):
        def __init__(self, fail):
            super().__init__()
            self.fail = fail

        def forward(self, x):
            inner = torchlens.trace(model, x)
            if self.fail:
                raise _Boom("after the inner trace")
            return inner.output

    with pytest.raises(_Boom):
        torchlens.trace(Outer(True), x)
    outer = torchlens.trace(Outer(False), x)
    assert "linear" in [op.name for op in outer.ops]
    assert backend.runs == runs  # both traces ran the compiled module eagerly
    model(x)
    assert backend.runs == runs + 1  # and the stance is back: it runs compiled
    assert_nothing_left(model)


class _WaitsForAnotherThread(nn.Module):
    """A forward that, halfway through, lets another thread run and waits until it is done."""

    def __init__(self, inside: threading.Event, done: threading.Event, fail: bool):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)
        self.inside, self.done, self.fail = inside, done, fail

    def forward(self, x):
        h = self.lin(x)
        self.inside.set()
        assert self.done.wait(60), "the other thread never ran"
        if self.fail:
            raise _Boom("after the other thread ran")
        return h + 1


@pytest.mark.parametrize("fail", [False, True], ids=["returns", "raises"])
def test_compiled_code_in_another_thread_runs_eagerly_during_a_trace(fail):
    """The compiler stance is process-wide (torch keeps it in one module global, read by every
    compiled call from any thread; no per-thread stance exists in torch 2.13), so while a trace
    runs, a compiled function called from another thread runs its eager Python: right values, no
    compiled graph, not recorded in the trace. When the trace ends, also by raising, the stance
    is back and the function runs compiled again, without recompiling."""
    backend = _CountingBackend()
    fn = torch.compile(_scaled_sin, backend=backend)
    x = torch.ones(2, 3)
    expected = _scaled_sin(x)
    fn(x)
    compiled, runs = backend.compiled, backend.runs
    assert (compiled, runs) == (1, 1)
    inside, done = threading.Event(), threading.Event()
    seen = {}

    def other_thread():
        assert inside.wait(60)
        try:
            seen["out"] = fn(x)
            seen["counts"] = (backend.compiled, backend.runs)
        finally:
            done.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    model = _WaitsForAnotherThread(inside, done, fail)
    try:
        if fail:
            with pytest.raises(_Boom):
                torchlens.trace(model, x)
        else:
            tr = torchlens.trace(model, x)
            names = [op.name for op in tr.ops]
            assert (
                "linear" in names and "sin" not in names
            )  # the other thread's ops are not this trace's
    finally:
        done.set()
        worker.join(60)
    assert seen["counts"] == (compiled, runs), (
        "during the trace the other thread ran the compiled graph"
    )
    torch.testing.assert_close(seen["out"], expected)
    fn(x)
    assert (backend.compiled, backend.runs) == (
        compiled,
        runs + 1,
    )  # compiled again after the trace
    assert_nothing_left(model)


def test_compiled_module_whose_ops_stay_hidden_raises_capture_error():
    """Where compiled code runs without the capture seeing it (the stance cannot be set), the
    trace is refused instead of having a hole. Simulated by an in-place-compiled module whose
    compiled call hides its ops from torch function modes."""
    sub = _Sub()

    def hidden_call(*args, **kwargs):
        with torch._C.DisableTorchFunction():
            return sub._call_impl(*args, **kwargs)

    sub._compiled_call_impl = hidden_call
    model = nn.Sequential(nn.Linear(3, 3), sub)
    with pytest.raises(CaptureError) as info:
        torchlens.trace(model, torch.ones(1, 3))
    msg = str(info.value)
    assert "'1' is compiled" in msg and "_orig_mod" in msg and "force_eager" in msg, msg
    assert_nothing_left(model)


# ----------------------------------------------------------------------------------------------
# TorchFunctionMode effects
# ----------------------------------------------------------------------------------------------


def test_fused_fast_path_is_disabled_under_the_mode():
    """nn.TransformerEncoderLayer's fused fast path is skipped while a torch function mode is
    active: the trace records the slow path's ops; outputs agree to float rounding."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        d_model=8, nhead=2, dim_feedforward=16, batch_first=True
    ).eval()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fast = layer(x)
        tr = torchlens.trace(layer, x)
    names = [op.name for op in tr.ops]
    assert "multi_head_attention_forward" in names and "layer_norm" in names
    torch.testing.assert_close(tr.output, fast, rtol=1e-5, atol=1e-5)


def test_in_place_write_unseen_by_the_mode_warns():
    class Sneaky(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            y = self.lin(x)
            with torch._C.DisableTorchFunction():  # the mode does not see this write
                y.add_(1)
            return y * 2

    model = Sneaky()
    with (
        torch.no_grad()
    ):  # ground truth from outside TorchLens: the linear's output, and after the write
        before = model.lin(torch.ones(1, 3))
    with pytest.warns(
        UserWarning,
        match=r"could not see, or as a sparse tensor, .* \(#1 linear\); they are not kept",
    ):
        tr = torchlens.trace(model, torch.ones(1, 3))
    assert tr.ops[1].name == "linear"
    assert tr.ops[1].tensors == (
        None,
    )  # its saved alias shows before + 1: not the value the op returned
    written = next(op for op in tr.ops if op.name == "written_in_place")
    assert written.inputs[0].op == 1
    torch.testing.assert_close(written.tensors[0], before + 1, rtol=0, atol=0)  # what `y * 2` read
    torch.testing.assert_close(tr.output, (before + 1) * 2, rtol=0, atol=0)
    # the module's output is that dropped value: refused with the reason, never "not saved"
    facets = tr.modules["lin"].calls[0].facets
    assert (
        "written in place after it ran by code the capture could not see"
        in facets.refused["output"]
    )
    with pytest.raises(torchlens.FacetNotFound, match="saving more cannot bring it back"):
        facets["output"]


def test_an_in_place_write_given_its_tensor_by_keyword_is_seen():
    """`nn.init.uniform_(h)` hands `h` on to the torch function as a keyword (`tensor=h`): the
    write is seen as one into `h`, so the linear's saved output is copied first and served as
    the op returned it (ground truth: a plain forward hook's clone), with no warning."""

    class Init(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

        def forward(self, x):
            h = self.a(x)
            nn.init.uniform_(h)
            return self.b(h)

    model, x = Init(), torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    seen = []
    handle = model.a.register_forward_hook(lambda m, a, o: seen.append(o.detach().clone()))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "written by code the capture could not see"
            tr = torchlens.trace(model, x)
    finally:
        handle.remove()
    torch.testing.assert_close(tr["a:output"], seen[0], rtol=0, atol=0)
    assert any(op.name == "uniform_" and op.mutated for op in tr.ops)


# ----------------------------------------------------------------------------------------------
# save= and lookups: errors that suggest
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "save,suggested",
    [
        (["resid_pst"], "'resid_post'"),
        ("resid_pst", "'resid_post'"),
        (["transformer.h.9"], "'transformer.h.1'"),
        (["transformer.h.0", "transformer.h.1.atn"], "'transformer.h.1.attn'"),
        (["patern"], "'pattern'"),
    ],
)
def test_save_matching_nothing_names_close_matches(save, suggested):
    before = hook_state(gpt2())
    with pytest.raises(SaveSpecError) as info:
        torchlens.trace(gpt2(), IDS, save=save)
    msg = str(info.value)
    assert "Did you mean" in msg and suggested in msg, msg
    assert isinstance(info.value, ValueError) and isinstance(info.value, TorchLensError)
    assert_nothing_left(gpt2(), before)


def test_save_selection_kept_nothing_lists_what_exists():
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    for save in (["pattern"], "resid_post", lambda address, facet: False):
        with pytest.raises(SaveSpecError) as info:
            torchlens.trace(model, torch.ones(1, 3), save=save)
        msg = str(info.value)
        assert "kept nothing" in msg and "Facets that exist here: input, output" in msg, msg
    assert_nothing_left(model)


@pytest.mark.parametrize(
    "save", [3, 2.5, {"transformer.h.0": True}, b"all", [3], ["all"], object()], ids=repr
)
def test_save_of_a_wrong_type_lists_what_is_accepted(save):
    with pytest.raises(SaveSpecError) as info:
        torchlens.trace(gpt2(), IDS, save=save)
    msg = str(info.value)
    if save == ["all"]:
        assert "on its own" in msg
    else:
        assert (
            "save= accepts 'all', 'none', a module address or facet name" in msg
            and "predicate" in msg
        ), msg
    assert_nothing_left(gpt2())


@functools.cache
def gpt2_trace() -> torchlens.Trace:
    return torchlens.trace(gpt2(), IDS)


@pytest.mark.parametrize(
    "address,facet,suggested",
    [
        ("transformer.h.0", "resid_pst", "'resid_post'"),
        ("transformer.h.1.attn", "patern", "'pattern'"),
        ("transformer.ln_f", "inv_sd", "'inv_std'"),
    ],
)
def test_unknown_facet_names_close_matches(address, facet, suggested):
    facets = gpt2_trace().modules[address].facets
    for lookup in (lambda: facets[facet], lambda: facets.site(facet)):
        with pytest.raises(FacetNotFound) as info:
            lookup()
        msg = str(info.value)
        assert "Did you mean" in msg and suggested in msg and "Its facets are:" in msg, msg
        assert isinstance(info.value, KeyError)
    assert facet not in facets


def test_facet_that_exists_elsewhere_and_module_that_never_ran():
    with pytest.raises(FacetNotFound) as info:
        gpt2_trace().modules["transformer.h.0.mlp"].facets["pattern"]
    assert "the mlp module 'transformer.h.0.mlp' has no facet 'pattern'" in str(info.value)

    class Partly(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(2, 2)
            self.unused = nn.Linear(2, 2)

        def forward(self, x):
            return self.used(x)

    tr = torchlens.trace(Partly(), torch.ones(1, 2))
    assert tr.modules["unused"].calls == [] and len(tr.modules["unused"].facets) == 0
    with pytest.raises(FacetNotFound) as info:
        tr.modules["unused"].facets["output"]
    assert "did not run in this forward pass" in str(info.value)


@pytest.mark.parametrize(
    "address,suggested",
    [
        ("transformer.h.9", "'transformer.h.1'"),
        ("transformer.h.0.atn", "'transformer.h.0.attn'"),
        ("lm_haed", "'lm_head'"),
    ],
)
def test_unknown_module_address_close_matches(address, suggested):
    with pytest.raises(ModuleNotFoundInTrace) as info:
        gpt2_trace().modules[address]
    msg = str(info.value)
    assert "Did you mean" in msg and suggested in msg, msg
    assert isinstance(info.value, KeyError) and isinstance(info.value, TorchLensError)
    assert address not in gpt2_trace().modules


def test_non_string_module_address_is_refused():
    with pytest.raises(ModuleNotFoundInTrace) as info:
        gpt2_trace().modules[3]
    assert "module addresses are strings" in str(info.value) and "e.g. ['', " in str(info.value)


# ----------------------------------------------------------------------------------------------
# Memory
# ----------------------------------------------------------------------------------------------


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.fixture(scope="module")
def gpt2_small():
    """GPT-2 small's shape (12 layers, d_model 768, 12 heads), random init, built once."""
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12)
    ).eval()
    ids = torch.randint(
        0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0)
    )
    return model, ids


def _saved_tensors(tr: torchlens.Trace) -> list[Tensor]:
    out = [t for op in tr.ops for t in op.tensors if t is not None]
    out += [
        s.tensor
        for r in tr.modules.values()
        for c in r.calls
        for s in c.facets.sites.values()
        if s.tensor is not None
    ]
    return out


@contextlib.contextmanager
def _cycle_collector_off():
    """The cycle collector off (after a collection) inside the block, on again after it."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _assert_all_dead(refs: list[weakref.ref]) -> None:
    alive = sum(r() is not None for r in refs)
    assert alive == 0, f"{alive} of {len(refs)} objects still alive"


def test_trace_freed_without_cycle_collection(gpt2_small):
    """The Trace and every tensor it saved die as soon as the last reference goes, with the
    cycle collector off: no reference cycle keeps a trace alive until the next collection."""
    model, ids = gpt2_small
    with _cycle_collector_off():
        tr = torchlens.trace(model, ids)
        saved = _saved_tensors(tr)
        assert len(saved) > 500
        refs = [weakref.ref(tr)] + [weakref.ref(t) for t in saved]
        del tr, saved
        _assert_all_dead(refs)
    assert_nothing_left(model)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "autograd on"])
def test_a_trace_dropped_unread_frees_its_tensors_without_cycle_collection(grad):
    """A trace dropped before anything is read from it (its derived facets' checks still pending,
    with autograd on its guarded outputs still unresolved) frees every tensor it holds at once,
    with the cycle collector off: neither a pending check nor a guard keeps a reference cycle
    with the sites and ops it serves (their memory used to wait for the collector's next pass
    over cycles, 82 MiB of GPT-2 small at 128 tokens under no_grad, 172 MiB with autograd on)."""
    from torchlens._core.holdings import trace_holdings

    model = testing.build("gpt2")
    with _cycle_collector_off():
        with torch.set_grad_enabled(grad):
            tr = torchlens.trace(model, IDS, save="all")
        assert tr.pending > 0, "no check is pending: the test needs some"
        held = [h.tensor for h in trace_holdings(tr)]  # reads nothing: runs no check, no guard
        assert len(held) > 100
        refs = [weakref.ref(tr)] + [weakref.ref(t) for t in held if t is not IDS]
        del tr, held
        _assert_all_dead(refs)
    assert_nothing_left(model)


@pytest.mark.parametrize("save", ["all", "none", ["resid_post"]], ids=str)
def test_trace_does_not_keep_the_model_alive(save):
    model = testing.build("gpt2")
    tr = torchlens.trace(model, IDS, save=save)
    model_ref = weakref.ref(model)
    del model
    gc.collect()
    assert model_ref() is None  # the trace is alive, the model is gone
    assert len(tr.ops) > 50 and tr.output.logits.shape == (1, 6, testing.VOCAB)
    trace_ref = weakref.ref(tr)
    del tr
    gc.collect()
    assert trace_ref() is None


@pytest.mark.parametrize("grad", [True, False], ids=["autograd on", "no_grad"])
def test_deepcopy_of_a_trace_holds_the_forwards_values_on_its_own(grad):
    """`copy.deepcopy(trace)` works in both grad modes (with autograd on the output holds tensors
    autograd computed, which torch refuses to deep-copy): the copy's output and facets are the
    plain forward's and forward hooks', and writing into the copy leaves the trace as it was."""
    import copy

    model = testing.build("gpt2")
    block = "transformer.h.1"
    kept = []
    handle = model.get_submodule(block).register_forward_hook(
        lambda m, a, o: kept.append((o[0] if isinstance(o, tuple) else o).detach().clone())
    )
    try:
        with torch.no_grad():
            logits = model(IDS).logits
    finally:
        handle.remove()
    with torch.set_grad_enabled(grad):
        tr = torchlens.trace(model, IDS, save=lambda address, facet: facet == "resid_post")
    dup = copy.deepcopy(tr)
    assert dup.output.logits is not tr.output.logits
    assert torch.equal(dup.output.logits.detach(), logits)
    assert torch.equal(dup[f"{block}:resid_post"], kept[0])
    with torch.no_grad():
        dup.output.logits.zero_()
        dup[f"{block}:resid_post"].zero_()
    assert torch.equal(tr.output.logits.detach(), logits)
    assert torch.equal(tr[f"{block}:resid_post"], kept[0])


def test_an_unread_traces_module_records_are_made_on_first_read_from_the_models_modules():
    """The records of a trace nobody has read are made on first read (`ModuleMap._deferred`): one
    per address the model's `named_modules` gives, with its class and every call of it, and the
    calls the finishing steps walk before that (`_every_call`) are the same calls."""
    model = testing.build("gpt2")
    tr = torchlens.trace(model, IDS, save=["resid_post"])
    unread = tr.modules._every_call()
    assert tr.modules._made is None  # nothing has read the map yet
    canonical: dict[int, str] = {}
    for addr, m in model.named_modules(remove_duplicate=False):
        canonical.setdefault(id(m), addr)
    by_class = {addr: type(m).__name__ for addr, m in model.named_modules()}
    assert list(tr.modules) == list(by_class)  # every module, in named_modules order
    assert {a: r.class_name for a, r in tr.modules.items()} == by_class
    assert {id(c) for c in unread} == {id(c) for r in tr.modules.values() for c in r.calls}
    for addr, rec in tr.modules.items():
        assert all(c.address == addr for c in rec.calls)
        assert [c.index for c in rec.calls] == list(range(len(rec.calls)))
    # a module the forward did not run has a record with no call (GPT-2's blocks all ran)
    assert all(tr.modules[f"transformer.h.{i}"].calls for i in range(model.config.n_layer))
    copy_of = pickle.loads(pickle.dumps(torchlens.trace(model, IDS, save="none")))
    assert list(copy_of.modules) == list(by_class)


def test_a_facet_site_has_no_instance_dictionary():
    """The garbage collector scans what a trace keeps for as long as it lives (a generation keeps
    one trace per step): a facet site is slotted, with no instance dictionary to scan besides."""
    model = testing.build("gpt2")
    tr = torchlens.trace(model, IDS, save="all")
    sites = [s for r in tr.modules.values() for c in r.calls for s in c.facets.sites.values()]
    assert len(sites) > 100
    assert not any(type(x) is dict for s in sites for x in gc.get_referents(s))


def test_repeated_traces_do_not_grow_rss(gpt2_small):
    model, ids = gpt2_small
    tr = torchlens.trace(model, ids)  # warm-up: allocator pools, op caches
    one_trace_mb = sum(t.numel() * t.element_size() for t in _saved_tensors(tr)) / 2**20
    assert one_trace_mb > 100
    del tr
    gc.collect()
    before = _rss_mb()
    for _ in range(3):
        tr = torchlens.trace(model, ids)
        del tr
        gc.collect()
    grown = _rss_mb() - before
    # a leaked trace per cycle would add ~3 * one_trace_mb
    assert grown < max(48.0, 0.25 * one_trace_mb), (
        f"RSS grew {grown:.0f} MB over 3 traces of {one_trace_mb:.0f} MB"
    )


def test_op_classification_cache_stays_bounded():
    """A process that meets ever new callables (a model re-created per request, a lambda per
    call) must not grow the op-classification cache without bound: after 10,000 fresh callables
    it holds at most its 4,096 entries, the first callables are no longer kept alive by it, and
    every answer is still right (name with one leading underscore removed; `name_` in place)."""
    from torchlens._core import ops as _ops

    first = []
    for i in range(10_000):

        def fn(*args):
            return None

        fn.__name__ = [f"_op{i}", f"op{i}_", "size"][i % 3]
        if i < 10:
            first.append(weakref.ref(fn))
        name, kind = _ops.classify(fn)
        expected = [(f"op{i}", _ops.PLAIN), (f"op{i}_", _ops.INPLACE), ("size", _ops.SKIP)][i % 3]
        assert (name, kind) == expected, (fn.__name__, name, kind)
        del fn
    gc.collect()
    assert all(ref() is None for ref in first), "the cache keeps the first callables alive"
    info = _ops._cached.cache_info()
    assert info.maxsize == 4096 and info.currsize <= 4096, info
    assert _ops.classify(torch.Tensor.add_) == ("add_", _ops.INPLACE)


def test_traces_share_the_immutable_parts_of_their_op_records():
    """Op records keep no object per op that another could stand for: every trace's `Ref(i, 0)`
    is one shared pair, and one-output ops of one shape share their `shapes` tuple (objects the
    garbage collector would otherwise scan for as long as each trace lives). The values are the
    ones the ops returned."""
    t1, t2 = torchlens.trace(gpt2(), IDS, save="none"), torchlens.trace(gpt2(), IDS, save="none")
    assert op_rows(t1) == op_rows(t2)
    for a, b in zip(t1.ops, t2.ops):
        for x, y in zip(a.inputs, b.inputs):
            if isinstance(x, Ref) and x.slot == 0:
                assert x is y and x == Ref(x.op, 0)
    single = [op.inputs for op in t1.ops if len(op.inputs) == 1 and isinstance(op.inputs[0], Ref)]
    assert single and all(  # an op reading op i's first output alone shares one inputs tuple
        len({id(i) for i in single if i == key}) == 1 for key in set(single) if key[0].slot == 0
    )
    one = [op for op in t1.ops if len(op.shapes) == 1]
    assert len({id(op.shapes) for op in one}) == len({op.shapes for op in one}) < len(one)
    with torch.no_grad():
        out = gpt2()(IDS, output_hidden_states=True)
    adds = [op for op in t1.ops if op.module == "transformer.h.0" and op.name == "add"]
    assert len(adds) == 2  # the block's two residual additions
    for op in adds:  # each shape is the one the op's output had
        assert op.shapes == (out.hidden_states[0].shape,) and type(op.shapes[0]) is torch.Size


# ----------------------------------------------------------------------------------------------
# The garbage collector, paused for the call
# ----------------------------------------------------------------------------------------------


def test_the_collector_is_off_during_the_trace_and_as_it_was_after():
    """Inside the traced forward no collector pass runs (a forward hook sees it off); after the
    trace, and after a nested trace inside a traced forward, it is on again; a collector the
    caller turned off stays off."""
    seen: list[bool] = []
    inner: list = []

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.sub = nn.Linear(3, 3)

        def forward(self, x):
            seen.append(gc.isenabled())
            if not inner:  # a trace inside the traced forward: the outer pause outlives it
                inner.append(torchlens.trace(self.sub, x))
                seen.append(gc.isenabled())
            return self.lin(x)

    model, x = Outer(), torch.ones(1, 3)
    torchlens.trace(model, x)
    assert seen == [False, False]
    assert_nothing_left(model)
    gc.disable()
    try:
        torchlens.trace(model, x)
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert seen == [False, False, False]


def test_the_collector_is_on_again_when_the_forward_raises():
    model = _Flaky().eval()
    model.stages[1].fail, model.stages[1].exc = "raise", _Boom("boom")
    with pytest.raises(_Boom):
        torchlens.trace(model, torch.ones(2, 3))
    assert_nothing_left(model)


def test_the_collector_gets_the_state_the_first_trace_found_when_the_forward_switches_it():
    """The caller's state comes back both ways, whatever the forward did to the one switch."""

    class Switch(nn.Module):
        def __init__(self, to: bool):
            super().__init__()
            self.to, self.lin = to, nn.Linear(2, 2)

        def forward(self, x):
            (gc.enable if self.to else gc.disable)()
            return self.lin(x)

    torchlens.trace(Switch(False), torch.ones(1, 2))
    assert gc.isenabled()
    gc.disable()
    try:
        torchlens.trace(Switch(True), torch.ones(1, 2))
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert_nothing_left()


def test_traces_in_two_threads_share_one_pause_the_last_one_out_ends():
    """Thread A's trace enters, then thread B's; A returns first: the collector stays off while
    B's trace runs, and is on once B's returns."""
    b_entered, a_done, b_go = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    class Wait(nn.Module):
        def __init__(self, who: str):
            super().__init__()
            self.who, self.lin = who, nn.Linear(2, 2)

        def forward(self, x):
            if self.who == "a":
                assert b_entered.wait(30)
            else:
                b_entered.set()
                assert b_go.wait(30)
                seen["b, after a returned"] = gc.isenabled()
            return self.lin(x)

    errors: list = []

    def run(who):
        try:
            torchlens.trace(Wait(who), torch.ones(1, 2))
        except BaseException as e:  # reported below
            errors.append(e)
        finally:
            b_entered.set()

    b = threading.Thread(target=run, args=("b",))
    a = threading.Thread(target=run, args=("a",))
    a.start()
    b.start()
    a.join(30)
    a_done.set()
    seen["between"] = gc.isenabled()
    b_go.set()
    b.join(30)
    assert not errors, errors
    assert seen == {"between": False, "b, after a returned": False}
    assert_nothing_left()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX")
def test_a_process_forked_while_another_thread_traces_has_the_collector_on():
    """The tracing thread does not exist in the child, so its trace never returns there: the
    child gets the collector's state back at the fork (`collector._after_fork_in_child`)."""
    inside, done = threading.Event(), threading.Event()

    class Hold(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            inside.set()
            assert done.wait(30)
            return self.lin(x)

    t = threading.Thread(target=lambda: torchlens.trace(Hold(), torch.ones(1, 2)))
    t.start()
    try:
        assert inside.wait(30)
        assert not gc.isenabled()  # the other thread's trace is running
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report and leave at once, running nothing else
            os.write(write, b"1" if gc.isenabled() and not collector._DEPTHS else b"0")
            os._exit(0)
        os.close(write)
        reported = os.read(read, 1)
        os.close(read)
        os.waitpid(pid, 0)
    finally:
        done.set()
        t.join(30)
    assert reported == b"1"
    assert_nothing_left()
