"""The torch function mode that records each op of a forward, and places the op edits.

Every torch function the forward calls passes through `OpRecorder.__torch_function__`, which runs
it and appends an `OpRecord`. A tensor used again after an in-place write changed it gets a
`written_in_place` op first (`OpRecorder._ref`). The module hooks that say where each op ran are
`torchlens._capture.recorder.Recorder`'s; how capture works as a whole is told there.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from torchlens._capture.aliases import KeptAliases
from torchlens._capture.values import tensor_args, writes_inputs
from torchlens._core.errors import EditSpecError
from torchlens._core.holdings import storage_ptr
from torchlens._core.ops import FOREIGN_MEMORY_OPS, INPLACE, REBUILT_OPS, REPOINT, SKIP, classify
from torchlens._core.records import ModuleCall, OpRecord, Ref

__all__ = ["OpRecorder"]

_NO_HIDING = contextlib.nullcontext()
#: `Ref(op, slot)` without the Python-level `__new__` of a named tuple (once per recorded op).
_new_ref = tuple.__new__
#: `Ref(i, 0)` for the first op positions, made once and shared by every trace: a `Ref` is an
#: immutable pair, and a trace otherwise keeps one per op, each an object the garbage collector
#: scans for as long as the trace lives (a generation keeps one trace per step).
_FIRST_REFS: list[Ref] = []
#: `(Ref(i, 0),)`, the inputs of an op that reads op `i`'s first output alone, shared the same way.
_FIRST_INPUTS: list[tuple[Ref]] = []
_FIRST_LOCK = threading.Lock()
#: Positions past this get a `Ref` of their own (the shared list stays under about 1 MiB).
_FIRST_REFS_MAX = 1 << 14


def _first_ref(idx: int) -> Ref:
    """`Ref(idx, 0)`, the shared one where `idx < _FIRST_REFS_MAX`."""
    if idx >= _FIRST_REFS_MAX:
        return _new_ref(Ref, (idx, 0))
    with _FIRST_LOCK:  # traces in other threads grow the lists too: each entry is its index's
        while len(_FIRST_REFS) <= idx:
            ref = _new_ref(Ref, (len(_FIRST_REFS), 0))
            _FIRST_INPUTS.append((ref,))
            _FIRST_REFS.append(ref)
    return _FIRST_REFS[idx]


class OpRecorder(KeptAliases, TorchFunctionMode):
    """Records the ops of one forward, as a torch function mode, and replaces the op outputs an
    edit plan names; the base of `torchlens._capture.recorder.Recorder`, not used on its own.

    Args:
        plan: the `CapturePlan` (`torchlens._analysis.selection`); this part reads whether every
            op keeps its output (`retain_all`).
        param_names: `id(parameter)` to qualified name.
        edits: an `EditPlan`, or None.
        spill, grads: as `torchlens._capture.aliases.KeptAliases` takes them.
    """

    def __init__(self, plan, param_names, edits, spill, grads) -> None:
        TorchFunctionMode.__init__(self)
        KeptAliases.__init__(self, spill, grads)
        self.retain_all = plan.retain_all
        self.param_names = param_names
        #: the module calls open now, innermost last (the hooks push and pop them)
        self.stack: list[ModuleCall] = []
        #: id(tensor) -> (the Ref it is, a weak reference to it, its `_stamp` when recorded)
        self.producer: dict[int, tuple[Ref, Any, Any]] = {}
        #: torch.Size -> the `(size,)` tuple every one-output op of that shape shares as its
        #: `OpRecord.shapes`: a trace keeps a few dozen shapes, not two objects per op (which
        #: the garbage collector would scan for as long as the trace lives)
        self._shapes: dict[torch.Size, tuple[torch.Size]] = {}
        #: torch.dtype -> the `(dtype,)` tuple shared the same way as `OpRecord.dtypes`
        self._dtypes: dict[torch.dtype, tuple[torch.dtype]] = {}
        self._kinds: dict[
            Any, tuple[str, int]
        ] = {}  # torch function -> `classify` answer, this trace
        #: (exception, op name) of the last op that raised, for the note `trace` adds; an op
        #: failure the model caught and handled is never mistaken for a later error.
        self.op_failure: tuple[BaseException, str] | None = None
        self._quiet = False  # True while the hooks run torch functions of their own
        #: True when another torch function mode (an outer trace, a user's mode) was active when
        #: this recorder was entered: the recorder's own bookkeeping is then hidden from it.
        self.nested = False
        self.edits = edits
        #: with `grads=`: id -> weak reference of each op output computed from frozen parameters
        #: alone (`_grad_leaves`)
        self._frozen_only: dict[int, Any] = {}
        #: `edited` ops recorded so far: an op's position in the forward (as the locating pass
        #: numbered it) is its index minus these.
        self._n_edited = 0

    def __enter__(self):
        self.nested = torch._C._len_torch_function_stack() > 0
        return super().__enter__()

    def hidden(self):
        """A context in which the recorder's own torch calls reach no outer torch function mode."""
        return torch._C.DisableTorchFunction() if self.nested else _NO_HIDING

    @contextlib.contextmanager
    def watching(self):
        """The recorder's mode on again after its forward, recording nothing (`_quiet_call`): code
        that runs inside `trace` after the forward (a `grads=` loss function) has its writes into
        the memory the trace saved seen, so the saved values are cloned first, as in the forward."""
        quiet = self._quiet
        self._quiet = True
        try:
            with self:
                yield
        finally:
            self._quiet = quiet

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
        """`x.data = y` ran: `x` holds other values now, and no counter says so; and `y`'s memory
        can be written through `x` after the forward (a module keeping `x` as an attribute)."""
        if len(args) > 1 and isinstance(args[1], Tensor):
            self.external.add(storage_ptr(args[1]))
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
        if info[0] in FOREIGN_MEMORY_OPS:  # its memory may be a NumPy array's, written later
            self.external.update(storage_ptr(o) for o in outs)
        if self.edges is not None and not mutated and not outs[0].requires_grad:
            out, outs = self._grad_leaves(out, outs, ins)
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

    # -- grads= leaves -------------------------------------------------------------------------

    def _grad_leaves(self, out: Any, outs: tuple, ins: list) -> tuple[Any, tuple]:
        """With `grads=`, where autograd's graph of the forward starts: `(out, outs)` of an op whose
        output does not require grad, with its floating outputs made to require grad where the
        rule below says so.

        The rule: grad mode is on at the op, and its tensor inputs include both a frozen floating
        parameter (or a tensor computed from frozen parameters alone) and something else (token
        ids, a model input, a buffer, a tensor computed without a parameter). Such an output (an
        embedding's lookup, a first layer on a model input) is exactly one that would require grad
        if the frozen parameters were made to: so the tensors that require grad are the ones they
        would be, from the first activations on, while the parameters stay frozen (so autograd
        saves no operand for a weight's gradient, which nobody asks for). A mask or other constant
        computed without a parameter is left as it is (it would not require grad either); an op on
        frozen parameters alone is noted in `_frozen_only`, not made to require grad (its output is
        not an activation, and making it require grad would save the other operand of every op
        that reads it as a weight). In-place ops are not considered.

        Each output made to require grad is handed to the model as a non-view alias of an autograd
        leaf (`aten._unsafe_view`: same memory and values, a new tensor), so the model may still
        write it in place as it could write the op's output; the leaf's `.grad` is never written
        (the one backward asks `torch.autograd.grad` for the sites only).
        """
        if not torch.is_grad_enabled():  # the model's own no_grad region: no graph there either
            return out, outs
        frozen = other = False
        params, derived = self.param_names, self._frozen_only
        for t in ins:
            if t.is_inference():  # cannot require grad, as a parameter made there could not
                continue
            entry = derived.get(id(t))
            if (entry is not None and entry() is t) or (
                (isinstance(t, torch.nn.Parameter) or id(t) in params)
                and not t.requires_grad
                and t.is_floating_point()
            ):
                frozen = True
            else:
                other = True
        if not frozen:
            return out, outs
        if not other:
            for o in outs:
                if o.is_floating_point() or o.is_complex():
                    derived[id(o)] = weakref.ref(o)
            return out, outs
        with self.hidden():
            made = tuple([_leaf_alias(o) for o in outs])
        if self.nested:  # an outer trace reads the alias as the op output it stands for
            for mode in torch.overrides._get_current_function_mode_stack():  # those below this one
                if isinstance(mode, OpRecorder) and mode is not self:
                    for o, alias in zip(outs, made):
                        if alias is not o:
                            mode.same_tensor(alias, o)
        if isinstance(out, Tensor):
            return made[0], made
        swap = {id(o): m for o, m in zip(outs, made)}
        items = [swap.get(id(x), x) if isinstance(x, Tensor) else x for x in out]
        if isinstance(out, list):
            return items, made
        return (tuple(items) if type(out) is tuple else type(out)(items)), made

    def same_tensor(self, alias: Tensor, t: Tensor) -> None:
        """Record that `alias` stands for `t` (the same memory and values, made where this
        recorder could not see it: an inner trace's `grads=` leaf alias), so an op that reads
        `alias` reads the op that produced `t`; nothing when this recorder did not see `t` made."""
        entry = self.producer.get(id(t))
        if entry is not None and entry[1]() is t:
            with torch._C.DisableTorchFunction():
                self.producer[id(alias)] = (entry[0], weakref.ref(alias), self._stamp(alias))

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

    def _ref(self, t: Tensor):
        entry = self.producer.get(id(t))
        if entry is not None and entry[1]() is t:
            if entry[2] != self._stamp(
                t
            ):  # written in place (or given other memory) since its producer recorded it
                return self._record("written_in_place", (t,), (), True, refs=(entry[0],))
            return entry[0]
        name = self.param_names.get(id(t))
        if name is None:  # made outside this forward: its storage may be written after it
            self.external.add(storage_ptr(t))
        return name

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
                name = params.get(id(t))
                if name is None:  # made outside this forward (`_ref`)
                    self.external.add(storage_ptr(t))
                found.append(name)
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
        if len(found) == 1:  # one input: op i's first output is one shared tuple (`_FIRST_INPUTS`)
            r = found[0]
            if type(r) is Ref and not r[1] and r[0] < len(_FIRST_INPUTS):
                return _FIRST_INPUTS[r[0]]
        return tuple(found)

    def _record(self, name, outs, ins, mutated, args=(), kwargs=None, refs=None):
        inputs = self._refs(ins) if refs is None else refs
        idx = len(self.ops)  # after the inputs: a stale input appends a `written_in_place` op first
        if self.edges is not None and not torch.is_grad_enabled():  # the model's no-grad region
            self.edges.off.add(idx)
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
                if self.edges is not None:
                    self.edges.keep_op(idx, 0, o0, kept0)
            else:
                tensors = (None,)
            first = _FIRST_REFS[idx] if idx < len(_FIRST_REFS) else _first_ref(idx)
            producer[id(o0)] = (first, weakref.ref(o0), stamp)
            shape, dtype = o0.shape, o0.dtype
            try:
                shapes = self._shapes.get(shape)
                if shapes is None:
                    shapes = self._shapes[shape] = (shape,)
            except TypeError:  # a symbolic size does not hash
                shapes = (shape,)
            dtypes = self._dtypes.get(dtype)
            if dtypes is None:
                dtypes = self._dtypes[dtype] = (dtype,)
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
                        self.edges.keep_op(idx, slot, o, kept[slot])
            else:
                tensors = (None,) * len(outs)
            first = _first_ref(idx)
            for slot, (o, stamp) in enumerate(zip(outs, stamps)):
                ref = first if slot == 0 else _new_ref(Ref, (idx, slot))
                producer[id(o)] = (ref, weakref.ref(o), stamp)
            o0 = outs[0]
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

    def add_external(self, t: Tensor, where: ModuleCall) -> None:
        """Record a tensor that enters the forward from outside (a model input) as an `input` op."""
        self.stack.append(where)
        try:
            self._record("input", (t,), (), False)
        finally:
            self.stack.pop()


def _leaf_alias(o: Tensor) -> Tensor:
    """`o`, made to require grad as an autograd leaf's non-view alias (`OpRecorder._grad_leaves`);
    `o` itself where it cannot or need not be (not floating, an inference tensor)."""
    if o.requires_grad or not (o.is_floating_point() or o.is_complex()) or o.is_inference():
        return o
    leaf = o.detach().requires_grad_()
    return torch.ops.aten._unsafe_view(leaf, leaf.shape)
