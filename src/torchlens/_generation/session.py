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
with the RNG state restored after it, and the edited forward then checks every op it replaces.
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
from torchlens._capture.stores import DirectoryStore
from torchlens._edits import plan_edits
from torchlens._generation.result import StepInfo
from torchlens._trace import Trace
from torchlens._tracing import annotate, finish, trace

__all__ = ["Session"]


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
