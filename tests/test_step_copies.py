"""The tensors the model keeps from one decode step to the next (its KV cache) are not copied at
each step's end (`torchlens._capture.step_copies.DeferredCopies`): a later forward's write into
them, the end of `generate` with the caller still holding them, or a first read copies them. Each
test compares what a step serves with what a plain forward hook cloned at that step's end."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache

import torchlens as tl
from torchlens import testing

IDS = testing.token_ids(length=6, seed=3, vocab=60) + 3
GREEDY = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
ATTN = "transformer.h.0.attn"


def _cache_at_each_step(model):
    """A forward hook on the model: after each forward of `generate`, (data pointer, clone) of
    layer 0's cached keys, as the forward left them."""
    seen: list[tuple[int, torch.Tensor]] = []

    def hook(module, args, kwargs, output):
        cache = kwargs.get("past_key_values") or kwargs.get("cache")
        keys = cache.layers[0].keys
        seen.append((keys.data_ptr(), keys.detach().clone()))

    return seen, model.register_forward_hook(hook, with_kwargs=True)


def _generate(model, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gen = tl.trace_generate(model, IDS, **GREEDY, **kwargs)
    assert not [w for w in caught if "torchlens" in str(w.message)], [
        str(w.message) for w in caught
    ]
    return gen


def _outputs(step, name: str) -> list[torch.Tensor]:
    """The saved outputs of layer 0's attention's ops called `name`, in order."""
    return [op.tensors[0] for op in step.ops if op.module == ATTN and op.name == name]


def test_a_dynamic_caches_keys_are_copied_only_where_something_besides_the_trace_holds_them():
    """A dynamic cache replaces its keys by their concatenation with the new step's at every step:
    once `generate` returns, each step's concatenated keys but the last are held by that step's
    trace alone, so they were not copied (each still shares memory with the tensor the cache held
    at that step's end); the last are still the cache's, which every step's `output` holds, so
    they were copied. Each holds what the hook cloned at its step's end."""
    model = testing.build("gpt2")
    seen, handle = _cache_at_each_step(model)
    try:
        gen = _generate(model)
    finally:
        handle.remove()
    assert len(gen.steps) == len(seen) == 4
    assert gen.steps[-1].output.past_key_values.layers[0].keys.data_ptr() == seen[-1][0]
    for i, (step, (ptr, clone)) in enumerate(zip(gen.steps, seen)):
        keys = _outputs(step, "cat")[0]
        assert (keys.data_ptr() == ptr) == (i < 3), i
        assert torch.equal(keys, clone)


@pytest.mark.parametrize("steps", [None, [0, 2]])
def test_a_static_caches_keys_written_in_place_by_the_next_step_are_copied_before_the_write(steps):
    """A static cache writes each step's keys into the same tensor (`index_copy_`): the next step's
    recorder copies the earlier step's saved keys before that write, also when that next step
    keeps nothing (`steps=`), so every kept step serves the keys as its own forward left them (no
    saved output is dropped for a later write)."""
    model = testing.build("gpt2")
    seen, handle = _cache_at_each_step(model)
    try:
        gen = _generate(model, cache_implementation="static", steps=steps)
    finally:
        handle.remove()
    assert len({ptr for ptr, _ in seen}) == 1  # one tensor, written at every step
    for i, (step, (ptr, clone)) in enumerate(zip(gen.steps, seen)):
        if steps is not None and i not in steps:
            continue
        keys = _outputs(step, "index_copy_")[0]
        assert keys is not None and keys.data_ptr() != ptr
        assert torch.equal(keys, clone)


@pytest.mark.parametrize("how", ["in place", "through .data"])
def test_a_cache_the_caller_holds_is_copied_when_generate_returns(how):
    """A cache object the caller passed in still holds the last step's keys when `generate`
    returns: they are copied then, so a write into the caller's cache afterwards (in place, or
    through `.data`, which no counter sees) leaves what the last step serves as it was."""
    model = testing.build("gpt2")
    cache = DynamicCache()
    seen, handle = _cache_at_each_step(model)
    try:
        gen = _generate(model, past_key_values=cache)
    finally:
        handle.remove()
    held = cache.layers[0].keys
    assert held.data_ptr() == seen[-1][0]
    with torch.no_grad():
        (held.data if how == "through .data" else held).zero_()
    keys = _outputs(gen.steps[-1], "cat")[0]
    assert keys.data_ptr() != held.data_ptr()
    assert torch.equal(keys, seen[-1][1])
    assert not torch.equal(held, seen[-1][1])
