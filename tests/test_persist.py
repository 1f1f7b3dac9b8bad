"""Portable traces: `Trace.save` / `torchlens.load`.

Ground truth comes from outside TorchLens: forward hooks on the model and the eager model's
`output_attentions`. A loaded trace must serve those values, resolve every alias as the trace
it was saved from does, and `compare` must give the same verdicts. Loading must refuse
pickles, files outside the trace directory, classes that are not TorchLens records, truncated
files and other format versions, each with a TorchLensError that says why.
"""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

import torchlens as tl
import torchlens.mechinterp as mi
from torchlens import testing

IDS = testing.token_ids(length=6)


def _saved_and_loaded(tmp_path, family, save="all", attn="sdpa"):
    model = testing.build(family, attn)
    trace = tl.trace(model, IDS, save=save)
    with pytest.warns(UserWarning, match="KV|cache|Cache") if _has_cache(trace) else _nothing():
        trace.save(tmp_path / "t", model=model)
    return model, trace, tl.load(tmp_path / "t")


def _has_cache(trace) -> bool:
    out = trace.output
    return any(
        "Cache" in type(v).__name__ for v in (out.values() if hasattr(out, "values") else [])
    )


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_loaded_values_equal_forward_hooks_and_eager_attentions(tmp_path, family):
    model, trace, loaded = _saved_and_loaded(tmp_path, family)
    blocks = loaded.blocks
    attn = loaded.by_role("attention")
    mlps = loaded.by_role("mlp")
    assert len(blocks) == 2 and len(attn) == 2 and len(mlps) == 2
    seen = testing.hooked_outputs(model, blocks + attn + mlps, IDS)
    for a in blocks:
        torch.testing.assert_close(loaded.modules[a].facets["resid_post"], seen[a], rtol=0, atol=0)
    for a in attn + mlps:
        torch.testing.assert_close(loaded.modules[a].facets["output"], seen[a], rtol=0, atol=0)
    eager_model = testing.build(family, "eager")
    with torch.no_grad():
        eager = eager_model(IDS, output_attentions=True).attentions
    for i, a in enumerate(attn):
        torch.testing.assert_close(
            loaded.modules[a].facets["pattern"], eager[i], rtol=1e-4, atol=1e-5
        )
    logits = model(IDS).logits
    torch.testing.assert_close(loaded.output["logits"], logits, rtol=0, atol=0)
    # Every op output the trace held comes back bit for bit, with its metadata.
    assert len(loaded.ops) == len(trace.ops)
    for a, b in zip(trace.ops, loaded.ops):
        assert (a.name, a.module, a.call, a.inputs, a.shapes, a.dtypes) == (
            b.name,
            b.module,
            b.call,
            b.inputs,
            b.shapes,
            b.dtypes,
        )
        for x, y in zip(a.tensors, b.tensors):
            assert (x is None) == (y is None)
            if x is not None:
                assert torch.equal(x, y) and y.device.type == "cpu"
    assert loaded.model_info["config"]["vocab_size"] == testing.VOCAB
    assert loaded.saved_with["torchlens"] == tl.__version__


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_alias_resolution_and_compare_agree_without_the_model(tmp_path, family):
    model, trace, loaded = _saved_and_loaded(tmp_path, family)
    del model
    for generation in mi.GENERATIONS:
        before = [
            (r.query, r.status, r.module_address, r.facet, r.layer, r.reason)
            for r in mi.alias_report(trace, generation)
        ]
        after = [
            (r.query, r.status, r.module_address, r.facet, r.layer, r.reason)
            for r in mi.alias_report(loaded, generation)
        ]
        assert before == after and before, generation
    # compare against hook values (outside TorchLens), one planted wrong value.
    fresh = testing.build(family, "sdpa")
    seen = testing.hooked_outputs(fresh, loaded.blocks, IDS)
    values = {f"blocks.{i}.hook_resid_post": seen[a] for i, a in enumerate(loaded.blocks)}
    values["blocks.1.hook_resid_post"] = values["blocks.1.hook_resid_post"] + 1.0
    ra, rb = (
        mi.compare(trace, values, generation="2.x"),
        mi.compare(loaded, values, generation="2.x"),
    )
    assert ra.mismatched == rb.mismatched == ["blocks.1.hook_resid_post"]
    assert len(ra) == len(rb) == 2


def test_metadata_only_trace_round_trips(tmp_path):
    _, trace, loaded = _saved_and_loaded(tmp_path, "gpt2", save="none")
    assert all(t is None for op in loaded.ops for t in op.tensors)
    assert [(o.name, o.shapes, o.inputs) for o in loaded.ops] == [
        (o.name, o.shapes, o.inputs) for o in trace.ops
    ]
    site = loaded.modules[loaded.blocks[0]].facets.site("resid_post")
    assert not site.saved and tuple(site.shape) == (1, 6, 32)
    with pytest.raises(tl.FacetNotSaved):
        loaded.modules[loaded.blocks[0]].facets["resid_post"]


def test_an_edited_trace_keeps_its_edits(tmp_path):
    """A loaded reference that was edited must still say so: its `edits` records come back."""
    model = testing.build("gpt2", "sdpa")
    block = "transformer.h.0"
    seen = {}
    handle = model.get_submodule("transformer.h.1").register_forward_pre_hook(
        lambda m, args: seen.__setitem__("next_in", args[0].detach().clone())
    )
    try:
        trace = tl.trace(model, IDS, save="all", edit={f"{block}:resid_post": lambda x: x * 0.5})
    finally:
        handle.remove()
    with pytest.warns(UserWarning, match="Cache"):
        trace.save(tmp_path / "t")
    loaded = tl.load(tmp_path / "t")
    assert [
        (r.key, r.module_address, r.facet, r.calls, r.how, r.where, r.applied) for r in loaded.edits
    ] == [(f"{block}:resid_post", block, "resid_post", (0,), "fn", "forward hook", 1)]
    assert not any("EditRecord" in n for n in loaded.load_notes)
    # The edited value is what the next block received, in the loaded trace too.
    assert torch.equal(loaded.modules[block].facets["resid_post"], seen["next_in"])


# -- refusing what is not a trace --------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    model = testing.build("gpt2", "sdpa")
    trace = tl.trace(model, IDS, save=["resid_post"])
    with pytest.warns(UserWarning):
        trace.save(tmp_path / "t")
    return tmp_path / "t"


def _edit(path, fn):
    doc = json.loads((path / "trace.json").read_text())
    fn(doc)
    (path / "trace.json").write_text(json.dumps(doc))


def _tensor_path(path):
    """The tensor file trace.json names."""
    (entry,) = json.loads((path / "trace.json").read_text())["tensor_files"]
    return path / (entry if isinstance(entry, str) else entry["name"])


def _reseal(path):
    """Record the tensor file's present size in trace.json, as a forger would, so that what is
    checked next is the file's content."""
    size = _tensor_path(path).stat().st_size
    _edit(path, lambda doc: doc["tensor_files"][0].update(bytes=size))


class _Boom:
    def __reduce__(self):
        return (os.mkdir, ("PWNED",))


def test_a_pickle_in_place_of_the_tensors_is_never_unpickled(saved, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _tensor_path(saved).write_bytes(pickle.dumps(_Boom()))
    torch.save({"x": _Boom()}, tmp_path / "model.pt")
    with pytest.raises(tl.TraceFileError, match="not from one save"):
        tl.load(saved)
    _reseal(saved)  # the size and digest now match: the file itself is refused
    with pytest.raises(tl.TraceFileError, match="not a readable safetensors file"):
        tl.load(saved)
    _edit(saved, lambda d: d["tensor_files"][0].update(name="model.pt"))
    with pytest.raises(tl.TraceFileError, match="only a plain \\*.safetensors"):
        tl.load(saved)
    with pytest.raises(tl.TraceFileError, match="a file"):
        tl.load(tmp_path / "model.pt")
    assert not (tmp_path / "PWNED").exists()


def test_tensor_files_outside_the_directory_are_refused(saved, tmp_path):
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(_tensor_path(saved).read_bytes())
    for bad in ["../outside.safetensors", str(outside)]:
        _edit(saved, lambda d, bad=bad: d["tensor_files"][0].update(name=bad))
        with pytest.raises(tl.TraceFileError, match="only a plain"):
            tl.load(saved)
    os.symlink(outside, saved / "link.safetensors")
    _edit(saved, lambda d: d["tensor_files"][0].update(name="link.safetensors"))
    with pytest.raises(tl.TraceFileError, match="links outside"):
        tl.load(saved)


def test_classes_outside_torchlens_records_are_refused(saved):
    def plant(doc):
        doc["objects"][doc["root"]]["class"] = "Popen"

    _edit(saved, plant)
    with pytest.raises(tl.TraceFileError, match="may only name TorchLens records"):
        tl.load(saved)


def test_truncated_and_malformed_files_raise_a_clear_error(saved):
    tensors = _tensor_path(saved)
    data = tensors.read_bytes()
    tensors.write_bytes(data[: len(data) // 2])
    with pytest.raises(tl.TraceFileError, match="it is truncated"):
        tl.load(saved)
    _reseal(saved)
    with pytest.raises(tl.TraceFileError, match="malformed or truncated"):
        tl.load(saved)
    tensors.write_bytes(data)
    _reseal(saved)
    text = (saved / "trace.json").read_text()
    (saved / "trace.json").write_text(text[: len(text) // 2])
    with pytest.raises(tl.TraceFileError, match="not valid JSON"):
        tl.load(saved)
    (saved / "trace.json").write_text(text)
    _edit(saved, lambda d: d["objects"][d["root"]]["fields"]["ops"].append({"tensor": "t999999"}))
    with pytest.raises(tl.TraceFileError, match="t999999"):
        tl.load(saved)
    with pytest.raises(tl.TraceFileError, match="missing"):
        tl.load(saved / "nowhere")


def test_a_format_version_mismatch_says_what_differs(saved):
    def future(doc):
        doc["format_version"] = 99
        doc["versions"]["torchlens"] = "9.9.0"

    _edit(saved, future)
    with pytest.raises(tl.TraceFileError) as info:
        tl.load(saved)
    msg = str(info.value)
    assert "version 99" in msg and f"torchlens 9.9.0 there, {tl.__version__} here" in msg
    assert "torch " not in msg  # torch did not differ


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_a_float64_norms_computed_statistics_load_back(norm, tmp_path):
    """A fused norm's `inv_std` / `inv_rms` and `scale` are computed in float64 for a float64
    model, and say so: the saved trace loads (it was refused as malformed: the site said float32)
    and serves what recomputation from the norm's input gives."""
    torch.manual_seed(0)
    layer = torch.nn.LayerNorm(8) if norm == "layer" else torch.nn.RMSNorm(8, eps=1e-6)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), layer).double()
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    trace = tl.trace(model, x)
    name = "inv_std" if norm == "layer" else "inv_rms"
    with torch.no_grad():
        h = model[0](x)
        centred = h - h.mean(-1, keepdim=True) if norm == "layer" else h
        truth = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + layer.eps)
    for t in (trace, _round_trip(trace, tmp_path)):
        site = t.modules["1"].facets.sites[name]
        assert site.dtype == torch.float64 == t.modules["1"].facets[name].dtype
        assert torch.allclose(t.modules["1"].facets[name], truth, rtol=1e-12, atol=0)


def _round_trip(trace, tmp_path):
    trace.save(tmp_path / "t")
    return tl.load(tmp_path / "t")


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_trace_whose_pending_check_fails_while_it_is_copied_copies(how):
    """A write into a served tensor after the trace makes the pending checks that read it refuse;
    pickling or copying the trace runs them, and used to fail half-way through the sites
    ('dictionary changed size during iteration'). The copy and the trace both refuse them."""
    import copy

    model = testing.build("gpt2")
    with torch.no_grad():
        trace = tl.trace(model, IDS)
    trace["transformer.h.0:resid_pre"].mul_(2)
    other = pickle.loads(pickle.dumps(trace)) if how == "pickle" else copy.deepcopy(trace)
    for t in (trace, other):
        assert "normalized" in t.modules["transformer.h.0.ln_1"].facets.refused
