"""The argument checks of `trace_generate`, made before `generate` runs.

A generation setting is read as `generate` reads it (a keyword argument, else the
`generation_config=` given, else the model's); the settings TorchLens cannot trace one forward per
step of (beam search, assisted, prompt-lookup or chunked-prefill generation, no new token) are
refused, and `steps=` and the steps of `edit=` keys are checked against the most forward calls the
settings allow.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from torchlens._core.errors import EditSpecError, GenerateSpecError

__all__ = ["check_settings", "split_edits", "step_set"]

_DEFAULT = object()


def _setting(model: nn.Module, kwargs: dict, name: str, default: Any = None) -> Any:
    """A generation setting as `generate` reads it: a keyword argument, else the
    `generation_config=` given, else the model's `generation_config`."""
    if name in kwargs:
        return kwargs[name]
    for config in (kwargs.get("generation_config"), getattr(model, "generation_config", None)):
        value = getattr(config, name, _DEFAULT) if config is not None else _DEFAULT
        if value is not _DEFAULT and value is not None:
            return value
    return default


def _max_steps(model: nn.Module, prompt_length: int | None, kwargs: dict) -> int | None:
    """How many forward calls the generation can make at most (one per new token), or None when
    the settings do not say."""
    new = _setting(model, kwargs, "max_new_tokens")
    if new is None:
        length = _setting(model, kwargs, "max_length")
        if length is None or prompt_length is None:
            return None
        new = int(length) - prompt_length
    return int(new)


def check_settings(model: nn.Module, kwargs: dict, prompt_length: int | None) -> int | None:
    if "grads" in kwargs:  # trace's argument, which generate would take for a model keyword
        raise GenerateSpecError(
            "grads=: trace_generate takes no gradients (generate runs without autograd). Trace one "
            "forward with grads= instead: torchlens.trace(model, ids, grads=loss_fn) on the prefix "
            "you want, e.g. gen.sequences[:, :n]."
        )
    beams = _setting(model, kwargs, "num_beams", 1)
    if beams is not None and int(beams) > 1:
        raise GenerateSpecError(
            f"num_beams={beams}: trace_generate does not trace beam search (the beams reorder the cache "
            f"between steps, so a step's rows are not the rows of the step before). Use greedy decoding "
            f"(num_beams=1, the default) or sampling (do_sample=True with a seed)."
        )
    for name, why in (
        ("assistant_model", "assisted generation runs a second model between the steps"),
        ("prompt_lookup_num_tokens", "prompt-lookup decoding verifies several tokens per forward"),
        (
            "prefill_chunk_size",
            "a chunked prefill makes several forward calls before the first token",
        ),
    ):
        value = _setting(model, kwargs, name)
        if value is not None:
            raise GenerateSpecError(
                f"{name}={value!r}: trace_generate traces one prefill forward and then one "
                f"forward per new token; {why}. Leave {name} out."
            )
    n = _max_steps(model, prompt_length, kwargs)
    if n is not None and n <= 0:
        which = (
            "max_new_tokens"
            if _setting(model, kwargs, "max_new_tokens") is not None
            else "max_length"
        )
        raise GenerateSpecError(
            f"{which}={_setting(model, kwargs, which)!r} leaves {n} new tokens"
            + (f" after the {prompt_length}-token prompt" if which == "max_length" else "")
            + ": trace_generate needs at least one forward call to trace. Give max_new_tokens=1 or more."
        )
    return n


def step_set(value: Any, what: str, limit: int | None) -> set[int] | None:
    """The steps an int, range or sequence of ints names, checked against `limit` forward calls."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, range, list, tuple, set, frozenset)):
        raise GenerateSpecError(
            f"{what}={value!r}: give a step number (0 is the prefill, i the i-th decode forward), a range or a "
            f"list of them, e.g. {what}=[0, 1] or {what}=range(0, 32, 4)."
        )
    items = [value] if isinstance(value, int) else list(value)
    for s in items:
        if isinstance(s, bool) or not isinstance(s, int):
            raise GenerateSpecError(f"{what}={value!r}: {s!r} is not a step number (an int).")
        if s < 0:
            raise GenerateSpecError(
                f"{what}={value!r}: step {s} is negative; steps count from 0 (the prefill), and the number of steps "
                f"is known only when generation ends, so count from the start."
            )
        if limit is not None and s >= limit:
            raise GenerateSpecError(
                f"{what}={value!r}: step {s} is outside the generation, which makes at most {limit} forward calls "
                f"(steps 0..{limit - 1}: the prefill and one decode forward per further new token)."
            )
    return set(items)


def split_edits(
    edit: Any, limit: int | None
) -> tuple[dict, list[tuple[Any, set[int] | None, Any]]]:
    """`edit=` as (key -> value as given, [(site key, steps or None for every step, value)])."""
    if edit is None:
        return {}, []
    if not isinstance(edit, Mapping) or not edit:
        raise GenerateSpecError(
            f"edit= takes a non-empty dict from site to a function or tensor: a key applies at every step, and "
            f"(step, key) or (range(...), key) at those steps, e.g. edit={{'blocks.0.hook_resid_post': fn, "
            f"(3, 'blocks.1.hook_resid_post'): fn}}; got "
            f"{type(edit).__name__ if not isinstance(edit, Mapping) else 'an empty dict'}."
        )
    out = []
    for key, value in edit.items():
        if (
            isinstance(key, tuple)
            and len(key) == 2
            and isinstance(key[0], (int, range, tuple))
            and not isinstance(key[0], bool)
            and not (isinstance(key[0], tuple) and key[0] and isinstance(key[0][0], str))
        ):
            out.append((key[1], step_set(key[0], f"edit= key {key!r}: the step", limit), value))
        else:
            out.append((key, None, value))
    _one_edit_per_step(edit, out)
    return dict(edit), out


def _one_edit_per_step(edit: Mapping, entries: list[tuple[Any, set[int] | None, Any]]) -> None:
    """Refuse two entries of one site key whose steps meet (a key for every step and a `(step,
    key)` one, two overlapping ranges): each step takes one edit per site, as `trace` does."""
    keys = list(edit)
    for i, (site, steps, _) in enumerate(entries):
        for j in range(i):
            other, other_steps, _ = entries[j]
            if other != site:
                continue
            both = (
                steps
                if other_steps is None
                else other_steps
                if steps is None
                else steps & other_steps
            )
            if both is None or both:
                where = "every step" if both is None else f"step(s) {sorted(both)}"
                raise EditSpecError(
                    f"edit= keys {keys[j]!r} and {keys[i]!r} both edit {site!r} at {where}; give one "
                    f"edit per site and step (write one function that does both at the steps they "
                    f"share, and key the rest by their own steps)."
                )
