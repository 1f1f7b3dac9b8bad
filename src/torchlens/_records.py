"""The records a trace is made of: ops, module calls, facets, and the `Trace` itself."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ._errors import AmbiguousModuleCall, FacetNotFound, FacetNotSaved, LookupFailed, ModuleNotFoundInTrace

__all__ = ["Ref", "OpRecord", "FacetSite", "FacetMap", "ModuleCall", "ModuleRecord", "ModuleMap", "Trace"]


class Ref(NamedTuple):
    """Where a tensor came from: output `slot` of op number `op`."""

    op: int
    slot: int = 0


class _Dropped(NamedTuple):
    """In place of a module input/output alias the end-of-trace version check dropped: the
    facets read from it are refused with `reason`, not reported as unsaved."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    reason: str


class OpRecord:
    """One executed torch operation.

    Attributes:
        index (int): position in execution order (0-based).
        name (str): the torch function's name, e.g. `"linear"`, `"__add__"`, `"softmax"`; or
            `"written_in_place"` for the entry TorchLens adds where a tensor is used after an
            in-place write no recorded op returned (`x[i] = v`, a write through a view, a hook
            editing a module's output): its output is the tensor as it was used, its input the
            op that produced it before the write. `"accelerate_hook"` is the entry for a tensor an
            accelerate hook (`module._hf_hook`, e.g. a `ModelHook` that ablates) returned in place
            of one with other values; its input is the tensor it replaced.
        module (str): address of the innermost module that was running (`""` for the root).
        call (int): which call of that module (0 for the first).
        inputs (tuple[Ref | str | None, ...]): for each tensor argument, in order, a
            [`Ref`][torchlens.Ref] to the op that produced it, the parameter's qualified
            name (a `str`), or None for a tensor from outside the forward (a model input).
        shapes (tuple[torch.Size, ...]): the shape of each tensor output.
        dtypes (tuple[torch.dtype, ...]): the dtype of each tensor output.
        device (torch.device): the device of the first output.
        tensors (tuple[torch.Tensor | None, ...]): one entry per tensor output when saved, else
            None: the output detached, as the op returned it; a later in-place write during the
            forward clones it first, and a tensor still sharing memory with something the caller
            holds (inputs, weights, the output) is copied when `trace` returns.
        mutated (bool): True when the op changed one of its inputs in place.
    """

    __slots__ = ("index", "name", "module", "call", "inputs", "shapes", "dtypes", "device", "tensors", "mutated", "extra")

    def __init__(self, index, name, module, call, inputs, shapes, dtypes, device, tensors, mutated=False, extra=None):
        self.index = index
        self.name = name
        self.module = module
        self.call = call
        self.inputs = inputs
        self.shapes = shapes
        self.dtypes = dtypes
        self.device = device
        self.tensors = tensors
        self.mutated = mutated
        self.extra = extra

    @property
    def shape(self) -> torch.Size:
        """Shape of the first output."""
        return self.shapes[0]

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the first output."""
        return self.dtypes[0]

    @property
    def tensor(self) -> torch.Tensor | None:
        """The first output, when this trace saved it."""
        return self.tensors[0]

    def __repr__(self) -> str:
        where = self.module or "<root>"
        shape = "x".join(map(str, self.shape)) or "scalar"
        return f"OpRecord(#{self.index} {self.name} in {where}[{self.call}] -> {shape} {str(self.dtype).replace('torch.', '')})"


class _Pending:
    """A deferred check: the computation and check of a group of facet sites of one call, run
    once, on the first read of any of them (or by `FacetMap.check` / `Trace.check`).

    `fn(inputs)` computes from the tensors in `inputs` only (the protocol `FacetSite._inputs`
    describes) and returns `(values, error, refusal)`: the tensors by facet name (a site not
    named keeps the tensor it holds), the check's largest difference (or None), and the reason
    the check failed (None when it held). `after` are sites whose own check must hold first: if
    one of them is refused, so are these sites, with that reason.
    """

    __slots__ = ("fn", "inputs", "sites", "owner", "after", "marks")

    def __init__(self, fn: Any, inputs: list, sites: list[FacetSite], after: tuple[FacetSite, ...] = ()):
        self.fn = fn
        self.inputs = inputs
        self.sites = sites
        self.owner: FacetMap | None = None
        self.after = after
        # What each input held when the trace was returned (`seal`), so a write after the trace
        # (into a tensor the caller was served, which may share memory with an input) is caught.
        # None until sealed: `trace` seals every pending check as its last step.
        self.marks: list | None = None
        for s in sites:
            s._pending, s._inputs = self, inputs

    def seal(self, split: set) -> None:
        """Record what each input holds now, the state the forward left it in.

        An input gets `("version", t._version)`: every tensor the finished trace holds on one
        storage (with one dtype) shares one version counter (capture's aliases are views and
        detached aliases of the model's tensors; the copies `_snapshot` and `_store` make are
        views of one base tensor per storage and dtype), so an in-place write through any of
        them, or through a view the caller made of one, moves it. An inference tensor has no
        counter, and one in `split` (its bytes overlap a tensor of another dtype the trace holds,
        whose counter may be another) may be written without its counter moving: those get
        `("values", _stamp(t))`, a fingerprint of their values. Anything else (not a tensor)
        gets None.

        Args:
            split: the ids of the inputs whose counter may not move on a write into their bytes.
        """
        marks: list = []
        for t in self.inputs:
            if not isinstance(t, torch.Tensor):
                marks.append(None)
            elif t.is_inference() or id(t) in split:
                stamp = _stamp(t)
                marks.append(None if stamp is None else ("values", int(stamp)))
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
                with torch.no_grad(), _no_autocast(), (
                        torch._C.DisableTorchFunction() if nested else contextlib.nullcontext()):
                    try:
                        refusal = self._written()
                        if refusal is None:
                            values, error, refusal = fn(_placed(self.inputs))
                    except Exception as exc:  # a check that cannot run refuses, it never raises
                        values, error = {}, None
                        refusal = f"it could not be computed: {type(exc).__name__}: {exc}"
            self.fn = self.inputs = None
            for s in self.sites:
                s._pending = s._inputs = None
                if error is not None:
                    s.check_error = error
                if refusal is not None:
                    s._refusal = refusal
                    s.__dict__["tensor"] = None
                elif s.name in values:
                    s.__dict__["tensor"] = values[s.name]
            if refusal is not None and self.owner is not None:
                self.owner._refuse(self.sites, refusal)

    def _written(self) -> str | None:
        """Why the check must not run: an input no longer holds what the forward left in it."""
        if self.marks is None:  # not sealed (a check made outside `trace`): nothing to compare with
            return None
        for i, (t, mark) in enumerate(zip(self.inputs, self.marks)):
            if mark is None:
                continue
            kind, then = mark
            if kind == "version":
                changed = t._version != then
            else:
                now = _stamp(t)  # on the device the input is on now (a store may have moved it)
                changed = now is None or int(now) != then
            if changed:
                return (f"a tensor it is computed from (input {i} of its check, a {list(t.shape)} "
                        f"{str(t.dtype).replace('torch.', '')}) was written after the trace returned, e.g. in "
                        f"place into a facet the trace served, so its values are no longer the forward's; "
                        f"read the derived facets (or call trace.check()) before writing into a served "
                        f"tensor, or write into a copy (tensor.clone())")
        return None

    def discard(self, site: FacetSite) -> None:
        """`site` no longer waits for this check (its tensor was dropped)."""
        if site in self.sites:
            self.sites.remove(site)
        site._pending = site._inputs = None
        if not self.sites:
            self.fn = self.inputs = None


def _placed(inputs: list) -> list:
    """Each strided tensor of a check's `inputs` as a fresh contiguous copy, everything else as is.

    A matrix product's kernel path (and so its last bits) depends on where its operands' bytes
    sit: their alignment and strides. A store keeps the same values at other addresses (a
    memory-mapped file, another device's allocator), so a check computed from the tensors where
    they are would give a store-dependent result. Fresh copies are laid out the same way whatever
    held the originals, so a served value does not depend on `store=`, bit for bit.
    """
    return [torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_quantized
            and t.device.type != "meta" and type(t) in (torch.Tensor, torch.nn.Parameter) else t
            for t in inputs]


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_STAMP_CHUNK = 1 << 20
_STAMP_WEIGHTS: dict[tuple[str, torch.dtype], torch.Tensor] = {}


def _stamp_weights(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Odd position weights (`_STAMP_CHUNK` of them, made once per device and dtype)."""
    key = (str(device), dtype)
    w = _STAMP_WEIGHTS.get(key)
    if w is None:
        w = torch.arange(_STAMP_CHUNK, dtype=torch.int64, device=device).mul_(2654435761).bitwise_or_(1)
        w = _STAMP_WEIGHTS[key] = w.to(dtype)  # wraps to the dtype's width, still odd
    return w


def _stamp(t: Any) -> torch.Tensor | None:
    """A fingerprint of `t`'s values (a 0-d int64 tensor on its device); None for what has no
    values to compare (not a tensor; a meta, sparse or quantized one).

    The bits of each element times an odd weight that depends on its position (in 32-bit or
    64-bit integers, wrapping), summed in int64 chunk by chunk: exact integer arithmetic, so the
    same values give the same stamp whatever the reduction order, and a write that changes any
    element changes it but for a collision. It costs a pass over `t`, so `_Pending.seal` takes
    one only where a version counter cannot tell: an inference tensor (it has none), or a tensor
    whose storage the trace holds in several dtypes (their copies do not share one).
    """
    if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.layout != torch.strided or t.is_quantized:
        return None  # no values to read (a meta tensor), or no bits to view: nothing to compare
    with torch.no_grad(), _no_autocast():
        x = t.detach()
        if x.is_complex():
            x = torch.view_as_real(x)
        x = x.reshape(-1)
        bits = x.view(torch.uint8) if x.dtype == torch.bool else x.view(_INT_OF_SIZE[x.element_size()])
        wide = torch.int64 if bits.dtype == torch.int64 else torch.int32
        w = _stamp_weights(x.device, wide)
        total = torch.zeros((), dtype=torch.int64, device=x.device)
        for lo in range(0, bits.numel(), _STAMP_CHUNK):
            part = bits[lo : lo + _STAMP_CHUNK]
            # a new tensor (never into `part`, which may be `t`'s own memory), then the chunk's place
            total.mul_(1000003).add_(torch.mul(part, w[: part.numel()]).sum(dtype=torch.int64))
        return total


def _storage_ptr(t: torch.Tensor) -> int | None:
    """The data pointer of `t`'s storage, or None for a tensor with no storage of its own to point
    to (a sparse tensor; a wrapper subclass, whose data lives in the tensors it wraps)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _memory_key(t: torch.Tensor, _depth: int = 0) -> int | None:
    """What identifies the memory `t`'s values live in, to tell which tensors a write changes: its
    storage's data pointer; for a wrapper subclass (one with `__tensor_flatten__`, such as
    `TwoTensor`), its first inner tensor's, which a write into the wrapper writes too; None for
    a tensor with neither (a sparse tensor)."""
    ptr = _storage_ptr(t)
    if ptr is not None or _depth > 4 or not hasattr(type(t), "__tensor_flatten__"):
        return ptr
    try:
        names, _ = t.__tensor_flatten__()
        inner = next((x for x in (getattr(t, n) for n in names) if isinstance(x, torch.Tensor)), None)
    except Exception:  # a subclass whose flattening fails here: nothing to key it by
        return None
    return None if inner is None else _memory_key(inner, _depth + 1)


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage `t` can reach, as [start, end) (empty for an empty tensor)."""
    item = t.element_size()
    start = t.storage_offset() * item
    if t.numel() == 0:
        return start, start
    last = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * item


def seal_checks(trace: Any) -> None:
    """Seal every pending facet check of the finished `trace` (`_Pending.seal`).

    Called by `trace` as its last step, once `_snapshot` and the store have put the tensors
    the trace keeps where they stay. An input whose bytes overlap a tensor of another dtype the
    trace holds on the same storage is `split`: the copies of such a storage have one version
    counter per dtype, so a write through the other dtype would not move the input's counter.
    (Tensors of different dtypes on one storage that do not overlap, as the directory store
    lays out the storages it writes in one file, need no fingerprint.)
    """
    from ._store import _saved_tensors

    pendings: dict[int, _Pending] = {}
    for rec in trace.modules.values():
        for call in rec.calls:
            if call.facets is None:
                continue
            for site in call.facets._sites.values():
                pending = site._pending
                if pending is not None and pending.fn is not None:
                    pendings.setdefault(id(pending), pending)
    if not pendings:
        return
    # storage -> dtype -> the tensors the trace holds there in that dtype, for the storages the
    # pending inputs are on; the byte extents are worked out only for a storage held in two
    # dtypes or more (rare: most hold one)
    wanted = {_storage_ptr(t) for p in pendings.values() for t in p.inputs
              if isinstance(t, torch.Tensor) and not t.is_inference()}
    wanted.discard(None)  # a tensor without a storage of its own shares no counter with another dtype
    saved = _saved_tensors(trace)
    first: dict[tuple[Any, int], torch.dtype] = {}  # storage -> the dtype of the first tensor held there
    multi: set[tuple[Any, int]] = set()  # the storages held in a second dtype
    for _, _, t in saved:
        ptr = _storage_ptr(t)
        if ptr in wanted:
            key = (t.device, ptr)
            if first.setdefault(key, t.dtype) != t.dtype:
                multi.add(key)
    extents: dict[tuple[Any, int], dict[torch.dtype, list[tuple[int, int]]]] = {}
    if multi:
        for _, _, t in saved:
            key = (t.device, _storage_ptr(t))
            if key in multi:
                extents.setdefault(key, {}).setdefault(t.dtype, []).append(_extent(t))
    split: set[int] = set()
    for pending in pendings.values():
        for t in pending.inputs:
            if not isinstance(t, torch.Tensor) or t.is_inference():
                continue
            by_dtype = extents.get((t.device, _storage_ptr(t)))
            if by_dtype is None:
                continue
            lo, hi = _extent(t)
            if any(a < hi and lo < b for dtype, spans in by_dtype.items() if dtype != t.dtype for a, b in spans):
                split.add(id(t))
    for pending in pendings.values():
        pending.seal(split)


def _no_autocast() -> contextlib.ExitStack:
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


class FacetSite:
    """What TorchLens knows about one facet of one module call.

    A derived facet (a rebuilt attention pattern, a per-head result, a norm's statistics) and a
    real facet whose check is expensive (`z`'s `pattern @ v`, `resid_mid`'s residual sums) are
    *pending* when `trace` returns: the trace holds what they are computed from, and the tensor
    is computed and checked on first read of `tensor` (or by `FacetMap.check` /
    [`Trace.check`][torchlens.Trace.check]), then kept. Until then `checked` is False and
    `check_error` is None; a site whose check fails then is refused (`tensor` is None and its
    `FacetMap` lists it under `refused`). Nothing else about a site (its kind, shape, dtype,
    `saved`, its repr) computes anything.

    Attributes:
        name: the facet name (`"resid_post"`, `"pattern"`, ...).
        kind: `"real"` (the output of an op the model ran), `"computed"` (derived from recorded
            tensors and the module's weights, read-only), or `"reconstructed"` (rebuilt from a
            fused kernel's recorded inputs and checked against the kernel output, read-only).
            The kind is how TorchLens got the tensor; a name that resolves here (see
            `torchlens.mechinterp`) gets the status `real` for a real facet and
            `reconstructed_read_only` for a computed or reconstructed one.
        shape: the tensor's shape, known even when it was not saved.
        dtype: the tensor's dtype, known even when it was not saved.
        tensor: the tensor; reading it runs a pending check first. None when this trace's `save=`
            did not keep it, or when its check failed. Assigning None drops the tensor and any
            pending check with it.
        op: index of the op whose output this is, for real facets.
        check_error: for a checked facet, the largest absolute difference in its check against a
            relation the model fixes (the rebuilt vs the recorded kernel output; normalized *
            gain + bias vs the norm output; the sum over heads of result + bias vs the output
            projection; pattern @ v vs z; the residual sums around resid_mid); None while the
            check is pending. A facet whose check fails is not served: it is listed in
            `FacetMap.refused` with the reason.
        note: how the facet was found or computed, in one line.
    """

    # While a check is pending: the deferred check (a `_Pending`, shared by the sites it checks
    # together) and `_inputs`, the one list of tensors it computes from, weights included. The
    # protocol for code that holds or moves a trace's tensors: `_inputs` entries are captured
    # as the forward left them and are read only when the check runs; `_snapshot` copies those
    # the caller could still write into, and a store may replace an entry in place by a tensor
    # with the same values (on any device; the check computes where its inputs are), keeping
    # every tensor the trace holds on one storage and dtype on one version counter (views of one
    # base). When `trace` returns it seals the check (`_Pending.seal`: each entry's version, or a
    # fingerprint of its values where a counter cannot tell), which refuses if one no longer
    # matches when it runs (a write after the trace, e.g. into a served facet). Both are
    # None once the check ran or the site was dropped. The stored tensor itself is
    # `site.__dict__["tensor"]` (`tensor` is a property).
    _pending: _Pending | None = None
    _inputs: list | None = None
    _refusal: str | None = None  # why a deferred check refused this site, once it ran and failed

    def __init__(self, name: str, kind: str, shape: tuple[int, ...], dtype: torch.dtype,
                 tensor: torch.Tensor | None = None, op: int | None = None, check_error: float | None = None,
                 note: str = ""):
        self.name = name
        self.kind = kind
        self.shape = shape
        self.dtype = dtype
        self.tensor = tensor
        self.op = op
        self.check_error = check_error
        self.note = note

    @property
    def tensor(self) -> torch.Tensor | None:
        """The tensor, computed and checked first if this site is pending; None when `save=` did
        not keep it or its check failed."""
        if self._pending is not None:
            self._pending.run()
        return self.__dict__.get("tensor")

    @tensor.setter
    def tensor(self, value: torch.Tensor | None) -> None:
        self.__dict__["tensor"] = value
        if value is None and self._pending is not None:
            self._pending.discard(self)

    @property
    def checked(self) -> bool:
        """False while this site's check is pending (it runs on first read); True once it ran, or
        when the site needs no check."""
        return self._pending is None

    @property
    def saved(self) -> bool:
        """Whether the trace holds the tensor, or (a pending site) what it is computed from.
        Computes nothing; a pending site whose check then fails is no longer saved."""
        return self._refusal is None and (self._pending is not None or self.__dict__.get("tensor") is not None)

    @property
    def read_only(self) -> bool:
        """True for computed and reconstructed facets: no op in the model produced this tensor."""
        return self.kind != "real"

    def __getstate__(self) -> dict[str, Any]:
        """For pickling: the pending check runs first (it cannot be pickled), so the copy holds
        the final tensor and status."""
        if self._pending is not None:
            self._pending.run()
        return {k: v for k, v in self.__dict__.items() if k not in ("_pending", "_inputs")}

    #: The fields a saved trace stores (`Trace.save` runs the pending check first).
    _PERSISTED = ("name", "kind", "shape", "dtype", "tensor", "op", "check_error", "note")

    def _persist_fields(self) -> list[tuple[str, Any]]:
        return [(f, getattr(self, f)) for f in self._PERSISTED]

    def __repr__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        how = self.kind
        if self.op is not None:
            how += f", op #{self.op}"
        if self._pending is not None:
            how += ", check pending"
        elif self.check_error is not None:
            how += f", check error {self.check_error:.2g}"
        return f"FacetSite({self.name}: {list(self.shape)} {dtype}, {how}, {'saved' if self.saved else 'not saved'})"


def _forward_order(names) -> list[str]:
    """Facet names in forward order: `input`, then the order `FACETS` lists them in (the order
    a forward computes them: `resid_pre`, `resid_mid`, `resid_post`; `q`, `k`, `v`, ...), then
    names `FACETS` does not list, then `output`."""
    rank = _facet_rank()
    last = rank["output"] - 1
    return sorted(names, key=lambda name: rank.get(name, last))


@functools.lru_cache(maxsize=1)
def _facet_rank() -> dict[str, int]:
    """Facet name -> its place in forward order (`FACETS` is fixed once imported)."""
    from ._facet_spec import FACETS

    rank: dict[str, int] = {}
    for facets in FACETS.values():
        for name in facets:
            rank.setdefault(name, len(rank))
    last = len(rank)
    rank.update(input=-1, output=last + 1)
    return rank


class FacetMap(Mapping):
    """The facets of one module call: a read-only mapping from facet name to tensor.

    Iteration, `len` and `in` cover the facets whose tensor this trace saved, pending ones
    included: they compute nothing. `sites` lists every facet the module has, saved or not,
    with its kind and shape. Reading a facet (`facets[name]`, `items()`, `values()`) runs its
    check if it is pending (see [`FacetSite`][torchlens.FacetSite]); `check()` runs them all.
    Asking for a facet that exists but was not saved raises
    [`FacetNotSaved`][torchlens.FacetNotSaved]; asking for one that does not exist, or whose
    check failed, raises [`FacetNotFound`][torchlens.FacetNotFound] with close matches or the
    reason.

    Attributes:
        address: the module's address.
        role: the module's role.
        refused: facet name -> why it is not served: its check against a relation the model
            fixes failed or could not run. It lists the checks that ran: a pending check that
            fails later (on first read, or in `check()`) adds its facets here then, and takes
            them out of `sites`.
        ran: False for the empty map of a module that did not run in the forward.
    """

    _explain: dict[str, str] | None = None  # facet -> words to add to its reason, if refused

    def __init__(self, address: str, role: str, sites: dict[str, FacetSite], ran: bool = True):
        self.address = address
        self.role = role
        self.refused = {n: s.note for n, s in sites.items() if s.kind == "refused"}
        served = {n: s for n, s in sites.items() if s.kind != "refused"} if self.refused else sites
        self._sites = {n: served[n] for n in _forward_order(served)}
        self.ran = ran
        for s in self._sites.values():
            if s._pending is not None:
                s._pending.owner = self

    @property
    def sites(self) -> dict[str, FacetSite]:
        """Facet name -> [`FacetSite`][torchlens.FacetSite], in forward order: every facet the
        module has and serves (refused ones are in `refused`). A new dict on each access, so a
        check that runs while you iterate it changes nothing under you."""
        return dict(self._sites)

    def _refuse(self, sites: list[FacetSite], reason: str) -> None:
        """A deferred check failed: its sites move from `sites` to `refused`."""
        for s in sites:
            if self._sites.get(s.name) is s:
                del self._sites[s.name]
                self.refused[s.name] = reason + (self._explain or {}).pop(s.name, "")

    def explain_refusal(self, facet: str, text: str) -> None:
        """Add `text` to the reason `facet` is refused, now if it is, or when its pending check
        refuses it later; nothing if its check holds. (An edited trace words this way the
        refusals its edits cause.)"""
        if facet in self.refused:
            self.refused[facet] += text
        else:
            if self._explain is None:
                self._explain = {}
            self._explain[facet] = self._explain.get(facet, "") + text

    def check(self, name: str | None = None) -> dict[str, str]:
        """Run the pending checks: every one of this call, or that of the facet `name`.

        Returns:
            `refused`: the facets not served, with the reason.
        """
        todo = [self._sites[name]] if isinstance(name, str) and name in self._sites else \
            [] if name is not None else list(self._sites.values())
        for s in todo:
            if s._pending is not None:
                s._pending.run()
        return self.refused

    @property
    def pending(self) -> list[str]:
        """The facets whose check has not run yet (computes nothing)."""
        return [n for n, s in self._sites.items() if s._pending is not None]

    def _not_found(self, name: Any) -> FacetNotFound:
        if not isinstance(name, str):
            return FacetNotFound(
                self.address, repr(name), self._sites, self.role,
                f"facets are looked up by name (a str), not by {type(name).__name__}; "
                f"its facets are: {', '.join(self._sites) or '(none)'}",
            )
        if name in self.refused:
            return FacetNotFound(self.address, name, self._sites, self.role, f"it is not served: {self.refused[name]}")
        reason = "" if self.ran else "it did not run in this forward pass, so it has no facets"
        return FacetNotFound(self.address, name, self._sites, self.role, reason)

    def __getitem__(self, name: str) -> torch.Tensor:
        site = self._sites.get(name) if isinstance(name, str) else None
        if site is None:
            raise self._not_found(name)
        t = site.tensor  # runs a pending check
        if site._refusal is not None:
            raise self._not_found(name)
        if t is None:
            raise FacetNotSaved(self.address, name)
        return t

    def __iter__(self) -> Iterator[str]:
        return iter([n for n, s in self._sites.items() if s.saved])

    def __len__(self) -> int:
        return sum(s.saved for s in self._sites.values())

    def __contains__(self, name: object) -> bool:
        site = self._sites.get(name) if isinstance(name, str) else None
        return site is not None and site.saved

    def items(self):
        """(name, tensor) of the saved facets; runs their pending checks first, so a facet whose
        check fails is left out (and listed in `refused`)."""
        self.check()
        return super().items()

    def values(self):
        """The saved facets' tensors; runs their pending checks first (see `items`)."""
        self.check()
        return super().values()

    def site(self, name: str) -> FacetSite:
        """The [`FacetSite`][torchlens.FacetSite] of `name`, saved or not (its check is not run)."""
        site = self._sites.get(name) if isinstance(name, str) else None
        if site is None:
            raise self._not_found(name)
        return site

    #: The fields a saved trace stores; `sites` (under its public name) is loaded into `_sites`.
    _PERSISTED = ("address", "role", "refused", "sites", "ran")
    _persist_renames = {"sites": "_sites"}

    def _persist_fields(self) -> list[tuple[str, Any]]:
        return [(f, getattr(self, self._persist_renames.get(f, f))) for f in self._PERSISTED]

    def __repr__(self) -> str:
        items = []
        for n, s in self._sites.items():
            flag = "" if s.kind == "real" else f" {s.kind}"
            flag += "" if s.saved else " not saved"
            flag += " check pending" if s._pending is not None else ""
            items.append(f"{n}{list(s.shape)}{flag}")
        return f"FacetMap({self.address!r}: {', '.join(items)})"


@dataclass
class ModuleCall:
    """One call of one module during the forward pass.

    Attributes:
        address: the module's address, e.g. `"transformer.h.1"` (`""` for the root).
        index: 0 for the module's first call, 1 for the second, ...
        role: the module's role (`"block"`, `"attention"`, `"mlp"`, `"norm"`, `"embedding"`,
            `"unembed"`, `"root"` or `"other"`).
        class_name: the module's class, e.g. `"GPT2Block"`.
        first_op: index of this call's first op: the call's ops are
            `trace.ops[first_op:end_op]` (children's ops included).
        end_op: index one past this call's last op.
        facets: this call's [`FacetMap`][torchlens.FacetMap].
        input_ref: where the call's input came from: a [`Ref`][torchlens.Ref] to the op that
            produced it, a parameter's name (a `str`), or None for a tensor from outside the
            forward (a model input) or a call without a tensor input.
        output_ref: the same for the call's output (its first tensor, depth first).
    """

    address: str
    index: int
    role: str
    class_name: str
    first_op: int
    end_op: int = -1
    facets: FacetMap | None = None
    parent: ModuleCall | None = field(default=None, repr=False)
    retained: bool = field(default=False, repr=False)
    input_ref: Any = field(default=None, repr=False)
    output_ref: Any = field(default=None, repr=False)
    # Aliases of the input and output tensors, kept during capture where the producing op's
    # output is not; dropped when the trace is finished.
    _in: Any = field(default=None, repr=False)
    _out: Any = field(default=None, repr=False)


@dataclass
class ModuleRecord:
    """Everything the trace holds about one module address.

    Attributes:
        address: the module's address.
        class_name: the module's class, e.g. `"GPT2Block"`.
        role: see [`ModuleCall`][torchlens.ModuleCall].
        calls: one [`ModuleCall`][torchlens.ModuleCall] per time the module ran; empty if
            it never ran in this forward.
        aliases: other addresses the same module object is registered under (shared modules).
    """

    address: str
    class_name: str
    role: str
    calls: list[ModuleCall] = field(default_factory=list)
    aliases: tuple[str, ...] = ()

    @property
    def facets(self) -> FacetMap:
        """The facets of the module's only call.

        A module that never ran in this forward gets an empty map (`ran` is False), and asking it
        for a facet raises `FacetNotFound` saying so.

        Raises:
            AmbiguousModuleCall: the module ran several times; read `calls[i].facets`.
        """
        if len(self.calls) == 1:
            return self.calls[0].facets  # type: ignore[return-value]
        if not self.calls:
            return FacetMap(self.address, self.role, {}, ran=False)
        raise AmbiguousModuleCall(self.address, len(self.calls))

    def __repr__(self) -> str:
        return f"ModuleRecord({self.address!r}, {self.class_name}, role={self.role}, calls={len(self.calls)})"


class ModuleMap(Mapping):
    """Module records by address. A missed lookup raises with close matches."""

    def __init__(self, records: dict[str, ModuleRecord], aliases: dict[str, str]):
        self._records = records
        self._aliases = aliases

    def __getitem__(self, address: str) -> ModuleRecord:
        if not isinstance(address, str):
            raise ModuleNotFoundInTrace(repr(address), self._records)
        rec = self._records.get(address)
        if rec is None and address in self._aliases:
            rec = self._records[self._aliases[address]]
        if rec is None:
            if address in ("self", "<root>", "root"):
                return self._records[""]
            raise ModuleNotFoundInTrace(address, self._records)
        return rec

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, address: object) -> bool:
        return address in self._records or address in self._aliases

    def __repr__(self) -> str:
        return f"ModuleMap({len(self)} modules)"


class Trace:
    """One captured forward pass.

    Attributes:
        ops: every executed torch operation, in order ([`OpRecord`][torchlens.OpRecord]).
        modules: module records by address ([`ModuleMap`][torchlens.ModuleMap]); `""` is the
            root.
        output: what the model returned.
        blocks: the block address of each layer of the language-model stack, in run order (a block
            run several times appears once per call); a layer index is a position in this list.
        model_class: the root module's class name.
        save_spec: the normalized `save=` selection the trace was taken with.
        structure: the model's stacks, layers and sublayers as TorchLens found them
            (`structure.stacks`, `structure.kind`; see `torchlens._structure`).
        edits: for a trace taken with `edit=`, one record per key: the site, the calls edited, how
            the edit was placed and how often it ran; empty otherwise (not kept by `save`/`load`).
    """

    def __init__(self, ops, modules, output, blocks, model_class, save, structure=None):
        self.ops: list[OpRecord] = ops
        self.modules: ModuleMap = modules
        self.output = output
        self.blocks: list[str] = blocks
        self.model_class: str = model_class
        self.save_spec = save
        self.structure = structure
        self.edits: tuple = ()

    def save(self, path: str | os.PathLike, model: Any = None) -> list[str]:
        """Write this trace to the directory `path`, for [`torchlens.load`][torchlens.load].

        Tensors go to a safetensors file, everything else (module tree, op records, facets,
        dtypes, versions) to `trace.json`; nothing is pickled.

        Args:
            path: a directory (created if missing; a trace already there is replaced).
            model: optionally the traced model, to record its class and (Hugging Face) config.

        Returns:
            What could not be stored portably (a `save=` predicate, a KV-cache object in the
            output); also issued as one warning. Empty when everything was stored.

        Raises:
            TraceFileError: `path` is an existing file.
        """
        from ._persist import save

        return save(self, path, model)

    def draw(self, path: str | os.PathLike | None = None, **options: Any) -> Any:
        """The op graph as SVG text (shown as the picture in a notebook), written to `path` if given.

        Every op is a node (index, name, output shape, dtype where it changes), with the model inputs,
        the parameters where they enter and the output; arrows are the recorded data flow; module calls
        are nested boxes. It reads only the records, so a loaded or `save="none"` trace draws too.
        See the [op graph guide](../guides/op-graph.md).

        Args:
            path: where to write the drawing: a `.svg`, `.png` or `.pdf` file (PNG and PDF are
                rendered by Graphviz), or None.
            **options: `rolled=True` (each stack's layers with one recorded op sequence drawn once,
                `×N`; a differing layer, or a second call of one block, drawn apart with the reason),
                `depth=None` (levels of module boxes; deeper modules are one node each; `0`: no boxes),
                `focus=None` (a module address or a hook name: that module's ops and the edges into
                and out of it), `highlight=None` (hook names with `generation=`, a dict generation
                -> names, or `"facets"`: each marked on the op whose output it reads, with its
                status), `generation=None`, `max_nodes=4000` (past it the call refuses before the
                layout and says how to narrow the drawing; None: no limit).

        Returns:
            A `torchlens._draw.Drawing`: the SVG as a `str`, with `counts`, `unplaced` (names with no
            mark, and why) and `groups` (each rolled stack's groups of layers, and why a group is apart).

        Raises:
            DrawSpecError: an option is not accepted (the message says what is); `DrawingTooLarge`
                (a subclass) when the drawing has more than `max_nodes` nodes.
            LookupFailed: a `highlight=` or `focus=` name that no naming table knows, with close matches.
            LayoutEngineMissing: pygraphviz is not installed (`pip install 'torchlens[draw]'`).
        """
        from ._draw import draw

        return draw(self, path, **options)

    def __getitem__(self, name: str) -> torch.Tensor:
        """The tensor at a site: `trace["address:facet"]`, or any name another library uses.

        `trace["transformer.h.1:resid_post"]` is `trace.modules["transformer.h.1"].facets["resid_post"]`
        (write the root as `"<root>:logits"`). A name without a colon is resolved with
        [`resolve_alias`][torchlens.mechinterp.resolve_alias] in every naming generation, so
        `trace["blocks.1.hook_resid_post"]` and `trace["layers_output[1]"]` read the same tensor.

        Raises:
            LookupFailed: the lookup's own error: no such module, facet or name
                (`ModuleNotFoundInTrace`, `FacetNotFound`, `UnknownAlias`, ...), a facet `save=`
                did not keep (`FacetNotSaved`), or a name with no site in this trace (`AliasError`).
        """
        if not isinstance(name, str):
            raise LookupFailed(
                f"trace[...] takes a name (a str): 'address:facet' or another library's hook name, "
                f"not {type(name).__name__} {name!r}; the ops are trace.ops[i]."
            )
        if ":" in name:
            address, facet = name.rsplit(":", 1)
            return self.modules[address.strip()].facets[facet.strip()]
        from .mechinterp._resolver import AliasError, resolve_alias

        r = resolve_alias(self, name)
        if r.module_address is None or r.facet is None or r.status in ("structurally_absent", "ambiguous"):
            remedy = f" {r.remedy[0].upper()}{r.remedy[1:]}." if r.remedy else ""
            raise AliasError(f"{name!r} has no site to read in this trace ({r.status}): {r.reason}{remedy}")
        return r.tensor  # the call the name's layer ran (a block run twice is two layers)

    def check(self) -> dict[tuple[str, int, str], str]:
        """Run every pending check of the trace now, rather than on first read.

        Derived facets (rebuilt attention patterns, per-head results, norm statistics) and the
        expensive checks of real ones (`z`, `resid_mid`) run lazily; see
        [`FacetSite`][torchlens.FacetSite]. After `check()` no site is pending, every
        `check_error` is set, and each `FacetMap.refused` is final. `Trace.save` runs it.

        Returns:
            Every facet the trace does not serve because its check failed or could not run, as
            `(module address, call index, facet) -> reason`; empty when every check held.
        """
        refused = {}
        for rec in self.modules.values():
            for call in rec.calls:
                if call.facets is not None:
                    for facet, why in call.facets.check().items():
                        refused[(call.address, call.index, facet)] = why
        return refused

    @property
    def pending(self) -> int:
        """How many facet sites still wait for their check (computes nothing)."""
        return sum(len(c.facets.pending) for rec in self.modules.values() for c in rec.calls if c.facets is not None)

    def by_role(self, role: str) -> list[str]:
        """Addresses of the modules with `role` that ran, in the order they first ran."""
        recs = [r for r in self.modules.values() if r.role == role and r.calls]
        return [r.address for r in sorted(recs, key=lambda r: r.calls[0].first_op)]

    def __repr__(self) -> str:
        saved = sum(t is not None for op in self.ops for t in op.tensors)
        return (
            f"Trace({self.model_class}: {len(self.ops)} ops, {len(self.modules)} modules, "
            f"{len(self.blocks)} blocks, {saved} tensors saved)"
        )

    def summary(self, max_rows: int | None = None) -> str:
        """A plain-text table of the modules that ran: address, role, calls, facets with shapes.

        It computes nothing: the last line counts the facets whose check is still pending (they
        are computed and checked on first read, or by `check()`).
        """
        rows = [("module", "role", "calls", "facets")]
        for rec in self.modules.values():
            if not rec.calls:
                continue
            fac = rec.calls[0].facets
            facets = ", ".join(
                f"{n}{list(s.shape)}" + ("" if s.saved else "*") for n, s in (fac.sites.items() if fac else [])
            )
            rows.append((rec.address or "<root>", rec.role, str(len(rec.calls)), facets))
        if max_rows is not None:
            rows = rows[: max_rows + 1]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = ["  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3] for r in rows]
        pending = self.pending
        lines.append("(* = exists but not saved" + (
            f"; {pending} facets are checked on first read or by trace.check())" if pending else ")"))
        return "\n".join(lines)

    def _repr_html_(self, max_rows: int = 60) -> str:
        """The modules that ran as an HTML table (what `summary()` prints), for notebooks.

        Facets are listed with their shapes; a facet this trace did not save is grey and starred,
        and a computed or reconstructed (read-only) facet is in italics; a facet's tooltip says
        when its check is pending. Past `max_rows` modules the table says how many it left out.
        It computes nothing.
        """
        from ._html import code, esc, table

        ran = [rec for rec in self.modules.values() if rec.calls]
        rows = []
        for rec in ran[:max_rows]:
            facets = rec.calls[0].facets
            cells = []
            for name, site in (facets.sites.items() if facets else []):
                style = "white-space:nowrap;" + ("" if site.saved else "color:#8c959f;") + (
                    "font-style:italic;" if site.read_only else "")
                note = site.kind + ("" if site.saved else ", not saved") + (
                    "" if site.checked else ", check pending (runs on first read)") + (f": {site.note}" if site.note else "")
                cells.append(code(f"{name}{list(site.shape)}" + ("" if site.saved else "*"), style, note))
            depth = rec.address.count(".") + 1 if rec.address else 0
            address = code(rec.address or "<root>", f"margin-left:{depth * 0.8:.1f}em" if depth else "")
            rows.append([address, esc(rec.role), esc(len(rec.calls)), " ".join(cells)])
        notes = []
        if len(ran) > max_rows:
            notes.append(f"{len(ran) - max_rows} more modules ran; trace.summary() lists them all.")
        if any(not s.saved for rec in ran for c in rec.calls[:1] if c.facets for s in c.facets.sites.values()):
            notes.append("* exists but not saved.")
        notes.append("Italic: computed or reconstructed, read-only.")
        pending = self.pending
        if pending:
            notes.append(f"{pending} facets are checked on first read (or by trace.check()).")
        return table(["module", "role", "calls", "facets"], rows, caption=repr(self), note=" ".join(notes))
