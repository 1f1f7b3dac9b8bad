"""The tensors the model keeps from one decode step to the next (its KV cache) are not copied at
each step's end (`torchlens._capture.step_copies.DeferredCopies`): a later forward's write into
them, the end of `generate` with the caller still holding them, or a first read copies them. Each
test compares what a step serves with what a plain forward hook cloned at that step's end."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from transformers import DynamicCache

import torchlens as tl
from torchlens import testing
from torchlens._capture import step_copies

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


class _KeepDetached(transformers.LogitsProcessor):
    """After each forward, keeps a detached alias of layer 0's cached keys (same memory, and it
    does not keep the cache's own tensor alive), or writes into them in place after step `write`."""

    def __init__(self, cache, write: int | None = None):
        self.cache, self.kept, self.write = cache, [], write

    def __call__(self, input_ids, scores):
        keys = self.cache.layers[0].keys
        if self.write is not None and len(self.kept) == self.write:
            with torch.no_grad():
                keys.add_(1.0)
        self.kept.append(keys.detach())
        return scores


def test_memory_a_callback_kept_a_detached_alias_of_is_copied_when_generate_returns():
    """A logits processor keeps `keys.detach()` of the caller's cache at every step: those aliases
    hold each step's keys after the cache has moved on, so `generate` returning copies them; a
    write into one afterwards leaves what its step serves as the hook cloned it."""
    model = testing.build("gpt2")
    cache = DynamicCache()
    keep = _KeepDetached(cache)
    seen, handle = _cache_at_each_step(model)
    try:
        gen = _generate(model, past_key_values=cache, logits_processor=[keep])
    finally:
        handle.remove()
    with torch.no_grad():
        keep.kept[1].zero_()
    keys = _outputs(gen.steps[1], "cat")[0]
    assert keys.data_ptr() != keep.kept[1].data_ptr()
    assert torch.equal(keys, seen[1][1])


def test_a_write_between_two_forwards_refuses_the_earlier_steps_keys_saying_so():
    """A logits processor writes into the caller's cache in place after step 1: step 1's saved
    keys, left uncopied, no longer hold what its forward computed, so they are not served, and
    the warning says the write came between two forwards of generate."""
    model = testing.build("gpt2")
    cache = DynamicCache()
    with pytest.warns(UserWarning, match="between two forwards of generate"):
        gen = tl.trace_generate(
            model,
            IDS,
            **GREEDY,
            past_key_values=cache,
            logits_processor=[_KeepDetached(cache, write=1)],
        )
    assert _outputs(gen.steps[1], "cat")[0] is None
    assert _outputs(gen.steps[2], "cat")[0] is not None


@pytest.mark.parametrize("how", ["in place", "through .data"])
def test_the_cross_attention_keys_every_decode_step_reads_are_copied_once_for_all_steps(how):
    """An encoder-decoder's decode steps read the cross-attention keys the first decoder forward
    cached, through a view each step saves. The memory was made by an earlier forward, and only the
    cache object holds it: once `generate` returns, the caller's write into the cache leaves every
    step's view as the hook cloned the keys at that step's end, and the steps' views share one
    copy, not one a step."""
    model = testing.build("bart")
    seen: list[torch.Tensor] = []

    def hook(module, args, kwargs, output):
        cache = kwargs.get("past_key_values") or kwargs.get("cache")
        seen.append(cache.cross_attention_cache.layers[0].keys.detach().clone())

    handle = model.register_forward_hook(hook, with_kwargs=True)
    try:
        gen = _generate(model, decoder_start_token_id=0)
    finally:
        handle.remove()
    assert len(gen.steps) == len(seen) == 4
    keys = gen.steps[-1].output.past_key_values.cross_attention_cache.layers[0].keys
    with torch.no_grad():
        (keys if how == "in place" else keys.data).add_(1.0)  # the caller writes into its cache
    views = []
    for step, truth in zip(gen.steps[1:], seen[1:]):
        view = next(
            op.tensors[0]
            for op in step.ops
            if op.module == "model.decoder.layers.0.encoder_attn"
            and op.name == "transpose"
            and op.shapes[0][-1] == truth.shape[-2]
        )
        assert torch.equal(view, truth.transpose(-1, -2))
        views.append(view.untyped_storage().data_ptr())
    assert len(set(views)) == 1 and views[0] != keys.untyped_storage().data_ptr()


@pytest.mark.parametrize(
    "other, held",
    [
        ("nothing", False),
        ("a detached alias", True),
        ("a view", True),
        ("a .data alias", True),
        ("a numpy array", True),
        ("its storage object", True),
    ],
)
def test_held_elsewhere_counts_every_holder_of_the_storage_but_the_traces_tensors(other, held):
    """`_held_elsewhere` tells whether anything but the given tensors holds their storage."""
    t = torch.randn(8)
    ours = [t, t.detach()]
    keep = {
        "nothing": lambda: None,
        "a detached alias": t.detach,
        "a view": lambda: t[2:],
        "a .data alias": lambda: t.data,
        "a numpy array": t.numpy,
        "its storage object": t.untyped_storage,
    }[other]()
    assert step_copies._held_elsewhere(ours) is held
    del keep
    assert step_copies._held_elsewhere(ours) is False
