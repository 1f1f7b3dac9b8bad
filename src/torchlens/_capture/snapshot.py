"""Making a finished trace independent of the caller's tensors.

A saved tensor is a detached alias of what the model computed (see `_capture.recorder`). When
`trace` returns, the aliases that still share memory with something the caller can write into are
replaced by copies, here, once the trace is assembled, so only what the trace keeps is copied.

With autograd on, the autograd graph of the forward keeps many recorded tensors alive: the
tensors its nodes saved for the backward pass. Memory nothing but that graph holds is not copied
(`_autograd_holders` tells it apart, exactly, from memory any Python object holds); it is
*guarded* instead (`Guarded`, armed by `arm_guards`), as is every other storage the graph saved
(a node's own result, tanh's or softmax's, which no alive tensor holds): the only way to write
into it is through a node's saved tensor (`grad_fn._saved_self`), which shares the version
counter of the trace's alias, so the version taken when the trace is returned tells, on every
later read, whether the value is still the forward's. An op output whose memory was written that
way is dropped with a warning, a facet is refused with the reason, a pending check refuses
(`Pending.seal`).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import sys
import warnings
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from torchlens._core.holdings import Holding, held_tensors, storage_ptr
from torchlens._core.ownership import tree_children
from torchlens._core.pending import _RUN_LOCK

if TYPE_CHECKING:
    from torch.autograd.graph import Node

    from torchlens._capture.recorder import Recorder
    from torchlens._capture.step_copies import SharedWeights

__all__ = ["Guarded", "arm_guards", "resolve_groups", "snapshot"]


def snapshot(rec: Recorder, model: nn.Module, reachable: Any, own_output: bool = False) -> int:
    """`_snapshot` under `torch.no_grad()`: the copies record no autograd history, whatever the
    caller's grad mode (see `_snapshot`)."""
    with torch.no_grad():
        return _snapshot(rec, model, reachable, own_output)


def _snapshot(rec: Recorder, model: nn.Module, reachable: Any, own_output: bool = False) -> int:
    """Copy every tensor the finished trace holds that the caller could still write into.

    A saved tensor is a detached alias of what the model computed. Once the forward is over,
    most of those tensors are referenced by nothing but the trace; the others share storage
    with something the caller still holds: the model's parameters and buffers, the inputs
    and the returned output (`reachable`, walked through tuples, lists and mappings), any
    recorded tensor still alive (a cache the model keeps, a tensor a hook stashed), or any tensor
    the forward read but did not make (`rec.external`: a cache object's keys from an earlier
    forward, which the walk does not enter; a module's plain tensor attribute). Those
    aliases are replaced by copies, so no later in-place write (an optimizer step, editing
    `ids` to build a corrupted prompt, `trace.output.logits.zero_()`) changes the trace. The
    tensors a pending facet check will compute from (`FacetSite._inputs`: recorded tensors and
    the module weights it reads) are treated the same way, so a facet computed after an
    optimizer step still shows the forward that was traced.
    Memory that only the autograd graph shares with the trace (with autograd on) is not copied
    here: the trace's tensors on each such storage become one `Guarded` group (`rec.guarded`,
    armed by `arm_guards`), copied on the first read of any of them.
    It runs once the trace is assembled, so only what the trace keeps is copied; several
    views of one storage (a KV cache's keys as each op saw them) share one copy of it when
    that costs no more than copying each view; they are views of one base tensor on the copy
    (per dtype), so they share its version counter, as the aliases they replace did.

    With `own_output` (a plain `trace`: its last item, the output, goes to the caller only as
    `Trace.output`), a storage that only the output's tensors share with the trace is left
    uncopied too, as one `Guarded` group (`OUTPUT_REASON`) noted in `rec.output_groups`:
    `torchlens._capture.output_copies.settle` then copies it when the trace is returned unless it
    proves that nothing but the trace holds the output, in which case the first read of
    `Trace.output`, or of any of the trace's tensors on it, copies it.

    Args:
        model: the traced model.
        reachable: `(args, kwargs, output)` of the forward, in any nesting of containers.
        own_output: whether the output may be the trace's alone (see above).

    Returns:
        The number of bytes copied (the memory this costs on top of the saved aliases).
    """
    rec.guarded = []
    rec.output_groups = []
    for op in rec.ops:  # an op whose output was not kept: its arguments serve no rebuild
        if op.extra is not None and all(t is None for t in op._tensors):
            op.extra = None
    # Every place the finished trace holds a tensor (op outputs, kept kernel arguments, facets and
    # the inputs of their pending checks), grouped by the live storage it is on. Most saved
    # tensors are intermediates nothing else holds, and are left as they are.
    held = held_tensors(rec.ops, rec.calls)
    if not held:  # a save="none" trace: nothing to copy, no storage to look up
        return 0
    later = rec.deferred  # a generation's step: what the model keeps is not copied now
    live, shared, fixed, own = _live_storages(rec, model, reachable, own_output)
    groups: dict[Any, list[Holding]] = {}
    guarded: dict[
        Any, list[Holding]
    ] = {}  # storages only the autograd graph holds besides the trace
    owned: dict[int, list[Holding]] = {}  # storages only the output holds besides the trace
    ptrs: dict[
        int, int | None
    ] = {}  # id(tensor) -> its storage (a tensor is held in several places)
    for h in held:
        t = h.tensor
        ptr = ptrs.get(id(t), -1)
        if ptr == -1:
            ptr = ptrs[id(t)] = storage_ptr(t)
        if ptr is None:  # no storage of its own: whether the caller holds it cannot be told, so
            groups.setdefault(("own", id(t)), []).append(h)  # it is copied
        elif ptr in live:
            groups.setdefault(ptr, []).append(h)
        elif ptr in own:
            owned.setdefault(ptr, []).append(h)
        elif shared and (shared is EVERY_STORAGE or ptr in shared):
            guarded.setdefault(ptr, []).append(h)
    copied, weights, deferred = 0, [], []
    for key, items in groups.items():
        if type(key) is int and all(isinstance(h.holder, list) for h in items):
            weights.append(items)  # weights only pending checks read (`_share_copies`)
        elif (
            later is not None
            and type(key) is int
            and key not in fixed
            and not any(h.tensor.is_inference() for h in items)  # no counter to guard them by
        ):
            group = Guarded(items, DEFERRED_REASON)
            deferred.append(group)
            later.defer(key, group)
        else:
            copied += _copy_group(key, items)
    if weights:
        copied += _share_copies(weights, rec.shared_weights)
    if owned:
        armable = _owners(rec.ops, rec.calls)
        for ptr, items in owned.items():
            if all(_is_output(h) or id(h.holder) in armable for h in items) and not any(
                h.tensor.is_inference()
                for h in items  # no counter to guard them by
            ):
                rec.output_groups.append(Guarded(items, OUTPUT_REASON))
            else:  # a holder no guard can tell (a gradient's site): copied now
                copied += _copy_group(ptr, items)
    if guarded or deferred or rec.output_groups:
        rec.guarded = [Guarded(items) for items in guarded.values()] + deferred + rec.output_groups
    return copied


def _copy_group(key: Any, items: list[Holding]) -> int:
    """Replace the tensor each holding holds by a copy; the number of bytes copied.

    Several views of one storage (`key` its data pointer) share one copy of it when that costs no
    more than copying each view; they are views of one base tensor on the copy (per dtype), so
    they share its version counter, as the aliases they replace did.
    """
    tensors = [h.tensor for h in items]
    copied = 0
    whole = type(key) is int and len({id(t) for t in tensors}) > 1  # a storage several views share
    if whole:
        storage = tensors[0].untyped_storage()
        whole = storage.nbytes() <= sum(t.numel() * t.element_size() for t in tensors)
    if (
        whole
    ):  # one copy of the storage serves every view of it (and keeps them views of one another)
        new = storage.clone()
        copied += storage.nbytes()
        # One base tensor per dtype on the copy, and every view made from it, so the views share
        # its version counter (a write through one moves it for all, see `Pending.seal`).
        bases: dict[torch.dtype, Tensor] = {}
    memo: dict[int, Tensor] = {}
    for h, t in zip(items, tensors):
        c = memo.get(id(t))
        if c is None:
            if whole:
                base = bases.get(t.dtype)
                if base is None:
                    base = bases[t.dtype] = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                        new, 0, (0,), (1,)
                    )
                c = base.as_strided(t.size(), t.stride(), t.storage_offset())
            else:
                c = t.clone()
                copied += t.numel() * t.element_size()
            memo[id(t)] = c
        h.put(c)
    return copied


#: The copies `_share_copies` made, by where their source was: (device, storage pointer, storage
#: offset, shape, strides, dtype, conjugate bit, negative bit, type, and a quantized tensor's id)
#: -> the copy, held weakly (an entry goes when the last trace holding its copy does; its memory, a
#: block `_fresh_copies` made, when the last copy in it does).
_SHARED: weakref.WeakValueDictionary[tuple, Tensor] = weakref.WeakValueDictionary()
try:  # `_same_bits`'s faster comparison on the CPU; torch does not require numpy
    import numpy as _numpy
except ImportError:  # pragma: no cover - numpy is installed wherever the tests run
    _numpy = None  # type: ignore[assignment]
#: From how many elements `_same_bits` compares through numpy: measured on this project's CPU
#: machine (torch 2.13, one thread), the two are even at about 8,192 elements; below, numpy's
#: views cost more (8.5 us against 4.3 us for 1,024 elements), above, torch.equal's elementwise
#: result does (121 us against 446 us for 589,824).
_NUMPY_FROM = 8192
#: An integer dtype of each element size, to compare two tensors' bits (`_same_bits`).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _c_memcmp() -> Any:
    """The C library's `memcmp` through ctypes, or None where it cannot be loaded."""
    try:
        # a library object of our own, so the signature set below changes no one else's
        lib = ctypes.CDLL("msvcrt") if sys.platform == "win32" else ctypes.CDLL(None)
        fn = lib.memcmp
    except (OSError, AttributeError):  # pragma: no cover - found on Linux, macOS and Windows
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return fn


#: `memcmp`, `_same_bits`'s comparison of two contiguous CPU tensors: it reads both once and makes
#: nothing (measured on this project's CPU machine, torch 2.13, one thread: 133 us against numpy's
#: 202 us for a 768 x 768 float32 weight, about 1 us against torch.equal's 4 to 8 us for 768
#: elements).
_memcmp = _c_memcmp()
#: The tensor types whose `data_ptr` is where their values are (no wrapper subclass).
_PLAIN = (Tensor, nn.Parameter)


def _flat_cpu(t: Tensor) -> bool:
    """Whether `t`'s values are its bytes in one run from `data_ptr` on the CPU, read as they are:
    a contiguous strided CPU tensor of a plain type, with no conjugate or negative bit, and not an
    efficient zero tensor (no memory behind its `data_ptr`). `_same_bits` compares two such with
    `memcmp`; `_fresh_copies` puts such copies in a block."""
    return (
        t.device.type == "cpu"
        and type(t) in _PLAIN
        and t.layout == torch.strided
        and t.is_contiguous()
        and not (t.is_conj() or t.is_neg() or t._is_zerotensor())
    )


def _share_copies(groups: list[list[Holding]], watch: SharedWeights | None = None) -> int:
    """`_copy_group` for the storages only pending checks' input lists hold (a weight a derived
    facet is computed from: an attention output projection for the per-head results, a norm's
    gain), one list of holdings per storage: each tensor is replaced by a copy, which is an earlier
    trace's copy of the same tensor where one is alive and holds exactly its bits now, else a new
    one (`_fresh_copies`). The bytes copied.

    Sharing is safe there: a pending check's inputs are never served (a check computes new tensors
    from them, from copies of its own, `pending._placed`), so nothing reached through one trace can
    write into the copy another trace holds. The steps of a generation each hold the weights their
    checks read: one copy serves them all while the weights do not change, instead of one per step.
    A copy is reused only when its bits equal the tensor's (an integer view of both, so a -0.0 for
    a 0.0 or another NaN payload is a change): whatever changed the weight in between (even a write
    no version counter sees, through `.data` or numpy), the copy holds what the forward read.

    The large copies `_fresh_copies` made together share one block of memory, alive while any of
    them is: a block is reused whole or not at all (every copy in it still holds its weight's bits,
    and this trace reads each), so a trace never keeps alive the copy of a weight that changed
    since, nor a store writes one; a copy cloned on its own is reused alone. Tensors of one call on
    the same bytes, seen the same way (the same offset, shape, strides, dtype, conjugate and
    negative bits and type), share one copy; a quantized tensor gets a copy of its own (its scale
    is not in that key).

    Within one generation (`watch`, see `SharedWeights`), a copy an earlier step compared or made
    is reused without comparing its bits again while its weight's version counter has not moved
    and no step's recorder saw a write into the weight's memory; `SharedWeights.verify` compares
    them once when the generation ends.
    """
    keys: dict[int, tuple] = {}  # id(tensor) -> where its bytes are, as it reads them
    first: dict[tuple, Tensor] = {}  # such a key -> the first tensor seen there
    for items in groups:
        for h in items:
            t = h.tensor
            if id(t) not in keys:
                key = keys[id(t)] = (
                    t.device,
                    storage_ptr(t),
                    t.storage_offset(),
                    tuple(t.shape),
                    t.stride(),
                    t.dtype,
                    t.is_conj(),
                    t.is_neg(),
                    type(t),
                    id(t) if t.is_quantized else None,
                )
                first.setdefault(key, t)
    hits: dict[tuple, Tensor] = {}  # key -> an alive copy that holds its tensor's bits
    unread: set[tuple] = set()  # the hits `watch` vouched for, their bits not compared
    for key, t in first.items():
        c = _SHARED.get(key)
        if c is None:
            continue
        if watch is not None and watch.unchanged(key, c, t):
            hits[key] = c
            unread.add(key)
        elif _same_bits(t, c):
            hits[key] = c
    # A block this trace would reuse only in part is not reused: its other copies are stale.
    reused: dict[tuple, int] = {}  # (device, storage) of a block -> the bytes reused there
    for c in hits.values():
        where = (c.device, c.untyped_storage().data_ptr())
        reused[where] = reused.get(where, 0) + _span(c)
    copies = {
        key: c
        for key, c in hits.items()
        if reused[c.device, c.untyped_storage().data_ptr()] >= c.untyped_storage().nbytes()
    }
    fresh = [key for key in first if key not in copies]
    copied = 0
    for key, c in zip(fresh, _fresh_copies([first[key] for key in fresh])):
        copies[key] = _SHARED[key] = c
        copied += c.numel() * c.element_size()
    if watch is not None:
        watch.note(first, copies, unread, groups, keys)
    for items in groups:
        for h in items:
            h.put(copies[keys[id(h.tensor)]])
    return copied


#: Where `_fresh_copies` starts each copy in the memory they share: a multiple of 64 bytes.
_ALIGN = 64
#: From how many bytes `_fresh_copies` puts a tensor's copy in the block: a smaller one is cloned.
#: Measured on this project's CPU machine (torch 2.13, one thread): the tiny GPT-2's 14 (two 32 x
#: 32 weights, 12 vectors of 32) took 138 us into one block (three torch calls each, at
#: `accf85e`) against 23 us as clones, whose memory the allocator takes from what it holds.
_BLOCK_FROM = 1 << 16


def _span(t: Tensor) -> int:
    """The bytes `_fresh_copies` gives `t` in a block: its own, rounded up to `_ALIGN`."""
    return -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN


def _fresh_copies(tensors: list[Tensor]) -> list[Tensor]:
    """A new copy of each of `tensors` (no two of them the same tensor), for `_share_copies`.

    The contiguous CPU tensors of plain tensor types, of one dtype and `_BLOCK_FROM` bytes or more,
    are copied into one new block of memory, each a view of it starting a multiple of 64 bytes
    after the block's start (`_span`); anything else, and the only such tensor of its dtype, is
    cloned on its own. The block is the cheaper where the copies are large: measured on this
    project's CPU machine (torch 2.13, one thread, a fresh process, a logits-sized tensor made and
    freed before each round, as a forward does), copying the 74 tensors the checks of GPT-2 small
    read (27 MiB: the 12 output projections, their biases, and the 25 norms' gains and biases)
    took 17.8 to 18.0 ms as clones, whose new memory the kernel maps page by page as it is first
    written (13,159 minor page faults a round), and 3.5 to 3.7 ms with the 12 projections in one
    block (874 faults). The copies of one block are views of one tensor, so they share its version
    counter: a write through any of them would refuse every check that holds one, in every trace.
    Nothing writes into them (a pending check's inputs are never served); a check's seal reads the
    counter of each of its inputs.
    """
    out: list[Tensor | None] = [None] * len(tensors)
    blocks: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel() * t.element_size() >= _BLOCK_FROM and not t.is_quantized and _flat_cpu(t):
            blocks.setdefault(t.dtype, []).append(i)
        else:
            out[i] = t.clone()
    for dtype, idx in blocks.items():
        if len(idx) == 1:
            out[idx[0]] = tensors[idx[0]].clone()
            continue
        size = tensors[idx[0]].element_size()
        starts, n = [], 0
        for i in idx:
            starts.append(n)
            n += _span(tensors[i]) // size
        block = torch.empty(n, dtype=dtype, device=tensors[idx[0]].device)
        for i, start in zip(idx, starts):
            t = tensors[i]
            out[i] = block.as_strided(t.shape, t.stride(), start).copy_(t)
    return out  # type: ignore[return-value]


def _same_bits(a: Tensor, b: Tensor) -> bool:
    """Whether `a` and `b` hold the same bits, element for element (False when that cannot be told).

    Two contiguous CPU tensors of plain tensor types are compared byte for byte by the C
    library's `memcmp` (`_memcmp`). Otherwise, on the CPU, with numpy installed, numpy compares
    the integer views of a tensor of `_NUMPY_FROM` elements or more (about 2.7 times as fast as
    `torch.equal` on a 768 x 3072 weight: `torch.equal` builds an elementwise result first);
    below that, and off the CPU, `torch.equal` does (the two numpy views cost more than the
    comparison on a small tensor).
    """
    if (
        a.dtype != b.dtype
        or a.shape != b.shape
        or a.device != b.device
        or a.layout != torch.strided
    ):
        return False
    as_int = _BITS.get(a.element_size())
    if as_int is None or a.is_quantized:
        return False
    try:
        if (
            _memcmp is not None and _flat_cpu(a) and _flat_cpu(b)
        ):  # same dtype and shape: the same number of bytes, one run each, read as they are
            return _memcmp(a.data_ptr(), b.data_ptr(), a.numel() * a.element_size()) == 0
        a, b = a.detach().view(as_int), b.detach().view(as_int)
        if a.device.type == "cpu" and _numpy is not None and a.numel() >= _NUMPY_FROM:
            return bool(_numpy.array_equal(a.numpy(), b.numpy()))
        return torch.equal(a, b)
    except (RuntimeError, TypeError):  # a dtype that cannot be viewed as an integer one
        return False


class Guarded:
    """The trace's tensors on one storage that only the autograd graph shares (`_snapshot`), or
    that a generation's step leaves uncopied (`torchlens._capture.step_copies.DeferredCopies`,
    which also resolves it before a later step's write and when `generate` returns).

    Nothing is copied when `trace` returns. `arm_guards` takes each tensor's version; the first
    read of any of them (`OpRecord.tensors`, which also stands for the op's kept arguments,
    `FacetSite.tensor`) calls `resolve`: if every one still has its version, the storage is copied
    once and every tensor of the group becomes a view of the copy (as `_snapshot` copies a live
    storage), the trace's own memory from then on; if one was written (through the graph's saved
    tensor, `grad_fn._saved_self`, the only other way to reach this memory), none is served: op
    outputs are dropped with a warning, facets refused with the reason, and a pending check
    refuses by its seal.
    """

    __slots__ = ("_items", "marks", "_owners", "done", "reason")

    def __init__(self, items: list[Holding], reason: str | None = None):
        # Until `arm`: the holdings `_snapshot` found. From `arm` on: per item, `(holder, key,
        # tensor)` with the holder held weakly where it holds this group itself (an `OpRecord`, a
        # `FacetSite`), so that the group, its ops and its sites form no reference cycle, and a
        # dropped trace's memory is freed at once instead of at the collector's next pass over
        # cycles (172 MiB of a `save="all"` trace of GPT-2 small at 128 tokens, autograd on).
        self._items: list[Any] = items
        self.marks: list[tuple[int, int]] = []
        #: per item, weakly: what is told when it is refused or copied: the `FacetMap` of a site,
        #: the `Pending` whose input list it is, or the `OpRecord` whose output or kept argument
        #: it is
        self._owners: list[weakref.ref] = []
        self.done = False
        #: what a refusal says happened (`GUARD_REASON` for memory the autograd graph shares)
        self.reason = GUARD_REASON if reason is None else reason

    def arm(self, owners: dict[int, Any]) -> None:
        """Take each tensor's identity and version (once the store has placed them).

        Args:
            owners: the id of each holder that is not an op (a site, a pending check's input
                list, an op's kept arguments) -> its owner, as `_owners` above names it (a site's
                `FacetMap` as a weak reference already).
        """
        items, marks, found = [], [], []
        for h in self._items:
            t = h.current()
            if not isinstance(t, Tensor) or t is not h.tensor or t.is_inference():
                continue  # a store replaced it (its copy shares no memory with the graph), or no counter
            owner = h.holder if _is_output(h) else owners.get(id(h.holder))
            if owner is None:
                continue
            weak = _is_output(h) or h.key == "tensor"  # the holders given this group below
            items.append((weakref.ref(h.holder) if weak else h.holder, h.key, h.tensor))
            marks.append((id(t), t._version))
            found.append(owner if isinstance(owner, weakref.ref) else weakref.ref(owner))
            if h.key == "tensor":  # a site: its first read resolves the group
                h.holder._guard = self
            elif _is_output(h) or isinstance(h.holder, dict):  # an op's output or kept argument
                owner._guard = (owner._guard or ()) + (self,)
            # a pending check's input: its seal refuses the check if it was written
        self._items, self.marks, self._owners = items, marks, found
        self.done = not items

    def tensors(self) -> list[Tensor]:
        """The tensors the armed group still holds on its storage (until it is resolved)."""
        return [] if self.done else [t for _, _, t in self._items]

    def _entries(self) -> list[tuple[Holding, Any, tuple[int, int]]]:
        """`(holding, owner, mark)` for each armed item whose holder is still alive, its owner
        as held (a site's `FacetMap` may be gone while the site is not: then None)."""
        found = []
        for (holder, key, tensor), owner_ref, mark in zip(self._items, self._owners, self.marks):
            if type(holder) is weakref.ref:  # an op or a site (a list or a dict is held as is)
                holder = holder()
                if holder is None:
                    continue
            owner = owner_ref()
            if owner is None and key != "tensor":  # its op or its check is gone: nothing to tell
                continue
            found.append((Holding(holder, key, tensor), owner, mark))
        return found

    def _written(self, entries: list) -> bool:
        """Whether a tensor of the group that still serves was written since `arm`."""
        for h, owner, (ident, version) in entries:
            t = h.current()
            if t is not None and id(t) == ident and _live_input(h, owner) and t._version != version:
                return True
        return False

    def check(self) -> None:
        """Refuse the group now if one of its tensors was written; copy nothing otherwise."""
        if not self.done and self._written(self._entries()):
            self.resolve()

    def resolve(self, copy: bool = True) -> None:
        """Copy the group, or refuse all of it if one was written (see the class docstring).

        Args:
            copy: False where nothing but the trace can reach the group's memory any more (a
                generation's cache tensors no one holds once `generate` returned:
                `DeferredCopies.finish`): an unwritten group is then served as it is, uncopied.
        """
        resolve_groups([self], copy)

    def _take(self) -> tuple[bool, list[tuple[Holding, Any]], list]:
        """`resolve`'s first half: whether one of the group's tensors was written, the holdings
        that still serve (each with its owner), and every entry, for `_disarm` once they are
        copied or refused."""
        self.done = True
        entries = self._entries()
        self._items, self._owners, self.marks = [], [], []
        written = self._written(entries)
        same = [
            (h, owner)
            for h, owner, (ident, _) in entries
            if id(h.current()) == ident and _live_input(h, owner)
        ]  # what a check let go of is left alone
        return written, same, entries

    def _disarm(self, entries: list) -> None:
        """Take the group off its sites and ops (`resolve`'s last step, after the copy): a reader in
        another thread that finds no guard there reads the copy, never the memory before it."""
        for h, owner, _ in entries:
            if h.key == "tensor":
                h.holder._guard = None
            elif not isinstance(h.holder, list):
                owner._guard = tuple(g for g in owner._guard or () if g is not self) or None

    def _refuse(self, same: list[tuple[Holding, Any]]) -> None:
        """A written group's tensors are not served (`resolve`'s second half, when written)."""
        dropped = []
        for h, owner in same:
            if _is_output(h):
                h.put(None)
                dropped.append(f"#{h.holder.index} {h.holder.name}")
            elif isinstance(h.holder, dict):  # a kept argument: its op's rebuild is gone with it
                owner.extra = None
            elif h.key == "tensor":
                reason = f"its tensor {self.reason}"
                h.holder._refusal = reason
                h.holder._value = None
                if owner is not None:  # the site's `FacetMap`, while it is alive
                    owner._refuse([h.holder], reason)
        if dropped:
            warnings.warn(
                f"torchlens: the saved outputs of op {', '.join(dropped[:5])} {self.reason}; they are "
                "not served.",
                stacklevel=6,
            )


def resolve_groups(groups: list[Guarded], copy: bool = True) -> None:
    """`Guarded.resolve` of several groups on one storage at once: the unwritten ones share one
    copy (`_copy_group`: one copy of the storage where their views cover it), as the aliases they
    replace shared its memory; each written one is refused. The steps of a generation that read
    the same memory (the cross-attention keys the first decoder forward cached) are resolved so
    when `generate` returns (`DeferredCopies.finish`), one copy for all of them, not one a step."""
    with _RUN_LOCK:
        taken = [(g, *g._take()) for g in groups if not g.done]
        kept = [h for _, written, same, _ in taken if not written for h, _ in same]
        if kept and copy:
            # on a first read inside another trace's forward, the copy is none of its ops
            nested = torch._C._len_torch_function_stack() > 0
            with torch.no_grad(), torch._C.DisableTorchFunction() if nested else _NOTHING:
                _copy_group(storage_ptr(kept[0].tensor), kept)
        for g, written, same, entries in taken:
            if written:
                g._refuse(same)
            elif copy:
                for h, owner in same:  # a sealed check's input is the copy now: its version
                    if isinstance(h.holder, list) and owner.marks is not None:
                        mark = owner.marks[h.key]
                        if mark is not None and mark[0] == "version":
                            owner.marks[h.key] = ("version", h.current()._version)
            g._disarm(entries)


def _is_output(h: Holding) -> bool:
    """Whether `h` is an op's output slot (the holder an `OpRecord`)."""
    return isinstance(h.key, int) and not isinstance(h.holder, list)


def _live_input(h: Holding, owner: Any) -> bool:
    """Whether a holding still serves: a pending input list only while its check has not run."""
    return not isinstance(h.holder, list) or owner.inputs is h.holder


def _live_storages(
    rec: Recorder, model: nn.Module, reachable: Any, own_output: bool = False
) -> tuple[set[int], set[int] | frozenset[int], set[int], set[int]]:
    """The storages (data pointers) the caller can still write into: the model's parameters and
    buffers, every tensor in `reachable` (through tuples, lists and mappings), every tensor the
    forward read but did not make (`rec.external`), and every recorded tensor still alive but
    those that only the autograd graph holds; apart, the storages of those and every other storage
    the autograd graph saved (`_autograd_holders`), which nothing alive but the graph shares
    (`EVERY_STORAGE` when the graph cannot be read); the parameters' and buffers' storages
    among the first; and, with `own_output`, the storages of the tensors the output (the last
    item of `reachable`) holds through the containers `ownership.tree_children` enters, which are
    in none of the others (nothing else alive, not the graph): left out of the first, since the
    caller may reach them only through `Trace.output`."""
    live: set[int] = set()

    def add(t: Tensor) -> None:
        ptr = storage_ptr(t)
        if ptr is not None:  # one without a storage of its own is copied whatever holds it
            live.add(ptr)

    for (
        m
    ) in rec.names:  # every module of the model (`model.parameters()` and `buffers()`, in one pass)
        for t in itertools.chain(m._parameters.values(), m._buffers.values()):
            if t is not None:
                add(t)
    fixed = set(live)  # the parameters' and buffers' storages
    # what the forward read that it did not make (a cache's keys from an earlier forward)
    live.update(p for p in rec.external if p is not None)
    out: dict[int, Tensor] = {}  # id -> each tensor the output holds (with `own_output`)
    todo: list[tuple[Any, int, bool]] = [(reachable, 0, False)]  # (value, depth, in the output)
    if own_output:
        out = _output_tensors(reachable[2])
        todo = [(reachable[0], 1, False), (reachable[1], 1, False), (reachable[2], 1, True)]
    seen = 0
    while todo and seen < 100_000:
        value, depth, in_output = todo.pop()
        seen += 1
        if isinstance(value, Tensor):
            if not (in_output and id(value) in out):  # an output's own tensor is decided below
                add(value)
        elif depth < 8 and isinstance(value, (Mapping, tuple, list)):
            items = value.values() if isinstance(value, Mapping) else value
            todo.extend((v, depth + 1, in_output) for v in items)
    alive = [t for t in (ref() for _, ref, _ in rec.producer.values()) if t is not None]
    graph_only, graph = _autograd_holders(alive) if alive else (set(), set())
    if graph is EVERY_STORAGE:  # the graph could not be read: copy every alive one, guard the rest
        for t in alive:
            add(t)
        for t in out.values():
            add(t)
        alive.clear()
        out.clear()
        live.discard(0)
        return live, EVERY_STORAGE, fixed, set()
    shared: set[int] = set(graph)  # what the graph can hand out (a node's saved result included)
    for t in alive:
        if id(t) in graph_only:
            ptr = storage_ptr(t)
            if ptr is not None:
                shared.add(ptr)
        elif id(t) not in out:
            add(t)
    alive.clear()
    own: set[int] = set()
    for t in out.values():
        ptr = storage_ptr(t)
        if ptr is None or ptr in live or ptr in shared:  # the graph can hand it out too: copied
            add(t)
        else:
            own.add(ptr)
    out.clear()
    own -= live  # another tensor of the output on that storage is live
    live.discard(0)  # empty tensors own no memory
    own.discard(0)
    shared -= live  # a storage something else holds too is copied
    shared.discard(0)
    return live, shared, fixed, own


def _output_tensors(output: Any) -> dict[int, Tensor]:
    """id -> every tensor `output` holds through the containers `ownership.tree_children` enters
    (tuples, lists, dicts, a `ModelOutput`'s items and attributes)."""
    found: dict[int, Tensor] = {}
    todo, seen = [output], 0
    while todo and seen < 100_000:
        value = todo.pop()
        seen += 1
        if isinstance(value, Tensor):
            found[id(value)] = value
        else:
            todo.extend(tree_children(value) or ())
    return found


def _owners(ops: list, calls: list) -> dict[int, Any]:
    """Each holder that is not an op (a site, a pending check's input list, an op's kept
    arguments) -> what its guard tells (`Guarded._owners`): the holders a guard can arm."""
    owners: dict[int, Any] = {}
    for op in ops:
        if op.extra is not None:
            owners[id(op.extra)] = op
    for call in calls:
        if call.facets is None:
            continue
        fmap = weakref.ref(call.facets)
        for site in call.facets._sites.values():
            owners[id(site)] = fmap
            if site._inputs is not None and site._pending is not None:
                owners[id(site._inputs)] = site._pending
    return owners


_NOTHING = contextlib.nullcontext()

#: Per autograd node type, the attributes that unpack what it saved (`_saved_self`, ...).
_SAVED_NAMES: dict[type, tuple[str, ...]] = {}
#: `_refs` of a tensor that no Python object holds, as `_autograd_holders` reads it (its list,
#: its loop variable, the call's argument, and the reference torch keeps from a tensor that C++
#: also owns to its Python object); None until calibrated, False when this torch does not count
#: that way (then nothing is taken for autograd-only).
_NO_PYTHON_HOLDER: list[Any] = [None]
#: `_autograd_holders`'s answer when the graph cannot be read: every storage is guarded.
EVERY_STORAGE = frozenset({-1})


def _refs(t: Tensor) -> int:
    """`t`'s reference count, read the one way `_calibrate` and `_autograd_holders` both
    read it (from a loop over a list, through this call)."""
    return sys.getrefcount(t)


def _calibrate() -> Any:
    """The reference count `_autograd_holders` reads for a tensor nothing in Python holds,
    measured on one such tensor; False unless a tensor also held by a list reads one more."""
    import weakref

    with torch.enable_grad():
        x = torch.ones(2, requires_grad=True)
        y = x * 2
        z = y.sin()  # saves y for the backward pass (the same tensor object)
        held_saved = [y * 3]
        zz = held_saved[0].cos()  # held by a list and saved
        ref = weakref.ref(y)
        del y
        probe = [ref()]
        counts = []
        for t in probe:
            assert t is not None  # z's graph saved y, so the weak reference is alive
            counts.append((_refs(t), t._use_count()))  # type: ignore[attr-defined]  # torch's stubs lack Tensor._use_count
        del t
        others = [held_saved[0]]
        for t in others:
            counts.append((_refs(t), t._use_count()))  # type: ignore[attr-defined]  # as above
        del t
        (graph_only, uc), (with_list, uc2) = counts
        del z, zz, probe, others
    if uc < 2 or uc2 < 2 or with_list != graph_only + 1:
        return False
    return graph_only


def _autograd_holders(alive: list[Tensor]) -> tuple[set[int], frozenset[int] | set[int]]:
    """What the autograd graph of the forward holds: the ids of the tensors in `alive` that
    nothing else holds, and the storages of every tensor the graph saved.

    The graph is walked from the alive tensors' `grad_fn`s, unpacking every node's saved
    tensors (`_saved_self`, ...): a tensor a node saved as its input is the very tensor object;
    one it saved as its own result (tanh's, softmax's) comes back as another tensor on the same
    memory, sharing its version counter. Every storage met is guarded (the caller can write into
    it through the node), and an alive tensor is autograd-only when each of its owners is
    accounted for: C++ owns it besides its Python object (`t._use_count() > 1`), no Python
    object refers to it (its reference count, calibrated once by `_calibrate`), and its owners
    are saved tensors of the graph and alive views of it (a view holds its base). Any other
    owner (a tensor the model made outside the capture, a C++ extension's state) leaves it
    reachable, and so copied. Without a graph (no alive tensor has a `grad_fn`: `no_grad`) the
    answer is empty; where a node's saved tensors cannot be read, nothing is autograd-only and
    every storage is guarded (`EVERY_STORAGE`).
    """
    roots: list[Node | None] = [t.grad_fn for t in alive if t.grad_fn is not None]
    if not roots:
        return set(), set()
    base = _NO_PYTHON_HOLDER[0]
    if base is None:
        try:
            base = _NO_PYTHON_HOLDER[0] = _calibrate()
        except Exception:  # a torch without these counters: take nothing for autograd-only
            base = _NO_PYTHON_HOLDER[0] = False
    owners: dict[int, int] = {}  # id -> C++ owners besides its Python object
    if base is not False:
        for t in alive:
            use = t._use_count()  # type: ignore[attr-defined]  # torch's stubs lack Tensor._use_count
            if use > 1 and _refs(t) == base:
                owners[id(t)] = use - 1
    found = dict.fromkeys(owners, 0)
    if found:
        for t in alive:  # an alive view holds its base
            if t._is_view():
                b = t._base
                if id(b) in found:
                    found[id(b)] += 1
                del b
    graph: set[int] = set()
    alive_ids = {id(t) for t in alive}
    views: dict[
        int, Tensor
    ] = {}  # saved views the capture did not record (kept: their ids stay theirs)
    seen: set[Any] = set()
    limit = 50 * len(alive) + 1000  # a walk far beyond the ops recorded: something else, stop
    while roots:
        node = roots.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if len(seen) > limit:
            return set(), EVERY_STORAGE
        names = _SAVED_NAMES.get(type(node))
        if names is None:
            names = _SAVED_NAMES[type(node)] = tuple(
                n for n in dir(node) if n.startswith("_saved_") or n == "saved_tensors"
            )
        for n in names:
            try:
                v = getattr(node, n)
            except Exception:  # a saved tensor that cannot be unpacked: guard everything
                return set(), EVERY_STORAGE
            for x in v if isinstance(v, (tuple, list)) else (v,):
                if isinstance(x, Tensor):
                    if id(x) in found:
                        found[id(x)] += 1
                    if found and id(x) not in alive_ids and id(x) not in views and x._is_view():
                        views[id(x)] = (
                            x  # a view made inside an op (linear's reshape) holds its base
                        )
                        b = x._base
                        if id(b) in found:
                            found[id(b)] += 1
                        del b
                    ptr = storage_ptr(x)
                    if ptr is not None:
                        graph.add(ptr)
            del v
        roots.extend(f for f, _ in node.next_functions)
    views.clear()
    return {i for i, n in owners.items() if found[i] == n}, graph


def arm_guards(rec: Recorder, trace: Any) -> None:
    """Arm the `Guarded` groups `_snapshot` left (`rec.guarded`), once the trace is where it
    stays (after a store: a tensor the store replaced by a copy shares no memory with the graph,
    and is left out)."""
    if not rec.guarded:
        return
    owners = _owners(trace.ops, rec.calls)  # holder id -> what a guard tells
    for group in rec.guarded:
        group.arm(owners)
    rec.guarded = []


#: Why a generation step's tensor that `DeferredCopies` left uncopied is not served.
DEFERRED_REASON = (
    "was written in place between two forwards of generate, before it was copied: the model kept "
    "its memory after the step (a KV cache, the step's output), and the write was not made by a "
    "forward the generation recorded, so it no longer holds what the step's forward computed there"
)
#: Why a tensor on memory only the model's output shared is not served (nothing can write there
#: before it is copied: `output_copies.settle` proved the trace alone holds the output, and the
#: first read of `Trace.output` or of the tensor copies it first; kept for `Guarded`'s protocol).
OUTPUT_REASON = (
    "was written in place after the trace returned, before it was first read: its memory is the "
    "model's output's, which only the trace held, so it no longer holds what the forward computed there"
)
GUARD_REASON = (
    "was written in place after the trace returned, before it was first read: its memory is shared "
    "with the autograd graph of the traced forward (a tensor autograd saved for the backward pass, "
    "reachable through grad_fn), so it no longer holds what the forward computed there. Read it "
    "before writing into a tensor of the graph, or write into a copy (tensor.clone())"
)
