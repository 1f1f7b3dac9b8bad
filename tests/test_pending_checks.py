"""The checks a lazily computed facet waits on: each test takes its ground truth from outside
TorchLens (eager `output_attentions`, forward hooks that clone, recomputation by hand).

- A tensor written after the trace (e.g. in place into a served facet) is never what a lazily
  computed facet is computed from: the facet is refused with the reason.
- A pending check runs with autocast off, whatever the reader's context; a fused kernel run
  under autocast is rebuilt in the dtype it computed in.
- A check that raises refuses its facet; `check` and `save` do not raise.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from fixtures.seeded import IDS, hooked, seeded_gpt2

import torchlens as tl
from torchlens._capture import snapshot, step_copies
from torchlens._core.holdings import Holding

# -- writes after the trace ----------------------------------------------------------------------


def test_write_into_served_resid_pre_refuses_norm_stats_not_serves_halved_ones():
    model = seeded_gpt2(initializer_range=0.5)
    x, _ = hooked(model, "transformer.h.0.ln_1", IDS)
    true_inv = torch.rsqrt(
        x.double().var(-1, unbiased=False, keepdim=True) + model.config.layer_norm_epsilon
    )
    t = tl.trace(model, IDS)
    fm = t.modules["transformer.h.0.ln_1"].facets
    t["transformer.h.0:resid_pre"].mul_(2.0)  # the caller writes into a tensor it was served
    with pytest.raises(tl.FacetNotFound, match="written after the trace returned.*trace.check"):
        fm["inv_std"]
    assert "inv_std" in fm.refused and "scale" in fm.refused
    # The same read before the write serves the traced value.
    t2 = tl.trace(model, IDS)
    fm2 = t2.modules["transformer.h.0.ln_1"].facets
    inv = fm2["inv_std"]
    t2["transformer.h.0:resid_pre"].mul_(2.0)
    assert torch.allclose(inv.double(), true_inv, atol=1e-5)


def test_constant_shift_of_served_k_refuses_scores_instead_of_serving_shifted_ones():
    model = seeded_gpt2(use_cache=False)
    t = tl.trace(model, IDS, use_cache=False)
    attn = "transformer.h.0.attn"
    q, k = t[attn + ":q"].clone(), t[attn + ":k"].clone()
    by_hand = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    t[attn + ":k"].add_(
        torch.randn(k.shape[-1])
    )  # shifts each score row by a constant: the pattern is unchanged
    fm = t.modules[attn].facets
    with pytest.raises(tl.FacetNotFound, match="written after the trace returned"):
        fm["scores"]
    assert "pattern" in fm.refused
    t2 = tl.trace(model, IDS, use_cache=False)
    assert torch.allclose(t2[attn + ":scores"].tril(), by_hand.tril(), atol=1e-5)


def test_zeroing_a_head_of_served_z_refuses_result_with_the_write_as_reason():
    model = seeded_gpt2()
    t = tl.trace(model, IDS)
    attn = "transformer.h.0.attn"
    t[attn + ":z"][:, 1].zero_()
    fm = t.modules[attn].facets
    assert "written after the trace returned" in t.check()[(attn, 0, "result")]
    assert "dropout" not in fm.refused["result"]


def test_write_into_an_inference_tensor_is_caught_too():
    model = seeded_gpt2(initializer_range=0.5)
    with torch.inference_mode():
        t = tl.trace(model, IDS)
        r = t["transformer.h.0:resid_pre"]
        assert r.is_inference()  # no version counter to read
        r.mul_(2.0)
    with pytest.raises(tl.FacetNotFound, match="written after the trace returned"):
        t["transformer.h.0.ln_1:inv_std"]


class _SplitHead(torch.nn.Module):
    """A linear layer whose output the model returns and whose first half a LayerNorm reads: the
    norm's input is a view of a tensor the caller holds (`trace.output[0]`), so the trace keeps
    copies, and the linear layer's served output is another view of the same copied storage."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 16)
        self.ln = torch.nn.LayerNorm(8)

    def forward(self, x):
        h = self.lin(x)
        a, b = h.split(8, dim=-1)
        return h, self.ln(a) + b


def _split_head() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The model, an input, and the norm's inv_std recomputed from a hook's clone of its input."""
    torch.manual_seed(0)
    model = _SplitHead().eval()
    with torch.no_grad():
        model.lin.bias.add_(3.0)
    x = torch.randn(3, 8)
    got = {}
    h = model.ln.register_forward_hook(
        lambda mod, i, o: got.setdefault("in", i[0].detach().clone())
    )
    with torch.no_grad():
        model(x)
    h.remove()
    a = got["in"].double()
    return model, x, torch.rsqrt(a.var(-1, unbiased=False, keepdim=True) + model.ln.eps)


@pytest.mark.parametrize("store", [None, "cpu", "dir"])
def test_a_write_into_a_served_view_of_a_copied_storage_is_caught(store, tmp_path):
    """The norm's input shares storage with `trace.output[0]`, so the trace holds copies (the
    snapshot's, then the store's); a write into another view of that copy (the linear layer's
    served output) must refuse the norm's facets, while a write into the caller's own output
    must not touch what they are computed from. Fails if the copies are made with `set_` (each
    view with a version counter of its own)."""
    model, x, true_inv = _split_head()
    where = tmp_path / "store" if store == "dir" else store
    t = tl.trace(model, x, store=where)
    served = t.modules["lin"].facets["output"]
    assert served.untyped_storage().data_ptr() != t.output[0].untyped_storage().data_ptr()  # a copy
    t.output[0].mul_(-5.0)  # the caller's own tensor: not what the trace keeps
    t2 = tl.trace(model, x, store=tmp_path / "store2" if store == "dir" else store)
    t2.output[0].zero_()
    assert torch.allclose(t2.modules["ln"].facets["inv_std"].double(), true_inv, atol=1e-5)
    served[:, :8].mul_(2.0)  # the caller writes into a tensor it was served
    fm = t.modules["ln"].facets
    with pytest.raises(tl.FacetNotFound, match="written after the trace returned"):
        fm["inv_std"]
    assert "normalized" in fm.refused


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="store='cpu' moves only accelerator tensors"
)
def test_a_write_into_a_cpu_stored_view_is_caught_on_an_accelerator():
    """`store="cpu"` copies accelerator storages to host memory: the views placed on one host
    copy share one version counter, so a write through one of them refuses what reads another."""
    model, x, true_inv = _split_head()
    model, x = model.cuda(), x.cuda()
    t = tl.trace(model, x, store="cpu")
    assert torch.allclose(t.modules["ln"].facets["inv_std"].double().cpu(), true_inv, atol=1e-5)
    t = tl.trace(model, x, store="cpu")
    served = t.modules["lin"].facets["output"]
    assert served.device.type == "cpu"
    served[:, :8].mul_(2.0)
    with pytest.raises(tl.FacetNotFound, match="written after the trace returned"):
        t.modules["ln"].facets["inv_std"]


def _int32_op_outputs(t) -> list[torch.Tensor]:
    """The int32 op outputs the trace keeps."""
    return [op.tensor for op in t.ops if op.tensor is not None and op.tensor.dtype == torch.int32]


def _write_through_is_caught(bits: torch.Tensor, norm_facets) -> None:
    """A write into `bits` (an int32 view of the norm's input memory) refuses its derived facet."""
    bits[0, 0].add_(1 << 20)  # changes the float bits the norm's input holds
    with pytest.raises(tl.FacetNotFound, match="written after the trace returned"):
        norm_facets["inv_std"]


def test_a_write_through_another_dtype_of_a_copied_storage_is_caught():
    """Tensors of one storage held in two dtypes get a version counter each once copied: the
    check falls back to a fingerprint of its input's values, so a write through the other dtype
    is still caught."""

    class Bits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = torch.nn.LayerNorm(8)

        def forward(self, x):
            return x.view(torch.int32), self.ln(x)  # the caller holds x's storage as int32 too

    torch.manual_seed(0)
    model, x = Bits().eval(), torch.randn(3, 8)
    t = tl.trace(model, x)
    ints = _int32_op_outputs(t)
    assert ints, "the trace keeps the int32 view"
    _write_through_is_caught(ints[0], t.modules["ln"].facets)


def test_a_write_through_another_dtype_that_only_an_op_holds_is_caught():
    """As above, with the other dtype held by an op output alone (no facet holds it): the op's
    recorded dtype puts its storage among those looked up."""

    class Stash(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = torch.nn.LayerNorm(8)

        def forward(self, x):
            self.bits = x.view(torch.int32)  # kept on the module: the caller can reach it
            return self.ln(x)

    torch.manual_seed(0)
    model, x = Stash().eval(), torch.randn(3, 8)
    t = tl.trace(model, x)
    fm = t.modules["ln"].facets
    assert all(s.dtype != torch.int32 for s in fm.sites.values())  # metadata: runs no check
    ints = _int32_op_outputs(t)
    assert ints, "the trace keeps the int32 view as an op output"
    _write_through_is_caught(ints[0], fm)


def test_a_write_through_another_dtype_that_only_a_facet_holds_is_caught():
    """As above, with the other dtype held by a facet alone (the input the hook kept of a module
    `save=` selects, read from a buffer's memory through a view no kept op holds): facets' own
    tensors are looked at too."""

    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = torch.nn.LayerNorm(8)

        def forward(self, bits, x):
            return self.ln(x), bits

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("b", torch.randn(3, 8))
            self.inner = Inner()

        def forward(self, y):
            return self.inner(self.b.view(torch.int32), self.b)[0] + y

    torch.manual_seed(0)
    model = Outer().eval()
    t = tl.trace(model, torch.zeros(3, 8), save=["inner"])
    bits = t.modules["inner"].facets["input"]
    assert bits.dtype == torch.int32
    assert not _int32_op_outputs(t)
    _write_through_is_caught(bits, t.modules["inner.ln"].facets)


def test_check_before_the_write_keeps_every_facet():
    model = seeded_gpt2()
    t = tl.trace(model, IDS)
    assert t.check() == {}
    t["transformer.h.0:resid_pre"].mul_(2.0)
    t["transformer.h.0.attn:q"].zero_()
    assert t.check() == {}
    assert t.modules["transformer.h.0.ln_1"].facets["normalized"] is not None


# -- autocast ------------------------------------------------------------------------------------


def test_read_under_autocast_serves_what_a_read_outside_serves():
    model = seeded_gpt2(initializer_range=0.5)
    attn = "transformer.h.0.attn"
    ref = tl.trace(model, IDS)
    want = {f: ref[f"{attn}:{f}"] for f in ("pattern", "result")}
    want["normalized"] = ref["transformer.h.0.ln_1:normalized"]
    t = tl.trace(model, IDS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = {f: t[f"{attn}:{f}"] for f in ("pattern", "result")}
        got["normalized"] = t["transformer.h.0.ln_1:normalized"]
    assert t.check() == {}
    for f, w in want.items():
        assert got[f].dtype == torch.float32
        assert torch.equal(got[f], w), f


def test_a_check_that_raises_refuses_and_check_and_save_do_not_raise(monkeypatch, tmp_path):
    from torchlens._analysis.facets import attention as _attention

    def broken(*a, **kw):
        raise RuntimeError("shape '[32, 2, 8]' is invalid for input of size 1024")

    monkeypatch.setattr(_attention, "_per_head_weight", broken)
    t = tl.trace(seeded_gpt2(), IDS)
    refused = t.check()
    assert (
        "could not be computed: RuntimeError: shape"
        in refused[("transformer.h.0.attn", 0, "result")]
    )
    with pytest.warns(
        UserWarning, match=r"could not store 1 value.*DynamicCache"
    ):  # the KV cache is no tensor
        t.save(tmp_path / "t")
    assert "result" not in tl.load(tmp_path / "t").modules["transformer.h.0.attn"].facets


def test_a_fused_kernel_run_under_autocast_is_rebuilt_in_the_dtype_it_computed_in():
    # Llama's RoPE returns a float32 query and key next to a bfloat16 value; autocast casts all
    # three to bfloat16 for the kernel. The rebuild must do the same, not refuse (or upcast).
    from torchlens import testing

    sdpa, eager = testing.build("llama", "sdpa"), testing.build("llama", "eager")
    ids = testing.token_ids(batch=2)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        t = tl.trace(sdpa, ids)
        ref = eager(ids, output_attentions=True).attentions
    kernel = next(op for op in t.ops if op.name == "scaled_dot_product_attention")
    assert {a.dtype for a in kernel.extra["args"][:3]} == {
        torch.float32,
        torch.bfloat16,
    }  # the case at hand
    for i, a in enumerate(t.by_role("attention")):
        facets = t.modules[a].facets
        assert "pattern" in facets and not facets.refused, facets.refused
        assert facets.sites["pattern"].dtype == facets["pattern"].dtype == torch.bfloat16
        torch.testing.assert_close(facets["pattern"].float(), ref[i].float(), rtol=0, atol=1e-2)


# -- weights the pending checks read, shared between traces while they hold the same bits ------


def _result_by_hand(z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """GPT-2's per-head attention result (`[batch, pos, head, d_model]`) from the traced z
    (`[batch, head, pos, d_head]`, as its attention computed it) and the output projection's
    weight as it was (`Conv1D`: `x @ w`): head h's slice of w's rows."""
    d_head = z.shape[-1]
    return torch.stack(
        [z[:, h] @ w[h * d_head : (h + 1) * d_head] for h in range(z.shape[1])], dim=2
    )


def _weight_inputs(t, attn: str) -> list[torch.Tensor]:
    """The copies of the output projection's weight the pending `result` check of `attn` holds."""
    site = t.modules[attn].facets._sites["result"]
    assert site._inputs is not None  # not read yet
    return [x for x in site._inputs if isinstance(x, torch.Tensor) and x.shape == (32, 32)]


def test_traces_alive_together_share_the_weight_copy_a_check_reads():
    """Two traces of an unchanged model hold one copy of the weight their pending checks read (the
    steps of a generation each used to hold their own), and both serve the value recomputed by
    hand from the weight."""
    model = seeded_gpt2()
    attn = "transformer.h.1.attn"
    w = model.transformer.h[1].attn.c_proj.weight.detach().clone()
    t1, t2 = tl.trace(model, IDS), tl.trace(model, IDS)
    (c1,), (c2,) = _weight_inputs(t1, attn), _weight_inputs(t2, attn)
    assert c1 is c2 and c1.data_ptr() != w.data_ptr()
    assert c1.data_ptr() != model.transformer.h[1].attn.c_proj.weight.data_ptr()
    for t in (t1, t2):
        expected = _result_by_hand(t[attn + ":z"].double(), w.double())
        assert torch.allclose(t[attn + ":result"].double(), expected, atol=1e-5)


@pytest.mark.parametrize("compare", ["memcmp", "numpy", "torch.equal"])
@pytest.mark.parametrize("how", ["in place", "through .data", "-0.0 for 0.0", "its last element"])
def test_a_weight_changed_between_traces_gets_a_copy_of_its_own(how, compare, monkeypatch):
    """A weight changed between two traces, even where no version counter sees it (`.data`), or
    only in its bits (a zero's sign), is copied again: each trace's derived facet is computed from
    the weight its own forward read, checked against the same recomputation by hand (a change to its
    last element alone, through `.data`, is seen: every byte is compared). Every way the
    bits are compared (the C library's memcmp for contiguous CPU tensors; else numpy from
    `_NUMPY_FROM` elements, `torch.equal` below) is run."""
    if compare == "memcmp":
        assert snapshot._memcmp is not None, "memcmp loads on the platforms the tests run on"
    else:
        monkeypatch.setattr(snapshot, "_memcmp", None)
    monkeypatch.setattr(snapshot, "_NUMPY_FROM", 0 if compare == "numpy" else 1 << 62)
    model = seeded_gpt2()
    attn = "transformer.h.1.attn"
    weight = model.transformer.h[1].attn.c_proj.weight
    if how == "-0.0 for 0.0":
        with torch.no_grad():
            weight[0, 0] = 0.0
    before = weight.detach().clone()
    t1 = tl.trace(model, IDS)
    with torch.no_grad():
        if how == "in place":
            weight.mul_(0.5)
        elif how == "through .data":
            version = weight._version
            weight.data.mul_(0.5)
            assert weight._version == version  # the counter did not move
        elif how == "its last element":
            weight.data[-1, -1] += 1.0
        else:
            weight[0, 0] = -0.0
    after = weight.detach().clone()
    t2 = tl.trace(model, IDS)
    (c1,), (c2,) = _weight_inputs(t1, attn), _weight_inputs(t2, attn)
    assert c1 is not c2
    assert torch.equal(c1.view(torch.int32), before.view(torch.int32))
    assert torch.equal(c2.view(torch.int32), after.view(torch.int32))
    for t, w in ((t1, before), (t2, after)):
        expected = _result_by_hand(t[attn + ":z"].double(), w.double())
        assert torch.allclose(t[attn + ":result"].double(), expected, atol=1e-5)


def test_the_weight_copies_one_trace_makes_share_one_block(monkeypatch):
    """The weights a trace's pending checks read that no alive trace has copied are copied into
    one new block of memory (one per dtype), each a multiple of 64 bytes after the last, with the
    weight's exact bits. A later trace that finds one weight changed reuses nothing of that block
    (its copy of the changed weight is stale, and reusing the rest would keep it alive): it copies
    every weight into a block of its own, and serves the values recomputed by hand once the first
    trace is gone. (The seeded model's weights are small: every one goes in the block here.)"""
    monkeypatch.setattr(snapshot, "_BLOCK_FROM", 0)
    model = seeded_gpt2()
    attns = ["transformer.h.0.attn", "transformer.h.1.attn"]
    weights = [model.get_submodule(a).c_proj.weight for a in attns]
    t1 = tl.trace(model, IDS)
    (c0,), (c1,) = (_weight_inputs(t1, a) for a in attns)
    block = c0.untyped_storage().data_ptr()
    assert c1.untyped_storage().data_ptr() == block
    assert (c1.data_ptr() - c0.data_ptr()) % 64 == 0
    for c, w in zip((c0, c1), weights):
        assert c.data_ptr() != w.data_ptr()
        assert torch.equal(c.view(torch.int32), w.detach().view(torch.int32))
    with torch.no_grad():
        weights[1].data.mul_(0.5)
    t2 = tl.trace(model, IDS)
    (d0,), (d1,) = (_weight_inputs(t2, a) for a in attns)
    assert d0 is not c0 and d1 is not c1
    assert d0.untyped_storage().data_ptr() == d1.untyped_storage().data_ptr() != block
    for d, w in zip((d0, d1), weights):
        assert torch.equal(d.view(torch.int32), w.detach().view(torch.int32))
    del t1, c0, c1
    for a, w in zip(attns, weights):
        expected = _result_by_hand(t2[a + ":z"].double(), w.detach().double())
        assert torch.allclose(t2[a + ":result"].double(), expected, atol=1e-5)


@pytest.mark.parametrize("view", ["conjugate", "negative"])
def test_views_of_one_weight_seen_two_ways_get_a_copy_each(view):
    """Two pending inputs on the same bytes, one read through a conjugate (or negative) view,
    are not one copy: each input's copy holds the values that input had."""
    w = torch.randn(4, 6, dtype=torch.complex64)
    a, b = (w, w.conj()) if view == "conjugate" else (w.imag, w.conj().imag)
    assert b.is_conj() or b.is_neg()  # the case at hand: a view, not a copy
    inputs = [a, b]
    expected = [a.clone(), b.resolve_conj().resolve_neg()]
    holdings = [Holding(inputs, i, t) for i, t in enumerate(inputs)]
    snapshot._share_copies([holdings])
    for got, want in zip(inputs, expected):
        assert torch.equal(got.resolve_conj().resolve_neg(), want)
        assert got.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()


def test_fresh_copies_take_one_block_per_dtype_and_clone_the_rest():
    """`_fresh_copies`: the contiguous CPU tensors of one dtype and `_BLOCK_FROM` bytes or more
    share one block, each starting a multiple of 64 bytes after the last; a smaller tensor, a
    non-contiguous one (its strides kept) and the only large one of its dtype are cloned alone."""
    floats = snapshot._BLOCK_FROM // 4
    a, b = torch.randn(floats + 1), torch.randn(2, floats // 2)
    small = torch.randn(7)
    half = torch.randn(floats * 2).to(torch.float16)
    strided = torch.randn(2, floats).t()
    given = (a, strided, b, small, half)
    out = snapshot._fresh_copies(list(given))
    assert [torch.equal(x, y) for x, y in zip(out, given)] == [True] * 5
    block = out[0].untyped_storage().data_ptr()
    assert out[2].untyped_storage().data_ptr() == block
    assert out[2].data_ptr() - out[0].data_ptr() == (floats + 1) * 4 + 60  # rounded up to 64
    assert out[1].stride() == strided.stride()
    for i in (1, 3, 4):
        assert out[i].untyped_storage().data_ptr() not in {
            block,
            *(t.untyped_storage().data_ptr() for t in given),
        }


def test_the_steps_of_a_generation_share_one_block_of_weight_copies(monkeypatch):
    """Every step of a generation reads the same weights, so the block of copies the first step
    makes serves every later one whole: one copy per weight for the generation, not one per step.
    (The seeded model's weights are small: every one goes in the block here.)"""
    monkeypatch.setattr(snapshot, "_BLOCK_FROM", 0)
    model = seeded_gpt2()
    attn = "transformer.h.1.attn"
    with torch.no_grad():
        gen = tl.trace_generate(model, IDS, max_new_tokens=4, do_sample=False, pad_token_id=0)
    copies = [_weight_inputs(step, attn)[0] for step in gen.steps]
    assert len(copies) == 4 and all(c is copies[0] for c in copies)
    assert copies[0].untyped_storage().nbytes() > copies[0].numel() * 4  # a view of a block


def _copies_of(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """What `_share_copies` puts in a pending input list holding `weights` (one storage each)."""
    inputs = list(weights)
    snapshot._share_copies([[Holding(inputs, i, w)] for i, w in enumerate(weights)])
    return inputs


def test_a_block_is_reused_whole_or_not_at_all():
    """Copies past `_BLOCK_FROM` (sizes that are not multiples of 64 bytes) made together are one
    block. A later call that reads every weight of the block gets the same copies back; one that
    reads only some of them gets new copies, so the block's other copies are not kept alive by it."""
    n = snapshot._BLOCK_FROM // 4 + 1
    weights = [torch.randn(n), torch.randn(n + 3), torch.randn(2 * n)]
    first = _copies_of(weights)
    assert len({c.untyped_storage().data_ptr() for c in first}) == 1
    again = _copies_of(weights)
    assert all(a is b for a, b in zip(again, first))
    part = _copies_of(weights[:2])
    assert all(a is not b for a, b in zip(part, first))
    assert all(torch.equal(c, w) for c, w in zip(part, weights))


def test_the_block_is_made_where_its_tensors_are():
    """`_fresh_copies` makes the block on its tensors' device, whatever the default device is."""
    n = snapshot._BLOCK_FROM // 4
    weights = [torch.randn(n), torch.randn(n)]
    with torch.device("meta"):
        out = snapshot._fresh_copies(weights)
    assert [c.device.type for c in out] == ["cpu", "cpu"]
    assert all(torch.equal(c, w) for c, w in zip(out, weights))


# -- within a generation: a copy compared or made by one step serves the next uncompared ---------


class _WriteAfterStep(transformers.LogitsProcessor):
    """Runs `write` between two forwards of a generation: after step `step`'s logits."""

    def __init__(self, step: int, write):
        self.calls, self.step, self.write = 0, step, write

    def __call__(self, input_ids, scores):
        if self.calls == self.step:
            self.write()
        self.calls += 1
        return scores


def _generate(model, **kwargs):
    with torch.no_grad():
        return tl.trace_generate(
            model,
            IDS,
            max_new_tokens=4,
            min_new_tokens=4,  # four steps whatever tokens come out (no early end of sequence)
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )


def _served_results(gen, attn: str) -> list:
    """Each step's `result` of `attn` as served: the tensor, or the refusal's reason."""
    out = []
    for step in gen.steps:
        refused = step.modules[attn].facets.check("result")
        out.append(refused["result"] if "result" in refused else step[attn + ":result"])
    return out


def test_the_steps_of_a_generation_compare_their_weight_copies_once_at_the_end(monkeypatch):
    """Between the steps of one generation nothing writes the weights: the first step copies them,
    no later step compares its copy bit for bit (the weights' counters have not moved and the
    recorder saw no write), and each copy is compared once, as `trace_generate` returns. Every
    step's `result` is still the value recomputed by hand from the weight."""
    model = seeded_gpt2()
    attn = "transformer.h.1.attn"
    w = model.transformer.h[1].attn.c_proj.weight.detach().clone()
    where: list[str] = []
    state = {"in": "steps"}
    same_bits, verify = snapshot._same_bits, step_copies.SharedWeights.verify

    def counted(a, b):
        where.append(state["in"])
        return same_bits(a, b)

    def verifying(self, steps):
        state["in"] = "verify"
        return verify(self, steps)

    monkeypatch.setattr(snapshot, "_same_bits", counted)
    monkeypatch.setattr(step_copies, "_same_bits", counted)
    monkeypatch.setattr(step_copies.SharedWeights, "verify", verifying)
    gen = _generate(model)
    assert len(gen.steps) == 4
    assert where and set(where) == {"verify"}
    copies = [_weight_inputs(step, attn)[0] for step in gen.steps]
    assert all(c is copies[0] for c in copies)
    for step, served in zip(gen.steps, _served_results(gen, attn)):
        expected = _result_by_hand(step[attn + ":z"].double(), w.double())
        assert torch.allclose(served.double(), expected, atol=1e-5)


@pytest.mark.parametrize("how", ["through .data", "in place"])
def test_a_weight_written_between_two_steps_is_never_served_for_the_later_steps_unseen(how):
    """A weight written between step 1 and step 2 (by a logits processor). In place, its counter
    moves, so step 2 compares its copy, finds it stale and copies again: steps 2 and 3 serve the
    `result` of the weight their forwards read (by hand), and step 1, which took step 0's copy
    uncompared, refuses, saying why: a write through `.data` before step 1 followed by this one
    would look the same, so whether step 1 read the weight before the change cannot be told.
    Through `.data`, which moves no counter, steps 1 to 3 took step 0's copy uncompared, and the
    comparison as `trace_generate` returns finds it stale: they refuse the same way. Step 0, whose
    copy was made from the weight as its forward left it, serves in both."""
    model = seeded_gpt2()
    attn = "transformer.h.1.attn"
    weight = model.transformer.h[1].attn.c_proj.weight
    before = weight.detach().clone()

    def write():
        with torch.no_grad():
            (weight.data if how == "through .data" else weight).mul_(0.5)

    gen = _generate(model, logits_processor=[_WriteAfterStep(1, write)])
    after = weight.detach().clone()
    assert not torch.equal(before, after)
    served = _served_results(gen, attn)
    assert len(served) == 4
    for i, (step, value) in enumerate(zip(gen.steps, served)):
        if i == 1 or (how == "through .data" and i >= 1):
            assert isinstance(value, str) and "changed during the generation" in value, value
            continue
        w = before if i < 2 else after
        expected = _result_by_hand(step[attn + ":z"].double(), w.double())
        assert torch.allclose(value.double(), expected, atol=1e-5)


def test_a_weight_written_inside_a_step_through_data_is_compared_at_that_step():
    """A forward pre-hook that halves a weight through `.data` at step 2 (no counter moves): the
    step's recorder sees the write into the weight's memory, so that step compares its copy, finds
    it stale and copies again; steps 2 and 3 serve the `result` of the halved weight (by hand)."""
    model = seeded_gpt2()
    attn = "transformer.h.1.attn"
    proj = model.transformer.h[1].attn.c_proj
    before = proj.weight.detach().clone()
    calls = {"n": 0}

    def halve(module, args):
        calls["n"] += 1
        if calls["n"] == 3:  # step 2's call
            module.weight.data.mul_(0.5)

    handle = proj.register_forward_pre_hook(halve)
    try:
        gen = _generate(model)
    finally:
        handle.remove()
    after = proj.weight.detach().clone()
    assert torch.equal(after, before * 0.5) and len(gen.steps) == 4
    for i, (step, value) in enumerate(zip(gen.steps, _served_results(gen, attn))):
        assert not isinstance(value, str), (i, value)
        w = before if i < 2 else after
        expected = _result_by_hand(step[attn + ":z"].double(), w.double())
        assert torch.allclose(value.double(), expected, atol=1e-5)


def test_a_copy_a_step_took_uncompared_is_judged_when_a_later_step_replaces_it():
    """A weight changed through `.data` after step 0 (no counter moves), then touched in place with
    its values unchanged after step 1 (its counter moves): step 1 took step 0's copy uncompared;
    step 2 compares, finds that copy stale and makes a new one. Step 1's read is judged as that
    copy is replaced: its check refuses, saying why, instead of serving the `result` of a weight
    its forward did not read; steps 2 and 3, which compared, serve their weight's (by hand)."""
    model = seeded_gpt2()
    attn = "transformer.h.1.attn"
    weight = model.transformer.h[1].attn.c_proj.weight
    before = weight.detach().clone()
    calls = {"n": 0}

    class Write(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            with torch.no_grad():
                if calls["n"] == 0:
                    weight.data[:8].mul_(1.5)  # no counter moves
                elif calls["n"] == 1:
                    weight.mul_(1.0)  # the counter moves, the values do not
            calls["n"] += 1
            return scores

    gen = _generate(model, logits_processor=[Write()])
    after = weight.detach().clone()
    assert not torch.equal(before, after)
    served = _served_results(gen, attn)
    assert len(served) == 4
    assert isinstance(served[1], str) and "changed during the generation" in served[1], served[1]
    for i in (0, 2, 3):
        w = before if i == 0 else after
        expected = _result_by_hand(gen.steps[i][attn + ":z"].double(), w.double())
        assert torch.allclose(served[i].double(), expected, atol=1e-5), i
