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
reach (the model's inputs, parameters and buffers, the returned output, or any recorded tensor
still alive) is replaced by a copy, so later in-place writes by the caller (an optimizer step, a
corrupted prompt built in the same `ids` tensor) leave the finished trace unchanged
(`torchlens._capture.snapshot.snapshot`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
import weakref
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from torchlens._capture.edges import Edges
from torchlens._capture.values import (
    all_plain,
    first_tensor,
    refuse_script_modules,
    replace_first,
    replace_input,
    tensor_args,
    writes_inputs,
)
from torchlens._core.errors import EditSpecError
from torchlens._core.holdings import (
    Holding,
    arg_slots,
    get_arg,
    held_tensors,
    memory_key,
    set_arg,
    storage_ptr,
)
from torchlens._core.ops import INPLACE, REBUILT_OPS, REPOINT, SKIP, classify
from torchlens._core.records import Dropped, ModuleCall, OpRecord, Ref

__all__ = ["Recorder"]

_NO_HIDING = contextlib.nullcontext()
#: one kept alias of a storage (`Recorder._cow`): an op's output slot, a rebuilt op's kept
#: argument, or a module input/output a hook kept
_Alias = tuple[int, int] | tuple[int, tuple[str, Any]] | tuple[ModuleCall, str]
#: `Ref(op, slot)` without the Python-level `__new__` of a named tuple (once per recorded op).
_new_ref = tuple.__new__


class Recorder(TorchFunctionMode):
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
        super().__init__()
        refuse_script_modules(names)
        self.names = names
        self.roles = roles
        self.retain_all = plan.retain_all
        self.retain_modules = plan.op_modules
        self._hold = {"_in": plan.hold_in, "_out": plan.hold_out}
        self.param_names = param_names
        self.ops: list[OpRecord] = []
        self.calls: list[ModuleCall] = []
        self.stack: list[ModuleCall] = []
        self.call_counts: dict[str, int] = {}
        #: id(tensor) -> (the Ref it is, a weak reference to it, its `_stamp` when recorded)
        self.producer: dict[int, tuple[Ref, Any, Any]] = {}
        self.thread = threading.get_ident()
        self.versions: dict[tuple[int, int], int] = {}  # (op, slot) -> version when saved
        #: (op, ("args", i) or ("kwargs", name)) -> version of a rebuilt op's kept argument
        self.arg_versions: dict[tuple[int, tuple[str, Any]], int] = {}
        #: storage -> the aliases kept of it: (op, output slot), (op, kept argument's key) of a
        #: rebuilt op, or (call, "_in" / "_out") a hook kept
        self._cow: dict[int | None, list[_Alias]] = {}
        self._cow_upto = 0
        self._writes: dict[
            int, int
        ] = {}  # storage data_ptr -> writes the mode saw into it (`_stamp`)
        self._hook_aliases: list[
            tuple[ModuleCall, str]
        ] = []  # module inputs/outputs the hooks kept
        self._hook_versions: dict[
            tuple[int, str], int
        ] = {}  # (id(call), side) -> the alias's version when kept
        self._hook_upto = 0
        self._kinds: dict[
            Any, tuple[str, int]
        ] = {}  # torch function -> `classify` answer, this trace
        self.spill = spill
        if spill is not None:
            spill.writes = self._writes
        self._spill_ops = (
            0  # ops before this index were written to `spill` (or had nothing to write)
        )
        self._kept_in_memory = (
            False  # a tensor the spill could not write (no storage of its own) stays held
        )
        self._spill_hooks = 0  # the same for `_hook_aliases`
        #: (exception, op name) of the last op that raised, for the note `trace` adds; an op
        #: failure the model caught and handled is never mistaken for a later error.
        self.op_failure: tuple[BaseException, str] | None = None
        #: (exception, module path) where a forward raised, seen by the innermost hook that
        #: unwound it; `trace` names it in the note it adds to the exception.
        self.failure: tuple[BaseException, list[str]] | None = None
        #: the `_capture.snapshot.Guarded` groups the snapshot left, until `arm_guards` arms them
        self.guarded: list = []
        self._quiet = False  # True while the hooks run torch functions of their own
        #: True when another torch function mode (an outer trace, a user's mode) was active when
        #: this recorder was entered: the recorder's own bookkeeping is then hidden from it.
        self.nested = False
        self.edits = edits
        #: `edited` ops recorded so far: an op's position in the forward (as the locating pass
        #: numbered it) is its index minus these.
        self._n_edited = 0
        #: the gradient edges of what the trace keeps (`grads=`), or None
        self.edges: Edges | None = Edges() if grads else None

    def __enter__(self):
        self.nested = torch._C._len_torch_function_stack() > 0
        return super().__enter__()

    def hidden(self):
        """A context in which the recorder's own torch calls reach no outer torch function mode."""
        return torch._C.DisableTorchFunction() if self.nested else _NO_HIDING

    # -- ops -----------------------------------------------------------------------------------

    def _classify(self, func) -> tuple[str, int]:
        try:
            return self._kinds[func]
        except KeyError:
            info = self._kinds[func] = classify(func)
            return info
        except TypeError:  # an unhashable callable
            return classify(func)

    def _repointed(self, args: tuple) -> None:
        """`x.data = y` ran: `x` holds other values now, and no counter says so."""
        entry = self.producer.get(id(args[0])) if args else None
        if entry is not None:
            self.producer[id(args[0])] = (
                entry[0],
                entry[1],
                None,
            )  # no stamp matches: next use is a write

    def _quiet_call(self, func, args, kwargs):
        """Run `func` unrecorded (the recorder's own calls, an accelerate hook's moves, an edit),
        still keeping what the trace holds right: an in-place write first clones the saved
        aliases on the memory it writes and is counted there (so a write through `x.data` marks
        `x` written), and `x.data = y` voids `x`'s stamp."""
        kind = self._classify(func)[1]
        if writes_inputs(kind, kwargs):
            with self.hidden():
                self._before_write(args, kwargs or {})
        elif kind == REPOINT:
            self._repointed(args)
        return func(*args, **kwargs) if kwargs else func(*args)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self._quiet:
            return self._quiet_call(func, args, kwargs)
        try:  # `_classify`, inlined: this runs once per op of the forward
            info = self._kinds[func]
        except KeyError:
            info = self._kinds[func] = classify(func)
        except TypeError:  # an unhashable callable
            info = classify(func)
        kind = info[1]
        if kind == SKIP:
            return func(*args, **kwargs) if kwargs else func(*args)
        if kind == REPOINT:
            out = func(*args, **kwargs) if kwargs else func(*args)
            self._repointed(args)
            return out
        if kwargs:
            mutated = (
                kind == INPLACE or kwargs.get("out") is not None or kwargs.get("inplace") is True
            )
            ins = tensor_args(args, kwargs)
        else:  # most ops: positional arguments only (`_capture.values.writes_inputs` and `tensor_args`, inlined)
            kwargs = {}
            mutated = kind == INPLACE
            ins = []
            for a in args:
                if isinstance(a, Tensor):
                    ins.append(a)
                elif isinstance(a, (list, tuple)):
                    ins.extend([x for x in a if isinstance(x, Tensor)])
        refs = None
        if (
            mutated
        ):  # the input refs are taken before the op writes them (the write makes them stale)
            if self.nested:
                with torch._C.DisableTorchFunction():
                    refs = tuple([self._ref(t) for t in ins])
                    self._before_write(args, kwargs)
            else:
                refs = tuple([self._ref(t) for t in ins])
                self._before_write(args, kwargs)
        try:
            out = func(*args, **kwargs)
        except BaseException as exc:
            self.op_failure = (exc, info[0])
            raise
        outs: tuple[Tensor, ...]
        if isinstance(out, Tensor):
            outs = (out,)
        elif isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
            outs = tuple(o for o in out if isinstance(o, Tensor))
        else:
            return out
        if self.edits is not None and self.edits.ops and not mutated and isinstance(out, Tensor):
            with self.hidden():
                refs = tuple([self._ref(t) for t in ins])
            edit = self.edits.ops.get(len(self.ops) - self._n_edited)
            if edit is not None:
                out = self._edit_op(edit, info[0], out)
                outs = (out,)
        if self.nested:
            with torch._C.DisableTorchFunction():
                self._record(info[0], outs, ins, mutated, args, kwargs, refs)
        else:
            self._record(info[0], outs, ins, mutated, args, kwargs, refs)
        return out

    # -- edits ---------------------------------------------------------------------------------

    def _run_edit(self, edit, t: Tensor) -> Tensor:
        """`edit` applied to `t`, its own torch calls not recorded by this trace (its `edited` op
        stands for them) but still seen by it (`_quiet_call`: an in-place write in it is one), and
        by any other torch function mode below: they are computation of the forward, not the
        recorder's bookkeeping."""
        quiet = self._quiet
        self._quiet = True
        try:
            return edit.apply(t)
        finally:
            self._quiet = quiet

    def _edit_op(self, edit, name: str, out: Tensor) -> Tensor:
        """The replaced output of the op the plan names at this position (checked to be that op)."""
        call = self.stack[-1] if self.stack else None
        where = (call.address, call.index) if call is not None else ("", 0)
        if (name, where) != (edit.op_name, (edit.op_module, edit.op_call)):
            raise EditSpecError(
                f"edit {edit.record.key!r}: the locating pass found {edit.op_name} in {edit.op_module or '<root>'} "
                f"(call {edit.op_call}) at op #{len(self.ops) - self._n_edited}, but the edited forward ran {name} in "
                f"{where[0] or '<root>'} (call {where[1]}) there: it took another path (an earlier edit changed "
                f"control flow, or the forward is not deterministic), so the edit is not placed."
            )
        # This runs in the mode's handler, where torch has taken the mode off its stack: it goes
        # back on for the edit, so that the edit's writes are seen (`_quiet_call`) as a hook
        # edit's are.
        torch.overrides._push_mode(self)
        try:
            return self._run_edit(edit, out)
        finally:
            torch.overrides._pop_mode()

    def _edit_hooked(self, edits, t: Tensor) -> Tensor:
        """`t` replaced by each edit in turn; each replacement is recorded as an `edited` op."""
        for edit in edits:
            with self.hidden():
                ref = self._ref(t)
            t = self._run_edit(edit, t)
            with self.hidden():
                self._record("edited", (t,), (), False, refs=(ref,))
            self._n_edited += 1
        return t

    def _stamp(self, t: Tensor) -> tuple:
        """What changes when `t` is written in place: `(version, writes)`, its version counter
        (None for an inference tensor, which has none) and the number of writes the mode saw into
        its storage (a write through `x.data`, an alias with a version counter of its own, moves
        only that). `x.data = y`, which gives `x` other memory and moves neither, is noted where
        the mode sees it (`REPOINT`)."""
        try:
            version = t._version
        except RuntimeError:  # an inference tensor
            version = None
        writes = self._writes
        if not writes:  # no write seen yet (most forwards see none): no storage to look up
            return (version, 0)
        key = memory_key(t)
        return (version, 0 if key is None else writes.get(key, 0))  # a sparse tensor: never counted

    def _ref(self, t: Tensor):
        entry = self.producer.get(id(t))
        if entry is not None and entry[1]() is t:
            if entry[2] != self._stamp(
                t
            ):  # written in place (or given other memory) since its producer recorded it
                return self._record("written_in_place", (t,), (), True, refs=(entry[0],))
            return entry[0]
        return self.param_names.get(id(t))

    def _refs(self, ins: list) -> tuple:
        """`tuple(self._ref(t) for t in ins)`, with the common case inlined: no write seen yet
        in this forward (so a stamp is `(version, 0)`) and each input as its producer left it."""
        if self._writes:
            ref = self._ref
            return tuple([ref(t) for t in ins])
        producer, params, found = self.producer, self.param_names, []
        for t in ins:
            entry = producer.get(id(t))
            if entry is None:
                found.append(params.get(id(t)))
                continue
            if entry[1]() is t:
                stamp = entry[2]
                if stamp is not None and not stamp[1]:
                    try:
                        version = t._version
                    except RuntimeError:  # an inference tensor
                        version = None
                    if version == stamp[0]:
                        found.append(entry[0])
                        continue
            found.append(
                self._ref(t)
            )  # stale (a `written_in_place` op first), or not its producer's
        return tuple(found)

    def _record(self, name, outs, ins, mutated, args=(), kwargs=None, refs=None):
        inputs = self._refs(ins) if refs is None else refs
        idx = len(self.ops)  # after the inputs: a stale input appends a `written_in_place` op first
        stack = self.stack
        call = stack[-1] if stack else None
        producer = self.producer
        retain = self.retain_all or (call is not None and call.retained)
        if len(outs) == 1:  # most ops: one output
            o0 = outs[0]
            if self._writes:
                stamp = self._stamp(o0)
            else:  # `_stamp`, inlined
                try:
                    stamp = (o0._version, 0)
                except RuntimeError:  # an inference tensor
                    stamp = (None, 0)
            if retain:
                kept0 = o0.detach()
                tensors: tuple[Tensor | None, ...] = (kept0,)
                if (
                    stamp[0] is not None
                ):  # a detached alias shares the counter: its version when saved
                    self.versions[idx, 0] = stamp[0]
                if self.edges is not None and o0.requires_grad:
                    self.edges.ops[idx, 0] = (self.edges.of(o0), kept0)
            else:
                tensors = (None,)
            first = _new_ref(Ref, (idx, 0))
            producer[id(o0)] = (first, weakref.ref(o0), stamp)
            shapes, dtypes = (o0.shape,), (o0.dtype,)
        else:
            stamps = [self._stamp(o) for o in outs]
            if retain:
                kept = tuple([o.detach() for o in outs])
                tensors = kept
                for slot, stamp in enumerate(stamps):
                    if stamp[0] is not None:  # as above
                        self.versions[idx, slot] = stamp[0]
                if self.edges is not None:
                    for slot, o in enumerate(outs):
                        if o.requires_grad:
                            self.edges.ops[idx, slot] = (self.edges.of(o), kept[slot])
            else:
                tensors = (None,) * len(outs)
            for slot, (o, stamp) in enumerate(zip(outs, stamps)):
                producer[id(o)] = (_new_ref(Ref, (idx, slot)), weakref.ref(o), stamp)
            o0 = outs[0]
            first = _new_ref(Ref, (idx, 0))
            shapes, dtypes = tuple([o.shape for o in outs]), tuple([o.dtype for o in outs])
        extra = None
        if retain and name in REBUILT_OPS:
            extra = self._keep_args(idx, args, kwargs)
        if call is None:
            self.ops.append(
                OpRecord(
                    idx, name, "", 0, inputs, shapes, dtypes, o0.device, tensors, mutated, extra
                )
            )
        else:
            self.ops.append(
                OpRecord(
                    idx,
                    name,
                    call.address,
                    call.index,
                    inputs,
                    shapes,
                    dtypes,
                    o0.device,
                    tensors,
                    mutated,
                    extra,
                )
            )
        return first

    def _keep_args(self, idx: int, args: tuple, kwargs: dict) -> dict:
        """The arguments of rebuilt op `idx` (`OpRecord.extra`), each tensor detached once (a
        tensor passed as query, key and value is one alias), with its version noted for
        `check_versions`. `_before_write` clones an alias before a write into its storage."""
        seen: dict[int, Tensor] = {}

        def keep(a: Any) -> Any:
            if not isinstance(a, Tensor):
                return a
            kept = seen.get(id(a))
            if kept is None:
                kept = seen[id(a)] = a.detach()
                if self.edges is not None and a.requires_grad:
                    self.edges.args[idx, id(kept)] = self.edges.of(a)
            return kept

        extra = {
            "args": tuple([keep(a) for a in args]),
            "kwargs": {k: keep(v) for k, v in kwargs.items()},
        }
        for key, t in arg_slots(extra):
            if not t.is_inference():  # inference tensors have no version counter
                self.arg_versions[idx, key] = t._version
        return extra

    def _before_write(self, args, kwargs) -> None:
        """Clone every saved alias (op outputs, kept kernel arguments, hook aliases) that shares
        storage with a tensor an op is about to write."""
        targets = [args[0]] if args and isinstance(args[0], Tensor) else []
        out = kwargs.get("out")
        targets += (
            [out] if isinstance(out, Tensor) else [t for t in (out or ()) if isinstance(t, Tensor)]
        )
        if not targets:
            return
        writes = self._writes
        # Memory is told by its storage (a wrapper subclass by its first inner tensor's); a sparse
        # tensor, with neither, is not counted or cloned: a write into it moves its version
        # counter, which the end check reads.
        ptrs = [memory_key(target) for target in targets]
        for ptr in ptrs:
            if ptr:  # every empty tensor has pointer 0: a write into one changes no other
                writes[ptr] = writes.get(ptr, 0) + 1
        ops, cow = self.ops, self._cow
        for n in range(self._cow_upto, len(ops)):
            for out_slot, t in enumerate(ops[n].tensors):
                if t is not None:
                    cow.setdefault(memory_key(t), []).append((n, out_slot))
            if ops[n].extra is not None:
                for key, t in arg_slots(ops[n].extra):
                    cow.setdefault(memory_key(t), []).append((n, key))
        self._cow_upto = len(ops)
        for call, attr in self._hook_aliases[self._hook_upto :]:
            cow.setdefault(memory_key(getattr(call, attr)), []).append((call, attr))
        self._hook_upto = len(self._hook_aliases)
        cow.pop(None, None)
        clones: dict[int, Tensor] = {}  # one clone per alias (a kept argument passed twice is one)
        for ptr in ptrs:
            for i, slot in cow.pop(ptr, ()):
                if isinstance(i, ModuleCall):  # a module input/output alias kept by a hook
                    assert isinstance(slot, str)  # its side, "_in" or "_out"
                    copy = getattr(i, slot).clone()
                    if self.edges is not None:
                        self.edges.moved(getattr(i, slot), copy)
                    setattr(i, slot, copy)
                    self._note_hook_version(i, slot, copy)
                    continue
                if isinstance(slot, tuple):  # a kept argument of a rebuilt op
                    old = get_arg(ops[i].extra, slot)
                    new = clones.get(id(old))
                    if new is None:
                        new = clones[id(old)] = old.clone()
                        if self.edges is not None:
                            self.edges.moved_arg(i, old, new)
                    set_arg(ops[i].extra, slot, new)
                    if new.is_inference():
                        self.arg_versions.pop((i, slot), None)
                    else:
                        self.arg_versions[i, slot] = new._version
                    continue
                assert isinstance(slot, int)  # an op's output slot
                tensors = list(ops[i].tensors)
                tensors[slot] = tensors[slot].clone()
                ops[i].tensors = tuple(tensors)
                if self.edges is not None:
                    self.edges.moved_op(i, slot, tensors[slot])
                if tensors[slot].is_inference():  # a clone made under inference_mode
                    self.versions.pop((i, slot), None)
                else:
                    self.versions[i, slot] = tensors[slot]._version

    def add_external(self, t: Tensor, where: ModuleCall) -> None:
        """Record a tensor that enters the forward from outside (a model input) as an `input` op."""
        self.stack.append(where)
        try:
            self._record("input", (t,), (), False)
        finally:
            self.stack.pop()

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
            if self.edges is not None and t.requires_grad:
                self.edges.keep_alias(alias, self.edges.of(t))
            self._note_hook_version(call, side, alias)
        elif not self.retain_all and call.address in self._hold[side]:
            self._hold_output(ref, t)

    def _note_hook_version(self, call: ModuleCall, side: str, alias: Tensor) -> None:
        """Note the version of a module input/output alias, for `check_versions`."""
        if alias.is_inference():  # no version counter
            self._hook_versions.pop((id(call), side), None)
        else:
            self._hook_versions[id(call), side] = alias._version

    def _hold_output(self, ref: Ref, t: Tensor) -> None:
        """Keep `t`, the tensor op `ref` produced (as it is now: a stale one got a
        `written_in_place` op from `_ref`), as that op's saved output."""
        op = self.ops[ref.op]
        if op.tensors[ref.slot] is not None:
            return
        kept = t.detach()
        if self.edges is not None and t.requires_grad:
            self.edges.ops[ref.op, ref.slot] = (self.edges.of(t), kept)
        tensors = list(op.tensors)
        tensors[ref.slot] = kept
        op.tensors = tuple(tensors)
        if not kept.is_inference():
            self.versions[ref.op, ref.slot] = kept._version
        if ref.op < self._cow_upto:  # `_before_write` has scanned this op already
            ptr = memory_key(kept)
            if ptr is not None:
                self._cow.setdefault(ptr, []).append((ref.op, ref.slot))

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

    def write_spill(self) -> None:
        """Write every tensor held since the last write to the directory store and hold its
        memory-mapped view instead (when a top-level block call ends, and once after the forward).

        A held op output whose version counter moved (a write the mode could not see) is not
        written: it stays in memory for `check_versions`, which drops it. Every other one is
        still the value its op produced (the recorder clones a held alias before any write it
        sees), so the file holds that value; the view no model code can reach is no longer
        version-checked or cloned on writes.
        """
        ops, start = self.ops, self._spill_ops
        held = held_tensors(ops[start:], hooks=self._hook_aliases[self._spill_hooks :])
        extra_op = {id(op.extra): op.index for op in ops[start:] if op.extra is not None}
        # A tensor with no storage of its own (sparse, a wrapper subclass) is not written: it stays
        # in memory, version-checked, like one whose counter moved.
        found: list[tuple[Holding, dict, Any]] = []
        versions: dict[Any, int]  # (op, slot), (op, argument key) or (id(call), side) -> version
        key: tuple[Any, Any]
        for h in held:
            if storage_ptr(h.tensor) is None:
                self._kept_in_memory = True
                continue
            if isinstance(h.holder, OpRecord):
                versions, key = self.versions, (h.holder.index, h.key)
            elif isinstance(h.holder, dict):  # a rebuilt op's kept argument
                versions, key = self.arg_versions, (extra_op[id(h.holder)], h.key)
            else:  # a module input/output alias a hook kept
                versions, key = self._hook_versions, (id(h.holder), h.key)
            v = versions.get(key)
            if v is None or h.tensor._version == v:  # a moved one stays for `check_versions`
                found.append((h, versions, key))
        self._spill_ops, self._spill_hooks = len(ops), len(self._hook_aliases)
        if not found:
            return
        self.spill.write([h for h, _, _ in found])
        for _, versions, key in found:
            versions.pop(key, None)
        if (
            self.edges is not None
        ):  # the gradient edges follow their tensors to the memory-mapped views
            for h, _, _ in found:
                if isinstance(h.holder, OpRecord):
                    self.edges.moved_op(h.holder.index, h.key, h.holder.tensors[h.key])
                elif isinstance(h.holder, dict):
                    self.edges.moved_arg(extra_op[id(h.holder)], h.tensor, get_arg(h.holder, h.key))
                else:
                    self.edges.moved(h.tensor, getattr(h.holder, h.key))
        # The views share no storage with the model: nothing held so far needs a clone on a write,
        # unless a tensor that could not be written stays in memory: then the next write looks at
        # every kept tensor again (the views it meets share no memory with what a model writes).
        self._cow.clear()
        self._cow_upto = 0 if self._kept_in_memory else len(ops)
        self._hook_upto = 0 if self._kept_in_memory else len(self._hook_aliases)

    def check_versions(self) -> list[int]:
        """Indices of ops whose saved alias was written by something the mode could not see.

        A kept argument of a rebuilt op (`OpRecord.extra`) written that way no longer holds
        what the op read, so its facets must not be rebuilt from it: `extra["stale"]` is set
        to the reason, which the facet derivation gives as the refusal.
        """
        ops = self.ops
        bad = []
        for (i, slot), version in self.versions.items():
            t = ops[i].tensors[slot]
            if t is not None and t._version != version:
                bad.append(i)
        dropped = []  # module inputs/outputs the hooks kept, written the same way: not served
        for call, side in self._hook_aliases:
            t, hook_version = getattr(call, side), self._hook_versions.get((id(call), side))
            if isinstance(t, Tensor) and hook_version is not None and t._version != hook_version:
                what = f"{call.address or '<root>'} {'input' if side == '_in' else 'output'}"
                setattr(
                    call,
                    side,
                    Dropped(
                        tuple(t.shape),
                        t.dtype,
                        (
                            f"the {what.split()[-1]} tensor of {what.split()[0]!r} was written in place after the trace "
                            "kept it, by code the capture could not see (a write under torch._C.DisableTorchFunction, "
                            "through NumPy, or into a sparse tensor), so what the trace held is no longer what the "
                            "model used there"
                        ),
                    ),
                )
                dropped.append(what)
        if dropped:
            warnings.warn(
                f"torchlens: {len(dropped)} module inputs/outputs the trace kept were written in place by code the "
                f"capture could not see, or as a sparse tensor, which it cannot copy before a write "
                f"({', '.join(dropped[:5])}); they are not kept, since they would show the later contents.",
                stacklevel=3,
            )
        for (i, key), version in self.arg_versions.items():
            extra = ops[i].extra
            if extra is None or "stale" in extra or get_arg(extra, key)._version == version:
                continue
            which = f"tensor argument {key[1]}" if key[0] == "args" else f"argument {key[1]!r}"
            extra["stale"] = (
                f"{which} of {ops[i].name} (op #{i}) was written in place after the op ran, by code the capture "
                "could not see (a write under torch._C.DisableTorchFunction, or in code that bypasses torch "
                "functions), so the kept argument no longer holds what the op read"
            )
        return sorted(set(bad))
