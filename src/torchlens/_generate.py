"""`torchlens.trace_generate`: a model's own `generate`, with every forward call it makes traced.

A generation is many forward passes: the prefill over the prompt, then one decode forward per new
token, each reading the keys and values of the earlier positions from a KV cache. Here each of
them is captured as its own [`Trace`][torchlens.Trace], by the same machinery `trace` uses, split
so that one `Recorder` runs per forward call:

- before `generate` runs, every module gets the recorder's two hooks through one dispatcher
  (`_Session`), which passes each call to the recorder of the forward call under way, if any;
- a forward pre-hook on the root, run before any other, opens a capture (a new `Recorder`, the
  compiler stance, the accelerate wrapping, the torch function mode) each time `generate` calls
  the model; a forward hook on the root, run after every other (`always_call`), closes it and
  assembles that step's `Trace` exactly as `trace` assembles one (structure, facets, `save=`
  trimming, snapshot, `store=`, sealed checks);
- an encoder-decoder model's encoder runs once, called by `generate` directly before the first
  decoder forward: a pre-hook on the encoder opens step 0's capture there, the capture pauses
  (its mode off) from the encoder's return to the decoder's first call and goes on through it, so
  `steps[0]` holds the encoder stack and the decoder stack; each later step is a decoder forward
  that reads the encoder through `encoder_outputs` and the cross-attention cache.

Nothing is patched. Every hook is removed and every open capture closed before `trace_generate`
returns or raises, also when `generate` raises in the middle of a step.

`edit=` is planned per step, as `trace` plans it: each edited step first runs one locating pass
(`save="none"`) on a deep copy of the cache the step receives (so the real cache is updated once),
with the RNG state restored after it, and the edited forward then checks every op it replaces.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from torchlens._analysis.role_rules import Roles, parse_roles, static_roles
from torchlens._analysis.selection import parse_save, plan_capture
from torchlens._capture.accelerate import accelerate_hooks
from torchlens._capture.compiled import CompiledRunsEagerly, compiled_module_class
from torchlens._capture.recorder import Recorder
from torchlens._capture.stores import DirectoryStore, parse_store
from torchlens._core.errors import GenerateSpecError, TorchLensError
from torchlens._decode import DecodeReport, check_decode
from torchlens._edits import plan_edits
from torchlens._trace import Trace
from torchlens._tracing import _annotate as annotate
from torchlens._tracing import _finish as finish
from torchlens._tracing import trace

__all__ = ["GenerateSpecError", "GenerationTrace", "StepInfo", "trace_generate"]


@dataclass
class StepInfo:
    """What one forward call of a generation received, as `generate` passed it.

    Attributes:
        index: the step (0 is the prefill, `i` the `i`-th decode forward).
        kind: `"prefill"` or `"decode"`.
        kept: whether the step's trace keeps tensors (`steps=`); otherwise records only.
        input_ids: the token ids the step ran on, `[batch, new]` (an encoder-decoder model's
            `decoder_input_ids`).
        attention_mask: the attention mask as passed, `[batch, past + new]`, or None.
        position_ids: the position ids as passed, or None when `generate` passed none.
        cache_position: the `cache_position` as passed, or None.
        past_length: the cache's length before the step (0 for the prefill).
        cache: the class name of the cache object the step received, or None.
    """

    index: int
    kind: str
    kept: bool
    input_ids: Tensor | None
    attention_mask: Tensor | None
    position_ids: Tensor | None
    cache_position: Tensor | None
    past_length: int
    cache: str | None

    @property
    def new_tokens(self) -> int:
        """How many positions the step computed (the prompt's length at the prefill, else 1)."""
        return 0 if self.input_ids is None else int(self.input_ids.shape[-1])


@dataclass
class GenerationTrace:
    """One run of a model's `generate`, every forward call traced.

    Attributes:
        steps: one [`Trace`][torchlens.Trace] per forward call, in order: `steps[0]` the
            prefill, `steps[i]` the `i`-th decode forward. Each is a full trace of that call
            (modules, facets, statuses, `save=`/`store=` rules); its positions are the tokens the
            call computed (one per row at a decode step), and an attention pattern's keys are
            every position the call attended to, the cached ones included
            (`[batch, heads, new, past + new]` with a dynamic cache).
        info: one [`StepInfo`][torchlens.StepInfo] per step: what `generate` passed it.
        output: what `model.generate` returned (a tensor, or a `ModelOutput` with
            `return_dict_in_generate=True`).
        sequences: the generated sequences, prompt included: what `model.generate` returns for
            the same arguments and seed.
        prompt: the prompt `input_ids` as given.
        encoder_decoder: the model is an encoder-decoder (T5, BART): `steps[0]` holds the encoder's
            one call (its stack) and the decoder's first forward; every later step is a decoder
            forward, whose cross-attention reads the encoder's output from the cache.
        edits: the `edit=` as given, by step: step -> the keys applied there.
        model: the model that generated (held for `check_decode`).
    """

    steps: list[Trace]
    info: list[StepInfo]
    output: Any
    sequences: Tensor
    prompt: Tensor | None
    encoder_decoder: bool = False
    edits: dict[int, tuple] = field(default_factory=dict)
    model: nn.Module | None = field(default=None, repr=False)
    _call: dict = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.steps)

    def __repr__(self) -> str:
        kept = sum(i.kept for i in self.info)
        return (
            f"GenerationTrace({type(self.model).__name__ if self.model is not None else '?'}: "
            f"{len(self.steps)} steps (prefill + {len(self.steps) - 1} decode), {kept} keep tensors, "
            f"sequences {list(self.sequences.shape)})"
        )

    def check_decode(
        self,
        steps: int | range | Sequence[int] | None = None,
        *,
        tolerance: str | None = "auto",
        atol: float | None = None,
        rtol: float | None = None,
        explain: bool = True,
    ) -> DecodeReport:
        """Rerun each decode step as a full forward without the cache and compare every saved site.

        For decode step `i`, the model is run once more on
        every token fed so far (the prompt and the tokens fed at steps `1..i`), with the step's
        attention mask, the position ids that mask implies (`cumsum - 1`, as `generate` derives
        them) and `use_cache=False`; each site the step saved is compared with the rerun's site at
        the step's new positions (an attention pattern over the keys the step attended to).

        Args:
            steps: which decode steps to check (an int, a list or range of ints; default: every
                decode step that kept tensors). Step 0, the prefill, may be named too.
            tolerance: `"auto"` (default): each site's tolerance is set from its dtype as
                `compare(tolerance="auto")` sets it, from a float64 rerun of a copy of the model:
                `|decode - full| <= 4 (max|full - full64| + eps |full|)`. None: `atol`/`rtol`.
            atol: absolute tolerance when `tolerance=None` (default 1e-5).
            rtol: relative tolerance when `tolerance=None` (default 1e-4).
            explain: for a step that differs, say where and why (the first site that differs and
                what the step's tensor equals instead: shifted positions, keys attended that the
                full forward masks, the new key missing from the cache read).

        Returns:
            A [`DecodeReport`][torchlens.DecodeReport]: one row per (step, site) compared, and per
            step its verdict and explanation.
        """
        return check_decode(self, steps, tolerance=tolerance, atol=atol, rtol=rtol, explain=explain)


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


def _check_settings(model: nn.Module, kwargs: dict, prompt_length: int | None) -> int | None:
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


def _step_set(value: Any, what: str, limit: int | None) -> set[int] | None:
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


def _split_edits(
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
            out.append((key[1], _step_set(key[0], f"edit= key {key!r}: the step", limit), value))
        else:
            out.append((key, None, value))
    return dict(edit), out


def _cache_of(kwargs: dict) -> tuple[str | None, Any]:
    """(keyword, cache object) among a forward call's keyword arguments: `cache` in transformers
    5.2x, `past_key_values` before; (None, None) when there is none."""
    for name in ("cache", "past_key_values"):
        value = kwargs.get(name)
        if value is not None and hasattr(value, "get_seq_length"):
            return name, value
    return None, None


def _copy_roles(roles: Roles) -> Roles:
    """A fresh copy of the roles found before the forward, for one step (`find` settles them in place)."""
    out = Roles(roles, roles.overrides)
    out.groups = roles.groups
    return out


def _copy(t: Any) -> Tensor | None:
    return t.detach().clone() if isinstance(t, Tensor) else None


class _Capture:
    """One forward call under capture: its recorder and the contexts it entered."""

    def __init__(self, rec: Recorder, plan: Any, store: Any, edit_plan: Any):
        self.rec = rec
        self.plan = plan
        self.store = store
        self.edit_plan = edit_plan
        self.stack = contextlib.ExitStack()
        self.dispatch: Any = None  # what accelerate_hooks returned, once entered
        self.depth = 0
        self.top: nn.Module | None = None  # the module whose call closes the capture
        self.active = False  # the recorder's mode is on
        self.kind = "step"  # "encoder" from an encoder's call to the decoder's first forward
        self.keep = True  # the step keeps tensors (steps=)

    def enter(self) -> None:
        try:
            self.stack.enter_context(CompiledRunsEagerly())
            self.dispatch = self.stack.enter_context(accelerate_hooks(self.rec.names, self.rec))
            self.resume()
        except BaseException:
            self.stack.close()
            raise

    def pause(self) -> None:
        """Take the recorder's mode off (between an encoder's call and the first decoder forward)."""
        if self.active:
            self.active = False
            self.rec.__exit__(None, None, None)

    def resume(self) -> None:
        self.rec.__enter__()
        self.active = True

    def exit(self, exc: BaseException | None = None) -> None:
        try:
            if self.active:
                self.active = False
                if exc is None:
                    self.rec.__exit__(None, None, None)
                else:
                    self.rec.__exit__(type(exc), exc, exc.__traceback__)
        finally:
            if exc is None:
                self.stack.close()
            else:
                self.stack.__exit__(type(exc), exc, exc.__traceback__)


class _Session:
    """The hooks of one `trace_generate` call: a recorder's hooks on every module, passed to the
    capture under way, and the root's (and an encoder's) opening and closing hooks."""

    def __init__(
        self,
        model,
        names,
        aliases,
        roles,
        spec_keep,
        spec_none,
        keep_steps,
        store,
        edits,
        roles_arg,
        encoder,
    ):
        self.model = model
        self.names = names
        self.aliases = aliases
        self.roles = roles
        self.plans = {
            True: plan_capture(spec_keep, roles, {a: m for m, a in names.items()}),
            False: plan_capture(spec_none, roles, {a: m for m, a in names.items()}),
        }
        self.keep_steps = keep_steps
        self.store = store
        self.edits = edits
        self.roles_arg = roles_arg
        self.encoder = encoder
        self.thread = threading.get_ident()
        self.params: dict[int, str] = {}
        for m, addr in names.items():
            for n, p in m._parameters.items():
                if p is not None:
                    self.params.setdefault(id(p), f"{addr}.{n}" if addr else n)
        self.capture: _Capture | None = None
        self.locating = False
        self.steps: list[Trace] = []
        self.info: list[StepInfo] = []
        self.applied: dict[int, tuple] = {}
        self.handles: list[Any] = []
        self.where: str | None = None  # the part of a step under way, for an error's note

    # -- installing --------------------------------------------------------------------------

    def install(self) -> None:
        model = self.model
        self.handles.append(
            model.register_forward_pre_hook(self.open_root, with_kwargs=True, prepend=True)
        )
        if self.encoder is not None:
            self.handles.append(
                self.encoder.register_forward_pre_hook(
                    self.open_encoder, with_kwargs=True, prepend=True
                )
            )
        for m in self.names:
            self.handles.append(m.register_forward_pre_hook(self.pre_hook, with_kwargs=True))
            self.handles.append(m.register_forward_hook(self.post_hook, always_call=True))
        self.handles.append(
            model.register_forward_hook(self.close_root, with_kwargs=True, always_call=True)
        )
        if self.encoder is not None:
            self.handles.append(
                self.encoder.register_forward_hook(
                    self.close_encoder, with_kwargs=True, always_call=True
                )
            )

    def remove(self, exc: BaseException | None = None) -> None:
        """Remove every hook and close a capture left open (`generate` raised past the hooks, or
        a `BaseException` the module's hooks do not see)."""
        for h in self.handles:
            h.remove()
        self.handles.clear()
        capture, self.capture = self.capture, None
        if capture is not None:
            capture.exit(exc if exc is not None else sys.exc_info()[1])

    # -- the recorder's hooks, passed on ------------------------------------------------------

    def _ours(self) -> bool:
        return (
            self.capture is not None
            and self.capture.active
            and not self.locating
            and threading.get_ident() == self.thread
        )

    def pre_hook(self, module, args, kwargs=None):
        capture = self.capture
        if capture is None or not self._ours():
            return None
        return capture.rec.pre_hook(module, args, kwargs)

    def post_hook(self, module, args, *rest):
        capture = self.capture
        if capture is None or not self._ours():
            return None
        return capture.rec.post_hook(module, args, *rest)

    # -- opening and closing one capture ------------------------------------------------------

    def _open(self, module, args, kwargs, encoder: bool) -> None:
        """Start the capture of the next step: at the root's call, or at an encoder-decoder
        model's encoder call, which step 0 then covers together with the first decoder forward."""
        step = len(self.steps)
        keep = self.keep_steps is None or step in self.keep_steps
        wanted = self._edits_at(step)
        self.where = f"locating the edit= keys of step {step}"
        edit_plan = self._locate(args, kwargs, wanted) if wanted else None
        self.where = f"step {step} ({'the prefill' if step == 0 else f'decode forward {step}'})"
        store = self.store
        if isinstance(store, DirectoryStore):  # one directory per step
            store = DirectoryStore(os.path.join(store.path, f"step-{step:04d}"))
        plan = self.plans[keep]
        rec = Recorder(
            self.names,
            _copy_roles(self.roles),
            plan,
            self.params,
            edit_plan,
            store if isinstance(store, DirectoryStore) else None,
        )
        capture = _Capture(rec, plan, store, edit_plan)
        capture.top = module
        capture.kind = "encoder" if encoder else "step"
        capture.keep = keep
        self.applied[step] = tuple(wanted)
        if not encoder:  # before the recorder's mode is on: this bookkeeping is no op of the step
            self._note_step(args, kwargs, keep)
        capture.enter()
        self.capture = capture

    def _note_step(self, args, kwargs, keep: bool) -> None:
        step = len(self.steps)
        name, cache = _cache_of(kwargs)
        ids = kwargs.get("decoder_input_ids", kwargs.get("input_ids", args[0] if args else None))
        mask = (
            kwargs.get("decoder_attention_mask")
            if "decoder_input_ids" in kwargs
            else kwargs.get("attention_mask")
        )
        past = int(cache.get_seq_length()) if cache is not None else 0
        self.info.append(
            StepInfo(
                step,
                "prefill" if step == 0 else "decode",
                keep,
                _copy(ids),
                _copy(mask),
                _copy(kwargs.get("decoder_position_ids", kwargs.get("position_ids"))),
                _copy(kwargs.get("cache_position")),
                past,
                type(cache).__name__ if cache is not None else None,
            )
        )

    def _edits_at(self, step: int) -> dict:
        return {key: value for key, steps, value in self.edits if steps is None or step in steps}

    def _locate(self, args, kwargs, wanted: dict):
        """The edit plan of one step: a `save="none"` trace of the same call on a copy of its cache."""
        name, cache = _cache_of(kwargs)
        located_kwargs = dict(kwargs)
        if cache is not None:
            located_kwargs[name] = copy.deepcopy(cache)
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
        self.locating = True
        try:
            with torch.random.fork_rng(devices=devices):
                located = trace(
                    self.model, *args, save="none", roles=self.roles_arg, **located_kwargs
                )
        finally:
            self.locating = False
        return plan_edits(located, wanted)

    def open_root(self, module, args, kwargs):
        if self.locating or threading.get_ident() != self.thread:
            return None
        capture = self.capture
        if capture is not None and not capture.active:  # after the encoder: step 0 goes on
            self._note_step(args, kwargs, capture.keep)
            capture.resume()
            return None
        if capture is not None:  # a call inside a capture under way (the model calls itself)
            capture.depth += 1
            return None
        self._open(module, args, kwargs, encoder=False)
        return None

    def open_encoder(self, module, args, kwargs):
        if self.locating or threading.get_ident() != self.thread:
            return None
        if self.capture is not None:
            if self.capture.active:
                self.capture.depth += 1
            return None
        if self.steps:  # generate runs the encoder once, before step 0; a later call is not traced
            return None
        self._open(module, args, kwargs, encoder=True)
        return None

    def close_root(self, module, args, kwargs, output):
        return self._close(module, args, kwargs, output)

    def close_encoder(self, module, args, kwargs, output):
        return self._close(module, args, kwargs, output)

    def _close(self, module, args, kwargs, output):
        capture = self.capture
        if (
            capture is None
            or not capture.active
            or self.locating
            or threading.get_ident() != self.thread
        ):
            return None
        if capture.depth:
            capture.depth -= 1
            return None
        if module is not capture.top:
            return None
        if output is None:  # the forward raised: close the capture, name where
            self.capture = None
            exc = sys.exc_info()[1]
            capture.exit(exc)
            if exc is not None:
                annotate(exc, capture.rec)
            return None
        if capture.kind == "encoder":  # the decoder's first forward completes step 0
            capture.pause()
            capture.kind, capture.top = "step", self.model
            return None
        self.capture = None
        capture.exit()
        self.steps.append(self._assemble(capture, module, args, kwargs, output))
        self.where = None
        return None

    def _assemble(self, capture: _Capture, module, args, kwargs, output) -> Trace:
        """The step's `Trace`, assembled as `torchlens.trace` assembles one (the same function)."""
        rec = capture.rec
        return finish(
            rec,
            self.model,
            self.names,
            self.aliases,
            rec.roles,
            capture.plan,
            capture.edit_plan,
            capture.store,
            capture.dispatch,
            (args, kwargs, output),
        )


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
            a decode step). Each edited step runs one locating pass first, on a copy of its cache.
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
            stopped).
        SaveSpecError, EditSpecError, NotEditable, StoreSpecError, RoleSpecError: as for `trace`.
        Exception: whatever `generate` raises propagates, with a note naming the op and module
            where a traced forward raised; nothing TorchLens installed is left behind.

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
    limit = _check_settings(model, generate_kwargs, prompt_length)
    keep_steps = _step_set(steps, "steps", limit)
    given, edits = _split_edits(edit, limit)
    names: dict[nn.Module, str] = {}
    aliases: dict[str, str] = {}
    for addr, m in model.named_modules(remove_duplicate=False):
        if m in names:
            aliases[addr] = names[m]
        else:
            names[m] = addr
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
    if encoder is not None and edits:
        raise GenerateSpecError(
            f"edit=: trace_generate does not edit an encoder-decoder model's generation yet ({type(model).__name__}: "
            f"step 0 spans the encoder's call and the decoder's first forward, which one locating pass cannot place "
            f"an edit in). Trace it without edit=, or edit one forward with torchlens.trace(..., edit=...)."
        )
    session = _Session(
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
        args = () if input_ids is None else (input_ids,)
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
    ran = len(session.steps)
    if keep_steps is not None and max(keep_steps, default=-1) >= ran:
        raise GenerateSpecError(
            f"steps={steps!r}: step {max(keep_steps)} never ran: generation stopped after {ran} forward calls "
            f"(steps 0..{ran - 1}; an end-of-sequence token or a stopping criterion ended it early)."
        )
    for key, wanted, _ in edits:
        if wanted is not None and not any(s < ran for s in wanted):
            raise GenerateSpecError(
                f"edit= key for {key!r} at steps {sorted(wanted)}: none of them ran: generation stopped after {ran} "
                f"forward calls (steps 0..{ran - 1})."
            )
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
