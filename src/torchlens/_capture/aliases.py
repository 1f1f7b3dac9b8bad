"""The tensors a recorder keeps, kept true to what the model computed there.

Saved tensors are detached *aliases*, not copies. Before an in-place write the mode sees, every
alias sharing the written storage is cloned (`KeptAliases._before_write`); each alias's version is
noted when it is kept, and at the end of the trace `KeptAliases.check_versions` drops one that
code the mode could not see wrote. `KeptAliases.write_spill` moves what is held to a directory
store as capture goes. How capture works as a whole is told in `torchlens._capture.recorder`.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import Tensor

from torchlens._capture.edges import Edges
from torchlens._capture.values import written_tensors
from torchlens._core.holdings import (
    Holding,
    arg_slots,
    get_arg,
    held_tensors,
    memory_key,
    set_arg,
    storage_ptr,
)
from torchlens._core.records import Dropped, ModuleCall, OpRecord, Ref

__all__ = ["KeptAliases"]

#: one kept alias of a storage (`KeptAliases._cow`): an op's output slot, a rebuilt op's kept
#: argument, or a module input/output a hook kept
_Alias = tuple[int, int] | tuple[int, tuple[str, Any]] | tuple[ModuleCall, str]


class KeptAliases:
    """The tensors one recorder keeps (op outputs, rebuilt ops' arguments, module inputs and
    outputs its hooks kept) and the rules that keep them true: a clone before every write the
    mode sees, version stamps and notes, the spill to a directory store, the end-of-trace check.

    The base of `torchlens._capture.op_recorder.OpRecorder`, not used on its own.

    Args:
        spill: a `torchlens._capture.stores.DirectoryStore` to write held tensors to as capture
            goes (each time a top-level block call ends), or None to keep them in memory.
        grads: keep the gradient edge of every tensor the trace keeps, as the model produced or
            used it (`torchlens._capture.edges.Edges`), for `trace(..., grads=loss_fn)`.
    """

    def __init__(self, spill, grads) -> None:
        self.ops: list[OpRecord] = []
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
        #: the gradient edges of what the trace keeps (`grads=`), or None
        self.edges: Edges | None = Edges() if grads else None
        #: What the steps of a generation share of the copies a trace makes when it returns, set
        #: by `trace_generate`'s session (`_capture.step_copies`); None for a `trace` call: the
        #: weight copies their pending checks read (`SharedWeights`), and the earlier steps'
        #: tensors left uncopied, which a write into their memory copies first (`DeferredCopies`).
        self.shared_weights: Any = None
        self.deferred: Any = None
        #: the storages of the tensors the forward read that it did not make and that are no
        #: parameter (a model input, a buffer, a cache's tensors from an earlier forward, a tensor
        #: a module keeps as a plain attribute): whatever holds them may write into them after the
        #: trace, so a saved tensor on one is copied as the trace returns (`snapshot`)
        self.external: set[int | None] = set()

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
                if self.edges is not None:
                    self.edges.keep_arg(idx, kept, a)
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
        targets = written_tensors(args, kwargs)
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
        if self.deferred is not None:  # an earlier step's tensors there are copied first
            self.deferred.before_write(ptrs)
        if self.shared_weights is not None:  # and the reads of a weight there judged
            self.shared_weights.before_write(ptrs)
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
        if self.edges is not None:
            self.edges.keep_op(ref.op, ref.slot, t, kept)
        tensors = list(op.tensors)
        tensors[ref.slot] = kept
        op.tensors = tuple(tensors)
        if not kept.is_inference():
            self.versions[ref.op, ref.slot] = kept._version
        if ref.op < self._cow_upto:  # `_before_write` has scanned this op already
            ptr = memory_key(kept)
            if ptr is not None:
                self._cow.setdefault(ptr, []).append((ref.op, ref.slot))

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
