"""What the steps of one generation share of the copies a trace makes when it is returned.

A `trace` call copies, as it returns, every saved tensor the caller could still write into
(`torchlens._capture.snapshot`). The steps of `trace_generate` are traces too, and between two
of them run `generate`'s own code and the model's next forward, whose writes the next step's
recorder sees. Two things are shared by the steps of one generation instead of copied at each
step's end (one object of each per `trace_generate` call, set on each step's recorder by
`torchlens._generation.session.Session`):

- `SharedWeights`: the copies of the weights the steps' pending checks read, compared with their
  weights once, when `generate` returns, instead of at every step;
- `DeferredCopies`: the tensors the model keeps from one forward to the next (the KV cache, the
  step's output) are not copied at the step's end; they are guarded (`snapshot.Guarded`), and
  copied before a later step's forward writes into them, or when `generate` returns if anything
  but the traces still holds them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch
from torch import Tensor

from torchlens._capture.snapshot import Guarded, _same_bits, resolve_groups
from torchlens._core.holdings import Holding, memory_key

__all__ = ["DeferredCopies", "SharedWeights"]


class SharedWeights:
    """The weight copies the steps of one `trace_generate` call share, and what lets a step reuse
    one without comparing its bits (`_capture.snapshot._share_copies`).

    Every step of a generation reads the same weights for its pending checks (each attention's
    output projection, each norm's gain and bias), and they do not change between steps unless
    something writes into them. Comparing a copy with its weight costs a pass over both (2.6 ms a
    step for GPT-2 small's 27 MiB), so a step reuses the copy an earlier step compared or made
    (`note`) without comparing it when the weight's version counter is where it was then
    (`unchanged`) and no step's recorder has seen a write into its memory since (`before_write`): an
    in-place write through the weight or any view of it moves the counter, and one inside a
    forward through `.data` (which has a counter of its own) is seen by the recorder. What neither
    sees is a write between two forwards through `.data` or numpy: `verify`, once `generate`
    returns, compares each such copy with its weight, and where one differs, every check a step
    read it without comparing refuses, saying why. The reads of a copy that a later step replaces
    (its weight's counter moved, so it compared and found the copy stale) are judged the same way
    then, since an unseen write may have come before them; a write a recorder sees inside a
    forward has them judged just before it (`before_write`), while the weight still holds what
    they read. A weight changed through `.data` and changed back before `generate` returned is not
    caught by any of these; a derived facet's own check (per-head results that must sum to the
    attention's output, a normalized input that must give the norm's output) refuses where the
    values the forward used differ.
    """

    __slots__ = ("_entries", "_stale", "_by_memory")

    def __init__(self) -> None:
        #: key (`_share_copies`'s) -> [copy, weight, its version when compared or copied (None
        #: once a recorder saw a write into it), the pending checks' input lists that took the
        #: copy without a comparison]
        self._entries: dict[tuple, list] = {}
        #: the ids of the input lists that took a copy found stale before `verify`
        self._stale: set[int] = set()
        #: a weight's memory (`memory_key`) -> the keys of the entries of the weights there
        self._by_memory: dict[int | None, set[tuple]] = {}

    def before_write(self, ptrs: Iterable[int | None]) -> None:
        """A step's recorder is about to let an op write into the memory `ptrs` (a `.data` write
        inside a forward): the reads that took a copy of a weight there uncompared are judged now,
        while the weight still holds what they read (stale if it differs from the copy), and the
        next step to read it compares it again."""
        for ptr in ptrs:
            for key in self._by_memory.get(ptr, ()):
                entry = self._entries.get(key)
                if entry is not None:
                    self._judge(entry)
                    entry[2], entry[3] = None, []

    def _judge(self, entry: list) -> None:
        """The reads that took `entry`'s copy uncompared are stale if the copy no longer holds its
        weight's bits (the weight changed since the copy was compared or made, whenever that was)."""
        if entry[3] and not _same_bits(entry[1], entry[0]):
            self._stale.update(id(inputs) for inputs in entry[3])

    def unchanged(self, key: tuple, copy: Tensor, weight: Tensor) -> bool:
        """Whether `copy` may stand for `weight` without comparing their bits: it is the copy
        last compared or made for this key, and the weight's version counter has not moved since
        (nor did a recorder see a write into its memory since: `before_write`)."""
        entry = self._entries.get(key)
        return (
            entry is not None
            and entry[0] is copy
            and not weight.is_inference()
            and weight._version == entry[2]
        )

    def note(
        self,
        first: dict[tuple, Tensor],
        copies: dict[tuple, Tensor],
        unread: set[tuple],
        groups: list[list[Holding]],
        keys: dict[int, tuple],
    ) -> None:
        """After a step's `_share_copies`: the copies it compared or made become the reference
        (their weight's version taken now), those it reused uncompared are noted for `verify`."""
        entries = self._entries
        for key, c in copies.items():
            t = first[key]
            if key in unread or t.is_inference():
                continue
            entry = entries.get(key)
            if entry is not None and entry[0] is c:  # compared again: what it was read for stands
                entry[1], entry[2] = t, t._version
            else:
                # A new copy replaces one that steps may have taken uncompared: their reads are
                # judged now (not stale if only another weight of the copy's block changed).
                if entry is not None:
                    self._judge(entry)
                entries[key] = [c, t, t._version, []]
                self._by_memory.setdefault(memory_key(t), set()).add(key)
        for items in groups:
            for h in items:
                key = keys[id(h.tensor)]
                entry = entries.get(key) if key in unread else None
                if entry is not None and entry[0] is copies[key]:
                    entry[3].append(h.holder)

    def verify(self, steps: list) -> None:
        """Compare each copy that a step took uncompared with its weight, once `generate` has
        returned; where they differ, every check that took it so refuses (`Pending.void`).

        Args:
            steps: the generation's step traces.
        """
        for entry in self._entries.values():
            self._judge(entry)
        void = self._stale  # the pending input lists that took a copy now found stale
        self._entries, self._stale, self._by_memory = {}, set(), {}
        if not void:
            return
        reason = (
            "a weight it is computed from changed during the generation, and this step read a "
            "copy of it taken earlier without comparing the two (its version counter had not "
            "moved, and a write through .data or numpy moves none), so whether its forward read "
            "the weight before or after the change cannot be told; trace the generation again "
            "without writing into the weights while it runs"
        )
        for step in steps:
            for call in step.modules._every_call():
                if call.facets is None:
                    continue
                for site in call.facets._sites.values():
                    pending = site._pending
                    if (
                        pending is not None
                        and pending.fn is not None
                        and id(pending.inputs) in void
                    ):
                        pending.void(reason)


class DeferredCopies:
    """The saved tensors of a generation's steps that the model still held when their step ended
    (the KV cache it reads at the next step, the step's output), left uncopied (`_snapshot`).

    A step of `trace_generate` holds aliases of what its forward computed. Those the model keeps
    are copied by `trace` as it returns, since the caller could write into them; a generation
    reads the cache again at every step, and copying it at each step's end costs a pass over the
    whole cache (at 128 prompt tokens, GPT-2 small's 24 tensors, 9.2 MiB at the first decode step,
    3.6 ms a step on this project's CPU machine, one torch thread). Here each such storage's
    tensors become one `snapshot.Guarded` group instead, armed with their versions when the step
    is returned (`snapshot.arm_guards`), and are copied, as they were when the step ended:

    - before a later step's forward writes into that memory: its recorder asks first
      (`before_write`), so a cache updated in place (a static cache's `index_copy_`) is copied
      before the write;
    - when `generate` returns (`finish`), if anything but the traces' own tensors still holds that
      memory (`_held_elsewhere`: a cache object the caller passed in, every step's `output`, a
      tensor a logits processor kept).

    Memory nothing else holds by then (a dynamic cache's earlier tensors, replaced by their
    concatenation with the next step's keys) is never copied: its guard is taken off, and the
    trace's tensors are the only ones on it. A write between two forwards that moves the memory's
    version counter refuses the group's values when `generate` returns (`DEFERRED_REASON`); one
    that moves no counter (through `.data` or numpy, between two forwards of `generate`) is not
    seen.
    """

    __slots__ = ("_groups",)

    def __init__(self) -> None:
        #: storage (data pointer) -> the groups on it not copied yet
        self._groups: dict[int, list[Guarded]] = {}

    def defer(self, ptr: int, group: Guarded) -> None:
        """Leave `group` (a step's tensors on storage `ptr`) uncopied."""
        self._groups.setdefault(ptr, []).append(group)

    def before_write(self, ptrs: Iterable[int | None]) -> None:
        """A recorded op is about to write into the storages `ptrs`: copy the groups on them."""
        for ptr in ptrs:
            if ptr is None:
                continue
            resolve_groups(self._groups.pop(ptr, []))

    def finish(self) -> None:
        """`generate` returned: copy the groups whose memory anything but the traces holds."""
        base = _baseline()
        for groups in self._groups.values():
            ours = {id(t): t for group in groups for t in group.tensors()}
            # a group written since its step is refused either way; the others share one copy
            resolve_groups(groups, copy=_held_elsewhere(list(ours.values()), base))
        self._groups.clear()


#: `torch._C._storage_Use_Count`: how many references a storage has; None where torch lacks it.
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _baseline() -> tuple[int, int] | None:
    """(Python references, storage references) of a storage that one tensor and its Python storage
    object hold, as `_held_elsewhere` counts them; None where torch gives no count."""
    if _USE_COUNT is None:
        return None
    probe_tensor = torch.empty(1)
    probe = probe_tensor.untyped_storage()
    return sys.getrefcount(probe), _USE_COUNT(probe._cdata)


def _held_elsewhere(tensors: list[Tensor], base: tuple[int, int] | None = None) -> bool:
    """Whether anything but `tensors` (the traces' own tensors, all on one storage) holds that
    storage: another tensor on it (the model's, the caller's, a detached alias a callback kept), a
    numpy array made from one, or its storage object. Told from the storage's reference count
    (each tensor on a storage holds one reference, as does its Python storage object) and the
    Python references to that object, each measured against `base` (`_baseline`, taken here when
    not given); True where torch gives no count, so the memory is then copied."""
    base = _baseline() if base is None else base
    if base is None or _USE_COUNT is None or not tensors:
        return True
    base_refs, base_uses = base
    storage = tensors[0].untyped_storage()
    return (
        _USE_COUNT(storage._cdata) - base_uses > len(tensors) - 1
        or sys.getrefcount(storage) > base_refs
    )
