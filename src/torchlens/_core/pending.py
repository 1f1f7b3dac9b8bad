"""Deferred checks: a pending facet site holds what it is computed from, and its computation and
check run once, on first read (`Pending`); `seal_checks` records, as `trace` returns, what every
pending check's inputs hold, so a write after the trace refuses the check instead of changing it."""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from torchlens._core.holdings import arg_slots, extent, held_tensors, storage_ptr

if TYPE_CHECKING:
    from torchlens._core.sites import FacetMap, FacetSite

__all__ = ["Pending", "no_autocast", "seal_checks", "stamp"]


class Pending:
    """A deferred check: the computation and check of a group of facet sites of one call, run
    once, on the first read of any of them (or by `FacetMap.check` / `Trace.check`).

    `fn(inputs)` computes from the tensors in `inputs` only (the protocol `FacetSite._inputs`
    describes) and returns `(values, error, refusal)`: the tensors by facet name (a site not
    named keeps the tensor it holds), the check's largest difference (or None), and the reason
    the check failed (None when it held). `after` are sites whose own check must hold first: if
    one of them is refused, so are these sites, with that reason.

    Each site holds its check; the check refers back to its sites and to the `FacetMap` that owns
    them (`owner`) only weakly. So a check forms no reference cycle with them, and the tensors it
    computes from are freed with the last site that waits for it, when the caller drops the
    trace, instead of at the garbage collector's next pass over cycles (81.9 MiB of a dropped
    `save="all"` trace of GPT-2 small at 128 tokens waited for it when the references were
    strong). A site nothing holds any more needs no value: a check that runs skips it.
    """

    __slots__ = ("fn", "inputs", "_sites", "_owner", "after", "marks", "voided", "__weakref__")

    def __init__(
        self, fn: Any, inputs: list, sites: list[FacetSite], after: tuple[FacetSite, ...] = ()
    ):
        self.fn = fn
        self.inputs = inputs
        self._sites = [weakref.ref(s) for s in sites]
        self._owner: weakref.ref[FacetMap] | None = None
        self.after = after
        # What each input held when the trace was returned (`seal`), so a write after the trace
        # (into a tensor the caller was served, which may share memory with an input) is caught.
        # None until sealed: `trace` seals every pending check as its last step.
        self.marks: list | None = None
        #: why the check refuses whatever its inputs hold (`void`), or None
        self.voided: str | None = None
        for s in sites:
            s._pending, s._inputs = self, inputs

    @property
    def sites(self) -> list[FacetSite]:
        """The sites this check computes and checks that are still alive."""
        return [s for s in (r() for r in self._sites) if s is not None]

    @property
    def owner(self) -> FacetMap | None:
        """The `FacetMap` that lists the sites (a failed check moves them to its `refused`), or
        None before one does, or once it is gone."""
        return None if self._owner is None else self._owner()

    @owner.setter
    def owner(self, facets: FacetMap | None) -> None:
        self._owner = None if facets is None else weakref.ref(facets)

    def seal(self, split: set) -> None:
        """Record what each input holds now, the state the forward left it in.

        An input gets `("version", t._version)`: every tensor the finished trace holds on one
        storage (with one dtype) shares one version counter (capture's aliases are views and
        detached aliases of the model's tensors; the copies `_capture.snapshot` and `_capture.stores` make are
        views of one base tensor per storage and dtype), so an in-place write through any of
        them, or through a view the caller made of one, moves it. An inference tensor has no
        counter, and one in `split` (its bytes overlap a tensor of another dtype the trace holds,
        whose counter may be another) may be written without its counter moving: those get
        `("values", stamp(t))`, a fingerprint of their values. Anything else (not a tensor)
        gets None.

        Args:
            split: the ids of the inputs whose counter may not move on a write into their bytes.
        """
        marks: list = []
        for t in self.inputs:
            if not isinstance(t, torch.Tensor):
                marks.append(None)
            elif t.is_inference() or id(t) in split:
                mark = stamp(t)
                marks.append(None if mark is None else ("values", int(mark)))
            else:
                marks.append(("version", t._version))
        self.marks = marks

    def run(self) -> None:
        with _RUN_LOCK:
            fn = self.fn
            if fn is None:  # ran already (another site of the group, another thread)
                return
            refusal, values, error = None, {}, None
            for s in self.after:
                s.tensor  # noqa: B018 - runs that site's check
                if s._refusal is not None:
                    refusal = f"it is computed from {s.name}, which is not served: {s._refusal}"
                    break
            if refusal is None:
                # Inside another trace the check's own torch calls must not be recorded by it; the
                # caller's autocast must not change what the check computes.
                nested = torch._C._len_torch_function_stack() > 0
                with (
                    torch.no_grad(),
                    no_autocast(),
                    torch._C.DisableTorchFunction() if nested else contextlib.nullcontext(),
                ):
                    try:
                        refusal = self._written()
                        if refusal is None:
                            values, error, refusal = fn(_placed(self.inputs))
                    except Exception as exc:  # a check that cannot run refuses, it never raises
                        values, error = {}, None
                        refusal = f"it could not be computed: {type(exc).__name__}: {exc}"
            self.fn, self.inputs = None, []
            sites = self.sites
            for s in sites:
                s._pending = s._inputs = None
                if error is not None:
                    s.check_error = error
                if refusal is not None:
                    s._refusal = refusal
                    s._value = None
                elif s.name in values:
                    s._value = values[s.name]
            owner = self.owner
            if refusal is not None and owner is not None:
                owner._refuse(sites, refusal)

    def void(self, reason: str) -> None:
        """Make the check refuse with `reason` when it runs, whatever its inputs hold now (an
        input found, after the trace, not to be what the forward used: `SharedWeights.verify`)."""
        self.voided = reason

    def _written(self) -> str | None:
        """Why the check must not run: an input no longer holds what the forward left in it."""
        if self.voided is not None:
            return self.voided
        if self.marks is None:  # not sealed (a check made outside `trace`): nothing to compare with
            return None
        for i, (t, mark) in enumerate(zip(self.inputs, self.marks)):
            if mark is None:
                continue
            kind, then = mark
            if kind == "version":
                changed = t._version != then
            else:
                now = stamp(t)  # on the device the input is on now (a store may have moved it)
                changed = now is None or int(now) != then
            if changed:
                return (
                    f"a tensor it is computed from (input {i} of its check, a {list(t.shape)} "
                    f"{str(t.dtype).replace('torch.', '')}) was written after the trace returned, e.g. in "
                    f"place into a facet the trace served, so its values are no longer the forward's; "
                    f"read the derived facets (or call trace.check()) before writing into a served "
                    f"tensor, or write into a copy (tensor.clone())"
                )
        return None

    def discard(self, site: FacetSite) -> None:
        """`site` no longer waits for this check (its tensor was dropped)."""
        self._sites = [r for r in self._sites if r() is not None and r() is not site]
        site._pending = site._inputs = None
        if not self._sites:
            self.fn, self.inputs = None, []


def _placed(inputs: list) -> list:
    """Each strided tensor of a check's `inputs` as a fresh contiguous copy, everything else as is.

    A matrix product's kernel path (and so its last bits) depends on where its operands' bytes
    sit: their alignment and strides. A store keeps the same values at other addresses (a
    memory-mapped file, another device's allocator), so a check computed from the tensors where
    they are would give a store-dependent result. Fresh copies are laid out the same way whatever
    held the originals, so a served value does not depend on `store=`, bit for bit.
    """
    return [
        torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)
        if isinstance(t, torch.Tensor)
        and t.layout == torch.strided
        and not t.is_quantized
        and t.device.type != "meta"
        and type(t) in (torch.Tensor, torch.nn.Parameter)
        else t
        for t in inputs
    ]


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_STAMP_CHUNK = 1 << 20
_STAMP_WEIGHTS: dict[tuple[str, torch.dtype], torch.Tensor] = {}


def _stamp_weights(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Odd position weights (`_STAMP_CHUNK` of them, made once per device and dtype)."""
    key = (str(device), dtype)
    w = _STAMP_WEIGHTS.get(key)
    if w is None:
        w = (
            torch.arange(_STAMP_CHUNK, dtype=torch.int64, device=device)
            .mul_(2654435761)
            .bitwise_or_(1)
        )
        w = _STAMP_WEIGHTS[key] = w.to(dtype)  # wraps to the dtype's width, still odd
    return w


def stamp(t: Any) -> torch.Tensor | None:
    """A fingerprint of `t`'s values (a 0-d int64 tensor on its device); None for what has no
    values to compare (not a tensor; a meta, sparse or quantized one).

    The bits of each element times an odd weight that depends on its position (in 32-bit or
    64-bit integers, wrapping), summed in int64 chunk by chunk: exact integer arithmetic, so the
    same values give the same stamp whatever the reduction order, and a write that changes any
    element changes it but for a collision. It costs a pass over `t`, so `Pending.seal` takes
    one only where a version counter cannot tell: an inference tensor (it has none), or a tensor
    whose storage the trace holds in several dtypes (their copies do not share one).
    """
    if (
        not isinstance(t, torch.Tensor)
        or t.device.type == "meta"
        or t.layout != torch.strided
        or t.is_quantized
    ):
        return None  # no values to read (a meta tensor), or no bits to view: nothing to compare
    with torch.no_grad(), no_autocast():
        x = t.detach()
        if x.is_complex():
            x = torch.view_as_real(x)
        x = x.reshape(-1)
        bits = (
            x.view(torch.uint8) if x.dtype == torch.bool else x.view(_INT_OF_SIZE[x.element_size()])
        )
        wide = torch.int64 if bits.dtype == torch.int64 else torch.int32
        w = _stamp_weights(x.device, wide)
        total = torch.zeros((), dtype=torch.int64, device=x.device)
        for lo in range(0, bits.numel(), _STAMP_CHUNK):
            part = bits[lo : lo + _STAMP_CHUNK]
            # a new tensor (never into `part`, which may be `t`'s own memory), then the chunk's place
            total.mul_(1000003).add_(torch.mul(part, w[: part.numel()]).sum(dtype=torch.int64))
        return total


def seal_checks(trace: Any) -> None:
    """Seal every pending facet check of the finished `trace` (`Pending.seal`).

    Called by `trace` as its last step, once `_capture.snapshot` and the store have put the tensors
    the trace keeps where they stay. An input whose bytes overlap a tensor of another dtype the
    trace holds on the same storage is `split`: the copies of such a storage have one version
    counter per dtype, so a write through the other dtype would not move the input's counter.
    (Tensors of different dtypes on one storage that do not overlap, as the directory store
    lays out the storages it writes in one file, need no fingerprint.)
    """
    pendings: dict[int, Pending] = {}
    calls = trace.modules._every_call()  # the records of a trace not read yet are not made here
    for call in calls:
        for facets in (
            call.facets,
            getattr(call, "grads", None),
        ):  # values, and gradients (`grads=`)
            if facets is None:
                continue
            for site in facets._sites.values():
                pending = site._pending
                if pending is not None and pending.fn is not None:
                    pendings.setdefault(id(pending), pending)
    if not pendings:
        return
    # (device, storage) -> the dtypes of the pending inputs there. A storage is held in two dtypes
    # or more when its pending inputs have two, or when another tensor the trace holds there has a
    # dtype they lack; the byte extents are worked out only for such a storage (rare: most hold
    # one dtype).
    wanted: dict[tuple[Any, int], set[torch.dtype]] = {}
    for p in pendings.values():
        for t in p.inputs:
            if isinstance(t, torch.Tensor) and not t.is_inference():
                ptr = storage_ptr(t)
                if ptr is not None:  # without a storage of its own it shares no counter
                    wanted.setdefault((t.device, ptr), set()).add(t.dtype)
    multi: set[tuple[Any, int | None]] = {key for key, dtypes in wanted.items() if len(dtypes) > 1}
    # A held tensor of a dtype every such storage's pending inputs have cannot add a second one,
    # so its storage is not looked up: most of what a trace holds is of the pending inputs' dtype.
    common = set.intersection(*wanted.values()) if wanted else set()
    for t in _uncommon(trace.ops, calls, common):
        key = (t.device, storage_ptr(t))
        dtypes = wanted.get(key)  # type: ignore[arg-type]
        if dtypes is not None and t.dtype not in dtypes:
            multi.add(key)
    extents: dict[tuple[Any, int | None], dict[torch.dtype, list[tuple[int, int]]]] = {}
    if multi:
        for t in (h.tensor for h in held_tensors(trace.ops, calls)):
            key = (t.device, storage_ptr(t))
            if key in multi:
                extents.setdefault(key, {}).setdefault(t.dtype, []).append(extent(t))
    split: set[int] = set()
    for pending in pendings.values() if extents else ():
        for t in pending.inputs:
            if not isinstance(t, torch.Tensor) or t.is_inference():
                continue
            by_dtype = extents.get((t.device, storage_ptr(t)))
            if by_dtype is None:
                continue
            lo, hi = extent(t)
            if any(
                a < hi and lo < b
                for dtype, spans in by_dtype.items()
                if dtype != t.dtype
                for a, b in spans
            ):
                split.add(id(t))
    for pending in pendings.values():
        pending.seal(split)


def _uncommon(ops: list, calls: list, common: set[torch.dtype]) -> Iterator[torch.Tensor]:
    """The tensors `held_tensors(ops, calls)` walks whose dtype is not in `common`, but for the
    inputs of pending checks (`seal_checks` has their dtypes already): op outputs (an op whose
    recorded dtypes are all common is passed over without reading its tensors), the arguments
    kept for a rebuild, facets' stored tensors (and their gradients')."""
    for op in ops:
        if op.extra is not None:
            yield from (t for _, t in arg_slots(op.extra) if t.dtype not in common)
        if not all(d in common for d in op.dtypes):
            yield from (t for t in op._tensors if t is not None and t.dtype not in common)
    for call in calls:
        for facets in (call.facets, getattr(call, "grads", None)):
            if facets is not None:
                for site in facets._sites.values():
                    t = site._value
                    if isinstance(t, torch.Tensor) and t.dtype not in common:
                        yield t


def no_autocast() -> contextlib.ExitStack:
    """Autocast switched off for every device type this torch knows, so a check computes in the
    dtypes of its inputs whatever the caller's context."""
    stack = contextlib.ExitStack()
    for device in _autocast_devices():
        try:
            stack.enter_context(torch.autocast(device_type=device, enabled=False))
        except Exception:  # a device type this build does not support
            continue
    return stack


@functools.lru_cache(maxsize=1)
def _autocast_devices() -> tuple[str, ...]:
    """The device types autocast can be on in this process: the CPU and each available accelerator."""
    found = ["cpu"]
    for device in ("cuda", "xpu", "mps", "hpu", "mtia"):
        module = getattr(torch, device, None) or getattr(torch.backends, device, None)
        try:
            if module is not None and module.is_available():
                found.append(device)
        except Exception:  # a backend module without a usable is_available
            continue
    return tuple(found)


#: Serializes deferred checks, so two threads reading one site run its check once. Re-entrant:
#: a check may run the checks its sites depend on.
_RUN_LOCK = threading.RLock()
