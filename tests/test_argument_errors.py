"""Errors teach: a wrong argument raises a TorchLens error that names it and says what is
accepted, before the model runs where it can be known then, and leaves nothing behind (files a
directory store wrote, the model's state). Each case comes from an audit of the public surface
with wrong inputs a user makes; each fails on the code before its fix."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import torchlens as tl
import torchlens.mechinterp as mi
from torchlens import testing

IDS = testing.token_ids(length=5)


@pytest.fixture(scope="module")
def gpt2():
    return testing.build("gpt2")


@pytest.fixture(scope="module")
def llama():
    return testing.build("llama")


def _files(root) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
    )


# -- nothing left behind ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(save=["resid_post", "inv_rms"]), tl.SaveSpecError),  # gpt2's norms have inv_std
        (dict(grads=lambda out: out.logits), tl.GradientError),  # not a scalar
    ],
    ids=["save-absent-facet", "grads-not-scalar"],
)
def test_a_directory_store_is_removed_when_the_trace_is_refused_after_the_forward(
    gpt2, tmp_path, kwargs, error
):
    with pytest.raises(error):
        tl.trace(gpt2, IDS, store=tmp_path / "t", **kwargs)
    assert _files(tmp_path) == []


def _stops_at_once(model) -> dict:
    """generate settings that let 4 new tokens be made, and stop after the first: its token is
    the end of sequence (so only step 0, the prefill, runs)."""
    first = int(model.generate(IDS, max_new_tokens=1, do_sample=False)[0, -1])
    return dict(max_new_tokens=4, do_sample=False, eos_token_id=first, pad_token_id=first)


def test_a_generation_refused_after_generate_removes_its_step_directories(llama, tmp_path):
    with pytest.raises(tl.GenerateSpecError, match="step 2 never ran"):
        tl.trace_generate(llama, IDS, steps=[0, 2], store=tmp_path / "g", **_stops_at_once(llama))
    assert _files(tmp_path) == []


def test_an_edit_tensor_of_the_wrong_shape_is_refused_before_the_edited_forward():
    """A train-mode BatchNorm's running statistics move with each forward: the locating pass's
    move is undone, and the wrong shape is refused before the edited forward runs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(tl.EditSpecError, match=r"has shape \[3\], but the site is \[6, 8\]"):
        tl.trace(model, torch.randn(6, 4), edit={"1:output": torch.zeros(3)})
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


# -- arguments that reached nothing --------------------------------------------------------------


def test_trace_generate_refuses_a_save_facet_no_step_has(llama):
    with pytest.raises(tl.SaveSpecError, match="names 'inv_std'.*in any step"):
        tl.trace_generate(llama, IDS, save=["resid_post", "inv_std"], max_new_tokens=2)


def test_an_edit_step_that_never_ran_is_refused_beside_one_that_ran(llama):
    with pytest.raises(tl.GenerateSpecError, match="step 2 never ran"):
        tl.trace_generate(
            llama,
            IDS,
            edit={((0, 2), "blocks.0.hook_resid_post"): lambda t: t},
            **_stops_at_once(llama),
        )


def test_store_names_in_another_case_are_refused(gpt2, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("CPU", "Device"):
        with pytest.raises(tl.StoreSpecError, match=f"did you mean {name.lower()!r}"):
            tl.trace(gpt2, IDS, store=name)
    assert os.listdir(tmp_path) == []


def test_facet_map_check_and_by_role_refuse_unknown_names(gpt2):
    trace = tl.trace(gpt2, IDS)
    with pytest.raises(tl.FacetNotFound, match="Did you mean 'resid_mid'"):
        trace.modules["transformer.h.0"].calls[0].facets.check("resid_midd")
    with pytest.raises(tl.RoleSpecError, match="Did you mean 'block'"):
        trace.by_role("blocks")
    assert trace.by_role("block") == ["transformer.h.0", "transformer.h.1"]


def test_tolerances_that_would_be_ignored_are_refused(gpt2):
    trace = tl.trace(gpt2, IDS)
    value = {"blocks.0.hook_resid_post": trace["transformer.h.0:resid_post"]}
    with pytest.raises(mi.ToleranceError, match="only with tolerance='auto'"):
        mi.compare(trace, value, model=gpt2, inputs=IDS)
    for bad in (-1e-5, "x", float("nan")):
        with pytest.raises(mi.ToleranceError, match="atol="):
            mi.compare(trace, value, atol=bad)
    assert mi.compare(trace, value).ok


def test_check_decode_refuses_atol_with_the_auto_tolerance_and_a_changed_model():
    model = testing.build("llama")
    gen = tl.trace_generate(model, IDS, max_new_tokens=2, do_sample=False)
    with pytest.raises(tl.GenerateSpecError, match="only with tolerance=None"):
        gen.check_decode(atol=0.0)
    assert gen.check_decode(tolerance=None, atol=1e-5, rtol=1e-4).ok
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(2)  # as an optimizer step would
    with pytest.raises(tl.GenerateSpecError, match="weights were written since trace_generate"):
        gen.check_decode()


def test_testing_build_refuses_a_family_typo():
    with pytest.raises(tl.LookupFailed, match="Did you mean 'gpt2'"):
        testing.build("gtp2")


# -- TorchLens errors, not Python's ----------------------------------------------------------------


def test_what_is_not_a_trace_is_refused_saying_what_to_pass(gpt2, llama):
    gen = tl.trace_generate(llama, IDS, max_new_tokens=1)
    with pytest.raises(tl.TorchLensError, match=r"gen\.steps\[i\]"):
        mi.resolve_alias(gen, "blocks.0.hook_resid_post")
    with pytest.raises(tl.TorchLensError, match=r"torchlens\.trace\(model"):
        mi.alias_report(gpt2)
    with pytest.raises(tl.TorchLensError, match="needs a torchlens.Trace"):
        mi.compare(None, {})


def test_wrong_argument_types_raise_torchlens_errors(gpt2, llama, tmp_path):
    trace = tl.trace(gpt2, IDS)
    for rows in (0, -1, "5", True):
        with pytest.raises(tl.TorchLensError, match="max_rows="):
            trace.summary(max_rows=rows)
    with pytest.raises(tl.TorchLensError, match="Trace.save"):
        trace.save(None)
    with pytest.raises(tl.TorchLensError, match="load"):
        tl.load(None)
    with pytest.raises(tl.GenerateSpecError, match="grads="):
        tl.trace_generate(llama, IDS, max_new_tokens=1, grads=lambda out: out.logits.sum())
    with pytest.raises(tl.SaveSpecError, match=r"predicate\(address, facet\)"):
        tl.trace(gpt2, IDS, save=lambda address: True)
    with pytest.raises(tl.EditSpecError, match="one argument"):
        tl.trace(gpt2, IDS, edit={"blocks.0.hook_resid_post": lambda: 0})
    with pytest.raises(tl.SaveSpecError, match="not 'address:facet' keys"):
        tl.trace(gpt2, IDS, save="transformer.h.0:resid_post")
    with pytest.raises(tl.GradientError, match="computed from nothing"):
        tl.trace(gpt2, IDS, grads=lambda out: torch.tensor(1.0, requires_grad=True))


def test_an_edit_function_that_raises_is_named_by_its_key(gpt2):
    def broken(t):
        raise RuntimeError("user bug")

    with pytest.raises(RuntimeError, match="user bug") as info:
        tl.trace(gpt2, IDS, edit={"blocks.0.hook_resid_post": broken})
    assert any("'blocks.0.hook_resid_post'" in note for note in info.value.__notes__)


def test_the_trace_repr_counts_the_facets_a_save_list_keeps(gpt2):
    """`save=["resid_post"]` keeps each block's output as its facet, not as an op output: the
    one-line repr counts them (it said 0 tensors saved)."""
    assert repr(tl.trace(gpt2, IDS, save=["resid_post"])).endswith("2 tensors saved)")
    assert repr(tl.trace(gpt2, IDS, save="none")).endswith("0 tensors saved)")


def test_near_misses_and_empty_requests_say_what_is_accepted(gpt2, llama):
    trace = tl.trace(gpt2, IDS)
    with pytest.raises(tl.LookupFailed, match="module addresses are strings"):
        trace.modules[0]
    with pytest.raises(tl.TorchLensError, match="did you mean highlight='facets'"):
        trace.draw(highlight="facet")
    with pytest.raises(mi.CompareSpecError, match="nothing to compare"):
        mi.compare(trace, {})
    gen = tl.trace_generate(llama, IDS, max_new_tokens=2, do_sample=False)
    with pytest.raises(tl.GenerateSpecError, match="names no step"):
        gen.check_decode(steps=[])


def test_numbers_of_other_types_are_accepted(gpt2):
    """NumPy scalars and 0-d tensors are numbers: tolerances and row counts take them."""
    import numpy as np

    trace = tl.trace(gpt2, IDS)
    value = {"blocks.0.hook_resid_post": trace["transformer.h.0:resid_post"]}
    for atol in (np.float32(1e-5), torch.tensor(1e-5), 1):
        assert mi.compare(trace, value, atol=atol).ok
    assert len(trace.summary(max_rows=np.int64(3)).splitlines()) == 5  # header, 3 rows, note


def test_check_decode_compares_a_replaced_parameter_by_nothing():
    """A parameter replaced by another tensor since the generation (an accelerate offload hook
    swaps them at each forward) is not taken for a written one; one written in place is (see
    test_check_decode_refuses_atol_with_the_auto_tolerance_and_a_changed_model)."""
    model = testing.build("llama")
    gen = tl.trace_generate(model, IDS, max_new_tokens=2, do_sample=False)
    w = model.model.layers[0].mlp.up_proj.weight
    model.model.layers[0].mlp.up_proj.weight = nn.Parameter(w.detach().clone())
    assert gen.check_decode().ok


def test_a_keyword_only_out_call_writes_only_its_out_tensor():
    """`torch.mul(input=y, other=2, out=z)` writes z, not y: no `written_in_place` op for y."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x):
            y = self.a(x)
            z = torch.empty_like(y)
            torch.mul(input=y, other=2.0, out=z)
            return self.b(y) + z

    with torch.no_grad():
        tr = tl.trace(M(), torch.randn(2, 3))
    assert "written_in_place" not in [op.name for op in tr.ops]
    assert tr.modules["b"].calls[0].input_ref.op == 1  # the linear's output, as it was made


def test_draw_refuses_a_generation_with_nothing_to_name(gpt2):
    trace = tl.trace(gpt2, IDS)
    with pytest.raises(tl.TorchLensError, match="neither is given"):
        trace.draw(generation="2.x")
