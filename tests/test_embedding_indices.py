"""An embedding's `indices` are the indices it looked up (issue 22, item 4).

`indices` is served as the embedding module's first argument, noted "token ids". A learned
position embedding that computes its positions itself takes something else first: MBart's
encoder passes `inputs_embeds[..., -1]` (a float tensor, "just for the shape"), its decoder the
token ids, BioGPT (no other test uses it) the attention mask; the positions looked up are
`arange(T) + offset`. The rule: `indices`, where served, is an integer tensor and is the index
tensor of the module's lookup, row for row.

Models: MBart, PLBart and BioGPT (PLBart and BioGPT are used by no other test), tiny seeded
configs of `tests/_edge_models.py`.

Ground truth, from outside TorchLens: a lookup copies rows of the weight, so for every position
of a plain forward hook's output the index is the one row of `weight` it equals (random init
rows are distinct); for a token embedding that scales its rows, the model input ids.
"""

from __future__ import annotations

import functools

import _edge_models as em
import pytest
import torch

import torchlens as tl
from torchlens import testing

#: arch -> (address, where its truth comes from: "rows" (match the weight), or the input keyword holding its ids)
EMBEDDINGS = {
    "mbart": (
        ("model.encoder.embed_positions", "rows"),
        ("model.decoder.embed_positions", "rows"),
        ("model.decoder.embed_tokens", "decoder_input_ids"),
    ),
    "plbart": (
        ("model.encoder.embed_positions", "rows"),
        ("model.decoder.embed_positions", "rows"),
    ),
    "biogpt": (("biogpt.embed_positions", "rows"), ("biogpt.embed_tokens", "input_ids")),
    # MVP (no other test): its position embedding is given the token ids and looks up arange(T) + 2
    "mvp": (("model.encoder.embed_positions", "rows"), ("model.decoder.embed_positions", "rows")),
}
CASES = [(a, addr, src) for a, rows in EMBEDDINGS.items() for addr, src in rows]


@functools.cache
def traced(arch: str):
    model = em.build(arch)
    args, kwargs = em.inputs(arch)
    return model, args, kwargs, tl.trace(model, *args, **kwargs, save="all")


def _looked_up(model, address, args, kwargs) -> torch.Tensor:
    """[batch, pos] indices of the weight rows the module returned (exact row matches)."""
    out = testing.hooked_outputs(model, [address], *args, **kwargs)[address]
    weight = model.get_submodule(address).weight.detach()
    rows = out.reshape(-1, out.shape[-1])
    match = (rows[:, None, :] == weight[None, :, :]).all(-1)
    assert bool((match.sum(1) == 1).all()), f"{address}: each output row is one weight row"
    return match.float().argmax(1).reshape(out.shape[:-1])


@pytest.mark.parametrize("arch,address,source", CASES, ids=[f"{a}-{s}" for a, s, _ in CASES])
def test_indices_are_the_indices_looked_up(arch, address, source):
    model, args, kwargs, trace = traced(arch)
    if source == "rows":
        truth = _looked_up(model, address, args, kwargs)
    else:
        truth = kwargs[source] if source in kwargs else args[0]
    site = trace.modules[address].calls[-1].facets.sites.get("indices")
    if site is None or site.tensor is None:
        return  # absent is honest; a served one must be right
    got = site.tensor
    assert not got.is_floating_point(), f"{address} serves a {got.dtype} tensor as indices"
    assert got.shape == truth.shape and torch.equal(got.long(), truth.long()), (
        f"{address} indices {got.tolist()} are not the rows looked up {truth.tolist()}"
    )


@pytest.mark.parametrize("arch,address,source", CASES, ids=[f"{a}-{s}" for a, s, _ in CASES])
def test_a_save_list_keeps_the_indices(arch, address, source):
    """`save=["indices"]` keeps them, also where the module computes them itself (the positions
    are then an op of the embedding, not its input, which capture must keep)."""
    model, args, kwargs, full = traced(arch)
    served = full.modules[address].calls[-1].facets.sites.get("indices")
    if served is None or served.tensor is None:
        return
    trace = tl.trace(model, *args, **kwargs, save=["indices"])
    site = trace.modules[address].calls[-1].facets.sites["indices"]
    assert site.saved, f"{address}: save=['indices'] dropped them"
    torch.testing.assert_close(site.tensor, served.tensor, rtol=0, atol=0)


def _zeroed_indices(model, args, kwargs, address):
    """(the trace with `address`'s indices edited to zeros, the rows the module returned in that
    forward as a plain forward hook saw them, one per position)."""
    seen = []
    module = model.get_submodule(address)
    handle = module.register_forward_hook(lambda m, a, o: seen.append(o.detach().clone()))
    try:
        trace = tl.trace(model, *args, **kwargs, edit={f"{address}:indices": torch.zeros_like})
    finally:
        handle.remove()
    return trace, seen[-1].reshape(-1, seen[-1].shape[-1])


@pytest.mark.parametrize("arch,address,source", CASES, ids=[f"{a}-{s}" for a, s, _ in CASES])
def test_an_indices_edit_changes_the_rows_looked_up(arch, address, source):
    """An edit of `indices` replaces the tensor the lookup reads, wherever it is made: a plain
    forward hook on the module in the edited forward sees the weight rows at the new indices."""
    model, args, kwargs, full = traced(arch)
    served = full.modules[address].calls[-1].facets.sites.get("indices")
    if served is None or served.tensor is None:
        return
    trace, rows = _zeroed_indices(model, args, kwargs, address)
    weight = model.get_submodule(address).weight.detach()
    scale = rows[0] / weight[0]  # a token embedding that scales its rows (all by one factor)
    torch.testing.assert_close(rows, (weight[0] * scale).expand_as(rows))
    assert torch.equal(
        trace.modules[address].calls[-1].facets["indices"],
        torch.zeros_like(served.tensor),
    )


@pytest.mark.parametrize("arch", ["pegasus", "blenderbot"])
def test_indices_computed_by_the_parent_are_edited_at_their_op_and_refused_unkept(arch):
    """Pegasus's and Blenderbot's decoders compute the positions themselves (an add in
    `model.decoder`) and pass them to `embed_positions` after a shape: the edit was planned on the
    embedding's pre-hook, which replaced nothing, and failed as "ran 0 times"; save=['indices']
    left them silently "not saved". The edit is now placed at their op (ground truth: the rows a
    plain forward hook sees the embedding return are the weight rows at the edited indices), and
    a save list that cannot keep them says why."""
    model = em.build(arch)
    args, kwargs = em.inputs(arch)
    address = "model.decoder.embed_positions"
    trace, rows = _zeroed_indices(model, args, kwargs, address)
    assert trace.edits[0].where.startswith("op #") and trace.edits[0].applied == 1
    weight = model.get_submodule(address).weight.detach()
    torch.testing.assert_close(rows, weight[0].expand_as(rows), rtol=0, atol=0)
    some = tl.trace(model, *args, **kwargs, save=["indices", "resid_post"])
    with pytest.raises(tl.FacetNotFound, match="computed in 'model.decoder'"):
        some.modules[address].calls[0].facets["indices"]
