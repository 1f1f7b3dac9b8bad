"""`torchlens.trace_generate`: a model's own `generate`, with every forward call it makes traced.

The arguments are checked first (`torchlens._generation.arguments`), the hooks that capture each
forward call are installed (`torchlens._generation.session`), `generate` runs unchanged, and the
steps are returned as a `GenerationTrace`. Nothing is patched. Every hook is removed and every
open capture closed before `trace_generate` returns or raises, also when `generate` raises in the
middle of a step.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from torchlens._analysis.role_rules import parse_roles, static_roles
from torchlens._analysis.selection import parse_save
from torchlens._capture.collector import paused
from torchlens._capture.compiled import compiled_module_class
from torchlens._capture.stores import parse_store
from torchlens._core.errors import GenerateSpecError, TorchLensError
from torchlens._core.holdings import trace_calls
from torchlens._generation.arguments import check_settings, split_edits, step_set
from torchlens._generation.result import GenerationTrace
from torchlens._generation.session import Session
from torchlens._tracing import module_names

__all__ = ["trace_generate"]


def _sequences(output: Any) -> Tensor:
    if isinstance(output, Tensor):
        return output
    seq = (
        output.get("sequences")
        if isinstance(output, Mapping)
        else getattr(output, "sequences", None)
    )
    if not isinstance(seq, Tensor):
        raise TorchLensError(
            f"model.generate returned {type(output).__name__}, which holds no `sequences` tensor."
        )
    return seq


def _check_ran(done: list, keep_steps: Any, steps: Any, edits: list) -> None:
    """Raise `GenerateSpecError` for a `steps=` step or an `edit=` step that never ran (the
    generation stopped before it: an end-of-sequence token, a stopping criterion)."""
    ran = len(done)
    stopped = (
        f"generation stopped after {ran} forward calls (steps 0..{ran - 1}; an end-of-sequence "
        "token or a stopping criterion ended it early)"
    )
    if keep_steps is not None and max(keep_steps, default=-1) >= ran:
        raise GenerateSpecError(f"steps={steps!r}: step {max(keep_steps)} never ran: {stopped}.")
    for key, wanted, _ in edits:
        missing = sorted(s for s in wanted if s >= ran) if wanted is not None else []
        if missing:
            raise GenerateSpecError(
                f"edit= key for {key!r} at steps {sorted(wanted)}: step"
                f"{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} never ran: {stopped}."
            )


def trace_generate(
    model: nn.Module,
    input_ids: Tensor | None = None,
    *,
    save: str | Sequence[str] | Callable[[str, str], bool] = "all",
    edit: Mapping[str | tuple, Callable[[Tensor], Tensor] | Tensor] | None = None,
    steps: int | range | Sequence[int] | None = None,
    roles: Mapping[str, str] | None = None,
    store: str | os.PathLike | None = None,
    **generate_kwargs: Any,
) -> GenerationTrace:
    """Run `model.generate(input_ids, **generate_kwargs)` once, every forward call it makes traced.

    The model's own `generate` runs, unchanged: greedy decoding, or sampling (`do_sample=True`)
    with the seed you set before the call, so `.sequences` is what `model.generate` returns for
    the same arguments and seed. Each forward call `generate` makes is captured as one
    [`Trace`][torchlens.Trace]: `.steps[0]` is the prefill over the prompt, `.steps[i]` the
    `i`-th decode forward, whose positions are the one new token per row and whose attention
    reads the cached keys. Left-padded batches (`attention_mask=`), the Hugging Face cache
    classes (`cache_implementation="static"`, a sliding-window model's cache) and
    encoder-decoder models (T5, BART: `steps[0]` holds the encoder's call too) are traced as they run.

    Args:
        model: a module with a `generate` method (a Hugging Face `GenerationMixin` model).
        input_ids: the prompt, `[batch, length]` (left-padded with an `attention_mask` for prompts
            of different lengths).
        save: what each kept step keeps, as for [`trace`][torchlens.trace] (`"all"`, `"none"`, a
            facet or module name or a list of them, a predicate).
        edit: sites to replace as the model computes them, as for `trace`: `{key: fn}` edits the
            site at every step; `{(step, key): fn}` (`step` an int, a range or a tuple of ints)
            only at those steps. `fn` receives the site's tensor of that step (`[batch, 1, ...]` at
            a decode step). Each edited step runs one locating pass first, on a copy of its cache;
            what that pass writes into the step's inputs and the model's buffers and
            parameters is restored before the step's edited forward.
            On an encoder-decoder model, an encoder site is edited in the encoder's one call
            (step 0; key it without a step or at step 0), a decoder site at every decoder forward
            (or at the steps its key names); the keys are resolved before the encoder runs, on one
            full forward of the model.
        steps: which steps keep tensors under `save=` (an int, a range or a list of step numbers);
            the others keep records only (`save="none"`). Default: every step.
        roles: as for `trace`.
        store: as for `trace`; a directory gets one subdirectory per step (`step-0000`, ...).
        **generate_kwargs: passed to `model.generate` as given (`max_new_tokens`,
            `attention_mask`, `do_sample`, `cache_implementation`, `return_dict_in_generate`, ...).

    Returns:
        A [`GenerationTrace`][torchlens.GenerationTrace].

    Raises:
        GenerateSpecError: `model` has no `generate`; beam search (`num_beams` > 1), assisted or
            chunked-prefill generation; `max_new_tokens=0`; a `steps=` or an `edit=` step outside
            the generation (before `generate` runs when the settings bound the steps, else after it
            stopped); an encoder site keyed to a decode step.
        SaveSpecError, EditSpecError, NotEditable, StoreSpecError, RoleSpecError: as for `trace`.
        Exception: whatever `generate` raises propagates, with a note naming the op and module
            where a traced forward raised; nothing TorchLens installed is left behind.

    Note:
        Python's cyclic garbage collector is off for the whole `generate` call, as it is for a
        `trace` call (see its note): the steps kept grow with every token, and no collection
        pass scans them again and again meanwhile. A model whose forward makes reference cycles
        that hold tensors (none of `torchlens.testing`'s families does) keeps them until
        `generate` returns, not one forward.

    Examples:
        >>> import torch, torchlens as tl
        >>> from torchlens import testing
        >>> model = testing.build("llama")
        >>> gen = tl.trace_generate(model, testing.token_ids(length=4), max_new_tokens=3, do_sample=False)
        >>> len(gen.steps), gen.steps[1]["model.layers.0:resid_post"].shape
        (3, torch.Size([1, 1, 32]))
        >>> gen.steps[2]["model.layers.0.self_attn:pattern"].shape  # 1 new query over 6 keys
        torch.Size([1, 4, 1, 6])
    """
    if not isinstance(model, nn.Module):
        raise GenerateSpecError(
            f"model: trace_generate() needs a torch.nn.Module with a generate method, got "
            f"{type(model).__name__}."
        )
    wrapper = compiled_module_class()
    if wrapper is not None and isinstance(model, wrapper):
        orig = model._orig_mod
        assert isinstance(orig, nn.Module)  # torch.compile's wrapper holds the module it compiled
        model = orig
    generate = getattr(model, "generate", None)
    if not callable(generate):
        raise GenerateSpecError(
            f"model: {type(model).__name__} has no generate method; trace_generate runs a model's own generate "
            f"(a transformers GenerationMixin model, such as AutoModelForCausalLM's). For one forward pass, use "
            f"torchlens.trace(model, ...)."
        )
    prompt_length = int(input_ids.shape[-1]) if isinstance(input_ids, Tensor) else None
    limit = check_settings(model, generate_kwargs, prompt_length)
    keep_steps = step_set(steps, "steps", limit)
    given, edits = split_edits(edit, limit)
    names, aliases = module_names(model)
    static = static_roles(model, names, parse_roles(roles, list(names.values())))
    spec_keep = parse_save(save, names.values(), aliases)
    spec_none = parse_save("none", names.values(), aliases)
    store = parse_store(store)  # StoreSpecError before anything runs
    config = getattr(model, "config", None)
    encoder = None
    get_encoder = getattr(model, "get_encoder", None)
    if getattr(config, "is_encoder_decoder", False) and callable(get_encoder):
        encoder = get_encoder()
        if encoder not in names or encoder is model:
            encoder = None
    session = Session(
        model,
        names,
        aliases,
        static,
        spec_keep,
        spec_none,
        keep_steps,
        store,
        edits,
        roles,
        encoder,
    )
    session.install()
    try:
        try:
            args = () if input_ids is None else (input_ids,)
            with (
                paused()
            ):  # see `_capture.collector`; the steps kept grow, and no pass rescans them
                output = generate(*args, **generate_kwargs)
        except BaseException as exc:
            session.remove(exc)
            if hasattr(exc, "add_note"):
                where = (
                    session.where
                    or f"generate itself, between forward calls ({len(session.steps)} steps done)"
                )
                exc.add_note(
                    f"torchlens: trace_generate raised in {where}; every hook it installed is removed"
                )
            raise
        session.remove()
        session.shared_weights.verify(session.steps)
        session.deferred.finish()
        _check_ran(session.steps, keep_steps, steps, edits)
        if keep_steps is None or keep_steps:  # a save= facet that no kept step has
            kept = [t for i, t in enumerate(session.steps) if keep_steps is None or i in keep_steps]
            session.plans[True].check_each_named(
                [c for t in kept for c in trace_calls(t)], "in any step this generation kept"
            )
    except BaseException:  # generate raised, or the generation was refused after it
        session.discard_stores()  # what the steps wrote serves no trace
        raise
    return GenerationTrace(
        session.steps,
        session.info,
        output,
        _sequences(output),
        input_ids,
        encoder is not None,
        {s: a for s, a in session.applied.items() if a},
        model,
        {"input_ids": input_ids, "kwargs": dict(generate_kwargs), "save": save, "roles": roles},
    )
