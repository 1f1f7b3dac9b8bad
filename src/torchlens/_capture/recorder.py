"""Capturing one eager forward pass: a `TorchFunctionMode` for ops, module hooks for structure.

How it works, in one paragraph: `trace` registers a forward pre-hook and a forward hook on every
module of the model and enters a `TorchFunctionMode`. Every torch function the forward calls
passes through the mode, which runs it and appends an [`OpRecord`][torchlens.OpRecord]:
its name, the module running it, references to the ops that produced its tensor inputs, and the
shapes of its outputs. The hooks keep a stack of module calls, so each op knows where it ran.
No torch function or class is patched; every hook and the mode are removed before `trace`
returns or raises. Two things are changed for the duration of a trace and then restored: the
`torch.compile` stance is set to `force_eager` process-wide (see `torchlens._capture.compiled`: other threads
running compiled code meanwhile run it eagerly too), and the hooks accelerate attaches to a
dispatched model's modules are wrapped on those modules only (see
`torchlens._capture.accelerate`). Traces nest: an outer trace records the model ops an inner
trace runs, never the inner
recorder's own bookkeeping (which runs with torch functions disabled when a mode lies below).

Saved tensors are detached *aliases*, not copies, which keeps capture fast and memory-lean.
They still behave as copies: before any op that writes in place (`add_`, `x[i] = ...`,
`inplace=True`, `out=`), the recorder clones every saved alias (op outputs, the arguments kept
for rebuilding a fused attention kernel or `multi_head_attention_forward` (`OpRecord.extra`), and
the module inputs/outputs the hooks kept) that shares storage with the tensor about to be
written: `x += attn(x, x, x)` leaves the attention's kept query/key/value as the op read them.
Each alias's version counter is checked at the end, so a write the mode could not see is
reported, and the alias it overwrote is dropped rather than served with contents the op never
returned; a kept argument overwritten that way is marked stale, and the facets rebuilt from it are
refused with that reason. Inference tensors (`torch.inference_mode()`) have no version counter, so
that last check cannot cover them.

A tensor used after an in-place write is used with its new contents, and the trace says so.
Every recorded tensor carries a stamp: its version counter (none for an inference tensor) and the
count of writes the mode saw into its storage; `x.data = y`, seen by the mode, voids `x`'s stamp.
When a tensor whose stamp changed since its producer recorded it is used again (as an op
input, or as a module's input or output as
the hooks see it), the recorder first appends a `written_in_place` op whose output is the tensor as
it is now and whose input is the op that produced it before the write. This covers writes that no
recorded op returns: `x[i] = v`, a write through a view (`y.view(-1).add_(1)` changes `y`), a
user's forward hook that edits a module's output (also through `.data`, which has a version counter
of its own, or by `x.data = y`, which gives `x` other memory), and writes the mode could not see
that move the version counter. A write that moves nothing the stamp holds (into memory shared with
NumPy, `x.numpy()[:] = 0`) is not seen at all: the values served there are the later ones.

When `trace` returns, every saved alias that still shares storage with a tensor the caller can
reach (the model's inputs, parameters and buffers, the returned output, any recorded tensor
still alive, or any tensor the forward read but did not make: a cache's keys from an earlier
forward, a module's plain tensor attribute) is replaced by a copy, so later in-place writes by
the caller (an optimizer step, a corrupted prompt built in the same `ids` tensor) leave the
finished trace unchanged (`torchlens._capture.snapshot.snapshot`).

The recorder is built in three parts, one class on another: `Recorder` (this module) adds the
module hooks to `torchlens._capture.op_recorder.OpRecorder`, the torch function mode that records
ops and places op edits, which stands on `torchlens._capture.aliases.KeptAliases`, the tensors
kept and the rules above that keep them true (clones before writes, version stamps, the spill,
the end-of-trace check).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch
from torch import Tensor, nn

from torchlens._capture.op_recorder import OpRecorder
from torchlens._capture.values import (
    all_plain,
    first_tensor,
    refuse_script_modules,
    replace_first,
    replace_input,
    tensor_args,
)
from torchlens._core.records import ModuleCall

__all__ = ["Recorder"]


class Recorder(OpRecorder):
    """Records ops (as a torch function mode) and module calls (through hooks) for one forward.

    Not part of the public API: [`trace`][torchlens.trace] creates one per call.

    Args:
        names: module object to canonical address.
        roles: address to role.
        plan: the `CapturePlan` (`torchlens._analysis.selection`): whether every op keeps its output, which
            calls (and everything inside them) keep their op outputs, and which keep only the
            tensors their hooks see as input or output.
        param_names: `id(parameter)` to qualified name.
        edits: an `EditPlan`: sites to replace as the forward computes
            them (module inputs/outputs in the hooks, op outputs in the mode), or None.
        spill: a `torchlens._capture.stores.DirectoryStore` to write held tensors to as capture goes
            (each time a top-level block call ends), or None to keep them in memory.
        grads: keep the gradient edge of every tensor the trace keeps, as the model produced or
            used it (`torchlens._capture.edges.Edges`), for `trace(..., grads=loss_fn)`.
    """

    def __init__(self, names, roles, plan, param_names, edits=None, spill=None, grads=False):
        refuse_script_modules(names)
        super().__init__(plan, param_names, edits, spill, grads)
        self.names = names
        self.roles = roles
        self.retain_modules = plan.op_modules
        self._hold = {"_in": plan.hold_in, "_out": plan.hold_out}
        self.calls: list[ModuleCall] = []
        self.call_counts: dict[str, int] = {}
        self.thread = threading.get_ident()
        #: (exception, module path) where a forward raised, seen by the innermost hook that
        #: unwound it; `trace` names it in the note it adds to the exception.
        self.failure: tuple[BaseException, list[str]] | None = None
        #: the `_capture.snapshot.Guarded` groups the snapshot left, until `arm_guards` arms them
        self.guarded: list = []
        #: the groups of those on memory only the output shares (`output_copies.settle` decides)
        self.output_groups: list = []

    # -- modules -------------------------------------------------------------------------------

    # The hooks accept the signatures with and without kwargs: another thread can run the model
    # while `trace` removes its hooks, and `Module._call_impl` then calls a hook it listed before
    # the removal without the kwargs it no longer knows the hook wants.

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict | None = None):
        # Quiet already: a module called by code the trace does not record (an edit function, an
        # accelerate hook's body) is part of that code, not a module call of the forward.
        if threading.get_ident() != self.thread or self._quiet:
            return None
        kwargs = kwargs or {}
        changed = False
        self._quiet = True
        try:
            if self.edits is not None and self.edits.hook_in:
                addr = self.names[module]
                edits = self.edits.hook_in.get((addr, self.call_counts.get(addr, 0)))
                if edits:
                    args, kwargs = replace_input(
                        args, kwargs, lambda t: self._edit_hooked(edits, t)
                    )
                    changed = True
            # The bookkeeping reaches no torch function mode, this one included: outside an op,
            # this mode is active, and every `t._version` or `t.detach()` would pass through it.
            # A tensor subclass among the inputs keeps its own `__torch_function__` (its aliases
            # stay of its type), so then the mode passes the calls through as `_quiet`.
            with torch._C.DisableTorchFunction() if all_plain(args, kwargs) else self.hidden():
                self._enter(module, args, kwargs)
        finally:
            self._quiet = False
        return (args, kwargs) if changed else None

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        addr = self.names[module]
        n = self.call_counts.get(addr, 0)
        self.call_counts[addr] = n + 1
        parent = self.stack[-1] if self.stack else None
        retained = (
            self.retain_all
            or addr in self.retain_modules
            or (parent is not None and parent.retained)
        )
        call = ModuleCall(
            addr,
            n,
            self.roles[addr],
            type(module).__name__,
            len(self.ops),
            parent=parent,
            retained=retained,
        )
        if parent is None:  # the root: its tensor inputs become `input` ops
            for x in tensor_args(args, kwargs):
                if self._ref(x) is None:
                    self.add_external(x, call)
        t = args[0] if args and isinstance(args[0], Tensor) else None
        if t is None and not args:
            t = next((v for v in kwargs.values() if isinstance(v, Tensor)), None)
        if t is not None:
            self._keep_io(call, "_in", t)
        self.stack.append(call)
        self.calls.append(call)

    def post_hook(self, module: nn.Module, args: tuple, *kwargs_and_output: Any):
        if threading.get_ident() != self.thread or self._quiet:  # as in `pre_hook`
            return None
        output = kwargs_and_output[-1]
        changed = False
        self._quiet = True
        try:
            if self.edits is not None and self.edits.hook_out and output is not None and self.stack:
                top = self.stack[-1]
                edits = self.edits.hook_out.get((top.address, top.index))
                if edits and top.address == self.names[module]:
                    output = replace_first(output, lambda t: self._edit_hooked(edits, t))
                    changed = True
            t = output if type(output) is Tensor else first_tensor(output)
            with (
                torch._C.DisableTorchFunction() if t is None or type(t) is Tensor else self.hidden()
            ):  # as in `pre_hook`
                call = self._leave(module, output, t)
            if (
                self.spill is not None
                and call is not None
                and call.role == "block"
                and not any(c.role == "block" for c in self.stack)
            ):
                with self.hidden():
                    self.write_spill()
        finally:
            self._quiet = False
        return output if changed else None

    def _leave(self, module: nn.Module, output: Any, t: Tensor | None) -> ModuleCall | None:
        """Pop this module's call (and any left open under it) and note its output `t`
        (`first_tensor(output)`); the call, or None when it was not on the stack."""
        addr = self.names[module]
        if (
            output is None
        ):  # torch runs always_call hooks with output None while an exception unwinds
            exc = sys.exc_info()[1]
            if exc is not None and (self.failure is None or self.failure[0] is not exc):
                self.failure = (exc, [c.address or "<root>" for c in self.stack])
        while self.stack:  # pop up to and including this module's call (robust to errors)
            call = self.stack.pop()
            call.end_op = len(self.ops)
            if call.address == addr:
                break
        else:
            return None
        if t is not None:
            self._keep_io(call, "_out", t)
        return call

    def _keep_io(self, call: ModuleCall, side: str, t: Tensor) -> None:
        """Note which op produced a module's input or output; keep an alias where that is not enough.

        The alias is kept when no op of the forward produced the tensor (a model input, a
        parameter) or when only this module's subtree is retained (the producer's output is not).
        A call the plan holds this side of (`save=["resid_post"]` holds each block's output)
        keeps the tensor as the output of the op that produced it, and nothing else of its ops.
        """
        entry = self.producer.get(id(t))
        ref = None
        if (
            entry is not None and not self._writes and entry[1]() is t
        ):  # `_ref`, inlined for the common case
            stamp = entry[2]
            if stamp is not None and not stamp[1]:
                try:
                    version = t._version
                except RuntimeError:  # an inference tensor
                    version = None
                if version == stamp[0]:
                    ref = entry[0]
        if ref is None:
            ref = self._ref(t)
        if side == "_in":
            call.input_ref = ref
        else:
            call.output_ref = ref
        if ref is None or isinstance(ref, str) or (call.retained and not self.retain_all):
            alias = t.detach()
            setattr(call, side, alias)
            self._hook_aliases.append((call, side))
            if self.edges is not None:
                self.edges.keep_alias(alias, t)
            self._note_hook_version(call, side, alias)
        elif not self.retain_all and call.address in self._hold[side]:
            self._hold_output(ref, t)
