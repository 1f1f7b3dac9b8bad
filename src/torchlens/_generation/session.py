"""One capture per forward call of a generation: the hooks `trace_generate` installs.

A generation is many forward passes: the prefill over the prompt, then one decode forward per new
token, each reading the keys and values of the earlier positions from a KV cache. Each of them is
captured as its own `Trace`, by the same machinery `trace` uses, split so that one `Recorder` runs
per forward call:

- before `generate` runs, every module gets the recorder's two hooks through one dispatcher
  (`Session`), which passes each call to the recorder of the forward call under way, if any;
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

`edit=` is planned per step, as `trace` plans it: each edited step first runs one locating pass
(`save="none"`) on a deep copy of the cache the step receives (so the real cache is updated once),
with the RNG state restored after it, and the edited forward then checks every op it replaces; the
step's trace must find each edited site at the op replaced. An encoder-decoder model's edits are
resolved once, before the encoder's call, and placed in two parts at step 0 (the encoder's call,
the decoder's first forward), each moved onto the step's capture when its first module is entered
(`torchlens._generation.encdec_edits`).
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import threading
from typing import Any

import torch
from torch import Tensor, nn

from torchlens._analysis.role_rules import Roles
from torchlens._analysis.selection import plan_capture
from torchlens._capture.accelerate import accelerate_hooks
from torchlens._capture.compiled import CompiledRunsEagerly
from torchlens._capture.recorder import Recorder
from torchlens._capture.step_copies import DeferredCopies, SharedWeights
from torchlens._capture.stores import DirectoryStore
from torchlens._core.errors import FacetNotFound
from torchlens._edits import EditPlan, plan_edits
from torchlens._generation.encdec_edits import (
    decoder_sites,
    encoder_plan,
    given_keys,
    input_ops,
    resolve_keys,
)
from torchlens._generation.result import StepInfo
from torchlens._trace import Trace
from torchlens._tracing import annotate, finish, locating_trace, parameter_names

__all__ = ["Session"]


def _cache_of(kwargs: dict) -> tuple[str | None, Any]:
    """(keyword, cache object) among a forward call's keyword arguments: `cache` in transformers
    5.2x, `past_key_values` before; (None, None) when there is none."""
    for name in ("cache", "past_key_values"):
        value = kwargs.get(name)
        if value is not None and hasattr(value, "get_seq_length"):
            return name, value
    return None, None


def _past_length(cache: Any, kwargs: dict, earlier: list[StepInfo]) -> int:
    """The positions `cache` holds before a step: its own count where it keeps one; for a cache
    that keeps none (a state-space model's, Mamba's: `get_seq_length` raises), the step's first
    `cache_position`, else the tokens the earlier steps ran on."""
    try:
        return int(cache.get_seq_length())
    except (ValueError, NotImplementedError, TypeError, AttributeError):
        position = kwargs.get("cache_position")
        if isinstance(position, Tensor) and position.numel():
            return int(position.reshape(-1)[0])
        return sum(int(i.input_ids.shape[-1]) for i in earlier if i.input_ids is not None)


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
        #: an encoder-decoder step's part still to place: (its first module, its plan, the position
        #: its ops count from in the locating trace), merged once that module is entered
        self.part: tuple[nn.Module, EditPlan, int] | None = None

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


class Session:
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
        #: the parameters' names by id, and the parameters, held for the generation so that no
        #: other tensor takes one of those ids meanwhile (`torchlens._tracing.parameter_names`)
        self.params, self.held_params = parameter_names(names)
        self.capture: _Capture | None = None
        self.locating = False
        self.steps: list[Trace] = []
        self.info: list[StepInfo] = []
        self.applied: dict[int, tuple] = {}
        self.handles: list[Any] = []
        self.where: str | None = None  # the part of a step under way, for an error's note
        #: an encoder-decoder model's `edit=` entries, resolved before the encoder's call
        self.encdec_keys: list | None = None
        #: the weight copies the steps' pending checks share, compared once `generate` returns
        self.shared_weights = SharedWeights()
        #: the steps' tensors the model kept, copied before a later step writes into them, or once
        #: `generate` returns where the caller can still reach them
        self.deferred = DeferredCopies()
        #: each step's directory store (`store=` a directory), whose files a failed call removes
        self.step_stores: list[DirectoryStore] = []

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

    def discard_stores(self) -> None:
        """Remove the files every step's directory store wrote: the call failed, and they serve
        no trace."""
        for store in self.step_stores:
            store.discard()

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
        part = capture.part
        if part is None or module is not part[0]:
            return capture.rec.pre_hook(module, args, kwargs)
        # The first module of an encoder-decoder step's part: its hook edits go in before its
        # call is entered (they may edit its input), its op edits once the recorder has entered it
        # (and recorded a root's inputs), counted from there.
        capture.part = None
        plan = capture.edit_plan
        assert plan is not None  # an encoder-decoder step with edits holds a plan from its opening
        plan.merge_hooks(part[1])
        out = capture.rec.pre_hook(module, args, kwargs)
        here = len(capture.rec.ops) - sum(1 for op in capture.rec.ops if op.name == "edited")
        plan.merge_ops(part[1], here - part[2])
        return out

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
        self.where = f"locating the edit= keys of step {step}"
        part = None
        if self.encoder is None:
            wanted = self._edits_at(step)
            edit_plan = plan_edits(self._located(args, kwargs), wanted) if wanted else None
            applied = tuple(wanted)
        elif encoder:  # step 0's encoder call: every key resolved, the encoder's sites located
            edit_plan, part, applied = self._locate_encoder(module, args, kwargs)
        else:  # a decoder forward after step 0
            wanted = decoder_sites(self.encdec_keys or [], step)
            try:
                edit_plan = plan_edits(self._located(args, kwargs), wanted) if wanted else None
            except FacetNotFound as exc:
                if not hasattr(exc, "add_note"):  # Python before 3.11
                    raise
                exc.add_note(
                    f"torchlens: step {step} is a decode forward of an encoder-decoder model: its "
                    f"cross-attention reads the keys and values cached at step 0 instead of computing "
                    f"them, so a cross-attention k or v (or anything computed from the encoder's "
                    f"output alone) exists at step 0 only; key such an edit as (0, key)."
                )
                raise
            if edit_plan is not None:
                given_keys(edit_plan, self.encdec_keys or [])
            applied = tuple(r.key for r in edit_plan.records) if edit_plan is not None else ()
        self.where = f"step {step} ({'the prefill' if step == 0 else f'decode forward {step}'})"
        store = self.store
        if isinstance(store, DirectoryStore):  # one directory per step
            store = DirectoryStore(os.path.join(store.path, f"step-{step:04d}"))
            self.step_stores.append(store)
        plan = self.plans[keep]
        rec = Recorder(
            self.names,
            _copy_roles(self.roles),
            plan,
            self.params,
            edit_plan,
            store if isinstance(store, DirectoryStore) else None,
        )
        rec.shared_weights, rec.deferred = self.shared_weights, self.deferred
        capture = _Capture(rec, plan, store, edit_plan)
        capture.top = module
        capture.kind = "encoder" if encoder else "step"
        capture.keep = keep
        capture.part = part
        self.applied[step] = applied
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
        past = _past_length(cache, kwargs, self.info) if cache is not None else 0
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

    def _located(self, args, kwargs) -> Trace:
        """The locating pass of one forward call (`torchlens._tracing.locating_trace`) on the same
        arguments and a copy of its cache."""
        name, cache = _cache_of(kwargs)
        located_kwargs = dict(kwargs)
        if cache is not None:
            located_kwargs[name] = copy.deepcopy(cache)
        self.locating = True
        try:
            return locating_trace(self.model, args, located_kwargs, self.roles_arg)
        finally:
            self.locating = False

    def _locate_encoder(self, module, args, kwargs) -> tuple[EditPlan | None, Any, tuple]:
        """Step 0 of an encoder-decoder generation with `edit=`, before the encoder runs: one full
        forward of the model on the encoder's arguments (and a one-token decoder input) resolves
        every key and locates the encoder's sites. Returns the step's plan (empty until each part
        is placed), the encoder's part and the keys it applies."""
        if not self.edits:
            return None, None, ()
        tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, Tensor)]
        start = getattr(
            getattr(self.model, "generation_config", None), "decoder_start_token_id", None
        )
        decoder_ids = torch.full(
            (tensors[0].shape[0], 1),
            start if isinstance(start, int) else 0,
            dtype=torch.long,
            device=tensors[0].device,
        )
        located = self._located(args, dict(kwargs, decoder_input_ids=decoder_ids, use_cache=False))
        encoder = self.names[module]
        self.encdec_keys = resolve_keys(located, encoder, self.edits)
        plan, first = encoder_plan(located, encoder, self.encdec_keys)
        part = (module, plan, first) if plan is not None else None
        applied = tuple(r.key for r in plan.records) if plan is not None else ()
        return EditPlan(), part, applied

    def _locate_first_decoder(self, capture: _Capture, module, args, kwargs) -> None:
        """Step 0's decoder forward, after the encoder's call: its sites located as a later step's
        are, its module calls numbered past the encoder's, placed once the model is entered."""
        wanted = decoder_sites(self.encdec_keys or [], 0)
        if not wanted:
            return
        self.where = "locating the edit= keys of step 0 (the decoder's first forward)"
        located = self._located(args, kwargs)
        plan = plan_edits(located, wanted)
        given_keys(plan, self.encdec_keys or [])
        counts = dict(capture.rec.call_counts)
        plan.move_calls(lambda address, i: i + counts.get(address, 0))
        capture.part = (module, plan, input_ops(located))
        self.applied[0] = tuple(dict.fromkeys([*self.applied[0], *(r.key for r in plan.records)]))
        self.where = "step 0 (the prefill)"

    def open_root(self, module, args, kwargs):
        if self.locating or threading.get_ident() != self.thread:
            return None
        capture = self.capture
        if capture is not None and not capture.active:  # after the encoder: step 0 goes on
            if self.encdec_keys is not None:
                self._locate_first_decoder(capture, module, args, kwargs)
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
        if capture.edit_plan is not None and not capture.edit_plan.records:
            capture.edit_plan = None  # an encoder-decoder step none of the keys edits
        step = self._assemble(capture, module, args, kwargs, output)  # checks the edits' places
        self.steps.append(step)
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
